"""`qwen3vl build`: resolve what to build, then compile the artifact module (one entry per
bucket, `encode_<B>`) into the cache; `compiled_module` builds the language model's module too."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from emitter.config import VisionConfig, resolve_config
from emitter.identity import DEFAULT_LADDER, artifact_identity, format_explanation, vision_artifact_fields
from emitter.precision import PRECISIONS, Precision, precision as precision_of
from emitter.policy import DEFAULT_POLICY, ProcessorPolicy, load_policy
from emitter.video_policy import DEFAULT_VIDEO_POLICY, VideoPolicy, load_video_policy
from emitter.targets import DEFAULT_TARGET, target_flags
from emitter.vision import check_binding, check_bucket, emit_artifact_module, parse_bucket

# The runtime's artifacts read their weights from a parameter archive: IREE then packs
# them for the matmuls once at load instead of on every call (docs/history/performance-notebook.md).
DEFAULT_BINDING = "parameters"

from runtime.artifact.cache import ArtifactCache
from runtime.artifact.compiler import compile_estimate, compile_mlir, resolve_precision


@dataclass(frozen=True)
class BuildPlan:
    cfg: VisionConfig
    title: str
    policy: ProcessorPolicy
    buckets: tuple[int, ...]
    target: str
    diagnostics: bool = False
    inspect_blocks: tuple[int, ...] | None = None
    precision: Precision = PRECISIONS["f32"]
    weights: str = "arguments"
    video_policy: VideoPolicy = DEFAULT_VIDEO_POLICY

    def fields(self) -> dict:
        """The identity fields of the artifact module for the whole bucket set."""
        return vision_artifact_fields(self.cfg, self.buckets, self.policy, target=self.target,
                                      diagnostics=self.diagnostics, inspect_blocks=self.inspect_blocks,
                                      precision=self.precision, weights=self.weights,
                                      video_policy=self.video_policy)


@dataclass(frozen=True)
class BuildResult:
    buckets: tuple[int, ...]
    identity: str
    path: Path
    built: bool
    seconds: float


def folder_vision(model: str | None, preset_name: str | None, precision: Precision):
    """(config, title, precision, image policy, video policy) of a checkpoint folder or a
    preset, the config checked against the weights' headers before anything is sized by it."""
    cfg, title = resolve_config(model, preset_name)
    if model:
        from runtime.checkpoints.vision import check_checkpoint, vision_native_weights
        check_checkpoint(model, cfg)
        if precision.native:  # the linears MLX stores in 8 or 4 bits in those bits, the rest f32
            cfg, precision = replace(cfg, native_weights=vision_native_weights(model, cfg)), PRECISIONS["f32"]
    policy = load_policy(model, cfg) if model else DEFAULT_POLICY
    video_policy = load_video_policy(model, cfg) if model else DEFAULT_VIDEO_POLICY
    return cfg, title, precision, policy, video_policy


def vision_source(model: str | None, preset_name: str | None, precision: Precision | str):
    """`folder_vision`, or for a folder holding a GGUF text file and its llama.cpp mmproj the
    mmproj's (`gguf_vision.vision_parts`); under `native` its quantized linears run in their
    bits, as an MLX tower's (docs/text.md)."""
    from runtime.checkpoints import gguf_vision
    precision = precision_of(precision)
    mmproj = gguf_vision.mmproj_file(model) if model else None
    if not mmproj:
        return folder_vision(model, preset_name, precision)
    cfg, policy, video_policy = gguf_vision.vision_parts(mmproj)
    if precision.native:  # the quantized linears in their bits, the rest f32
        cfg, precision = replace(cfg, native_weights=gguf_vision.native_weights(mmproj, cfg)), PRECISIONS["f32"]
    return cfg, f"model {Path(model).name}", precision, policy, video_policy


