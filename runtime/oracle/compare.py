"""The oracle's comparison: graph values against reference values, stage by stage.

Per stage: elements, max |a-e|, max |a-e|/|e| (over elements with |e| > atol), relative
L2 ||a-e||/||e||, the count of elements with |a-e| > atol + rtol*|e|, the non-finite
count, and pass (see `PASS_RULE`). For `merger` and `deepstack_merger_list.K` the actual
is the graph's output (`image_embeds`, `deepstack_features.K`: what a prefill consumes).

Same-input verdicts: the reference recomputes each inspected block from the graph's own
input to that block (the previous block's output, or `embed`), every merger from the
graph's own input to it, `embed` from the graph's own patch and position embeddings, and
the block of any failing stage; a failing stage is then `local` (wrong even on the
graph's own input) or `inherited` (right on its own input: the error came from
upstream). Stages with no upstream stage (`patch_embed`, `pos_embed`) are always local.
A `blocks.N.input` row is its source stage again and shares its same-input result.

Default tolerances, per precision (`DEFAULT_TOLERANCES`), from the errors of the real
graph on random checkpoints against the f64 reference (two images; worst stage of all;
"elementwise" is max |a-e|/(1+|e|), what atol = rtol must exceed), and from the smallest
wrong graphs they must still catch (tests/test_mutations.py):

                                      rel L2    elementwise
  f32 graph,  tiny (4 blocks)         7.9e-7    3.0e-6
  f32 graph,  2B-sized (24 blocks)    2.2e-6    1.4e-5
    the same, f32 reference           2.3e-6    1.3e-5
  bf16 graph, tiny                    4.9e-3    1.4e-2
  bf16 graph, 2B-sized                5.8e-3    4.8e-2
  f32, LayerNorm eps 1e-5, tiny       2.3e-5    3.8e-5
  f32, LayerNorm eps 1e-5, 2B-sized   1.4e-5    7.1e-5
  f32, attention scale x1.0001, tiny  6.7e-5    1.4e-4
  f32, attention scale x1.0001, 2B    5.0e-5    1.2e-4
  f32, tanh GELU in mergers, tiny     2.1e-4
  f32, rotary halves swapped, tiny    0.45

f32: max rel L2 5e-6, 2.3x above the 2B graph's error and 2.7x below the smallest
mutation's (eps on 2B; 6x and 4.6x on tiny); the relative L2 bound is what catches a
stage wrong everywhere by a little. atol = rtol = 1e-4, 7x above the 2B graph's worst
element, catch a few elements wrong by much. bf16 rounds every matmul operand (2^-9
relative each), so its bounds are an honest bf16 graph's with room: max rel L2 3e-2
(5x the 2B graph's), atol = rtol = 0.2 (4x); a bf16 run cannot tell mutations this
small, only gross ones.
"""

from __future__ import annotations

import math
import re

import numpy as np

from emitter.config import VisionConfig
from emitter.vision import BLOCK_STAGES, MERGER_STAGES, STAGE_PREFIX, stage_names

DEFAULT_TOLERANCES = {
    "f32": {"atol": 1e-4, "rtol": 1e-4, "max_rel_l2": 5e-6},
    "bf16": {"atol": 2e-1, "rtol": 2e-1, "max_rel_l2": 3e-2},
}
DEFAULT_ATOL = DEFAULT_TOLERANCES["f32"]["atol"]
DEFAULT_RTOL = DEFAULT_TOLERANCES["f32"]["rtol"]
DEFAULT_MAX_REL_L2 = DEFAULT_TOLERANCES["f32"]["max_rel_l2"]
PASS_RULE = ("a stage passes when its shape matches, no element is non-finite, no element has "
             "|a-e| > atol + rtol*|e|, and ||a-e||/||e|| <= max_rel_l2")
INNER_STAGES = ("input",) + BLOCK_STAGES  # `blocks.N.input` is the block's input (previous output)


def tolerances(precision: str = "f32", atol=None, rtol=None, max_rel_l2=None) -> dict:
    """The precision's default tolerances, with any given value in place of its default;
    ValueError naming the option for a negative or non-finite one."""
    if precision not in DEFAULT_TOLERANCES:
        raise ValueError(f"--precision {precision}: expected one of {', '.join(DEFAULT_TOLERANCES)}")
    tol = dict(DEFAULT_TOLERANCES[precision])
    for key, flag, value in (("atol", "--atol", atol), ("rtol", "--rtol", rtol),
                             ("max_rel_l2", "--max-rel-l2", max_rel_l2)):
        if value is None:
            continue
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag} {value}: expected a finite, non-negative number")
        tol[key] = float(value)
    return tol


# --------------------------------------------------------------------------- one stage

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


