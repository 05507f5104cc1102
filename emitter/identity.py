"""Artifact identity: a sha256 over a canonical JSON of everything that decides whether
a compiled `.vmfb` may be reused (see DESIGN.md, "Identity and the artifact cache").

Never imports `runtime`. The compiler (`iree.compiler`) is imported lazily, only to
read its version; what a target means on this machine is emitter/targets.py's
`resolved_device_target`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from . import __version__, quant
from .config import ConfigError, VisionConfig, check_precision, graph_weights
from .targets import DEFAULT_TARGET, TARGETS, host_cpu, resolved_device_target, target_flags
from .vision import check_binding, check_bucket, default_inspect_blocks, emit_artifact_module

# Bump when the meaning of a cached artifact changes in a way no other field records
# (e.g. the calling convention of the emitted function). Vision 2: one module per bucket
# set, entries `encode_<B>`. Text 1: `prefill_<S>` and `decode` (emitter/text.py).
FORMAT_VERSION = 2
TEXT_FORMAT_VERSION = 1

# The default bucket ladder (patches per call): two 256x256 images fill 512.
DEFAULT_LADDER = (64, 128, 256, 512)


def extended_bucket(patches: int, top: int = DEFAULT_LADDER[-1]) -> int:
    """The bucket past a ladder whose largest is `top` for an image of `patches` patches: the
    smallest power of two that holds it (1024, 2048, ..., 16384 for a 2048x2048 image, and
    on up to whatever the processor's max_pixels allows). Powers of two, not a finer ladder:
    a bucket compiles in seconds to minutes (the 2B tower at 8192, about 3 min on 2 cores),
    each one once per cache, and padding past the image costs the linear work of its rows
    (padding patches attend only to themselves): at most 2x the patches, and nothing for the
    common sizes (1024x1024 is 4096 patches, 1920x1080 8160)."""
    return max(2 * top, 1 << (max(patches, 1) - 1).bit_length())


def ladder_for(patch_counts, buckets=DEFAULT_LADDER) -> tuple[int, ...]:
    """`buckets` plus the `extended_bucket` of each image larger than its largest: the
    buckets that default-ladder sessions build so that every image fits, sorted."""
    top = max(buckets)
    return tuple(sorted(set(buckets) | {extended_bucket(n, top) for n in patch_counts if n > top}))


def canonical_json(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def artifact_identity(fields: dict) -> str:
    """sha256 hex of the canonical JSON of `fields`."""
    return hashlib.sha256(canonical_json(fields).encode("ascii")).hexdigest()


def weight_schema_fields(specs) -> dict:
    """Compact weight schema of a graph's `WeightSpec`s (`config.graph_weights`,
    `text.text_weights`): count and sha256 of the full [name, shape, dtype, host_transform] list."""
    schema = [[w.name, list(w.shape), w.dtype, w.host_transform] for w in specs]
    digest = hashlib.sha256(canonical_json({"weights": schema}).encode("ascii")).hexdigest()
    return {"count": len(schema), "sha256": digest}


def installed_compiler_version() -> dict:
    """The installed compiler: package version and source revisions (`iree.compiler.version`)."""
    from iree.compiler import version as v
    return {"package": "iree-base-compiler", "version": str(v.VERSION),
            "revisions": {k: str(r) for k, r in sorted(v.REVISIONS.items())}}


def target_fields(target: str, extra_flags=()) -> dict:
    """Name, backend, every compiler flag, and what the flags resolve to here."""
    flags = [*target_flags(target), *extra_flags]
    device = resolved_device_target(tuple(flags))
    out = {"name": target, "runtime_driver": TARGETS[target][0], "flags": flags, "device_target": device}
    backend = re.match(r'#hal\.device\.target<"([^"]*)", \[#hal\.executable\.target<"([^"]*)"', device)
    out["backend"] = backend.group(2) if backend else None
    if "--iree-llvmcpu-target-cpu=host" in flags:
        cpu, features = host_cpu(device)
        out["host_cpu"] = {"name": cpu, "features": features}
    return out


# bf16 x bf16 matmuls pay only where the bf16 dot product runs at twice the rate of f32
# FMAs: AMD Zen 4/5 (vdpbf16ps, measured 455-464 bf16 against 223 f32 GFLOP/s on 2 cores)
# and Arm's BF16 (BFMMLA). Intel's AVX-512 BF16 (Cooper Lake to Granite Rapids) runs it on one
# port, at f32's rate, so the activations' rounding and packing make a bf16 x bf16 graph
# slower than f32 (measured 1.3x on a 2B tower); without one (AVX2) IREE 3.13 lowers it to
# a scalar loop (~50x). There, bf16-f32 (docs/performance.md, "bf16 on every CPU").
_DOUBLE_RATE_BF16 = (("znver", "+avx512bf16"), ("", "+bf16"))  # (LLVM CPU name prefix, feature)


def bf16_form(target: str, extra_flags=()) -> tuple[str, str]:
    """("bf16" or "bf16-f32", why) for `target` as LLVM resolves it here: "bf16" on GPU
    targets and CPUs with a double-rate bf16 dot product, else "bf16-f32"."""
    device = resolved_device_target(tuple([*target_flags(target), *extra_flags]))
    if '#hal.executable.target<"llvm-cpu"' not in device:
        return "bf16", "a GPU target"
    cpu, features = host_cpu(device)
    cpu, features = cpu or "", (features or "").split(",")
    if any(cpu.startswith(prefix) and feature in features for prefix, feature in _DOUBLE_RATE_BF16):
        return "bf16", f"{cpu} has a double-rate bf16 dot product"
    if "+avx512bf16" in features:
        return "bf16-f32", f"{cpu}'s bf16 dot product runs at the rate of f32 FMAs"
    return "bf16-f32", f"{cpu or target} has no bf16 dot product"


def graph_precision(precision: str, target: str | None = None, extra_flags=()) -> str:
    """The precision a graph is built in for what a user asked (`USER_PRECISIONS`) on
    `target`: bf16 as `bf16_form` says (bf16-f32: bf16 weights widened to f32 inside each
    matmul, half the weight bytes of f32, never IREE's scalar bf16 loop)."""
    check_precision(precision)
    if precision == "bf16":
        return bf16_form(target or DEFAULT_TARGET, extra_flags)[0]
    if precision in quant.KERNEL_BITS:  # q8_0, q4_0: the kernel object of the target's ISA
        from kernels.build import KernelError
        from .kernel_calls import target_isa
        try:
            flags = tuple(target_flags(target or DEFAULT_TARGET)) + tuple(extra_flags)
            return f"{precision}-{target_isa(flags)}"
        except KernelError as e:
            raise ConfigError(f"--precision {precision}: {e}") from None
    return precision


def precision_note(asked: str, used: str, target: str | None = None) -> str | None:
    """One line for a user whose precision was changed to the target's fast form, or None."""
    if asked == used or asked != "bf16":
        return None
    why = bf16_form(target or DEFAULT_TARGET)[1]
    return (f"note: --precision {asked}: {why}; running {used} (bf16 weights, widened to f32 inside each "
            f"matmul: half the weight memory, about f32's matmul speed)")


def bucket_set(buckets, cfg: VisionConfig | None = None) -> list[int]:
    """A bucket or several as the artifact's bucket set: checked, distinct, ascending."""
    buckets = [buckets] if isinstance(buckets, int) else list(buckets)
    return sorted({check_bucket(b, cfg) for b in buckets})


def artifact_fields(kind: str, config: dict, graph: str, weights, precision: str, target: str | None = None,
                    compiler_version=None, extra_flags=(), **fields) -> dict:
    """Canonical JSON-able dict of everything that decides whether a compiled module of
    `kind` ("vision" or "text") may be reused: its config, the emitted `graph` (title comment
    left out: guards against an emitter change nobody recorded in its version), the weight
    schema of `weights`, the precision, what the target resolves to here and the compiler;
    `fields` are the kind's own (buckets, context, policies, ...). `compiler_version`
    overrides the installed compiler's (tests); `extra_flags` are appended to the target's
    iree-compile flags (and so must be passed to the compiler too)."""
    out = {
        "format_version": {"vision": FORMAT_VERSION, "text": TEXT_FORMAT_VERSION}[kind],
        "emitter_version": __version__,
        f"{kind}_config": config,
        "precision": check_precision(precision),
        "weight_schema": weight_schema_fields(weights),
        "graph_sha256": hashlib.sha256(graph.encode("utf-8")).hexdigest(),
        "target": target_fields(target or DEFAULT_TARGET, extra_flags),
        "compiler": installed_compiler_version() if compiler_version is None else compiler_version,
        **fields,
    }
    if kind == "text":
        out["kind"] = "qwen3vl-text"
    return out


def vision_artifact_fields(cfg: VisionConfig, buckets, policy, target: str | None = DEFAULT_TARGET,
                           diagnostics: bool = False, inspect_blocks=None, compiler_version=None,
                           extra_flags=(), precision: str = "f32", weights: str = "arguments",
                           video_policy=None) -> dict:
    """`artifact_fields` of the vision artifact module (`emit_artifact_module`) for the
    bucket set `buckets` (one bucket or several). `policy` is a `ProcessorPolicy` (or its
    `to_dict()`), `video_policy` a `VideoPolicy` (or its dict; None: the released one)."""
    buckets = bucket_set(buckets, cfg)
    diagnostics = bool(diagnostics)
    if diagnostics:
        blocks = default_inspect_blocks(cfg) if inspect_blocks is None else inspect_blocks
        blocks = sorted({int(i) for i in blocks})
    else:
        blocks = []  # the plain variant does not depend on them
    graph = emit_artifact_module(cfg, buckets, diagnostics=diagnostics, inspect_blocks=inspect_blocks, title="",
                                 precision=check_precision(precision), weights=weights)
    return artifact_fields("vision", cfg.to_dict(), graph, graph_weights(cfg, precision), precision, target,
                           compiler_version, extra_flags, buckets=buckets, diagnostics=diagnostics,
                           inspect_blocks=blocks, weight_binding=check_binding(weights),
                           processor_policy=policy if isinstance(policy, dict) else policy.to_dict(),
                           video_policy=_video_policy_dict(video_policy))


def text_artifact_fields(cfg, shape, deepstack_layers: int, precision: str = "f32",
                         target: str | None = DEFAULT_TARGET, graph: str | None = None) -> dict:
    """`artifact_fields` of the language-model module (`text.emit_text_module`) of a
    `text.TextShape`; `graph`: the module's MLIR text when the caller has it already."""
    from .text import emit_text_module, text_weights
    from .quant import compile_flags
    graph = graph or emit_text_module(cfg, shape, deepstack_layers, precision)
    return artifact_fields("text", cfg.to_dict(), graph, text_weights(cfg, precision), precision, target,
                           extra_flags=compile_flags(precision, cfg.native_weights), buckets=list(shape.buckets),
                           context=shape.context, deepstack_layers=deepstack_layers,
                           lanes=shape.lanes, kv_blocks=shape.blocks, kv_cache_dtype=shape.kv_dtype)


def _video_policy_dict(video_policy) -> dict:
    from .video_policy import DEFAULT_VIDEO_POLICY
    if isinstance(video_policy, dict):
        return video_policy
    return (video_policy or DEFAULT_VIDEO_POLICY).to_dict()


def explain_identity(cfg: VisionConfig, bucket, diagnostics: bool = False, inspect_blocks=None,
                     model_dir: str | Path | None = None, target: str | None = None, policy=None,
                     precision: str = "f32", weights: str = "arguments") -> str:
    """Human text: the identity of the artifact for `bucket` (one or several) and the
    fields it hashes (pretty JSON). The policies come from `model_dir`'s preprocessor
    configs when given, else the released defaults."""
    from .policy import DEFAULT_POLICY, load_policy
    from .video_policy import load_video_policy
    if policy is None:
        policy = load_policy(model_dir, cfg) if model_dir else DEFAULT_POLICY
    video_policy = load_video_policy(model_dir, cfg) if model_dir else None
    fields = vision_artifact_fields(cfg, bucket, policy, target=target, diagnostics=diagnostics,
                                    inspect_blocks=inspect_blocks, precision=precision, weights=weights,
                                    video_policy=video_policy)
    return format_explanation(fields)


def format_explanation(fields: dict) -> str:
    return (f"identity {artifact_identity(fields)}\n"
            f"fields (sha256 of their canonical JSON):\n{json.dumps(fields, indent=2, sort_keys=True)}\n")