def make_plan(model: str | None, preset_name: str | None, buckets=(), target: str | None = None,
              diagnostics: bool = False, inspect_blocks=None, precision: Precision | str = "f32",
              weights: str | None = None, progress=None) -> BuildPlan:
    """Check every input before anything is compiled; ValueError naming the bad one. The
    plan's precision is the target's form of the one asked (`compiler.resolve_precision`:
    bf16 is built as bf16-f32 for a CPU without a double-rate bf16 dot product; `progress` hears so);
    native (a checkpoint's quantized linears in their own bits; mlx, its alias) is f32 over a
    config naming them."""
    if model and not Path(model).is_dir():
        raise ValueError(f"--model {model}: not a readable folder; expected a checkpoint folder "
                         f"(config.json, preprocessor_config.json, *.safetensors)")
    cfg, title, precision, policy, video_policy = vision_source(model, preset_name, precision)
    target = target or DEFAULT_TARGET
    target_flags(target)
    parsed = []
    for text in buckets or DEFAULT_LADDER:
        b = check_bucket(parse_bucket(text) if isinstance(text, str) else text, cfg)
        if b not in parsed:
            parsed.append(b)
    parsed.sort()  # the artifact's bucket set; packing picks the smallest that holds
    inspect = tuple(inspect_blocks) if inspect_blocks else None
    if inspect is not None and not diagnostics:
        raise ValueError(f"--inspect-block {inspect[0]}: needs --diagnostics (it picks which blocks' stages "
                         f"the diagnostics variant returns)")
    if inspect is not None:
        bad = [i for i in inspect if not 0 <= i < cfg.depth]
        if bad:
            raise ValueError(f"--inspect-block {bad[0]}: expected a block index in [0, {cfg.depth})")
    return BuildPlan(cfg, title, policy, tuple(parsed), target, bool(diagnostics), inspect,
                     resolve_precision(precision, target, progress), check_binding(weights or DEFAULT_BINDING),
                     video_policy)


def emit_graph(plan: BuildPlan) -> str:
    return emit_artifact_module(plan.cfg, plan.buckets, diagnostics=plan.diagnostics,
                                inspect_blocks=plan.inspect_blocks, title=plan.title, precision=plan.precision,
                                weights=plan.weights)


def compiled_module(cache: ArtifactCache, fields: dict, graph: Callable[[], str], target: str, label: str,
                    detail: str, progress: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """(the vmfb of `fields` in the cache, whether it was compiled now): on a miss, under the
    cache's lock, `graph()`'s MLIR compiled for `target` with the flags `fields` record
    (the target's and any the module adds); `progress` hears that the `label` compiles
    (once, and about how long: `compiler.compile_estimate`) and the time it took. Both
    models' modules are built here."""
    report = progress or (lambda message: None)
    identity = artifact_identity(fields)
    extra_flags = fields["target"]["flags"][len(target_flags(target)):]

    def emit() -> bytes:
        text = graph()
        report(f"compiling the {label} for this checkpoint (once, about {compile_estimate(text)} s): "
               f"{identity[:12]} ({detail}) ...")
        t0 = time.monotonic()
        data = compile_mlir(text, target, extra_flags)
        report(f"{label}: compiled in {time.monotonic() - t0:.1f} s")
        return data

    return cache.get_or_build(fields, emit, progress=report)


def build_artifact(plan: BuildPlan, cache: ArtifactCache,
                   progress: Callable[[str], None] | None = None) -> BuildResult:
    """The vision artifact module through the cache; `progress` hears when a compile starts and ends."""
    fields = plan.fields()
    start = time.monotonic()
    path, built = compiled_module(cache, fields, lambda: emit_graph(plan), plan.target, "vision tower",
                                  f"buckets {' '.join(map(str, plan.buckets))}, {plan.title}, {plan.target}",
                                  progress)
    return BuildResult(plan.buckets, artifact_identity(fields), path, built, time.monotonic() - start)


def explain_plan(plan: BuildPlan, cache: ArtifactCache) -> str:
    """The artifact's identity, whether the cache holds it, and the fields it hashes."""
    fields = plan.fields()
    path = cache.lookup(fields)
    state = f"cached at {path}" if path else f"not cached in {cache.root}"
    return f"buckets {' '.join(map(str, plan.buckets))}: {state}\n{format_explanation(fields)}"
