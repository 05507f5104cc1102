"""A/B timing of graph variants and compiler flags, dispatch by dispatch.

A whole-tower A/B (`ab_variants.py`) on this noisy machine reads a 5% change per kernel
only as a ratio with a wide range. This compiles one block of the tower (the preset at
depth 1: every kernel of a block, the mergers, the patch embedding) once per variant with
`--iree-hal-dump-executable-benchmarks-to`, which writes each dispatch as a module of its
own that runs it on zeroed buffers, compiles the dispatches whose names match `--match`,
and times them with `iree-benchmark-module --batch_size`, the variants alternating
dispatch by dispatch, round after round. Dispatches are paired across variants by what
they compute (the name after `dispatch_N_`), so a variant that renumbers them still pairs.
Variant names are `ab_variants.py`'s (`baseline`, `mmt4d`, ..., or `flags:--a,--b`).

    .venv/bin/python benchmarks/lab/ab_dispatches.py baseline mmt4d --precision bf16
    .venv/bin/python benchmarks/lab/ab_dispatches.py baseline flags:--iree-llvmcpu-matmul-tile-bytes=1048576 --match matmul
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_variants import emit, variant, variant_name  # noqa: E402
from emitter.config import PRESETS  # noqa: E402
from iree.compiler.tools.binaries import find_tool  # noqa: E402
from runtime.bench.vision import shallower  # noqa: E402
from runtime.artifact.compiler import compile_mlir  # noqa: E402

BENCHMARK_MODULE = Path(sys.executable).parent / "iree-benchmark-module"


def what(name: str) -> str:
    """What a dispatch computes, without its number: `matmul_512x4096x1024_bf16xbf16xf32`."""
    return re.sub(r"^.*dispatch_\d+_", "", name)


def dispatch_benchmarks(cfg, bucket, name, precision, match, workdir: Path) -> dict[str, tuple[Path, str]]:
    """Compile one variant with its dispatches dumped as benchmark modules; the matching
    ones compiled: {what it computes: (vmfb, the function to run)}."""
    dump = workdir / name.replace("/", "_").replace(":", "_")
    compile_mlir(emit(cfg, bucket, name, precision),
                 extra_flags=[*variant(name)[1], f"--iree-hal-dump-executable-benchmarks-to={dump}"])
    found = {}
    for source in sorted(dump.glob("*_benchmark.mlir")):
        text = source.read_text()
        function = re.search(r"util\.func public @(\w+)\(%arg0: i32\)", text)
        if not function or not re.search(match, function.group(1)):
            continue
        key = what(function.group(1))
        if key in found:  # the same computation dumped twice (deduplicated in the graph): keep one
            continue
        vmfb = source.with_suffix(".vmfb")
        subprocess.run([find_tool("iree-compile"), str(source), "-o", str(vmfb)], check=True)
        found[key] = (vmfb, function.group(1))
    return found


def time_dispatch(vmfb: Path, function: str, threads: int, batch: int, min_time: float) -> float:
    """Seconds per dispatch, as `iree-benchmark-module` reports it for a batch."""
    out = subprocess.run([str(BENCHMARK_MODULE), "--device=local-task", f"--task_topology_group_count={threads}",
                          f"--module={vmfb}", f"--function={function}", f"--batch_size={batch}",
                          f"--benchmark_min_time={min_time}s"], check=True, capture_output=True, text=True).stdout
    value, unit = re.search(r"real_time\s+([\d.]+) (ns|us|ms|s)\b", out).groups()
    return float(value) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs=2, metavar="VARIANT", type=variant_name,
                   help="two names from ab_variants.py, or flags:--a,--b")
    p.add_argument("--preset", default="qwen3-vl-2b", choices=sorted(PRESETS))
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--precision", choices=["f32", "bf16"], default="bf16")
    p.add_argument("--match", default="matmul", help="regex over the dispatch names to time (default: the matmuls)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=20, help="dispatches per timed batch")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds each timing runs for")
    p.add_argument("--json", help="write every time here")
    args = p.parse_args(argv)

    cfg = shallower(PRESETS[args.preset], 1)
    with tempfile.TemporaryDirectory() as tmp:
        built = [dispatch_benchmarks(cfg, args.bucket, name, args.precision, args.match, Path(tmp))
                 for name in args.variants]
        common = [key for key in built[0] if key in built[1]]
        for i, name in enumerate(args.variants):
            for key in sorted(set(built[i]) - set(common)):
                print(f"{name} only: {key} (not timed)")
        if not common:
            sys.exit(f"ab_dispatches: no dispatch matching {args.match!r} is in both variants")
        times = {key: {name: [] for name in args.variants} for key in common}
        for _ in range(args.rounds):
            for key in common:
                for i, name in enumerate(args.variants):
                    times[key][name].append(time_dispatch(*built[i][key], args.threads, args.batch_size, args.min_time))

    a, b = args.variants
    print(f"{args.preset} depth 1, bucket {args.bucket}, {args.precision}, {args.threads} threads, "
          f"{args.rounds} rounds alternating; ratio = {a} / {b} (over 1: {b} is faster)")
    total = {a: 0.0, b: 0.0}
    for key in common:
        med = {name: statistics.median(times[key][name]) for name in args.variants}
        pairs = [x / y for x, y in zip(times[key][a], times[key][b])]
        total = {name: total[name] + med[name] for name in total}
        print(f"  {key:60s} {med[a] * 1e3:9.3f} ms {med[b] * 1e3:9.3f} ms  x{med[a] / med[b]:.3f} "
              f"(rounds {min(pairs):.2f}-{max(pairs):.2f})")
    print(f"  {'all of the above, once each':60s} {total[a] * 1e3:9.3f} ms {total[b] * 1e3:9.3f} ms  "
          f"x{total[a] / total[b]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "times": times}, indent=1))


if __name__ == "__main__":
    main()
