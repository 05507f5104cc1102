"""The vision session: a model folder opened once; its weights resident once, read from
the weight archive (.irpa, memory-mapped); one artifact module holding every bucket's
entry (`encode_<B>`), from the cache; images in, merged embeddings and DeepStack
features out."""

from __future__ import annotations

import io
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import iree.runtime as rt

from emitter.atomic import write_atomic
from emitter.precision import Precision
from emitter.vision import graph_weights
from emitter.identity import DEFAULT_LADDER
from emitter.vision import entry_name, input_specs, result_names

from runtime.artifact.archive import cached_archive, entry_arrays, open_archive, release_mapped_pages
from runtime.artifact.build import DEFAULT_BINDING, build_artifact, make_plan
from runtime.artifact.cache import ArtifactCache, load_verified
from runtime.checkpoints.vision import weights_in_order
from runtime.artifact.iree_module import LoadedModule, device_config, parameters_module
from runtime.inputs.packing import Call, host_inputs, pack, patch_count
from runtime.inputs.processor import process_images

_threads_set: int | None = None


def set_thread_count(threads: int) -> None:
    """IREE's task topology is fixed when the first local-task device is made."""
    global _threads_set
    if threads < 1:
        raise ValueError(f"--threads {threads}: expected a count of IREE worker threads, 1 or more")
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
    pack of images and trimming. Safe to call again and from several threads: each result
    is a copy that later calls never touch.

    Each bucket's entry takes any row count (emitter/vision.py), so the artifact module is
    compiled once for every image size. Without `buckets` the session has the default
    buckets, and an image larger than the largest is a call of its own to it (`open_top`);
    with `buckets` a larger image is an error (`PackingError`)."""

    def __init__(self, model_dir, buckets=None, target: str | None = None, cache_dir=None,
                 threads: int | None = None, progress=None, diagnostics: bool = False, inspect_blocks=None,
                 precision: Precision | str = "f32", weights: str = DEFAULT_BINDING,
                 vision_weights: dict | None = None,
                 dump_inputs=None):
        """The weights come from the checkpoint's archive in the cache (written on first
        use, memory-mapped, checked against the config); the one artifact module serves
        every bucket, so each weight is packed once. `vision_weights`: the weights by
        checkpoint name, as `load_vision_weights` returns them, in place of the folder's
        (the oracle's zeroed-branch control; served from memory, no archive).
        `dump_inputs`: a folder; each call writes `<NN>/call.json` and one `.npy` per input."""
        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.plan = make_plan(str(model_dir), None, buckets or DEFAULT_LADDER, target, diagnostics, inspect_blocks,
                              precision, weights, progress)
        self.open_top = not buckets
        precision = self.plan.precision  # the target's form of it (bf16-f32 on CPUs without bf16 dot products)
        self.cfg, self.policy = self.plan.cfg, self.plan.policy
        self.video_policy = self.plan.video_policy
        self.cache = ArtifactCache(cache_dir)
        self.progress = progress
        self.seconds = {}
        self.archive_path = None
        if vision_weights is None:
            self.archive_path = cached_archive(model_dir, self.cfg, precision, self.cache, progress)
            self.parameters = open_archive(self.archive_path, self.cfg, precision)  # mmapped, checked
        self.seconds["load"] = time.perf_counter() - start
        if threads is not None:
            set_thread_count(threads)
        start = time.perf_counter()
        self.config = device_config(self.plan.target)
        self._extra_modules, self.device_weights = self._bind_weights(vision_weights, precision)
        self.seconds["upload"] = time.perf_counter() - start
        self._artifact: LoadedModule | None = None
        self.dump_dir = Path(dump_inputs) if dump_inputs else None
        self._calls = 0
        self._lock = threading.Lock()

    def _bind_weights(self, vision_weights, precision: Precision) -> tuple[list, list]:
        """(modules the artifact needs added before it, weight arguments of every call).
        Parameter-bound: an io_parameters module over the mapped archive (or over
        `vision_weights`); argument-bound: device arrays uploaded once."""
        specs = graph_weights(self.cfg, precision)
        if vision_weights is None:
            arrays = entry_arrays(self.parameters, specs)  # views of the mapped file
        else:
            arrays = weights_in_order(vision_weights, self.cfg, precision)
        if self.plan.weights == "arguments":
            return [], [rt.asdevicearray(self.config.device, a) for a in arrays]
        if vision_weights is None:
            return [parameters_module(self.config, self.parameters)], []
        self._weight_arrays = arrays  # the in-memory provider references these
        return [parameters_module(self.config, [(w.name, a) for w, a in zip(specs, arrays)])], []

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.plan.buckets

    @property
    def max_loaded(self) -> int:
        return len(self.buckets)  # one module holds them all

    def pack(self, grids, names=None) -> list[Call]:
        """The calls that encode images of `grids` (`runtime.inputs.packing.pack`)."""
        return pack(grids, self.buckets, names, self.open_top)

    def artifact(self) -> LoadedModule:
        """The artifact module (every bucket), from the cache (built on a miss), loaded once."""
        if self._artifact is None:
            result = build_artifact(self.plan, self.cache, self.progress)
            self.artifact_identity = result.identity
            self._artifact = LoadedModule(load_verified(result.path), config=self.config,
                                          modules=self._extra_modules, function=None)
            if self.archive_path and self.plan.weights == "parameters":  # packed now: the mapped copy may go
                release_mapped_pages(self.parameters)
        return self._artifact

    def function_name(self, bucket: int) -> str:
        return entry_name(bucket, self.plan.diagnostics)

    def module(self, bucket: int):
        """A callable running `bucket`'s entry of the artifact module (loaded on first use)."""
        if bucket not in self.buckets:
            raise ValueError(f"bucket {bucket}: not one of this session's buckets {list(self.buckets)}")
        artifact, name = self.artifact(), self.function_name(bucket)
        return lambda *args: artifact.call(name, *args)

    def result_names(self) -> list[str]:
        return result_names(self.cfg, self.plan.diagnostics, self.plan.inspect_blocks)

    def run_call(self, pixel_values: np.ndarray, grids, bucket: int, images=None) -> list[np.ndarray]:
        """One graph call on images already processed; each result (outputs, then any
        diagnostics stages) trimmed to the real rows: patches, or merged tokens."""
        patches = sum(patch_count(g) for g in grids)
        inputs = host_inputs(pixel_values, grids, self.cfg, bucket, self.open_top)
        rows = len(inputs[0])
        with self._lock:
            if self.dump_dir:
                self._dump(inputs, grids, bucket, images)
            results = self.module(bucket)(*inputs, *self.device_weights)
        return [r[:patches] if r.shape[0] == rows else r[:patches // self.cfg.merge_unit] for r in results]

    def _dump(self, inputs, grids, bucket: int, images) -> None:
        """`<dump_dir>/<NN>/`: one `.npy` per input, named as in abi.json, and call.json."""
        folder = self.dump_dir / f"{self._calls:02d}"
        self._calls += 1
        folder.mkdir(parents=True, exist_ok=True)
        names = [name for name, _, _ in input_specs(self.cfg, len(inputs[0]))]
        for name, array in zip(names, inputs):
            write_atomic(folder / f"{name}.npy", _npy_bytes(np.asarray(array)))
        patches = sum(patch_count(g) for g in grids)
        call = {"function": self.function_name(bucket), "bucket": bucket, "rows": len(inputs[0]),
                "images": list(images or []),
                "grid_thw": [list(map(int, g)) for g in grids], "patches": patches,
                "merged": patches // self.cfg.merge_unit, "inputs": [f"{n}.npy" for n in names],
                "outputs": self.result_names(), "precision": self.plan.precision.name,
                "weights_archive": str(self.archive_path) if self.archive_path else None}
        write_atomic(folder / "call.json", json.dumps(call, indent=1) + "\n")

    def encode(self, images, names=None) -> VisionOutput:
        """Images (paths or PIL images) -> VisionOutput."""
        start = time.perf_counter()
        pixel_values, grid_thw = process_images(images, self.policy, names=names)
        processed = time.perf_counter()
        out = self.encode_pixels(pixel_values, grid_thw, names)
        out.seconds = {"process": processed - start, "run": time.perf_counter() - processed}
        return out

    def encode_videos(self, videos, names=None) -> VisionOutput:
        """Video files -> VisionOutput (`runtime.inputs.video.encode_videos`): each video's rows
        in order, grid_thw its (T, h, w) grids, `out.videos` the decoded frames' times."""
        from runtime.inputs.video import encode_videos
        return encode_videos(self, videos, names)

    def prefill(self, input_ids, images, names=None, expand_pads: bool = True, videos=()):
        """Encode `images` (and `videos`) and package them for a language-model prefill
        (`PrefillPayload`): visual positions, embeddings, DeepStack features per decoder
        layer, M-RoPE ids. With `expand_pads`, a prompt holding one image pad per image is
        expanded first; video pads must come expanded as the processor writes them, with
        their timestamps (`ChatTokenizer.prompt_ids`). The special-token ids are the
        checkpoint's (config.json)."""
        from emitter.text_config import load_token_ids

        from runtime.inputs.prefill import build_prefill_payload, expand_image_pads

        token_ids = load_token_ids(self.model_dir)
        out = self.encode(images, names=names)
        ids = np.asarray(input_ids).reshape(-1)
        if expand_pads and np.count_nonzero(ids == token_ids.image_token_id) == len(out.grid_thw):
            ids = expand_image_pads(ids, out.grid_thw, self.cfg.spatial_merge_size, token_ids=token_ids)
        video = {}
        if len(videos):
            v = self.encode_videos(videos)
            video = dict(video_embeds=v.image_embeds, video_deepstack_features=v.deepstack_features,
                         video_grid_thw=v.grid_thw)
        return build_prefill_payload(ids, out.image_embeds, out.deepstack_features, out.grid_thw,
                                     len(self.cfg.deepstack_visual_indexes), self.cfg.spatial_merge_size,
                                     token_ids=token_ids, **video)

    def run_packed(self, pixel_values: np.ndarray, grid_thw, names=None) -> tuple[list[Call], dict[str, np.ndarray]]:
        """Images already processed, packed in order, one graph call per pack: every result
        by its ABI name, rows concatenated in image order (None when there is no image)."""
        grids = [tuple(int(v) for v in g) for g in np.asarray(grid_thw).reshape(-1, 3)]
        starts = np.cumsum([0] + [patch_count(g) for g in grids])
        calls = self.pack(grids, names)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in self.result_names()}
        for call in calls:
            rows = pixel_values[starts[call.images[0]]:starts[call.images[-1] + 1]]
            labels = [names[i] if names else f"image {i}" for i in call.images]
            for name, value in zip(parts, self.run_call(rows, [grids[i] for i in call.images], call.bucket, labels)):
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


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()
