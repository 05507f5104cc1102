"""The machine's vector FMA peak: the ceiling under every roof the bench measures.

`qwen3vl bench`'s roof is the best large matmul this machine runs (torch, numpy/OpenBLAS,
IREE), which is what a kernel reaches, not what the core can issue. This times a loop of
independent register-only multiply-adds on every core at once, as many threads as
`--threads`: f32 `vfmadd231ps` (32 flops on a zmm register) and, where the CPU has
avx512_bf16, `vdpbf16ps` (64 flops: 16 lanes, each a dot of two bf16 pairs). No memory
traffic, so it is an upper bound a matmul can approach but not pass. The C source is
compiled here with the system's C compiler (`cc`, or `--cc`).

    .venv/bin/python benchmarks/fma_peak.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MAX_THREADS = 256  # the C source's thread arrays (passed to it as -DMAX_THREADS)

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 12          /* independent accumulators: more than FMA latency x ports */
static long steps;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void *f32(void *out) {
    __m512 acc[CHAINS], a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_setzero_ps();
    for (long s = 0; s < steps; s++) {
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
        __asm__ volatile("" : "+v"(a));
    }
    float sum = 0; for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    *(float *)out = sum; return NULL;
}

#ifdef __AVX512BF16__
static void *bf16(void *out) {
    __m512 acc[CHAINS];
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x30003000);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_setzero_ps();
    for (long s = 0; s < steps; s++) {
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    float sum = 0; for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    *(float *)out = sum; return NULL;
}
#endif

static double gflops(void *(*kernel)(void *), int threads, double flops_per_op) {
    pthread_t t[MAX_THREADS]; float out[MAX_THREADS];
    double t0 = now();
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, kernel, &out[i]);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    return threads * (double)steps * CHAINS * flops_per_op / (now() - t0) / 1e9;
}

int main(int argc, char **argv) {
    int threads = atoi(argv[1]); steps = atol(argv[2]);
    printf("{\"f32\": %.1f", gflops(f32, threads, 32));
#ifdef __AVX512BF16__
    printf(", \"bf16\": %.1f", gflops(bf16, threads, 64));
#endif
    printf("}\n");
    return 0;
}
"""


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build(cc: str, workdir: Path) -> Path:
    flags = cpu_flags()
    if "avx512f" not in flags:
        sys.exit("fma_peak: this CPU has no AVX-512 (the kernel is written for zmm registers)")
    source, binary = workdir / "fma_peak.c", workdir / "fma_peak"
    source.write_text(SOURCE)
    isa = ["-mavx512f", *(["-mavx512bf16"] if "avx512_bf16" in flags else [])]
    subprocess.run([cc, "-O3", "-funroll-all-loops", f"-DMAX_THREADS={MAX_THREADS}", *isa, str(source),
                    "-o", str(binary), "-lpthread"], check=True)
    return binary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=150_000_000, help="loop steps a thread (12 ops each)")
    p.add_argument("--repeats", type=int, default=5, help="runs; the best is the peak")
    p.add_argument("--cc", default=shutil.which("cc") or "cc")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if not 1 <= args.threads <= MAX_THREADS:
        p.error(f"--threads {args.threads}: expected 1 to {MAX_THREADS}")
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(args.cc, Path(tmp))
        runs = [json.loads(subprocess.run([str(binary), str(args.threads), str(args.steps)], check=True,
                                          capture_output=True, text=True).stdout) for _ in range(args.repeats)]
    result = {"threads": args.threads, "repeats": args.repeats,
              **{k: {"best": max(r[k] for r in runs), "runs": [r[k] for r in runs]} for k in runs[0]}}
    for k in runs[0]:
        print(f"{k:5s} FMA peak, {args.threads} threads: {result[k]['best']:.1f} GFLOP/s "
              f"(runs {min(result[k]['runs']):.1f}-{result[k]['best']:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
