"""The vision session: a model folder opened once, weights resident on the device,
artifacts from the cache, images in, merged embeddings and DeepStack features out."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import iree.runtime as rt

from emitter.identity import DEFAULT_LADDER
from emitter.targets import runtime_driver
from emitter.config import graph_weights
from emitter.vision import PARAMETER_SCOPE, result_names

from .build import DEFAULT_BINDING, build_bucket, make_plan
from .cache import ArtifactCache, load_verified
from .checkpoint import load_vision_weights, weights_in_order
from .iree_module import LoadedModule, parameters_module
from .packing import Call, host_inputs, pack, patch_count
from .processor import process_images

_threads_set: int | None = None


def set_thread_count(threads: int) -> None:
    """IREE's task topology is fixed when the first local-task device is made."""
    global _threads_set
    if threads < 1:
        raise ValueError(f"--threads {threads}: expected a positive count")
    if _threads_set is None:
        rt.flags.parse_flags(f"--task_topology_group_count={threads}")
        _threads_set = threads
    elif _threads_set != threads:
        raise ValueError(f"--threads {threads}: this process already runs IREE with {_threads_set} threads")


@dataclass
class VisionOutput:
    """Images in the order given. image_embeds [M, out_hidden]; deepstack_features
    [K, M, out_hidden] in configured order; grid_thw [n_images, 3]."""
    image_embeds: np.ndarray
    deepstack_features: np.ndarray
    grid_thw: np.ndarray
    calls: list[Call] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def merged_counts(self, merge_unit: int) -> list[int]:
        return [patch_count(g) // merge_unit for g in self.grid_thw]


class VisionSession:
    """Open a checkpoint folder; `encode(images)` runs processor, packing, one call per
    bucket and trimming. Safe to call again and from several threads: each result is a
    copy that later calls never touch."""

    def __init__(self, model_dir, buckets=None, target: str | None = None, cache_dir=None,
                 threads: int | None = None, progress=None, diagnostics: bool = False, inspect_blocks=None,
                 precision: str = "f32", weights: str = DEFAULT_BINDING, max_loaded: int | None = None):
        """`max_loaded`: how many buckets' modules stay loaded at once (least recently used
        dropped first). With parameter-bound weights each loaded module holds its own packed
        copy of the weights, so it defaults to 2 there; with weights as arguments, all."""
        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.plan = make_plan(str(model_dir), None, buckets or DEFAULT_LADDER, target, diagnostics, inspect_blocks,
                              precision, weights)
        self.cfg, self.policy = self.plan.cfg, self.plan.policy
        self.cache = ArtifactCache(cache_dir)
        self.progress = progress
        self.seconds = {}
        weights = weights_in_order(load_vision_weights(model_dir, self.cfg), self.cfg, precision)
        self.seconds["load"] = time.perf_counter() - start
        if threads:
            set_thread_count(threads)
        start = time.perf_counter()
        self.config = rt.Config(runtime_driver(self.plan.target))
        if self.plan.weights == "parameters":  # each bucket's module packs them once, at load
            specs = graph_weights(self.cfg, precision)
            self._weight_arrays = weights  # the provider references these
            self._extra_modules = [parameters_module(self.config, [(w.name, a) for w, a in zip(specs, weights)],
                                                     PARAMETER_SCOPE)]
            self.device_weights = []
        else:  # uploaded once, passed to every call of every bucket
            self._extra_modules = []
            self.device_weights = [rt.asdevicearray(self.config.device, w) for w in weights]
        del weights
        self.seconds["upload"] = time.perf_counter() - start
        self._modules: OrderedDict[int, LoadedModule] = OrderedDict()
        self.max_loaded = max_loaded or (2 if self.plan.weights == "parameters" else len(self.buckets))
        self._lock = threading.Lock()

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.plan.buckets

    def module(self, bucket: int) -> LoadedModule:
        """The compiled graph for `bucket`, from the cache (built on a miss)."""
        if bucket in self._modules:
            self._modules.move_to_end(bucket)
        else:
            while len(self._modules) >= self.max_loaded:
                self._modules.popitem(last=False)  # frees its packed weights
            result = build_bucket(self.plan, bucket, self.cache, self.progress)
            self._modules[bucket] = LoadedModule(load_verified(result.path), config=self.config,
                                                 modules=self._extra_modules)
        return self._modules[bucket]

    def result_names(self) -> list[str]:
        return result_names(self.cfg, self.plan.diagnostics, self.plan.inspect_blocks)

    def run_call(self, pixel_values: np.ndarray, grids, bucket: int) -> list[np.ndarray]:
        """One graph call on images already processed; each result (outputs, then any
        diagnostics stages) trimmed to the real rows: patches, or merged tokens."""
        patches = sum(patch_count(g) for g in grids)
        inputs = host_inputs(pixel_values, grids, self.cfg, bucket)
        with self._lock:
            results = self.module(bucket)(*inputs, *self.device_weights)
        return [r[:patches] if r.shape[0] == bucket else r[:patches // self.cfg.merge_unit] for r in results]

    def encode(self, images, names=None) -> VisionOutput:
        """Images (paths or PIL images) -> VisionOutput."""
        start = time.perf_counter()
        pixel_values, grid_thw = process_images(images, self.policy, names=names)
        processed = time.perf_counter()
        out = self.encode_pixels(pixel_values, grid_thw, names)
        out.seconds = {"process": processed - start, "run": time.perf_counter() - processed}
        return out

    def prefill(self, input_ids, images, names=None, expand_pads: bool = True):
        """Encode `images` and package them for a language-model prefill (`PrefillPayload`):
        visual positions, embeddings, DeepStack features per decoder layer, M-RoPE ids.
        With `expand_pads`, a prompt holding one image pad per image is expanded first."""
        from .prefill import IMAGE_PAD, build_prefill_payload, expand_image_pads

        out = self.encode(images, names=names)
        ids = np.asarray(input_ids).reshape(-1)
        if expand_pads and np.count_nonzero(ids == IMAGE_PAD) == len(out.grid_thw):
            ids = expand_image_pads(ids, out.grid_thw, self.cfg.spatial_merge_size)
        return build_prefill_payload(ids, out.image_embeds, out.deepstack_features, out.grid_thw,
                                     len(self.cfg.deepstack_visual_indexes), self.cfg.spatial_merge_size)

    def run_packed(self, pixel_values: np.ndarray, grid_thw, names=None) -> tuple[list[Call], dict[str, np.ndarray]]:
        """Images already processed, packed in order, one graph call per pack: every result
        by its ABI name, rows concatenated in image order (None when there is no image)."""
        grids = [tuple(int(v) for v in g) for g in np.asarray(grid_thw).reshape(-1, 3)]
        starts = np.cumsum([0] + [patch_count(g) for g in grids])
        calls = pack(grids, self.buckets, names)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in self.result_names()}
        for call in calls:
            rows = pixel_values[starts[call.images[0]]:starts[call.images[-1] + 1]]
            for name, value in zip(parts, self.run_call(rows, [grids[i] for i in call.images], call.bucket)):
                parts[name].append(value)
        return calls, {name: np.concatenate(values) if values else None for name, values in parts.items()}

    def encode_pixels(self, pixel_values: np.ndarray, grid_thw, names=None) -> VisionOutput:
        """Processor output (pixel_values [N, patch_dim], grid_thw [n, 3]) -> VisionOutput."""
        k, out_hidden = len(self.cfg.deepstack_visual_indexes), self.cfg.out_hidden_size
        calls, results = self.run_packed(pixel_values, grid_thw, names)
        image_embeds = results["image_embeds"] if calls else np.zeros((0, out_hidden), np.float32)
        features = (np.stack([results[f"deepstack_features.{i}"] for i in range(k)]) if calls and k
                    else np.zeros((k, len(image_embeds), out_hidden), np.float32))
        grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        return VisionOutput(image_embeds, features.astype(np.float32), grids, calls)
