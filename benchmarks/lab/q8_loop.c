// The Q8_0 / 6-bit / Q4_0 kernel's loop alone, outside IREE (benchmarks/lab/bench_q8_loop.py builds and runs
// it): two builds of kernels/q8_matmul.c (A, B: entries renamed by -D) on the same weights, `threads`
// workers pulling 128-output workgroups off one counter as IREE's do, against a plain read of the
// same bytes (256-bit loads: the read roof), the three alternating round by round.
//
//   q8_loop M BITS THREADS MEGABYTES ROUNDS      (BITS 8, 6, 4, or 6k: GGUF's Q6_K, the q6k entry)
//
// prints one line of JSON: ms per [6144, 2048] projection (median of the rounds) of A, B and the
// read, and whether A and B gave the same bits. A baseline without the 6-bit entry (older
// kernels/q8_matmul.c) runs B in its place at 6 bits ("base_missing": true).
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ENTRY_ARGS                                                                                           \
  const int8_t*, const int8_t*, size_t, size_t, size_t, const float*, const float*, size_t, size_t, size_t,  \
      const int32_t*, const int32_t*, size_t, size_t, size_t, const uint8_t*, const uint8_t*, size_t, size_t, \
      size_t, const uint16_t*, const uint16_t*, size_t, size_t, size_t, float*, float*, size_t, size_t, size_t, \
      size_t, size_t, size_t, size_t, size_t
typedef void entry_t(ENTRY_ARGS);
entry_t q8_A, q4_A, q8_B, q6_B, q4_B, q6k_B;
entry_t q6_A __attribute__((weak));   // absent from a baseline older than the 6-bit entry
entry_t q6k_A __attribute__((weak));  // ... or than the Q6_K one
#define MEMREF(p) p, p, 0, 0, 0

enum { N = 6144, K = 2048, TILES = 8, GROUPS = N / 16 / TILES };
static size_t M, W, threads, wbytes, scales;  // scales: f16 scales a weight (Q6_K: its d per 256)
static uint8_t* w;
static uint16_t* dw;
static int8_t* x;
static float *dx, *y;
static int32_t* xs;
static entry_t* run_entry;  // NULL: the read
static atomic_long next_group;
static pthread_barrier_t start, done;
static volatile long long sink;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void read_share(size_t id) {  // this worker's share of every weight's bytes
  const size_t share = W * wbytes / threads / 128 * 128;
  const __m256i* p = (const __m256i*)(w + id * share);
  __m256i acc = _mm256_setzero_si256();
  for (size_t i = 0; i < share / 32; i += 4)
    acc = _mm256_add_epi64(acc, _mm256_xor_si256(_mm256_xor_si256(_mm256_load_si256(p + i), _mm256_load_si256(p + i + 1)),
                                                 _mm256_xor_si256(_mm256_load_si256(p + i + 2), _mm256_load_si256(p + i + 3))));
  sink += _mm256_extract_epi64(acc, 0);
}

static void* worker(void* arg) {
  for (;;) {
    pthread_barrier_wait(&start);
    if (!run_entry) {
      read_share((size_t)arg);
    } else {
      long g;
      while ((g = atomic_fetch_add(&next_group, 1)) < (long)(W * GROUPS))
        run_entry(MEMREF(x), MEMREF(dx), MEMREF(xs), MEMREF(w + g / GROUPS * wbytes),
                  MEMREF(dw + g / GROUPS * scales), MEMREF(y), M, N, K, TILES, g % GROUPS);
    }
    pthread_barrier_wait(&done);
  }
}

static double timed(entry_t* entry) {
  run_entry = entry;
  atomic_store(&next_group, 0);
  double t = now();
  pthread_barrier_wait(&start);
  pthread_barrier_wait(&done);
  return (now() - t) / W;
}

static int by_value(const void* a, const void* b) {
  double d = *(const double*)a - *(const double*)b;
  return (d > 0) - (d < 0);
}