def upstream(cfg: VisionConfig, name: str) -> str | None:
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


def _source(name: str) -> str:
    """The graph result (ABI name) a stage's actual value comes from."""
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


# --------------------------------------------------------------------------- values by stage

def actuals(cfg: VisionConfig, graph: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Graph values by oracle stage name: diagnostics stages, outputs for the mergers."""
    out = {n[len(STAGE_PREFIX):]: v for n, v in graph.items() if n.startswith(STAGE_PREFIX)}
    out.pop("merger", None)
    for k in range(len(cfg.deepstack_visual_indexes)):
        out.pop(f"deepstack_merger_list.{k}", None)
    if graph.get("image_embeds") is not None:
        out["merger"] = graph["image_embeds"]
    for k in range(len(cfg.deepstack_visual_indexes)):
        if graph.get(f"deepstack_features.{k}") is not None:
            out[f"deepstack_merger_list.{k}"] = graph[f"deepstack_features.{k}"]
    for i in range(cfg.depth):
        src = "embed" if i == 0 else f"blocks.{i - 1}"
        if src in out:
            out[f"blocks.{i}.input"] = out[src]
    return out


def expected_stages(cfg: VisionConfig, stages: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference's stages, with `blocks.N.input` added."""
    out = dict(stages)
    for i in range(cfg.depth):
        out[f"blocks.{i}.input"] = stages["embed"] if i == 0 else stages[f"blocks.{i - 1}"]
    return out


def _same_input(cfg: VisionConfig, ref, actual: dict[str, np.ndarray], grid_thw, wanted) -> dict[str, np.ndarray]:
    """The reference's value of each wanted stage, recomputed from the graph's own input
    to its block (or merger, or sum)."""
    from runtime.oracle.reference import merger_stages
    out: dict[str, np.ndarray] = {}
    names = set(wanted)
    if "embed" in names and "patch_embed" in actual and "pos_embed" in actual:
        out["embed"] = actual["patch_embed"].astype(ref.dtype) + actual["pos_embed"].astype(ref.dtype)
    for i in range(cfg.depth):
        if not any(n == f"blocks.{i}" or n.startswith(f"blocks.{i}.") for n in names):
            continue
        x = actual.get(upstream(cfg, f"blocks.{i}"))
        if x is None:
            continue
        inner = ref.block(i, x, grid_thw)
        out[f"blocks.{i}"] = inner.pop("out")
        out.update({f"blocks.{i}.{k}": v for k, v in inner.items()})
    mergers = ["merger"] + [f"deepstack_merger_list.{k}" for k in range(len(cfg.deepstack_visual_indexes))]
    for m in mergers:
        if not any(n == m or n.startswith(m + ".") for n in names):
            continue
        x = actual.get(upstream(cfg, m))
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


# --------------------------------------------------------------------------- every stage

def compare_stages(cfg: VisionConfig, actual: dict, expected: dict, names, tol: dict) -> list[dict]:
    """One comparison entry per stage name, in the order given (no verdicts yet)."""
    entries = []
    for name in names:
        entry = {"stage": name, "kind": _kind(name), "source": _source(name)}
        entry.update(compare(actual.get(name), expected[name], **tol))
        alias = re.fullmatch(r"blocks\.(\d+)\.input", name)
        if alias:
            i = int(alias.group(1))
            entry["alias_of"] = "embed" if i == 0 else f"blocks.{i - 1}"
        entries.append(entry)
    return entries


def add_verdicts(cfg: VisionConfig, entries: list[dict], ref, actual: dict, grid_thw, inspect, tol: dict) -> None:
    """Give each entry its same-input comparison (where recomputed) and its verdict: pass,
    local or inherited. The inspected blocks, the embedding sum and every merger are
    recomputed always; any other block only when one of its stages fails (a block costs
    as much as in the reference run itself)."""
    local = {c.get("alias_of", c["stage"]) for c in entries if not c["pass"]}
    local |= {c["stage"] for c in entries if "alias_of" not in c
              and (_inspected(c["stage"], inspect) or not c["stage"].startswith("blocks."))}
    same = _same_input(cfg, ref, actual, grid_thw, local)
    for entry in entries:
        local_name = entry.get("alias_of", entry["stage"])
        if local_name in same and actual.get(local_name) is not None:
            entry["same_input"] = _metrics(compare(actual[local_name], same[local_name], **tol))
            entry["same_input"]["input"] = upstream(cfg, local_name) or "patch_embed + pos_embed"
        else:
            entry["same_input"] = None
        if entry["pass"]:
            entry["verdict"] = "pass"
        elif entry["same_input"] is not None and entry["same_input"]["pass"]:
            entry["verdict"] = "inherited"
        else:
            entry["verdict"] = "local"
