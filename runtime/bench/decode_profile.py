"""One decode step of the language model, compiled alone and run with IREE's own tools:
the module (`decode_module`), random weights for it (`write_archive`), a timed run
(`step_ms`, `iree-benchmark-module`) and what its profile records (`copy_lengths`,
`profile_report`, `iree-profile`). Used by benchmarks/bench_decode.py and the test that
decode copies no whole KV cache (tests/test_decode_cache.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from dataclasses import replace

import numpy as np

from emitter import quant
from emitter.module import render
from emitter.kv_pages import BLOCK
from emitter.text import MATMUL_SUFFIXES, decode_function, text_weights, weight_layouts, weight_shapes
from emitter.text_shape import MODULE_NAME, TextShape, decode_name

TOOLS = Path(sys.executable).parent


def decode_shape(context: int, lanes: int = 1) -> TextShape:
    """`lanes` sequences of `context` slots (a multiple of 16), lane i's blocks
    i * context / 16 + 1.. in order."""
    return TextShape((min(512, context),), context, lanes)


# Benchmark names of a quantized checkpoint run in its bits (`--precision native`): every
# matmul weight in this layout, over f32. MLX's affine forms (groups of 64, mlx-vlm's
# default); `gguf-q4_0`, a GGUF Q4_0 file run in its bits (symmetric, groups of 32, f32 scales;
# not `--precision q4_0`, the kernel's); `int4-g64`, int4's layout (symmetric, f32 scales per 64).
NATIVE_FORMS = {"mlx4": quant.Layout(4, 64, affine=True), "mlx8": quant.Layout(8, 64, affine=True),
                "gguf-q4_0": quant.Layout(4, 32), "int4-g64": quant.Layout(4, 64)}


def graph_form(cfg, precision: str):
    """(config, graph precision) of a benchmark precision: a graph precision as it is, or
    a `NATIVE_FORMS` name as the config of such a checkpoint over f32."""
    if precision not in NATIVE_FORMS:
        return cfg, precision
    names = [s.name for s in text_weights(cfg) if s.name.endswith(MATMUL_SUFFIXES)]
    return replace(cfg, native_weights=tuple(quant.native_entry(n, NATIVE_FORMS[precision]) for n in names)), "f32"


def decode_module(cfg, context: int, precision: str, lanes: int = 1) -> str:
    """decode_<lanes> alone, over a pool of a context's blocks per lane."""
    shape, (cfg, precision) = decode_shape(context, lanes), graph_form(cfg, precision)
    function, shared = decode_function(cfg, shape, lanes, precision)
    return render(MODULE_NAME, "", shared, [function])


def write_archive(cfg, precision: str, path: Path) -> None:
    """Random weights for `decode_module` (a quantized weight's biases, where it has them, random too)."""
    import iree.runtime as rt
    cfg, precision = graph_form(cfg, precision)
    layouts = weight_layouts(cfg, precision, [name for name, _ in weight_shapes(cfg)])
    rng = np.random.default_rng(0)
    weights = {}
    for spec in text_weights(cfg, precision):
        if spec.name in weights:  # a quantized weight's scales, made with it
            continue
        layout = layouts.get(spec.name)  # stored [K, N], drawn [N, K]
        w = rng.standard_normal(layout.source_shape(spec.shape) if layout else spec.shape, dtype=np.float32) * np.float32(0.02)
        if layout:
            weights[spec.name], weights[quant.scales_name(spec.name)] = layout.store(w)
        else:
            weights[spec.name] = w if spec.dtype == "f32" else (w.view(np.uint32) >> 16).astype(np.uint16)
    rt.save_archive_file(weights, str(path))


def weight_bytes(cfg, precision: str) -> int:
    """Bytes of the module's weights under `precision` (archive and resident alike)."""
    from runtime.artifact.archive import spec_bytes
    return sum(map(spec_bytes, text_weights(*graph_form(cfg, precision))))