int main(int argc, char** argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: q8_loop M BITS THREADS MEGABYTES ROUNDS\n");
    return 2;
  }
  M = strtoul(argv[1], 0, 10);
  const int q6k = !strcmp(argv[2], "6k");  // Q6_K: 6-bit codes, int8 scales per 16, f16 d per 256; x's sums per 16
  const int bits = q6k ? 6 : atoi(argv[2]);
  threads = strtoul(argv[3], 0, 10);
  const double megabytes = atof(argv[4]);
  const int rounds = atoi(argv[5]);
  if (!M || (bits != 8 && bits != 6 && bits != 4) || !threads || threads > 64 || rounds < 1 || rounds > 999) {
    fprintf(stderr, "q8_loop: expected M >= 1, BITS 8, 6, 4 or 6k, THREADS 1-64, ROUNDS 1-999\n");
    return 2;
  }
  const size_t sum = q6k ? 16 : 32;  // inputs per sum of x
  wbytes = q6k ? (size_t)N * K * 13 / 16 : (size_t)N * K * bits / 8;
  scales = q6k ? (size_t)N * K / 256 : (size_t)N * K / 32;
  W = (size_t)(megabytes * 1e6 / (wbytes + 2 * scales)) + 1;
  w = aligned_alloc(64, W * wbytes);
  dw = aligned_alloc(64, W * scales * 2);
  x = aligned_alloc(64, M * K);
  dx = aligned_alloc(64, M * K / 32 * 4);
  xs = aligned_alloc(64, M * K / sum * 4);
  y = aligned_alloc(64, M * N * 4);
  float* y0 = aligned_alloc(64, M * N * 4);
  if (!w || !dw || !x || !dx || !xs || !y || !y0) {
    fprintf(stderr, "q8_loop: out of memory for %zu weights\n", W);
    return 1;
  }
  for (size_t i = 0; i < W * wbytes; ++i)  // 8 bits: -127..127 (the layout's range); 6 and 4 bits: any codes
    w[i] = bits == 8 ? (uint8_t)(int8_t)((int)((i * 2654435761u >> 13) % 255) - 127) : (uint8_t)(i * 2654435761u >> 11);
  for (size_t i = 0; i < W * scales; ++i) dw[i] = (uint16_t)(0x2000 + i % 1024);
  for (size_t i = 0; i < M * K; ++i) x[i] = (int8_t)((int)((i * 40503u >> 7) % 255) - 127);  // -127..127, as Q8_0's
  for (size_t i = 0; i < M * K / 32; ++i) dx[i] = 0.01f * (1 + i % 7);
  for (size_t i = 0; i < M * K / sum; ++i) {
    int32_t s = 0;
    for (size_t j = 0; j < sum; ++j) s += x[i * sum + j];
    xs[i] = s;
  }
  entry_t* b = q6k ? q6k_B : bits == 8 ? q8_B : bits == 6 ? q6_B : q4_B;
  entry_t* a = q6k ? (q6k_A ? q6k_A : b) : bits == 8 ? q8_A : bits == 6 ? (q6_A ? q6_A : b) : q4_A;
  for (size_t g = 0; g < GROUPS; ++g) a(MEMREF(x), MEMREF(dx), MEMREF(xs), MEMREF(w), MEMREF(dw), MEMREF(y0), M, N, K, TILES, g);
  for (size_t g = 0; g < GROUPS; ++g) b(MEMREF(x), MEMREF(dx), MEMREF(xs), MEMREF(w), MEMREF(dw), MEMREF(y), M, N, K, TILES, g);
  const int same = !memcmp(y0, y, M * N * 4);

  pthread_barrier_init(&start, 0, threads + 1);
  pthread_barrier_init(&done, 0, threads + 1);
  pthread_t th[64];
  for (size_t i = 0; i < threads; ++i) pthread_create(&th[i], 0, worker, (void*)i);
  double *ta = malloc(rounds * 8), *tb = malloc(rounds * 8), *tr = malloc(rounds * 8);
  timed(a), timed(b), timed(0);  // warm-up
  for (int r = 0; r < rounds; ++r) ta[r] = timed(a), tb[r] = timed(b), tr[r] = timed(0);
  qsort(ta, rounds, 8, by_value), qsort(tb, rounds, 8, by_value), qsort(tr, rounds, 8, by_value);
  printf("{\"weights\": %zu, \"weight_bytes\": %zu, \"a_ms\": %.4f, \"b_ms\": %.4f, \"read_ms\": %.4f, \"same\": %s, "
         "\"base_missing\": %s}\n",
         W, wbytes + 2 * scales, ta[rounds / 2] * 1e3, tb[rounds / 2] * 1e3, tr[rounds / 2] * 1e3,
         same ? "true" : "false", a == b ? "true" : "false");
  exit(0);  // the workers wait on the barrier for ever
}
