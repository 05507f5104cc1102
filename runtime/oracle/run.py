"""`qwen3vl oracle`: the compiled diagnostics graph against the numpy reference, stage by
stage, in graph order; which stage fails first, and whether it is wrong on its own
input (local) or only inherits drift from upstream (inherited). The command is
runtime/commands/oracle.py.

One payload: the images are processed once, packed into the session's buckets and run
through the diagnostics graph (one call per pack; per-stage results concatenated in
image order); the reference (`runtime.oracle.reference`, independent of the emitter) runs on
the same `pixel_values` and `grid_thw`. The comparison, the verdicts and the default
tolerances are `runtime.oracle.compare`'s; the negative controls (a DeepStack branch
zeroed in the compiled graph, one dropped from the prefill payload) are
`runtime.oracle.controls`'; the report's schema and table are `runtime.oracle.report`'s.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np

from emitter import __version__
from emitter.config import VisionConfig
from emitter.precision import Precision, precision as precision_of
from emitter.vision import default_inspect_blocks

from runtime.oracle.compare import (DEFAULT_ATOL, DEFAULT_MAX_REL_L2, DEFAULT_RTOL, DEFAULT_TOLERANCES,  # noqa: F401
                             PASS_RULE, actuals, add_verdicts, compare, compare_stages, expected_stages,
                             oracle_stage_names, parse_stages, tolerances)
from runtime.oracle.controls import CONTROL_KINDS, dropped_branch, not_applicable, zeroed_branch, zeroed_weights  # noqa: F401
from runtime.oracle.report import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, check_report, format_table  # noqa: F401

__all__ = ["REPORT_SCHEMA", "REPORT_SCHEMA_VERSION", "DEFAULT_TOLERANCES", "DEFAULT_ATOL", "DEFAULT_RTOL",
           "DEFAULT_MAX_REL_L2", "PASS_RULE", "CONTROL_KINDS", "compare", "oracle_stage_names", "parse_stages",
           "run_oracle", "format_table", "check_report"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(target: str, threads: int | None) -> dict:
    from iree.runtime import version as rv
    from emitter.identity import installed_compiler_version, target_fields
    from emitter.targets import runtime_driver
    info = {"target": target, "driver": runtime_driver(target), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
            "threads": threads, "platform": platform.platform(), "iree_runtime": rv.VERSION,
            "iree_compiler": installed_compiler_version()["version"]}
    try:
        fields = target_fields(target)
        info["backend"] = fields.get("backend")
        if "host_cpu" in fields:
            info["llvm_cpu"] = fields["host_cpu"]["name"]
    except ValueError:
        pass
    return info


def _check_images(images) -> list[str]:
    names = [str(p) for p in images]
    if not names:
        raise ValueError("IMAGE: give at least one image file")
    from runtime.inputs.processor import check_image_file
    for name in names:
        check_image_file(name)  # missing, a directory, a FIFO...: say which
    return names


def _inspect(cfg: VisionConfig, inspect_blocks, needed) -> tuple[int, ...]:
    bad = [i for i in (inspect_blocks or ()) if not 0 <= int(i) < cfg.depth]
    if bad:
        raise ValueError(f"--inspect-block {bad[0]}: expected a block index in [0, {cfg.depth})")
    base = tuple(inspect_blocks) if inspect_blocks else default_inspect_blocks(cfg)
    return tuple(sorted(set(int(i) for i in base) | needed))


def _first_failure(comparisons: list[dict]) -> dict | None:
    first = next((c for c in comparisons if not c["pass"]), None)
    return None if first is None else {
        "stage": first["stage"], "verdict": first["verdict"], "max_abs": first["max_abs"],
        "rel_l2": first["rel_l2"], "violations": first["violations"], "nonfinite": first["nonfinite"],
        "same_input_rel_l2": first["same_input"]["rel_l2"] if first["same_input"] else None}


def run_oracle(model_dir, images, atol: float | None = None, rtol: float | None = None,
               max_rel_l2: float | None = None, inspect_blocks=None, stages=None, reference_dtype: str = "f64",
               cache_dir=None, buckets=None, target=None, threads=None, progress=None,
               precision: Precision | str = "f32") -> dict:
    """Run the diagnostics graph and the reference on the same payload, then the negative
    controls; return the report.

    `atol`, `rtol`, `max_rel_l2`: None for the precision's default (`DEFAULT_TOLERANCES`);
    `inspect_blocks`: blocks whose inner stages to compare (default the first and last);
    `stages`: compare only these (oracle stage names; blocks they name are inspected);
    `precision`: the graph's ("f32" or "bf16"; the reference stays f64 or f32).
    Raises ValueError for bad input, runtime.artifact.compiler.CompileError when a compile fails."""
    from runtime.artifact.build import make_plan
    from runtime.checkpoints.vision import load_vision_weights
    from runtime.inputs.packing import pack
    from runtime.inputs.processor import process_images
    from runtime.oracle.reference import Reference
    from runtime.vision import VisionSession

    tol = tolerances(str(precision), atol, rtol, max_rel_l2)  # a precision the oracle has tolerances for
    precision = precision_of(precision)
    dtypes = {"f32": np.float32, "f64": np.float64}
    if reference_dtype not in dtypes:
        raise ValueError(f"--reference-dtype {reference_dtype}: expected f32 or f64")
    plan = make_plan(str(model_dir), None, buckets or (), target, True, None, precision)
    cfg = plan.cfg
    selected, needed = parse_stages(cfg, stages or ())
    inspect = _inspect(cfg, inspect_blocks, needed)
    names = _check_images(images)
    session_args = dict(buckets=buckets, target=target, cache_dir=cache_dir, threads=threads, progress=progress,
                        diagnostics=True, inspect_blocks=inspect, precision=precision)

    seconds = {}
    t0 = time.perf_counter()
    session = VisionSession(model_dir, **session_args)  # as `qwen3vl run` runs it
    seconds["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    pixel_values, grid_thw = process_images(names, session.policy, names=names)
    seconds["process"] = time.perf_counter() - t
    t = time.perf_counter()
    for bucket in sorted({c.bucket for c in pack(grid_thw, session.buckets, names)}):
        session.module(bucket)  # from the cache, compiled on a miss
    seconds["artifacts"] = time.perf_counter() - t
    t = time.perf_counter()
    calls, graph = session.run_packed(pixel_values, grid_thw, names)
    device = device_info(session.plan.target, threads)
    artifact = session.artifact_identity
    del session  # frees its loaded modules before the control's session loads its own
    seconds["graph"] = time.perf_counter() - t

    t = time.perf_counter()
    weights = load_vision_weights(model_dir, cfg)
    ref = Reference(cfg, weights, dtypes[reference_dtype])
    expected = expected_stages(cfg, ref.run(pixel_values, grid_thw))
    actual = actuals(cfg, graph)
    order = oracle_stage_names(cfg, inspect)
    compared = [n for n in order if n in set(selected)] if selected else order
    seconds["reference"] = time.perf_counter() - t

    t = time.perf_counter()
    comparisons = compare_stages(cfg, actual, expected, compared, tol)
    seconds["compare"] = time.perf_counter() - t
    t = time.perf_counter()
    add_verdicts(cfg, comparisons, ref, actual, grid_thw, inspect, tol)
    seconds["same_input"] = time.perf_counter() - t

    t = time.perf_counter()
    if cfg.deepstack_visual_indexes:
        zeroed = VisionSession(model_dir, vision_weights=zeroed_weights(weights, 0), **session_args)
        _, zeroed_graph = zeroed.run_packed(pixel_values, grid_thw, names)
        controls = [{**zeroed_branch(cfg, zeroed_graph, expected, order, tol, 0), "artifact": zeroed.artifact_identity},
                    {**dropped_branch(cfg, graph, grid_thw), "artifact": artifact}]
        del zeroed
    else:
        controls = not_applicable()
    seconds["controls"] = time.perf_counter() - t

    first_failure = _first_failure(comparisons)
    controls_ok = all(c["detected"] is not False for c in controls)
    grids = [[int(v) for v in g] for g in grid_thw]
    calls = [{"bucket": c.bucket, "images": list(c.images), "patches": c.patches} for c in calls]
    return {
        "schema": REPORT_SCHEMA,
        "schema_version": REPORT_SCHEMA_VERSION,
        "tool": {"name": "qwen3vl oracle", "version": __version__},
        "model": {"path": str(Path(model_dir).resolve()), "title": plan.title, "config": cfg.to_dict()},
        "images": [{"path": n, "grid_thw": g, "patches": int(np.prod(g)),
                    "merged": int(np.prod(g)) // cfg.merge_unit} for n, g in zip(names, grids)],
        "grids": grids,
        "calls": calls,
        "artifact": artifact,
        "device": device,
        "precision": precision.name,
        "graph_precision": plan.precision.name,  # bf16 is built as bf16-f32 unless the CPU has a double-rate bf16 dot product
        "reference": {"dtype": reference_dtype, "module": "runtime.oracle.reference"},
        "tolerances": {**tol, "rule": PASS_RULE, "defaults": DEFAULT_TOLERANCES[precision.name]},
        "inspect_blocks": list(inspect),
        "stages_selected": selected or None,
        "comparisons": comparisons,
        "same_input": {
            "description": "the reference recomputes the inspected blocks, every merger, the embedding sum, "
                           "and the block of any failing stage from the graph's own input to it",
            "inspect_blocks": list(inspect),
            "local_failures": [c["stage"] for c in comparisons if c["verdict"] == "local"],
            "inherited_failures": [c["stage"] for c in comparisons if c["verdict"] == "inherited"],
        },
        "controls": controls,
        "controls_pass": controls_ok,
        "first_failure": first_failure,
        "pass": first_failure is None and controls_ok,
        "seconds": seconds,
    }
