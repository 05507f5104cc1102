"""`qwen3vl oracle`: the compiled diagnostics graph against the numpy reference, stage by
stage, in graph order; which stage fails first, and whether it is wrong on its own
input (local) or only inherits drift from upstream (inherited).

One payload: the images are processed once, packed into the session's buckets and run
through the diagnostics graph (one call per pack; per-stage results concatenated in
image order); the reference (`runtime.reference`, independent of the emitter) runs on
the same `pixel_values` and `grid_thw`.

Per stage: elements, max |a-e|, max |a-e|/|e| (over elements with |e| > atol), relative
L2 ||a-e||/||e||, the count of elements with |a-e| > atol + rtol*|e|, the non-finite
count, and pass (see `PASS_RULE`). For `merger` and `deepstack_merger_list.K` the actual
is the graph's output (`image_embeds`, `deepstack_features.K`: what a prefill consumes).

Same-input controls: the reference recomputes each inspected block from the graph's own
input to that block (the previous block's output, or `embed`), every merger from the
graph's own input to it, `embed` from the graph's own patch and position embeddings, and
the block of any failing stage; those comparisons carry that second comparison, so a
failing stage is `local` (wrong even on the graph's own input) or `inherited` (right on
its own input: the error came from upstream). Stages with no upstream stage
(`patch_embed`, `pos_embed`) are always local. A `blocks.N.input` row is its source
stage again and shares its same-input result.

Default tolerances (atol 1e-3, rtol 1e-3, relative L2 1e-4): the f32 graph against the f64
reference stays below max |a-e| 2e-5 and relative L2 2.2e-6 on every stage of a random
2B-sized checkpoint (24 blocks), about 50x inside; the absolute term leaves room for the
larger activations of released checkpoints, and the relative-L2 bound catches a stage
that is wrong everywhere by less than atol (a small-valued stage, a missing bias).

Negative controls: the graph's outputs are perturbed (last DeepStack branch dropped;
DeepStack branch 0 zeroed) and compared again; each must be detected, or the run fails.
"""

from __future__ import annotations

import math
import os
import platform
import re
import time
from pathlib import Path

import click
import numpy as np

from emitter import __version__
from emitter.cli import fail
from emitter.config import VisionConfig
from emitter.vision import BLOCK_STAGES, MERGER_STAGES, STAGE_PREFIX, default_inspect_blocks, stage_names

from .oracle_report import (CONTROL_NAMES, REPORT_SCHEMA, REPORT_SCHEMA_VERSION, check_report,  # noqa: F401
                            format_table, write_report)

DEFAULT_ATOL = 1e-3
DEFAULT_RTOL = 1e-3
DEFAULT_MAX_REL_L2 = 1e-4
PASS_RULE = ("a stage passes when its shape matches, no element is non-finite, no element has "
             "|a-e| > atol + rtol*|e|, and ||a-e||/||e|| <= max_rel_l2")
INNER_STAGES = ("input",) + BLOCK_STAGES  # `blocks.N.input` is the block's input (previous output)

__all__ = ["REPORT_SCHEMA", "REPORT_SCHEMA_VERSION", "DEFAULT_ATOL", "DEFAULT_RTOL", "DEFAULT_MAX_REL_L2",
           "PASS_RULE", "compare", "oracle_stage_names", "parse_stages", "run_oracle", "format_table",
           "check_report", "oracle_command"]


# --------------------------------------------------------------------------- comparing

