"""A prefill chunk's attention alone, one layer of the 2B's shape: the hand-written kernel
(emitter/kernel_calls.py `chunk_attention`, the q8_0 and q4_0 graphs' form) against the
graph form it replaced (emitter/attention.py `grouped_attention` over the span the table
names, the f32 and bf16 graphs' form), both compiled by iree-compile for this machine and
called alternately in one process, bf16 pools by default.

    .venv/bin/python benchmarks/lab/bench_chunk_attention.py --starts 0 1536 3584 --rounds 5

Prints ms per call (median of the rounds, each the mean of `--calls` calls) and, for the
kernel, ns per (query row, head, key) pair it computes (the causal half only) and per pair a
dense form would compute, at each chunk start. Random q and pools, uploaded once; each call
also reads its [rows, heads, head_dim] result back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from emitter.kv_pages import BLOCK  # noqa: E402
from emitter.targets import target_flags  # noqa: E402
from kernels import decode_attention as da  # noqa: E402
from emitter.kernel_calls import target_isa  # noqa: E402
from emitter.text import chunk_module  # noqa: E402
from kernels.build import build_object  # noqa: E402
from runtime.artifact.compiler import compile_mlir  # noqa: E402
from runtime.artifact.iree_module import LoadedModule  # noqa: E402
from runtime.vision import set_thread_count  # noqa: E402


def module(form: str, rows: int, kv_heads: int, groups: int, d: int, blocks: int, kv_dtype: str, target: str,
           objects: Path) -> LoadedModule:
    obj = build_object(target_isa(tuple(target_flags(target))), objects, da.SOURCE) if form == "kernel" else None
    return LoadedModule(compile_mlir(chunk_module(obj, rows, kv_heads, groups, d, blocks, kv_dtype), target))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="the chunk's rows")
    p.add_argument("--starts", type=int, nargs="+", default=[0, 1536, 3584], help="chunk starts (multiples of 16)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-cache-dtype", choices=("f32", "bf16"), default="bf16")
    p.add_argument("--target", default="llvm-cpu")
    p.add_argument("--forms", nargs="+", default=["kernel", "graph"], choices=["kernel", "graph"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    set_thread_count(args.threads)
    blocks = (max(args.starts) + args.rows) // BLOCK + 1
    heads, rng = args.kv_heads * args.groups, np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        mods = {f: module(f, args.rows, args.kv_heads, args.groups, args.head_dim, blocks, args.kv_cache_dtype,
                          args.target, Path(tmp)) for f in args.forms}
    q = rng.standard_normal((args.rows, heads, args.head_dim), dtype=np.float32)
    pools = [rng.standard_normal((args.kv_heads, blocks, BLOCK, args.head_dim), dtype=np.float32)
             for _ in range(2)]
    if args.kv_cache_dtype == "bf16":
        pools = [x.astype(ml_dtypes.bfloat16) for x in pools]
    table = rng.permutation(np.arange(1, blocks)).astype(np.int32)
    print(f"chunk of {args.rows} rows, {heads} heads ({args.kv_heads} KV), head_dim {args.head_dim}, "
          f"{args.kv_cache_dtype} pools, {args.target}, {args.threads} threads: ms per call, median of {args.rounds}")
    for start in args.starts:
        span = table[:(start + args.rows) // BLOCK]
        host = (q, *pools, span, np.int32(start))
        uploaded = {f: [m.upload(x) for x in host] for f, m in mods.items()}  # not timed
        times = {f: [] for f in mods}
        for _ in range(args.rounds):
            for f, m in mods.items():
                m(*uploaded[f])
                t = time.perf_counter()
                for _ in range(args.calls):
                    m(*uploaded[f])
                times[f].append((time.perf_counter() - t) / args.calls)
        pairs = heads * sum(start + i + 1 for i in range(args.rows))
        dense = heads * args.rows * (start + args.rows)
        line = f"  start {start:5d}:"
        for f, ts in times.items():
            ms = statistics.median(ts) * 1e3
            line += f"  {f} {ms:8.2f} ms"
            if f == "kernel":
                line += f" ({ms * 1e6 / pairs:.2f} ns a causal pair, {ms * 1e6 / dense:.2f} a dense one)"
        if len(times) == 2:
            line += f"  kernel/graph x{statistics.median(times['kernel']) / statistics.median(times['graph']):.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
