"""One decode step of the language model by KV-cache context, with IREE's own tools.

The module's `decode` function alone (emitter/text.py), at a preset's widths with
`--layers` decoder layers and a small vocabulary (lm_head out of the way), random weights in
a parameter archive; `iree-benchmark-module` times a step at each `--contexts` size
and `--precision`, alternating, in one run. `--profile` adds, per context, IREE's per-dispatch times
(`iree-profile`, host-execution events) in all and by kind, the copies the step's command buffer
makes, and the read bandwidth measured then (the time the weights' bytes take at it).

    .venv/bin/python benchmarks/bench_decode.py --layers 2 --contexts 256 4096 --rounds 3
    .venv/bin/python benchmarks/bench_decode.py --layers 2 --contexts 4096 --profile
    .venv/bin/python benchmarks/bench_decode.py --layers 2 --contexts 256 --precision f32 bf16 int8
    .venv/bin/python benchmarks/bench_decode.py --layers 2 --contexts 256 --precision int4 mlx4
    .venv/bin/python benchmarks/bench_decode.py --layers 4 --contexts 1024 --lanes 1 4 --precision f32 bf16

`--lanes` times the server's batched step (`decode_<lanes>`, one token for each of
that many sequences) instead of one sequence's. Each precision is built with the flags the
session compiles it with (`Precision.compile_flags`); `--without-module-flags` also times each
one that has any built without them (`<precision>/plain`: the A/B of those flags).

    .venv/bin/python benchmarks/bench_decode.py --layers 8 --contexts 576 --precision mlx4 --without-module-flags

Memory: the archive (2B widths: ~0.2 GB per layer in f32) and one module at a time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from emitter.text_config import TEXT_PRESETS
from runtime.artifact.compiler import compile_mlir
from emitter.precision import GRAPH_PRECISIONS, precision as precision_of
from runtime.bench.decode_profile import (NATIVE_FORMS, decode_module, graph_form, profile_report, step_ms,
                                          weight_bytes, write_archive)


def module_flags(cfg, precision: str) -> tuple[str, ...]:
    """The iree-compile flags the session adds for `precision` (a NATIVE_FORMS name: its
    checkpoint's config over f32)."""
    form_cfg, form = graph_form(cfg, precision)
    return precision_of(form).compile_flags(form_cfg.native_weights)


def base_precision(label: str) -> str:
    """The precision of a run's label (`<precision>/plain`: that precision without its flags)."""
    return label.split("/")[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-2b", choices=sorted(TEXT_PRESETS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size (lm_head rows)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--precision", nargs="+", default=["f32"], choices=[*GRAPH_PRECISIONS, *NATIVE_FORMS],
                        help="one or more graph precisions, timed alternating (the first is the base); mlx4, "
                             "mlx8: an MLX checkpoint's affine weights in their bits, groups of 64; gguf-q4_0: a "
                             "GGUF Q4_0 file in its bits (f32 activations; q4_0 is the kernel's precision); "
                             "int4-g64: int4's layout")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over the contexts")
    parser.add_argument("--repeats", type=int, default=10, help="decode calls per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lanes", type=int, nargs="+", default=[1], help="sequences per step (the server's lanes)")
    parser.add_argument("--profile", action="store_true", help="per-dispatch times and copies per context")
    parser.add_argument("--without-module-flags", action="store_true",
                        help="also time each precision that adds iree-compile flags (Precision.compile_flags) built "
                             "without them, as <precision>/plain")
    args = parser.parse_args(argv)
    cfg = replace(TEXT_PRESETS[args.preset], num_hidden_layers=args.layers, vocab_size=args.vocab)
    flags = {p: module_flags(cfg, p) for p in args.precision}
    if args.without_module_flags:
        flags.update({f"{p}/plain": () for p in args.precision if flags[p]})
    runs = [(p, c, n) for p in flags for c in args.contexts for n in args.lanes]
    with tempfile.TemporaryDirectory(prefix="bench_decode.") as tmp:
        tmp = Path(tmp)
        archives, vmfbs = {}, {}
        for precision in args.precision:
            archives[precision] = tmp / f"weights_{precision}.irpa"
            write_archive(cfg, precision, archives[precision])
        for label, context, lanes in runs:
            vmfbs[label, context, lanes] = tmp / f"decode_{label.replace('/', '_')}_{context}_{lanes}.vmfb"
            module = decode_module(cfg, context, base_precision(label), lanes)
            vmfbs[label, context, lanes].write_bytes(compile_mlir(module, extra_flags=flags[label]))
        times = {run: [] for run in runs}
        for _ in range(args.rounds):
            for run in runs:  # the last slot: every key but the new one masked in
                label, context, lanes = run
                times[run].append(step_ms(vmfbs[run], archives[base_precision(label)], context - 1, args.repeats,
                                          args.threads, lanes=lanes))
        print(f"{args.preset} widths, {args.layers} layers, vocab {args.vocab}, {args.threads} threads: ms per "
              f"decode step, median (min-max) of {args.rounds} rounds")
        base = statistics.median(times[runs[0]])
        for run in runs:
            precision, context, lanes = run
            t = times[run]
            rounds = sorted(a / b for a, b in zip(t, times[runs[0]]))  # each round's own ratio to the base
            print(f"  {precision:8s} context {context:6d} lanes {lanes}: {statistics.median(t):7.2f} "
                  f"({min(t):.2f}-{max(t):.2f})  x{statistics.median(t) / base:.2f} of {runs[0][0]} at context "
                  f"{runs[0][1]}, {runs[0][2]} lane(s) (rounds' own: median x{statistics.median(rounds):.3f}, "
                  f"{rounds[0]:.2f}-{rounds[-1]:.2f}); weights {weight_bytes(cfg, base_precision(precision)) / 1e6:.0f} MB")
        if args.profile:
            from runtime.bench.roof import memory_bandwidth_gbs
            read = memory_bandwidth_gbs(args.threads)["read_gbs"]
            print(f"  read bandwidth now: {read:.1f} GB/s (torch, a 1 GiB sum, {args.threads} threads)")
            for run in runs:
                precision, context, lanes = run
                path = tmp / f"decode_{precision.replace('/', '_')}_{context}_{lanes}.ireeprof"
                step_ms(vmfbs[run], archives[base_precision(precision)], context - 1, 3, args.threads, profile=path,
                        lanes=lanes)
                floor = weight_bytes(cfg, base_precision(precision)) / read / 1e6
                print(f"  {precision} context {context} lanes {lanes} (profiled, 3 steps; its weights at that "
                      f"bandwidth: {floor:.2f} ms):")
                print("\n".join(profile_report(path, 3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