def step_ms(vmfb: Path, archive: Path, slot: int, repeats: int, threads: int, profile: Path | None = None,
            context: int = 0, lanes: int = 1) -> float:
    """Mean ms of one decode step (token 5 at cache slot `slot` of each of `lanes` sequences
    of a `context`-slot module, default slot + 1 rounded up to a block, each lane's table
    that many slots' blocks) over `repeats` calls."""
    context = context or -(-(slot + 1) // BLOCK) * BLOCK
    blocks = context // BLOCK
    table = ",".join(str(i) for i in range(1, lanes * blocks + 1))
    command = [str(TOOLS / "iree-benchmark-module"), "--device=local-task", f"--module={vmfb}",
               f"--parameters=model={archive}", f"--function={decode_name(lanes)}",
               f"--input={lanes}xi32={','.join(['5'] * lanes)}",
               f"--input=3x{lanes}xi32={','.join([str(slot)] * 3 * lanes)}",
               f"--input={lanes}xi32={','.join([str(slot)] * lanes)}", f"--input={lanes}x{blocks}xi32={table}",
               f"--benchmark_min_time={repeats}x",
               f"--task_topology_group_count={threads}", "--benchmark_format=json"]
    if profile:
        command += ["--device_profiling_mode=host-execution", f"--device_profiling_output={profile}"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    runs = json.loads(done.stdout[done.stdout.index("{"):])["benchmarks"]
    return next(r["real_time"] for r in runs if r["run_type"] == "iteration")


def copy_lengths(path: Path) -> list[int]:
    """Bytes of each copy recorded in the profiled command buffers."""
    commands = subprocess.run([str(TOOLS / "iree-profile"), "command", str(path)], capture_output=True, text=True,
                              check=True).stdout
    return [int(m) for m in re.findall(r"op=copy .*length=(\d+)", commands)]


def dispatch_kind(key: str) -> str:
    """What a decode dispatch does, from the name IREE gives it (or the kernel's export)."""
    if key.startswith("q8_matmul"):
        return "projections and lm_head, Q8_0 kernel"
    if any(op in key for op in ("matmul", "vecmat", "matvec")):
        return "matmuls, IREE's (projections of other precisions, rope tables)"
    if "xi8" in key or "i8xi32" in key:
        return "activation quantization"
    if "gather" in key or "softmax" in key or key.startswith(("decode_attention", "chunk_attention")):
        return "attention (KV block reads, scores; the decode-attention kernel)"
    if "memcpy" in key or "copy" in key:
        return "copies"
    if "reduction" in key:
        return "reductions (norms, attention sums)"
    return "elementwise (rope, residuals, gating)"


def profile_report(path: Path, steps: int, top: int = 8) -> list[str]:
    """Dispatch time per step in all and by kind (`dispatch_kind`), the top dispatches, and
    the copies in the step's command buffer."""
    out = subprocess.run([str(TOOLS / "iree-profile"), "dispatch", "--format=jsonl", str(path)],
                         capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    groups = sorted((r for r in rows if r.get("type") == "host_dispatch_group"), key=lambda r: -r["total_ns"])
    kinds: dict[str, list] = {}
    for r in groups:
        kind = kinds.setdefault(dispatch_kind(r["key"]), [0, 0])
        kind[0], kind[1] = kind[0] + r["total_ns"], kind[1] + r["count"]
    lines = [f"    {sum(r['total_ns'] for r in groups) / steps / 1e6:7.2f} ms/step in "
             f"{sum(r['count'] for r in groups) // steps} dispatches, by kind:"]
    lines += [f"    {ns / steps / 1e6:7.2f} ms/step {count // steps:4d}x  {kind}"
              for kind, (ns, count) in sorted(kinds.items(), key=lambda kv: -kv[1][0])]
    lines.append("    top dispatches:")
    lines += [f"    {r['total_ns'] / steps / 1e6:7.2f} ms/step  {r['key']}" for r in groups[:top]]
    sizes = copy_lengths(path)
    big = [s for s in sizes if s >= 1 << 20]
    lines.append(f"    copies recorded: {len(sizes)}, of them >= 1 MiB: {len(big)} ({sum(big) / 2**20:.0f} MiB)")
    return lines + queue_report(path, steps)


def dispatch_events(path: Path) -> list[dict]:
    """Every dispatch of a profile with its host start and end, its queue submission and its
    tiles' summed time (`iree-profile dispatch --dispatch_events`), in start order."""
    out = subprocess.run([str(TOOLS / "iree-profile"), "dispatch", "--format=jsonl", "--dispatch_events", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return sorted((json.loads(line) for line in out.splitlines() if '"host_dispatch_event"' in line),
                  key=lambda e: e["start_host_time_ns"])


def submission_sizes(path: Path) -> list[int]:
    """The dispatches in each queue submission of a profile, in order."""
    sizes: dict[int, int] = {}
    for e in dispatch_events(path):
        sizes[e["submission_id"]] = sizes.get(e["submission_id"], 0) + 1
    return list(sizes.values())


def queue_report(path: Path, steps: int) -> list[str]:
    """How the dispatches sat on the queue: queue submissions a step, the queue's idle time
    between one dispatch's end and the next one's start (a step's share, the gaps between
    steps included), and the dispatches of 8 or more workgroups whose tiles all ran on one
    worker (their tiles' summed time under 1.2x the dispatch's wall time)."""
    events = dispatch_events(path)
    idle = sum(max(0, b["start_host_time_ns"] - a["end_host_time_ns"]) for a, b in zip(events, events[1:]))
    wide = [e for e in events if e["workgroup_count"][0] >= 8]
    alone = [e for e in wide if e["tile_duration_sum_ns"] < 1.2 * e["duration_ns"]]
    return [f"    queue: {len({e['submission_id'] for e in events}) / steps:.0f} submissions a step, "
            f"{idle / steps / 1e6:.2f} ms/step idle between dispatches; {len(alone)} of {len(wide)} dispatches of "
            f">= 8 workgroups on one worker ({sum(e['duration_ns'] for e in alone) / steps / 1e6:.2f} ms/step)"]
