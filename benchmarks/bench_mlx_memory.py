"""Memory of an MLX-quantized language model run in its bits (`--precision mlx`) against the
same checkpoint expanded to f32 (`--precision f32`), at a preset's widths.

A checkpoint quantized by the real `mx.quantize` in mlx-vlm's layout (`--bits`, `--group`,
`--layers` decoder layers, the preset's vocabulary unless `--vocab`), then per precision two
fresh processes (runtime/bench/mlx_memory.py): the first writes the weight archive and
answers, the second loads it from the cache and answers. Printed: peak RSS and resident
memory above each process's start, as multiples of the weights' f32 bytes and of their bytes
in their bits, and the archive's size.

    .venv/bin/python benchmarks/bench_mlx_memory.py --preset qwen3-vl-2b --layers 4

Memory: the f32 run peaks at about 2.6x the f32 weights (2B widths, 4 layers: ~5 GB). The whole
model at a preset's size, tower included, through `qwen3vl generate`: bench_mlx_generate.py.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from emitter.text import text_weights
from emitter.text_config import TEXT_PRESETS
from runtime.bench.mlx_memory import measure, write_mlx_text
from runtime.checkpoints.text import native_weights

BYTES = {"i4": 0.5, "i8": 1, "f32": 4}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-2b", choices=sorted(TEXT_PRESETS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the preset's)")
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--group", type=int, default=64, choices=[32, 64, 128])
    parser.add_argument("--precision", nargs="+", default=["mlx", "f32"], choices=["mlx", "f32"])
    args = parser.parse_args(argv)
    cfg = replace(TEXT_PRESETS[args.preset], num_hidden_layers=args.layers)
    cfg = replace(cfg, vocab_size=args.vocab) if args.vocab else cfg
    with tempfile.TemporaryDirectory(prefix="bench_mlx_memory.") as tmp:
        model, cache = Path(tmp) / "m", Path(tmp) / "cache"
        write_mlx_text(model, cfg, args.bits, args.group)
        f32 = sum(int(np.prod(s.shape)) * 4 for s in text_weights(cfg))
        in_bits = sum(int(np.prod(s.shape)) * BYTES[s.dtype]
                      for s in text_weights(replace(cfg, native_weights=native_weights(model, cfg))))
        print(f"{args.preset} widths, {args.layers} layers, vocab {cfg.vocab_size}, {args.bits}-bit groups of "
              f"{args.group}: weights {f32 / 1e9:.2f} GB in f32, {in_bits / 1e9:.3f} GB in their bits "
              f"(q, scales, biases)")
        for precision in args.precision:
            first, second = measure(model, cache, precision), measure(model, cache, precision)
            print(f"  --precision {precision}: archive {first['archive'] / 1e9:.3f} GB; peak RSS writing it "
                  f"{first['peak'] / 1e9:.2f} GB ({first['peak'] / f32:.2f}x f32 weights), from the cache "
                  f"{second['peak'] / 1e9:.2f} GB ({second['peak'] / f32:.2f}x); resident once loaded "
                  f"{second['loaded'] / 1e9:.2f} GB ({second['loaded'] / in_bits:.2f}x the weights in their bits), "
                  f"after an answer {second['answered'] / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
