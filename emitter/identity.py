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

from . import __version__
from .config import VisionConfig
from .precision import Precision, for_graph
from .targets import DEFAULT_TARGET, TARGETS, host_cpu, resolved_device_target, target_flags
from .vision import check_binding, check_bucket, default_inspect_blocks, emit_artifact_module, graph_weights

# Bump when the meaning of a cached artifact changes in a way no other field records
# (e.g. the calling convention of the emitted function). Vision 3: one module per bucket
# set, entries `encode_<B>` taking a run-time row count. Text 1: `prefill_<S>` and `decode`
# (emitter/text.py).
FORMAT_VERSION = 3
TEXT_FORMAT_VERSION = 1

# The default buckets (most patches one call holds). An entry's rows are a run-time count,
# padded to whole row units (emitter/vision.py `row_unit`), so a bucket is compiled once
# for every image size it takes: 512 holds up to two 256x256 images in 256-row chunks (each
# skips the other's keys); 16384 holds the rest in 512-row chunks, and, in a session with
# the default buckets, any larger image alone (`runtime.inputs.packing.pack`, open top).
DEFAULT_LADDER = (512, 16384)


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


def bucket_set(buckets, cfg: VisionConfig | None = None) -> list[int]:
    """A bucket or several as the artifact's bucket set: checked, distinct, ascending."""
    buckets = [buckets] if isinstance(buckets, int) else list(buckets)
    return sorted({check_bucket(b, cfg) for b in buckets})


def artifact_fields(kind: str, config: dict, graph: str, weights, precision: Precision | str,
                    target: str | None = None,
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
        "precision": for_graph(precision).name,
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
                           extra_flags=(), precision: Precision | str = "f32", weights: str = "arguments",
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
    precision = for_graph(precision)
    graph = emit_artifact_module(cfg, buckets, diagnostics=diagnostics, inspect_blocks=inspect_blocks, title="",
                                 precision=precision, weights=weights)
    return artifact_fields("vision", cfg.to_dict(), graph, graph_weights(cfg, precision), precision, target,
                           compiler_version, extra_flags, buckets=buckets, diagnostics=diagnostics,
                           inspect_blocks=blocks, weight_binding=check_binding(weights),
                           processor_policy=policy if isinstance(policy, dict) else policy.to_dict(),
                           video_policy=_video_policy_dict(video_policy))


def text_artifact_fields(cfg, shape, deepstack_layers: int, precision: Precision | str = "f32",
                         target: str | None = DEFAULT_TARGET, graph: str | None = None) -> dict:
    """`artifact_fields` of the language-model module (`text_module.emit_text_module`) of a
    `text.TextShape`; `graph`: the module's MLIR text when the caller has it already."""
    from .text import text_weights
    from .text_module import emit_text_module
    precision = for_graph(precision)
    graph = graph or emit_text_module(cfg, shape, deepstack_layers, precision)
    return artifact_fields("text", cfg.to_dict(), graph, text_weights(cfg, precision), precision, target,
                           extra_flags=precision.compile_flags(cfg.native_weights), buckets=list(shape.buckets),
                           context=shape.context, deepstack_layers=deepstack_layers,
                           lanes=shape.lanes, kv_blocks=shape.blocks, kv_cache_dtype=shape.kv_dtype,
                           **({"pooled": "last"} if shape.pooled else {}))  # a generative module's fields as before


def _video_policy_dict(video_policy) -> dict:
    from .video_policy import DEFAULT_VIDEO_POLICY
    if isinstance(video_policy, dict):
        return video_policy
    return (video_policy or DEFAULT_VIDEO_POLICY).to_dict()


def explain_identity(cfg: VisionConfig, bucket, diagnostics: bool = False, inspect_blocks=None,
                     model_dir: str | Path | None = None, target: str | None = None, policy=None,
                     precision: Precision | str = "f32", weights: str = "arguments") -> str:
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
