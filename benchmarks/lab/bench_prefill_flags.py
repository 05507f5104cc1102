"""Prefill with and without the iree-compile flags a quantized text module adds
(`Precision.compile_flags`: data tiling from global optimization), alternating in one process.

A random checkpoint at a preset's widths with `--layers` decoder layers and a `--vocab`
vocabulary: under mlx4 / mlx8 quantized by the real `mx.quantize` in mlx-vlm's layout (groups
of 64, run in its bits), under int8 / int4 an f32 one quantized at load. Two `TextSession`s
over the same weight archive, one built as the session builds it and one with
`compile_flags` patched to none while it builds (`plain`); each prefills the same `--prompt`
tokens in turn (the prefix cache off), `--rounds` times after one warm call each.

    .venv/bin/python benchmarks/lab/bench_prefill_flags.py --precision mlx4 --layers 4 --rounds 6

Memory: both modules at once (2B widths, 4 layers, 4-bit: ~0.4 GB of weights, shared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

from emitter.precision import Precision
from emitter.text_config import TEXT_PRESETS
from runtime.text import TextSession

MLX_BITS = {"mlx4": 4, "mlx8": 8}


@contextmanager
def without_module_flags():
    """`Precision.compile_flags` returning none while the block runs (the identity and the build read it)."""
    original = Precision.compile_flags
    Precision.compile_flags = lambda *args: ()
    try:
        yield
    finally:
        Precision.compile_flags = original


def write_model(folder: Path, cfg, precision: str) -> str:
    """The checkpoint for `precision`; the session's precision for it."""
    if precision in MLX_BITS:
        from runtime.bench.mlx_memory import write_mlx_text
        write_mlx_text(folder, cfg, MLX_BITS[precision], 64)
        return "native"
    from runtime.checkpoints.synthetic_text import write_text_model
    write_text_model(folder, cfg, seed=1)
    return precision


def session(folder: Path, cache: Path, precision: str, bucket: int, plain: bool) -> TextSession:
    s = TextSession(folder, buckets=(bucket,), context=2 * bucket, cache_dir=cache, precision=precision,
                    kv_cache_dtype="bf16", prefix_cache=False)
    if plain:
        with without_module_flags():
            s.module
    else:
        s.module
    return s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-2b", choices=sorted(TEXT_PRESETS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--precision", default="mlx4", choices=[*MLX_BITS, "int8", "int4"])
    parser.add_argument("--prompt", type=int, default=500, help="prompt tokens")
    parser.add_argument("--bucket", type=int, default=512, help="the module's prompt bucket")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    cfg = replace(TEXT_PRESETS[args.preset], num_hidden_layers=args.layers, vocab_size=args.vocab)
    with tempfile.TemporaryDirectory(prefix="bench_prefill_flags.") as tmp:
        folder, cache = Path(tmp) / "m", Path(tmp) / "cache"
        precision = write_model(folder, cfg, args.precision)
        sessions = {name: session(folder, cache, precision, args.bucket, name == "plain")
                    for name in ("flags", "plain")}
        ids = np.arange(args.prompt) % 1000 + 10
        positions = np.broadcast_to(np.arange(args.prompt), (3, args.prompt))
        times = {name: [] for name in sessions}
        for round_ in range(args.rounds + 1):
            for name, s in sessions.items():
                t0 = time.perf_counter()
                s.prefill(ids, positions)
                if round_:  # the first call of each is a warm-up
                    times[name].append(time.perf_counter() - t0)
        print(f"{args.preset} widths, {args.layers} layers, vocab {args.vocab}, {args.precision}: prefill of "
              f"{args.prompt} tokens, s, median (min-max) of {args.rounds} alternating calls")
        for name, t in times.items():
            print(f"  {name:5s} {statistics.median(t):7.3f} ({min(t):.3f}-{max(t):.3f})")
        ratios = [a / b for a, b in zip(times["flags"], times["plain"])]
        print(f"  flags / plain: {statistics.median(times['flags']) / statistics.median(times['plain']):.3f} "
              f"(per round {min(ratios):.2f}-{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
