"""Where a call's time goes, by IREE's own tools: the artifact as `qwen3vl export` writes it,
called by `iree-benchmark-module` with HAL profiling on (`--device_profiling_mode=
host-execution`: each dispatch's span on the CPU device), and `iree-profile dispatch`'s
per-dispatch aggregates, grouped by kind, per call.

    .venv/bin/python benchmarks/profile_dispatches.py --model CKPT --bucket 512 --precision bf16

`CKPT` is any checkpoint folder (`qwen3vl random-checkpoint DIR --preset qwen3-vl-2b` makes a
random 2B one). The first call is a warm-up (its transients fault their pages in): the
figures are per call over the `--calls` after it. Dispatches run one after another here
(one queue), so their times add up to the call. Profiling costs time of its own, most in
dispatches of many small tiles (a 2B f32 call took 11% longer profiled with IREE 3.13's
default matmul tiles, 5% with 2 MiB ones), so the call is timed unprofiled too: compare
variants by that, and read the per-dispatch rates as lower bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.bench.vision import parse_sizes, random_images, vision_flops  # noqa: E402

BIN = Path(sys.executable).parent
# The glibc settings `runtime.artifact.iree_module.keep_freed_memory` makes in-process (the tunable
# caps the mmap threshold at 32 MiB): freed transients are reused, not faulted in again.
GLIBC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=2147483648:glibc.malloc.arena_max=1"


def kind(name: str) -> str:
    """A dispatch's kind from the name IREE gives it (`<fn>_dispatch_<n>_<op>_<shape>_<types>`)."""
    if "batch_matmul" in name:
        return "attention matmuls (q.k, p.v)"
    if "matmul" in name or "matvec" in name:
        return "linears (weights)"
    if "softmax" in name:
        return "softmax"
    if name.startswith("_encoding") or "_encoding_" in name:
        return "data-tiling packs"
    if "reduction" in name:
        return "norm statistics"
    return "elementwise, rotary, transposes"


def flops(name: str) -> float:
    """2 x the multiply-adds a matmul dispatch's name states (MxNxK, or BxMxNxK batched)."""
    m = re.search(r"_(batch_)?mat(?:mul|vec_like)_(\d+(?:x\d+)+)_", name)
    if not m:
        return 0.0
    dims = [int(v) for v in m.group(2).split("x")]
    total = 2.0
    for d in dims:
        total *= d
    return total


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def profile(args, workdir: Path) -> dict:
    out = workdir / "artifact"
    run([str(BIN / "qwen3vl"), "export", "--model", args.model, "-o", str(out), "--bucket", str(args.bucket),
         "--precision", args.precision, "--name", "model", *(["--cache-dir", args.cache_dir] if args.cache_dir else [])],
        stdout=subprocess.DEVNULL)
    paths = []
    for i, image in enumerate(random_images(parse_sizes(args.images, "--images"))):
        paths.append(str(workdir / f"image{i}.png"))
        image.save(paths[-1])
    dump = workdir / "inputs"
    run([str(BIN / "qwen3vl"), "run", "--model", args.model, "--bucket", str(args.bucket), "--precision", args.precision,
         "--dump-inputs", str(dump), *(["--cache-dir", args.cache_dir] if args.cache_dir else []), *paths],
        stdout=subprocess.DEVNULL)
    call = json.loads((dump / "00" / "call.json").read_text())
    trace = workdir / "calls.ireeprof"
    benchmark = [str(BIN / "iree-benchmark-module"), "--device=local-task",
                 f"--task_topology_group_count={args.threads}", f"--module={out / 'model.vmfb'}",
                 f"--parameters=model={out / 'model.irpa'}", f"--function={call['function']}",
                 *[f"--input=@{dump / '00' / name}" for name in call["inputs"]],
                 f"--benchmark_min_time={args.calls + 1}x"]

    def wall_ms(*profiling):
        bench = run([*benchmark, *profiling], env={**os.environ, "GLIBC_TUNABLES": GLIBC}, capture_output=True)
        wall = re.search(r"real_time\s+([\d.]+) ms", bench.stdout)
        return float(wall.group(1)) if wall else None

    profiled = wall_ms("--device_profiling_mode=host-execution,executable-metadata",
                       f"--device_profiling_output={trace}")
    unprofiled = wall_ms()  # what profiling costs: it records every tile, so small tiles pay more
    lines = run([str(BIN / "iree-profile"), "dispatch", "--dispatch_events", "--format=jsonl", str(trace)],
                capture_output=True).stdout
    events = [json.loads(line) for line in lines.splitlines() if '"host_dispatch_event"' in line]
    return {"events": events, "grid": call, "wall_ms": profiled, "unprofiled_ms": unprofiled}