def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def compare(actual, expected, atol: float, rtol: float, max_rel_l2: float = DEFAULT_MAX_REL_L2) -> dict:
    """One stage, actual (graph) against expected (reference), in f64. `actual` None means
    the graph did not return the stage: it fails. Non-finite metrics are written as None."""
    if actual is None:
        e = np.asarray(expected)
        return {"shape": list(e.shape), "elements": int(e.size), "missing": True, "max_abs": None,
                "max_rel": None, "rel_l2": None, "violations": int(e.size), "nonfinite": 0, "pass": False}
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return {"shape": list(e.shape), "actual_shape": list(a.shape), "elements": int(e.size), "missing": False,
                "max_abs": None, "max_rel": None, "rel_l2": None, "violations": int(e.size), "nonfinite": 0,
                "pass": False}
    finite = np.isfinite(a) & np.isfinite(e)
    nonfinite = int(a.size - np.count_nonzero(finite))
    diff = np.abs(np.where(finite, a, 0.0) - np.where(finite, e, 0.0))
    mag = np.abs(np.where(finite, e, 0.0))
    violations = int(np.count_nonzero(diff > atol + rtol * mag))
    max_abs = float(diff.max()) if diff.size else 0.0
    scaled = mag > atol
    max_rel = float((diff[scaled] / mag[scaled]).max()) if np.any(scaled) else 0.0
    num, den = float(np.linalg.norm(diff)), float(np.linalg.norm(mag))
    rel_l2 = num / den if den > 0 else (0.0 if num == 0 else math.inf)
    ok = nonfinite == 0 and violations == 0 and rel_l2 <= max_rel_l2
    return {"shape": list(e.shape), "elements": int(e.size), "missing": False, "max_abs": max_abs,
            "max_rel": max_rel, "rel_l2": _finite_or_none(rel_l2), "violations": violations,
            "nonfinite": nonfinite, "pass": bool(ok)}


# --------------------------------------------------------------------------- stage names

def oracle_stage_names(cfg: VisionConfig, inspect_blocks) -> list[str]:
    """The compared stages in graph order: the diagnostics stages with `blocks.N.input`
    before each inspected block's inner stages."""
    names = []
    for name in stage_names(cfg, inspect_blocks):
        m = re.fullmatch(r"blocks\.(\d+)\.norm1", name)
        if m:
            names.append(f"blocks.{m.group(1)}.input")
        names.append(name)
    return names


def _valid_forms(cfg: VisionConfig) -> str:
    k = len(cfg.deepstack_visual_indexes)
    inner = "|".join(INNER_STAGES)
    merger = "|".join(MERGER_STAGES)
    forms = ["patch_embed", "pos_embed", "embed", f"blocks.N or blocks.N.{{{inner}}} (N in 0..{cfg.depth - 1})"]
    if k:
        forms.append(f"deepstack_merger_list.K[.{{{merger}}}] (K in 0..{k - 1})")
    forms.append(f"merger[.{{{merger}}}]")
    return ", ".join(forms)


def parse_stages(cfg: VisionConfig, stages) -> tuple[list[str], set[int]]:
    """Check `--stage` names; returns them and the blocks whose inner stages they need."""
    every = set(oracle_stage_names(cfg, range(cfg.depth)))
    needed = set()
    for name in stages:
        if name not in every:
            raise ValueError(f"--stage {name}: unknown stage; expected {_valid_forms(cfg)}")
        m = re.fullmatch(r"blocks\.(\d+)\.\w+", name)
        if m:
            needed.add(int(m.group(1)))
    return list(dict.fromkeys(stages)), needed


def _kind(name: str) -> str:
    """"patch" (one row per patch) or "merged" (one row per merged token)."""
    if name.startswith("deepstack_merger_list.") or name in ("merger", "merger.fc1", "merger.act"):
        return "merged"  # DeepStack mergers normalize after the 2x2 shuffle
    return "patch"


def _upstream(cfg: VisionConfig, name: str) -> str | None:
    """The graph stage whose value is the reference's input for the same-input recompute."""
    m = re.fullmatch(r"blocks\.(\d+)(\..+)?", name)
    if m:
        i = int(m.group(1))
        return "embed" if i == 0 else f"blocks.{i - 1}"
    m = re.fullmatch(r"deepstack_merger_list\.(\d+)(\..+)?", name)
    if m:
        return f"blocks.{cfg.deepstack_visual_indexes[int(m.group(1))]}"
    if name == "merger" or name.startswith("merger."):
        return f"blocks.{cfg.depth - 1}"
    return None


# --------------------------------------------------------------------------- running

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


