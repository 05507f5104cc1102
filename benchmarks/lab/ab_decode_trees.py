"""One decode step as two (or more) source trees emit it, alternating, over one archive.

Each tree (a checkout or `git worktree` of this repository) emits the `decode_1` module
(runtime/bench/decode_profile.decode_module) at a preset's widths with `--layers` layers
and `--vocab` lm_head rows; all are compiled with the session's flags for `--precision`
and timed over the same random weights by `iree-benchmark-module`, the order alternating
between rounds; each round's own ratio to the first tree is reported beside the medians.
`--profile` then adds each module's per-dispatch and queue report (bench_decode.py's).

    git worktree add --detach ../base main~1
    .venv/bin/python benchmarks/lab/ab_decode_trees.py ../base . --layers 28 --vocab 151936 --precision q8_0

A benchmark, not a test; nothing imports it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from emitter.precision import precision as precision_of  # noqa: E402
from emitter.text_config import TEXT_PRESETS  # noqa: E402
from runtime.artifact.compiler import compile_mlir  # noqa: E402
from runtime.bench.decode_profile import profile_report, step_ms, write_archive  # noqa: E402

EMIT = ("import sys; from dataclasses import replace; from emitter.text_config import TEXT_PRESETS; "
        "from runtime.bench.decode_profile import decode_module; "
        "cfg = replace(TEXT_PRESETS[{preset!r}], num_hidden_layers={layers}, vocab_size={vocab}); "
        "sys.stdout.write(decode_module(cfg, {context}, {precision!r}, {lanes}))")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", type=Path, help="source trees; ratios are to the first")
    p.add_argument("--preset", default="qwen3-vl-2b", choices=sorted(TEXT_PRESETS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--context", type=int, default=256, help="slots; the step writes the last one")
    p.add_argument("--precision", default="q8_0")
    p.add_argument("--lanes", type=int, default=1)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=10, help="decode calls per timing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    cfg = replace(TEXT_PRESETS[args.preset], num_hidden_layers=args.layers, vocab_size=args.vocab)
    tmp = Path(tempfile.mkdtemp(prefix="ab_decode_trees."))
    archive = tmp / "weights.irpa"
    write_archive(cfg, args.precision, archive)
    vmfbs = []
    for i, tree in enumerate(args.trees):
        code = EMIT.format(preset=args.preset, layers=args.layers, vocab=args.vocab, context=args.context,
                           precision=args.precision, lanes=args.lanes)
        text = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree.resolve())},
                              capture_output=True, text=True, check=True).stdout
        vmfbs.append(tmp / f"decode_{i}.vmfb")
        vmfbs[-1].write_bytes(compile_mlir(text, extra_flags=precision_of(args.precision).compile_flags()))
    times = [[] for _ in args.trees]
    for r in range(args.rounds):
        for i in (range(len(vmfbs)) if r % 2 == 0 else reversed(range(len(vmfbs)))):
            times[i].append(step_ms(vmfbs[i], archive, args.context - 1, args.repeats, args.threads,
                                    lanes=args.lanes))
    print(f"{args.preset} widths, {args.layers} layers, vocab {args.vocab}, context {args.context}, "
          f"{args.precision}, {args.lanes} lane(s), {args.threads} threads, {args.rounds} alternating rounds:")
    for tree, t in zip(args.trees, times):
        own = sorted(a / b for a, b in zip(t, times[0]))
        print(f"  {str(tree):30s} {statistics.median(t):7.2f} ms ({min(t):.2f}-{max(t):.2f}), "
              f"x{statistics.median(own):.3f} of the first (rounds' own {own[0]:.3f}-{own[-1]:.3f})")
    if args.profile:
        for tree, vmfb in zip(args.trees, vmfbs):
            path = vmfb.with_suffix(".ireeprof")
            step_ms(vmfb, archive, args.context - 1, args.repeats, args.threads, profile=path, lanes=args.lanes)
            print(f"  {tree} (profiled, {args.repeats} steps):")
            print("\n".join(profile_report(path, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
