"""A decode step of this tree against the same step of an earlier tree (`--baseline`: a
checkout of a commit before the paged KV cache, or any earlier commit), with IREE's own
tools, alternating in one run.

Each side's `runtime.bench.decode_profile` compiles its decode at `--context` (2B widths,
`--layers` decoder layers, a small vocabulary) for each of `--lanes` (1: one sequence's
step; more: the server's batched step, each lane a sequence of its own blocks), and writes
random weights; then `iree-benchmark-module` times a step at slot context - 1 of each,
alternating for `--rounds` rounds. Ratios (of medians): this tree / baseline at each lane
count, and each tree's step at the most lanes / its step at the fewest. On a loaded
machine the minimum of each series is reported too; `--cpu` times the CPU a step takes
on one thread instead (user + system of a run of 5 + `--repeats` steps less a run of 5,
per step), steadier than the wall clock there.

    git worktree add /tmp/contiguous 66e80df
    .venv/bin/python benchmarks/bench_paged_decode.py --baseline /tmp/contiguous --context 4096
    git worktree add /tmp/before main
    .venv/bin/python benchmarks/bench_paged_decode.py --baseline /tmp/before --context 1024 --lanes 1 4
    .venv/bin/python benchmarks/bench_paged_decode.py --baseline /tmp/before --layers 8 --context 1024 \\
        --precision q8_0 --kv-cache-dtype bf16 --profile
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BUILD = """
import sys
from dataclasses import replace
from pathlib import Path
from emitter.text_config import TEXT_PRESETS
from runtime.artifact.compiler import compile_mlir
from runtime.bench import decode_profile as bench
try:
    from emitter.precision import precision as precision_of
    compile_flags = lambda precision: precision_of(precision).compile_flags()
except ImportError:  # a tree before the precision table
    try:
        from emitter.quant import compile_flags
    except ImportError:  # a tree before the kernel precisions
        compile_flags = lambda precision: []
out, context, layers, vocab = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
precision, kv = sys.argv[5], sys.argv[6]
cfg = replace(TEXT_PRESETS["qwen3-vl-2b"], num_hidden_layers=layers, vocab_size=vocab)
flags = compile_flags(precision)
for lanes in map(int, sys.argv[7:]):  # a tree before the batched step knows one sequence only
    if kv != "f32":  # the KV cache's dtype: a tree with a paged cache of that dtype
        from emitter.module import render
        from emitter.text import decode_function
        from emitter.text_shape import MODULE_NAME
        function, shared = decode_function(cfg, replace(bench.decode_shape(context, lanes), kv_dtype=kv), lanes, precision)
        module = render(MODULE_NAME, "", shared, [function])
    else:
        module = bench.decode_module(cfg, context, precision, lanes) if lanes > 1 else bench.decode_module(cfg, context, precision)
    (out / f"decode_{lanes}.vmfb").write_bytes(compile_mlir(module, extra_flags=flags))
bench.write_archive(cfg, precision, out / "weights.irpa")
"""

TIME = """
import sys
from pathlib import Path
from runtime.bench import decode_profile as bench
out, slot, repeats, threads, lanes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
extra = {"lanes": lanes} if lanes > 1 else {}
print(bench.step_ms(out / f"decode_{lanes}.vmfb", out / "weights.irpa", slot, repeats, threads, **extra))
"""

PROFILE = """
import sys
from pathlib import Path
from runtime.bench import decode_profile as bench
out, slot, threads, lanes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
path = out / f"decode_{lanes}.ireeprof"
bench.step_ms(out / f"decode_{lanes}.vmfb", out / "weights.irpa", slot, 3, threads, profile=path, lanes=lanes)
print("\\n".join(bench.profile_report(path, 3)))
"""


def run(tree: Path, script: str, *args) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, cwd=tree, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip()


def cpu_ms(tree: Path, out: Path, slot: int, repeats: int, lanes: int) -> float:
    """CPU ms of one step of `tree`'s module on one thread (see the module's docstring)."""
    def cpu(steps: int) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run(tree, TIME, out, slot, steps, 1, lanes)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    return (cpu(5 + repeats) - cpu(5)) * 1e3 / repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="A checkout of an earlier commit (e.g. before the paged KV cache).")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--precision", default="f32", choices=["f32", "bf16", "q8_0", "q4_0"])
    p.add_argument("--kv-cache-dtype", default="f32", choices=["f32", "bf16"],
                   help="the KV pools' dtype (bf16: both trees must have a bf16 cache)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="CPU ms of a step on one thread, not wall ms on --threads")
    p.add_argument("--lanes", type=int, nargs="+", default=[1], help="sequences per step, each timed")
    p.add_argument("--profile", action="store_true",
                   help="after the timing, each tree's per-dispatch profile of 3 steps (`bench_decode.py --profile`'s)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    trees = {"baseline": Path(args.baseline).resolve(), "this": ROOT}
    lanes = sorted(set(args.lanes))
    times = {(name, n): [] for name in trees for n in lanes}
    with tempfile.TemporaryDirectory(prefix="bench_paged.") as tmp:
        for name, tree in trees.items():
            (Path(tmp) / name).mkdir()
            run(tree, BUILD, Path(tmp) / name, args.context, args.layers, args.vocab, args.precision,
                args.kv_cache_dtype, *lanes)
        for _ in range(args.rounds):
            for name, tree in trees.items():
                for n in lanes:
                    out, slot = Path(tmp) / name, args.context - 1
                    times[name, n].append(cpu_ms(tree, out, slot, args.repeats, n) if args.cpu else
                                          float(run(tree, TIME, out, slot, args.repeats, args.threads, n)))
        if args.profile:
            for name, tree in trees.items():
                for n in lanes:
                    print(f"{name}, {n} lane(s), context {args.context}:")
                    print(run(tree, PROFILE, Path(tmp) / name, args.context - 1, args.threads, n))
    median = {key: statistics.median(t) for key, t in times.items()}
    report = {f"{name}_{n}_lanes": {"median_ms": round(median[name, n], 3), "min_ms": round(min(times[name, n]), 3),
                                    "ms": [round(x, 3) for x in times[name, n]]} for name, n in times}
    report["this_over_baseline"] = {n: round(median["this", n] / median["baseline", n], 3) for n in lanes}
    if len(lanes) > 1:
        report[f"{lanes[-1]}_lanes_over_{lanes[0]}"] = {name: round(median[name, lanes[-1]] / median[name, lanes[0]], 3)
                                                        for name in trees}
    report.update(context=args.context, layers=args.layers, precision=args.precision,
                  kv_cache_dtype=args.kv_cache_dtype,
                  threads=1 if args.cpu else args.threads, measure="CPU ms" if args.cpu else "wall ms")
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
