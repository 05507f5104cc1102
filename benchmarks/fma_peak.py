"""The machine's vector FMA peak: the ceiling under every roof the bench measures.

`qwen3vl bench`'s roof is the best large matmul this machine runs (torch, numpy/OpenBLAS,
IREE), which is what a kernel reaches, not what the core can issue. This times a loop of
independent register-only multiply-adds on every core at once, as many threads as
`--threads`: f32 `vfmadd231ps` (32 flops on a zmm register) and, where the CPU has
avx512_bf16, `vdpbf16ps` (64 flops: 16 lanes, each a dot of two bf16 pairs). No memory
traffic, so it is an upper bound a matmul can approach but not pass. With avx512_bf16 it
also times IREE's own bf16 matmul inner loop, as IREE 3.13 emits it for the tower's
linears (the mmt4d loop of the 16x16x2 data tiles, read off fc2's assembly): one zmm load
of the packed weights and 16 `vdpbf16ps` with `{1to16}` broadcasts of the packed
activations into 16 accumulators, over K = 4096 panels (128 KiB each, in L2). The C source
is compiled here with the system's C compiler (`cc`, or `--cc`).

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

/* IREE's bf16 mmt4d inner loop: A [K/2][16][2] and B [K/2][16][2] bf16 panels (one 16x16
   output tile), 16 accumulators, each step one zmm load of B and 16 broadcast-from-memory
   vdpbf16ps (fc2's loop, `vdpbf16ps 4(%r12,%r8){1to16}, %zmm16, %zmm14`, ...). */
#define KSTEPS 2048        /* K = 4096: 128 KiB a panel */
/* About as many ops as the other kernels; at least one tile, however few --steps. */
static long mmt4d_tiles(void) { long t = steps * CHAINS / (16 * KSTEPS); return t > 0 ? t : 1; }
static void *mmt4d(void *out) {
    char *a = aligned_alloc(64, 64 * KSTEPS), *b = aligned_alloc(64, 64 * KSTEPS);
    for (long i = 0; i < 64 * KSTEPS; i++) { a[i] = (i & 1) ? 0x3f : 0; b[i] = (i & 1) ? 0x30 : 0; }
    long n = 64 * KSTEPS, tiles = mmt4d_tiles();
    float *o = out;
    for (long t = 0; t < tiles; t++) {
        __asm__ volatile(
            "vxorps %%xmm0,%%xmm0,%%xmm0\n vxorps %%xmm1,%%xmm1,%%xmm1\n vxorps %%xmm2,%%xmm2,%%xmm2\n"
            "vxorps %%xmm3,%%xmm3,%%xmm3\n vxorps %%xmm4,%%xmm4,%%xmm4\n vxorps %%xmm5,%%xmm5,%%xmm5\n"
            "vxorps %%xmm6,%%xmm6,%%xmm6\n vxorps %%xmm7,%%xmm7,%%xmm7\n vxorps %%xmm8,%%xmm8,%%xmm8\n"
            "vxorps %%xmm9,%%xmm9,%%xmm9\n vxorps %%xmm10,%%xmm10,%%xmm10\n vxorps %%xmm11,%%xmm11,%%xmm11\n"
            "vxorps %%xmm12,%%xmm12,%%xmm12\n vxorps %%xmm13,%%xmm13,%%xmm13\n vxorps %%xmm14,%%xmm14,%%xmm14\n"
            "vxorps %%xmm15,%%xmm15,%%xmm15\n xorq %%r8,%%r8\n"
            ".p2align 4\n1:\n"
            "vmovups (%[b],%%r8), %%zmm16\n"
            "vdpbf16ps (%[a],%%r8)%{1to16%}, %%zmm16, %%zmm15\n vdpbf16ps 4(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm14\n"
            "vdpbf16ps 8(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm13\n vdpbf16ps 12(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm12\n"
            "vdpbf16ps 16(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm11\n vdpbf16ps 20(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm10\n"
            "vdpbf16ps 24(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm9\n vdpbf16ps 28(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm8\n"
            "vdpbf16ps 32(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm7\n vdpbf16ps 36(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm6\n"
            "vdpbf16ps 40(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm5\n vdpbf16ps 44(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm4\n"
            "vdpbf16ps 48(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm3\n vdpbf16ps 52(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm2\n"
            "vdpbf16ps 56(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm1\n vdpbf16ps 60(%[a],%%r8)%{1to16%}, %%zmm16, %%zmm0\n"
            "addq $64, %%r8\n cmpq %[n], %%r8\n jne 1b\n"
            "vaddps %%zmm0, %%zmm15, %%zmm15\n vmovups %%zmm15, (%[o])\n"
            : : [a] "r"(a), [b] "r"(b), [n] "r"(n), [o] "r"(o)
            : "r8", "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16");
    }
    free(a); free(b); return NULL;
}
#endif

static double gflops(void *(*kernel)(void *), int threads, double ops, double flops_per_op) {
    pthread_t t[MAX_THREADS]; float out[MAX_THREADS * 16];
    double t0 = now();
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, kernel, &out[16 * i]);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    return threads * ops * flops_per_op / (now() - t0) / 1e9;
}

int main(int argc, char **argv) {
    int threads = atoi(argv[1]); steps = atol(argv[2]);
    printf("{\"f32\": %.1f", gflops(f32, threads, (double)steps * CHAINS, 32));
#ifdef __AVX512BF16__
    printf(", \"bf16\": %.1f", gflops(bf16, threads, (double)steps * CHAINS, 64));
    printf(", \"bf16_mmt4d_loop\": %.1f", gflops(mmt4d, threads, (double)mmt4d_tiles() * 16 * KSTEPS, 64));
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
    labels = {"f32": "f32 FMA peak", "bf16": "bf16 FMA peak", "bf16_mmt4d_loop": "IREE's bf16 mmt4d inner loop"}
    for k in runs[0]:
        print(f"{labels[k]:29s} {args.threads} threads: {result[k]['best']:.1f} GFLOP/s "
              f"(runs {min(result[k]['runs']):.1f}-{result[k]['best']:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
