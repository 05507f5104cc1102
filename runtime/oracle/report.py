"""The oracle's report: its versioned JSON schema (checked by `check_report`), the
table `qwen3vl oracle` prints, and the atomic write (its location checked first).

Schema version 2: `controls` is the list of negative controls run on the compiled path
(`runtime.oracle.controls`), each {kind, ran_on, branch, detected, first_failing_stage,
...}; the same-input summary moved to `same_input`; `precision` added."""

from __future__ import annotations

import json

from emitter.atomic import write_atomic

from runtime.oracle.controls import CONTROL_KINDS

REPORT_SCHEMA = "qwen3vl-oracle-report"
REPORT_SCHEMA_VERSION = 2


def check_report(report: dict) -> None:
    """Raise ValueError if `report` does not follow schema version REPORT_SCHEMA_VERSION."""
    def need(obj, key, types, where="report"):
        if not isinstance(obj, dict) or key not in obj:
            raise ValueError(f"{where}: missing {key!r}")
        if not isinstance(obj[key], types):
            raise ValueError(f"{where}.{key}: expected {types}, got {type(obj[key]).__name__}")
        return obj[key]

    num = (int, float, type(None))
    if need(report, "schema", str) != REPORT_SCHEMA:
        raise ValueError(f"report.schema: expected {REPORT_SCHEMA!r}")
    if need(report, "schema_version", int) != REPORT_SCHEMA_VERSION:
        raise ValueError(f"report.schema_version: expected {REPORT_SCHEMA_VERSION}")
    model = need(report, "model", dict)
    need(model, "path", str, "model")
    need(model, "config", dict, "model")
    for i, image in enumerate(need(report, "images", list)):
        need(image, "path", str, f"images[{i}]")
        need(image, "grid_thw", list, f"images[{i}]")
    grids = need(report, "grids", list)
    if len(grids) != len(report["images"]) or any(len(g) != 3 for g in grids):
        raise ValueError("report.grids: expected one [t, h, w] per image")
    device = need(report, "device", dict)
    for key in ("target", "driver", "cpu"):
        need(device, key, str, "device")
    tol = need(report, "tolerances", dict)
    for key in ("atol", "rtol", "max_rel_l2"):
        need(tol, key, (int, float), "tolerances")
    need(report, "precision", str)
    need(report, "inspect_blocks", list)
    for i, c in enumerate(need(report, "comparisons", list)):
        where = f"comparisons[{i}]"
        need(c, "stage", str, where)
        need(c, "elements", int, where)
        for key in ("max_abs", "max_rel", "rel_l2"):
            need(c, key, num, where)
        need(c, "violations", int, where)
        need(c, "nonfinite", int, where)
        need(c, "pass", bool, where)
        if c.get("verdict") not in ("pass", "local", "inherited"):
            raise ValueError(f"{where}.verdict: expected pass, local or inherited")
        need(c, "same_input", (dict, type(None)), where)
    need(report, "same_input", dict)
    controls = need(report, "controls", list)
    if sorted(c.get("kind", "") for c in controls if isinstance(c, dict)) != sorted(CONTROL_KINDS):
        raise ValueError(f"report.controls: expected one of each kind {list(CONTROL_KINDS)}")
    for i, c in enumerate(controls):
        where = f"controls[{i}]"
        if c.get("ran_on") not in ("compiled", None):
            raise ValueError(f"{where}.ran_on: expected 'compiled' (or null when not applicable)")
        need(c, "detected", (bool, type(None)), where)
        need(c, "first_failing_stage", (str, type(None)), where)
    need(report, "controls_pass", bool)
    first = need(report, "first_failure", (dict, type(None)))
    if first is not None:
        need(first, "stage", str, "first_failure")
    need(report, "pass", bool)


def _fmt(x, spec=".2e") -> str:
    if x is None:
        return "-"
    return format(x, spec)


def format_table(report: dict) -> str:
    """The comparisons as a table in graph order, then the controls and the verdict."""
    tol = report["tolerances"]
    dev = report["device"]
    lines = [f"model      {report['model']['path']}",
             "images     " + ", ".join(f"{i['path']} {tuple(i['grid_thw'])}" for i in report["images"]),
             "calls      " + ", ".join(f"bucket {c['bucket']} (images {c['images']}, {c['patches']} patches)"
                                      for c in report["calls"]),
             f"device     {dev['target']} ({dev['driver']}), {dev['cpu']}; reference {report['reference']['dtype']}",
             f"tolerance  atol {tol['atol']:g}, rtol {tol['rtol']:g}, max rel L2 {tol['max_rel_l2']:g}",
             ""]
    width = max([len("stage")] + [len(c["stage"]) for c in report["comparisons"]])
    head = (f"{'stage':<{width}}  {'elements':>9}  {'max_abs':>9}  {'max_rel':>9}  {'rel_l2':>9}  "
            f"{'>tol':>6}  {'nonfin':>6}  {'same-in L2':>10}  result")
    lines += [head, "-" * len(head)]
    for c in report["comparisons"]:
        same = c["same_input"]["rel_l2"] if c["same_input"] else None
        if c.get("missing"):
            result = "FAIL (missing from the graph)"
        elif c["pass"]:
            result = "ok"
        else:
            result = f"FAIL ({c['verdict']})"
        lines.append(f"{c['stage']:<{width}}  {c['elements']:>9}  {_fmt(c['max_abs']):>9}  {_fmt(c['max_rel']):>9}  "
                     f"{_fmt(c['rel_l2']):>9}  {c['violations']:>6}  {c['nonfinite']:>6}  {_fmt(same):>10}  {result}")
    lines.append("")
    for c in report["controls"]:
        state = {True: "detected", False: "NOT DETECTED", None: "skipped"}[c["detected"]]
        where = f" (first failing: {c['first_failing_stage']})" if c["first_failing_stage"] else ""
        lines.append(f"control    {c['kind']}: {c['description']} -> {state}{where}")
    first = report["first_failure"]
    if first is None:
        lines.append("first failure  none")
    else:
        how = ("wrong on its own input (local)" if first["verdict"] == "local"
               else "right on its own input: drift inherited from upstream")
        lines.append(f"first failure  {first['stage']}: {how}")
    lines.append(f"result     {'PASS' if report['pass'] else 'FAIL'} "
                 f"({sum(c['pass'] for c in report['comparisons'])}/{len(report['comparisons'])} stages)")
    return "\n".join(lines)


def check_report_path(path, model=None, images=()) -> None:
    """Before any work, ValueError unless `path` can take the report (see
    `runtime.outputs.check_output_path`: writable now, not an input)."""
    from runtime.outputs import check_output_path
    check_output_path(path, model, images, "--report")


def write_report(path, report: dict) -> None:
    write_atomic(path, json.dumps(report, indent=2, allow_nan=False) + "\n")
