"""One decode step of the language model by KV-cache context, with IREE's own tools.

The module's `decode` function alone (emitter/text.py), at a preset's widths with
`--layers` decoder layers and a small vocabulary (lm_head out of the way), random weights in
a parameter archive; `iree-benchmark-module` times a step at each `--contexts` size,
alternating, in one run. `--profile` adds, per context, IREE's per-dispatch times
(`iree-profile`, host-execution events) and the copies the step's command buffer makes.

    .venv/bin/python benchmarks/bench_decode.py --layers 2 --contexts 256 4096 --rounds 3
    .venv/bin/python benchmarks/bench_decode.py --layers 2 --contexts 4096 --profile

Memory: the archive (2B widths: ~0.2 GB per layer in f32) and one module at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from emitter.module import render
from emitter.text import MODULE_NAME, decode_function, text_weights
from emitter.text_config import TEXT_PRESETS
from runtime.compiler import compile_mlir

TOOLS = Path(sys.executable).parent


def decode_module(cfg, context: int, precision: str) -> str:
    function, shared = decode_function(cfg, context, precision)
    return render(MODULE_NAME, "", shared, [function])


def write_archive(cfg, precision: str, path: Path) -> None:
    import iree.runtime as rt
    rng = np.random.default_rng(0)
    weights = {}
    for spec in text_weights(cfg, precision):
        w = rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(0.02)
        weights[spec.name] = w if spec.dtype == "f32" else (w.view(np.uint32) >> 16).astype(np.uint16)
    rt.save_archive_file(weights, str(path))


def step_ms(vmfb: Path, archive: Path, slot: int, repeats: int, threads: int, profile: Path | None = None) -> float:
    """Mean ms of one decode step (token 5 at cache slot `slot`) over `repeats` calls."""
    command = [str(TOOLS / "iree-benchmark-module"), "--device=local-task", f"--module={vmfb}",
               f"--parameters=model={archive}", "--function=decode", "--input=1xi32=5",
               f"--input=3x1xi32={slot},{slot},{slot}", f"--input=i32={slot}", f"--benchmark_min_time={repeats}x",
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


def profile_report(path: Path, steps: int, top: int = 8) -> list[str]:
    """The top dispatches by time per step, and the copies in the step's command buffer."""
    out = subprocess.run([str(TOOLS / "iree-profile"), "dispatch", "--format=jsonl", str(path)],
                         capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    groups = sorted((r for r in rows if r.get("type") == "host_dispatch_group"), key=lambda r: -r["total_ns"])
    lines = [f"    {r['total_ns'] / steps / 1e6:7.2f} ms/step  {r['key']}" for r in groups[:top]]
    sizes = copy_lengths(path)
    big = [s for s in sizes if s >= 1 << 20]
    lines.append(f"    copies recorded: {len(sizes)}, of them >= 1 MiB: {len(big)} ({sum(big) / 2**20:.0f} MiB)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-2b", choices=sorted(TEXT_PRESETS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size (lm_head rows)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over the contexts")
    parser.add_argument("--repeats", type=int, default=10, help="decode calls per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="per-dispatch times and copies per context")
    args = parser.parse_args(argv)
    cfg = replace(TEXT_PRESETS[args.preset], num_hidden_layers=args.layers, vocab_size=args.vocab)
    with tempfile.TemporaryDirectory(prefix="bench_decode.") as tmp:
        tmp = Path(tmp)
        archive = tmp / "weights.irpa"
        write_archive(cfg, args.precision, archive)
        vmfbs = {}
        for context in args.contexts:
            vmfbs[context] = tmp / f"decode_{context}.vmfb"
            vmfbs[context].write_bytes(compile_mlir(decode_module(cfg, context, args.precision)))
        times = {c: [] for c in args.contexts}
        for _ in range(args.rounds):
            for context in args.contexts:  # the last slot: every key but the new one masked in
                times[context].append(step_ms(vmfbs[context], archive, context - 1, args.repeats, args.threads))
        print(f"{args.preset} widths, {args.layers} layers, vocab {args.vocab}, {args.precision}, "
              f"{args.threads} threads: ms per decode step, median (min-max) of {args.rounds} rounds")
        base = statistics.median(times[args.contexts[0]])
        for context in args.contexts:
            t = times[context]
            print(f"  context {context:6d}: {statistics.median(t):7.2f} ({min(t):.2f}-{max(t):.2f})"
                  f"  x{statistics.median(t) / base:.2f} of context {args.contexts[0]}")
        if args.profile:
            for context in args.contexts:
                path = tmp / f"decode_{context}.ireeprof"
                step_ms(vmfbs[context], archive, context - 1, 3, args.threads, profile=path)
                print(f"  context {context} (profiled, 3 steps):")
                print("\n".join(profile_report(path, 3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