def _graph_stages(session, pixel_values, grid_thw, names) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Every result of the diagnostics graph over all images, per name, in image order."""
    calls, graph = session.run_packed(pixel_values, grid_thw, names)
    info = [{"bucket": c.bucket, "images": list(c.images), "patches": c.patches} for c in calls]
    return graph, info


def _actuals(cfg: VisionConfig, graph: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Graph values by oracle stage name: diagnostics stages, outputs for the mergers."""
    out = {n[len(STAGE_PREFIX):]: v for n, v in graph.items() if n.startswith(STAGE_PREFIX)}
    out.pop("merger", None)
    for k in range(len(cfg.deepstack_visual_indexes)):
        out.pop(f"deepstack_merger_list.{k}", None)
    if "image_embeds" in graph:
        out["merger"] = graph["image_embeds"]
    for k in range(len(cfg.deepstack_visual_indexes)):
        if f"deepstack_features.{k}" in graph:
            out[f"deepstack_merger_list.{k}"] = graph[f"deepstack_features.{k}"]
    for i in range(cfg.depth):
        src = "embed" if i == 0 else f"blocks.{i - 1}"
        if src in out:
            out[f"blocks.{i}.input"] = out[src]
    return out


def _source(cfg: VisionConfig, name: str) -> str:
    if name == "merger":
        return "image_embeds"
    m = re.fullmatch(r"deepstack_merger_list\.(\d+)", name)
    if m:
        return f"deepstack_features.{m.group(1)}"
    m = re.fullmatch(r"blocks\.(\d+)\.input", name)
    if m:
        i = int(m.group(1))
        return STAGE_PREFIX + ("embed" if i == 0 else f"blocks.{i - 1}")
    return STAGE_PREFIX + name


def _expected(cfg: VisionConfig, stages: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(stages)
    for i in range(cfg.depth):
        out[f"blocks.{i}.input"] = stages["embed"] if i == 0 else stages[f"blocks.{i - 1}"]
    return out


def _same_input(cfg: VisionConfig, ref, actual: dict[str, np.ndarray], grid_thw, wanted) -> dict[str, np.ndarray]:
    """The reference's value of each wanted stage, recomputed from the graph's own input
    to its block (or merger, or sum)."""
    from .reference import merger_stages
    out: dict[str, np.ndarray] = {}
    names = set(wanted)
    if "embed" in names and "patch_embed" in actual and "pos_embed" in actual:
        out["embed"] = actual["patch_embed"].astype(ref.dtype) + actual["pos_embed"].astype(ref.dtype)
    for i in range(cfg.depth):
        if not any(n == f"blocks.{i}" or n.startswith(f"blocks.{i}.") for n in names):
            continue
        x = actual.get(_upstream(cfg, f"blocks.{i}"))
        if x is None:
            continue
        inner = ref.block(i, x, grid_thw)
        out[f"blocks.{i}"] = inner.pop("out")
        out.update({f"blocks.{i}.{k}": v for k, v in inner.items()})
    mergers = ["merger"] + [f"deepstack_merger_list.{k}" for k in range(len(cfg.deepstack_visual_indexes))]
    for m in mergers:
        if not any(n == m or n.startswith(m + ".") for n in names):
            continue
        x = actual.get(_upstream(cfg, m))
        if x is None:
            continue
        inner = merger_stages(x.astype(ref.dtype), ref.group(m + "."), cfg, m != "merger")
        out[m] = inner.pop("out")
        out.update({f"{m}.{k}": v for k, v in inner.items()})
    return out


def _inspected(name: str, inspect) -> bool:
    m = re.fullmatch(r"blocks\.(\d+)(\..+)?", name)
    return bool(m) and int(m.group(1)) in inspect


def _metrics(entry: dict) -> dict:
    keys = ("max_abs", "max_rel", "rel_l2", "violations", "nonfinite", "pass")
    return {k: entry[k] for k in keys}


def _negative_controls(cfg: VisionConfig, actual: dict, expected: dict, tol: dict) -> list[dict]:
    k = len(cfg.deepstack_visual_indexes)
    outputs = [f"deepstack_merger_list.{j}" for j in range(k)] + ["merger"]
    perturbations = []
    if k:
        last = f"deepstack_merger_list.{k - 1}"
        dropped = {n: v for n, v in actual.items() if n != last}
        perturbations.append((CONTROL_NAMES[0], f"graph output deepstack_features.{k - 1} dropped", last, dropped))
        first = "deepstack_merger_list.0"
        zeroed = dict(actual)
        zeroed[first] = np.zeros_like(actual[first]) if first in actual else None
        perturbations.append((CONTROL_NAMES[1], "graph output deepstack_features.0 zeroed", first, zeroed))
    controls = []
    for name, description, target, perturbed in perturbations:
        failing = [n for n in outputs if not compare(perturbed.get(n), expected[n], **tol)["pass"]]
        controls.append({"name": name, "perturbation": description, "expect_failing": target,
                         "failing_stages": failing, "detected": target in failing})
    if not k:
        controls = [{"name": n, "perturbation": "not applicable: the model has no DeepStack mergers",
                     "expect_failing": None, "failing_stages": [], "detected": None} for n in CONTROL_NAMES]
    return controls


def _check_tolerances(atol, rtol, max_rel_l2) -> None:
    for flag, value in (("--atol", atol), ("--rtol", rtol), ("--max-rel-l2", max_rel_l2)):
        if value is None or not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} {value}: expected a finite, non-negative number")