def per_call(events) -> tuple[list[dict], int]:
    """Each dispatch's time per call, over every call but the first; and how many calls that
    is. A call starts at each run of the first dispatch of the first call (a call can make
    several submissions: the blockwise form's key loop runs on the host)."""
    events = sorted(events, key=lambda e: e["start_host_time_ns"])
    first = events[0]["key"]
    starts = [i for i, e in enumerate(events) if e["key"] == first]
    kept, calls = events[starts[1]:], len(starts) - 1
    by_name = defaultdict(lambda: [0, 0])
    for e in kept:
        by_name[e["key"]][0] += e["duration_ns"]
        by_name[e["key"]][1] += 1
    rows = []
    for name, (ns, count) in by_name.items():
        ms, per = ns / 1e6 / calls, count // calls
        rows.append({"name": name, "kind": kind(name), "per_call": per, "ms": ms,
                     "gflops": flops(name) * per / (ms / 1e3) / 1e9 if flops(name) else None})
    return sorted(rows, key=lambda r: -r["ms"]), calls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--images", default="256x256,256x256", help="WxH,... random images packed into one call")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=5, help="profiled calls after one warm-up call")
    p.add_argument("--cache-dir")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", help="write the rows and kinds here")
    args = p.parse_args(argv)

    from emitter.config import load_model_config
    cfg = load_model_config(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        result = profile(args, Path(tmp))
    rows, calls = per_call(result["events"])
    total = sum(r["ms"] for r in rows)
    useful = vision_flops(cfg, [tuple(g) for g in result["grid"]["grid_thw"]])
    kinds = defaultdict(float)
    for r in rows:
        kinds[r["kind"]] += r["ms"]
    linears = kinds["linears (weights)"]
    print(f"{args.model}, bucket {args.bucket}, {args.precision}, {args.threads} threads, images {args.images}: "
          f"dispatch time {total:.1f} ms per call over {calls} calls after a warm-up one "
          f"(iree-benchmark-module: {result['wall_ms']} ms a call profiled, {result['unprofiled_ms']} ms not), "
          f"{useful / 1e9:.0f} GFLOP useful, {useful / total / 1e6:.0f} GFLOP/s")
    print("by kind:")
    for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<34} {ms:8.1f} ms  {100 * ms / total:5.1f}%")
    print(f"if every dispatch but the linears took no time: {linears:.1f} ms, {useful / linears / 1e6:.0f} GFLOP/s")
    print("top dispatches (ms per call, GFLOP/s of a matmul):")
    for r in rows[:args.top]:
        rate = f"{r['gflops']:6.0f}" if r["gflops"] else "      "
        print(f"  {r['ms']:8.2f} ms {100 * r['ms'] / total:5.1f}% x{r['per_call']:<3d} {rate}  {r['name']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "kinds": kinds, "total_ms": total,
                                               "useful_gflop": useful / 1e9, "wall_ms": result["wall_ms"],
                                               "unprofiled_ms": result["unprofiled_ms"]}, indent=1))


if __name__ == "__main__":
    main()
