"""A decode step over block tables (this tree) against the contiguous-row step of an
earlier tree (`--baseline`, a checkout of a commit before the paged KV cache), with
IREE's own tools, alternating in one run.

Each side's `runtime.bench.decode_profile` compiles its one-sequence decode at `--context`
(2B widths, `--layers` decoder layers, a small vocabulary), and writes random weights;
then `iree-benchmark-module` times a step at slot context - 1 of each, alternating for
`--rounds` rounds. The ratio is paged / contiguous.

    git worktree add /tmp/contiguous 66e80df
    .venv/bin/python benchmarks/bench_paged_decode.py --baseline /tmp/contiguous --context 4096
"""

from __future__ import annotations

import argparse
import json
import os
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
out, context, layers, vocab, precision = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cfg = replace(TEXT_PRESETS["qwen3-vl-2b"], num_hidden_layers=layers, vocab_size=vocab)
(out / "decode.vmfb").write_bytes(compile_mlir(bench.decode_module(cfg, context, precision)))
bench.write_archive(cfg, precision, out / "weights.irpa")
"""

TIME = """
import sys
from pathlib import Path
from runtime.bench import decode_profile as bench
out, slot, repeats, threads = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print(bench.step_ms(out / "decode.vmfb", out / "weights.irpa", slot, repeats, threads))
"""


def run(tree: Path, script: str, *args) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, cwd=tree, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="A checkout of a commit before the paged KV cache.")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    trees = {"contiguous": Path(args.baseline).resolve(), "paged": ROOT}
    times = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="bench_paged.") as tmp:
        for name, tree in trees.items():
            (Path(tmp) / name).mkdir()
            run(tree, BUILD, Path(tmp) / name, args.context, args.layers, args.vocab, args.precision)
        for _ in range(args.rounds):
            for name, tree in trees.items():
                times[name].append(float(run(tree, TIME, Path(tmp) / name, args.context - 1, args.repeats,
                                             args.threads)))
    report = {name: {"median_ms": round(statistics.median(t), 3), "ms": [round(x, 3) for x in t]}
              for name, t in times.items()}
    report["paged_over_contiguous"] = round(report["paged"]["median_ms"] / report["contiguous"]["median_ms"], 3)
    report.update(context=args.context, layers=args.layers, precision=args.precision, threads=args.threads)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