def run_oracle(model_dir, images, atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
               max_rel_l2: float = DEFAULT_MAX_REL_L2, inspect_blocks=None, stages=None,
               reference_dtype: str = "f64", cache_dir=None, buckets=None, target=None, threads=None,
               progress=None, perturb=None) -> dict:
    """Run the diagnostics graph and the reference on the same payload; return the report.

    `inspect_blocks`: blocks whose inner stages to compare (default the first and last);
    `stages`: compare only these (oracle stage names; blocks they name are inspected);
    `perturb(graph)`: a hook that edits the graph's results by ABI name before comparing
    (tests). Raises ValueError for bad input."""
    from .build import make_plan
    from .checkpoint import load_vision_weights
    from .processor import process_images
    from .reference import Reference
    from .session import VisionSession

    _check_tolerances(atol, rtol, max_rel_l2)
    dtypes = {"f32": np.float32, "f64": np.float64}
    if reference_dtype not in dtypes:
        raise ValueError(f"--reference-dtype {reference_dtype}: expected f32 or f64")
    plan = make_plan(str(model_dir), None, buckets or (), target, True, None)
    cfg = plan.cfg
    bad = [i for i in (inspect_blocks or ()) if not 0 <= int(i) < cfg.depth]
    if bad:
        raise ValueError(f"--inspect-block {bad[0]}: expected a block index in [0, {cfg.depth})")
    selected, needed = parse_stages(cfg, stages or ())
    base = tuple(inspect_blocks) if inspect_blocks else default_inspect_blocks(cfg)
    inspect = tuple(sorted(set(int(i) for i in base) | needed))
    tol = {"atol": float(atol), "rtol": float(rtol), "max_rel_l2": float(max_rel_l2)}
    names = [str(p) for p in images]
    if not names:
        raise ValueError("IMAGE: give at least one image file")
    from .processor import check_image_file
    for name in names:
        check_image_file(name)  # missing, a directory, a FIFO...: say which

    seconds = {}
    t0 = time.perf_counter()
    session = VisionSession(model_dir, buckets=buckets, target=target, cache_dir=cache_dir, threads=threads,
                            progress=progress, diagnostics=True, inspect_blocks=inspect)
    seconds["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    pixel_values, grid_thw = process_images(names, session.policy, names=names)
    seconds["process"] = time.perf_counter() - t
    t = time.perf_counter()
    from .packing import pack
    for bucket in sorted({c.bucket for c in pack(grid_thw, session.buckets, names)}):
        session.module(bucket)  # from the cache, compiled on a miss
    seconds["artifacts"] = time.perf_counter() - t
    t = time.perf_counter()
    graph, calls = _graph_stages(session, pixel_values, grid_thw, names)
    if perturb:
        graph = perturb(dict(graph)) or graph
    seconds["graph"] = time.perf_counter() - t

    t = time.perf_counter()
    ref = Reference(cfg, load_vision_weights(model_dir, cfg), dtypes[reference_dtype])
    expected = _expected(cfg, ref.run(pixel_values, grid_thw))
    actual = _actuals(cfg, graph)
    order = oracle_stage_names(cfg, inspect)
    compared = [n for n in order if n in set(selected)] if selected else order
    seconds["reference"] = time.perf_counter() - t

    t = time.perf_counter()
    comparisons = []
    for name in compared:
        entry = {"stage": name, "kind": _kind(name), "source": _source(cfg, name)}
        entry.update(compare(actual.get(name), expected[name], **tol))
        alias = re.fullmatch(r"blocks\.(\d+)\.input", name)
        if alias:
            i = int(alias.group(1))
            entry["alias_of"] = "embed" if i == 0 else f"blocks.{i - 1}"
        comparisons.append(entry)
    seconds["compare"] = time.perf_counter() - t

    # Same-input recomputes: the inspected blocks, the embedding sum and every merger
    # always; any other block only when one of its stages fails (a block costs as much
    # as in the reference run itself).
    t = time.perf_counter()
    local = {c.get("alias_of", c["stage"]) for c in comparisons if not c["pass"]}
    local |= {c["stage"] for c in comparisons if "alias_of" not in c
              and (_inspected(c["stage"], inspect) or not c["stage"].startswith("blocks."))}
    same = _same_input(cfg, ref, actual, grid_thw, local)
    for entry in comparisons:
        local_name = entry.get("alias_of", entry["stage"])
        if local_name in same and actual.get(local_name) is not None:
            entry["same_input"] = _metrics(compare(actual[local_name], same[local_name], **tol))
            entry["same_input"]["input"] = _upstream(cfg, local_name) or "patch_embed + pos_embed"
        else:
            entry["same_input"] = None
        if entry["pass"]:
            entry["verdict"] = "pass"
        elif entry["same_input"] is not None and entry["same_input"]["pass"]:
            entry["verdict"] = "inherited"
        else:
            entry["verdict"] = "local"
    seconds["same_input"] = time.perf_counter() - t
    controls = _negative_controls(cfg, actual, expected, tol)

    first = next((c for c in comparisons if not c["pass"]), None)
    first_failure = None if first is None else {
        "stage": first["stage"], "verdict": first["verdict"], "max_abs": first["max_abs"],
        "rel_l2": first["rel_l2"], "violations": first["violations"], "nonfinite": first["nonfinite"],
        "same_input_rel_l2": first["same_input"]["rel_l2"] if first["same_input"] else None}
    controls_ok = all(c["detected"] is not False for c in controls)
    grids = [[int(v) for v in g] for g in grid_thw]
    report = {
        "schema": REPORT_SCHEMA,
        "schema_version": REPORT_SCHEMA_VERSION,
        "tool": {"name": "qwen3vl oracle", "version": __version__},
        "model": {"path": str(Path(model_dir).resolve()), "title": plan.title, "config": cfg.to_dict()},
        "images": [{"path": n, "grid_thw": g, "patches": int(np.prod(g)),
                    "merged": int(np.prod(g)) // cfg.merge_unit} for n, g in zip(names, grids)],
        "grids": grids,
        "calls": calls,
        "device": device_info(session.plan.target, threads),
        "reference": {"dtype": reference_dtype, "module": "runtime.reference"},
        "tolerances": {**tol, "rule": PASS_RULE},
        "inspect_blocks": list(inspect),
        "stages_selected": selected or None,
        "comparisons": comparisons,
        "controls": {
            "same_input": {
                "description": "the reference recomputes the inspected blocks, every merger, the "
                               "embedding sum, and the block of any failing stage from the graph's "
                               "own input to it",
                "inspect_blocks": list(inspect),
                "local_failures": [c["stage"] for c in comparisons if c["verdict"] == "local"],
                "inherited_failures": [c["stage"] for c in comparisons if c["verdict"] == "inherited"],
            },
            "negative": controls,
            "pass": controls_ok,
        },
        "first_failure": first_failure,
        "pass": first is None and controls_ok,
        "seconds": seconds,
    }
    return report


# --------------------------------------------------------------------------- command

@click.command("oracle", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", metavar="DIR", required=True, help="Checkpoint folder (config.json, "
                                                               "preprocessor_config.json, *.safetensors).")
@click.argument("images", nargs=-1, metavar="IMAGE...")
@click.option("--report", "report_path", metavar="FILE", help="Write the JSON report here (also when a stage fails).")
@click.option("--atol", type=float, default=DEFAULT_ATOL, show_default=True,
              help="Absolute tolerance per element.")
@click.option("--rtol", type=float, default=DEFAULT_RTOL, show_default=True,
              help="Relative tolerance per element.")
@click.option("--max-rel-l2", type=float, default=DEFAULT_MAX_REL_L2, show_default=True,
              help="Largest relative L2 error ||a-e||/||e|| a stage may have.")
@click.option("--inspect-block", "inspect_blocks", type=int, multiple=True, metavar="N",
              help="A block whose inner stages to compare (repeatable; default the first and the last).")
@click.option("--stage", "stages", multiple=True, metavar="NAME",
              help="Compare only this stage (repeatable), e.g. embed, blocks.3, blocks.0.attn, merger.fc1.")
@click.option("--reference-dtype", type=click.Choice(["f32", "f64"]), default="f64", show_default=True,
              help="Precision of the numpy reference.")
@click.option("--bucket", "buckets", multiple=True, metavar="N",
              help="Patches per call, a positive multiple of 4 (repeatable; default 64 128 256 512).")
@click.option("--target", default=None, metavar="T", help="Compile target (default llvm-cpu).")
@click.option("--cache-dir", metavar="DIR", help="Artifact cache folder (default $QWEN3VL_CACHE_DIR, "
                                                  "else the user cache folder).")
@click.option("--threads", type=int, default=None, metavar="N", help="IREE worker threads.")
def oracle_command(model, images, report_path, atol, rtol, max_rel_l2, inspect_blocks, stages, reference_dtype,
                   buckets, target, cache_dir, threads):
    """Compare the compiled diagnostics graph with the numpy reference, stage by stage.

    Prints a table in graph order (embeddings, every block output, the inner stages of
    the inspected blocks, each merger's norm/fc1/act and output), names the first
    failing stage and whether it is wrong on the graph's own input to its block
    (local) or only inherits drift (inherited), and checks two negative controls (last
    DeepStack branch dropped, branch 0 zeroed) are detected.

    \b
    Pass rule (a = graph, e = reference): a stage passes when its shape
    matches, no element is non-finite, no element has |a-e| > atol + rtol*|e|,
    and ||a-e||/||e|| <= max-rel-l2. Exit 0 when every stage passes and both
    controls are detected, 1 otherwise (the report is written either way), 2
    for bad input.
    """
    from .compiler import CompileError

    def say(message):
        click.echo(message, err=True)

    try:
        _check_tolerances(atol, rtol, max_rel_l2)
        if report_path and not Path(report_path).resolve().parent.is_dir():
            raise ValueError(f"--report {report_path}: folder {Path(report_path).resolve().parent} does not exist")
        report = run_oracle(model, images, atol=atol, rtol=rtol, max_rel_l2=max_rel_l2,
                            inspect_blocks=inspect_blocks or None, stages=stages, reference_dtype=reference_dtype,
                            cache_dir=cache_dir, buckets=buckets or None, target=target, threads=threads,
                            progress=say)
    except (ValueError, OSError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except CompileError as e:
        click.echo(f"error: {e}", err=True)
        raise SystemExit(1)
    if report_path:
        write_report(report_path, report)
    click.echo(format_table(report))
    if report_path:
        click.echo(f"report     {report_path}")
    if not report["pass"]:
        raise SystemExit(1)
