"""Compile time of the language model's module (emitter/text.py) against context and lanes,
and of the vision tower's artifact module (emitter/vision.py) for bucket sets, this tree's
beside an earlier tree's (`--baseline`), each emitted by its own emitter and compiled by
iree-compile with its own flags: 2B widths with `--layers` decoder layers, the serve
defaults otherwise (prompt buckets 128 and 512, 3 DeepStack layers, f32); the tower of
`--vision-preset` whole, its weights from parameters as a session compiles it.

Per module: iree-compile's wall and CPU seconds (user + system: steadier than the wall
clock on a shared machine), its MLIR size, functions and executables (the dispatches left
after IREE's deduplication, from `--iree-hal-dump-executable-sources-to`); `--timing` also
prints the passes that took the most (`--mlir-timing`).

    git worktree add /tmp/before main
    .venv/bin/python benchmarks/bench_compile.py --baseline /tmp/before --contexts 4096 32768 --lanes 4
    .venv/bin/python benchmarks/bench_compile.py --contexts --vision 512 8192 512,16384   # tower rows only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

EMIT = """
import json, sys
from dataclasses import replace
from pathlib import Path
from emitter.text_module import emit_text_module
from emitter.text_shape import TextShape
from emitter.text_config import TEXT_PRESETS
from runtime.artifact.compiler import compile_command
out, layers, vocab, context, lanes = Path(sys.argv[1]), *map(int, sys.argv[2:6])
cfg = replace(TEXT_PRESETS["qwen3-vl-2b"], num_hidden_layers=layers, **({"vocab_size": vocab} if vocab else {}))
out.write_text(emit_text_module(cfg, TextShape((128, 512), context, lanes), 3))
print(json.dumps(compile_command()))
"""


EMIT_VISION = """
import json, sys
from pathlib import Path
from emitter.config import PRESETS
from emitter.vision import emit_artifact_module
from runtime.artifact.compiler import compile_command
out, preset, buckets = Path(sys.argv[1]), sys.argv[2], [int(b) for b in sys.argv[3].split(",")]
out.write_text(emit_artifact_module(PRESETS[preset], buckets, weights="parameters"))
print(json.dumps(compile_command()))
"""


def emit(tree: Path, script: str, path: Path, *args) -> list[str]:
    """Write `tree`'s module (`script` run with `path` and `args`) to `path`; its
    iree-compile command (MLIR on stdin)."""
    done = subprocess.run([sys.executable, "-c", script, str(path), *map(str, args)],
                          env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_once(command: list[str], mlir: Path, work: Path, timing: bool) -> dict:
    """Run iree-compile on `mlir`: wall and CPU seconds, executables, and its pass timing."""
    sources = work / "sources"
    flags = [f"--iree-hal-dump-executable-sources-to={sources}", "-o", str(work / "out.vmfb")]
    if timing:
        flags += ["--mlir-timing", "--mlir-timing-display=list"]
    start = time.perf_counter()
    with open(mlir, "rb") as stdin:
        child = subprocess.Popen(command + flags, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stderr = child.stderr.read().decode("utf-8", "replace")
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise SystemExit(f"iree-compile failed on {mlir}:\n{stderr[-3000:]}")
    text = mlir.read_text()
    return {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "mlir_mb": round(len(text) / 1e6, 2), "functions": len(re.findall(r"func\.func @", text)), "mlir_lines": text.count("\n"),
            "executables": len(list(sources.glob("*.mlir"))), "passes": top_passes(stderr) if timing else None}


def top_passes(stderr: str, top: int = 12) -> list[str]:
    """The `--mlir-timing` list's heaviest lines (wall time, then the pass)."""
    rows = [line.strip() for line in stderr.splitlines() if re.match(r"\s*\d+\.\d+ \(", line)]
    return rows[1:top + 1]  # the first is the total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", help="A checkout of an earlier commit, compiled the same way.")
    p.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768])
    p.add_argument("--lanes", type=int, nargs="+", default=[4])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the 2B preset's)")
    p.add_argument("--vision", nargs="*", default=[], metavar="B[,B...]",
                   help="vision tower bucket sets to compile (e.g. 512 8192 512,16384)")
    p.add_argument("--vision-preset", default="qwen3-vl-2b")
    p.add_argument("--timing", action="store_true", help="print iree-compile's heaviest passes")
    p.add_argument("--json")
    args = p.parse_args(argv)
    trees = {"this": ROOT, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    report = {}
    def measure(key: str, label: str, tree: Path, script: str, *script_args) -> None:
        work = Path(tmp) / key
        work.mkdir()
        command = emit(tree, script, work / "module.mlir", *script_args)
        row = report[key] = compile_once(command, work / "module.mlir", work, args.timing)
        print(f"{label}: " + json.dumps({k: v for k, v in row.items() if k != "passes"}), flush=True)
        for line in row["passes"] or []:
            print("    " + line)

    with tempfile.TemporaryDirectory(prefix="bench_compile.") as tmp:
        for context in args.contexts:
            for lanes in args.lanes:
                for name, tree in trees.items():
                    measure(f"{name}_{context}_{lanes}_lanes", f"{name:8} context {context:6} lanes {lanes}", tree,
                            EMIT, args.layers, args.vocab, context, lanes)
        for buckets in args.vision:
            for name, tree in trees.items():
                measure(f"{name}_vision_{buckets}", f"{name:8} {args.vision_preset} tower, buckets {buckets}", tree,
                        EMIT_VISION, args.vision_preset, buckets)
    report.update(layers=args.layers, vocab=args.vocab or "2B preset", vision_preset=args.vision_preset)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
