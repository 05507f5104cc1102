// q8_matmul: y[M, N] = x[M, K] @ w[N, K]^T in blocks of 32 on both sides (llama.cpp Q8_0 x Q8_0
// math), one IREE workgroup's share, linked into IREE's embedded ELF executables through
// `hal.executable.objects` (kernels/q8_matmul.py writes the dispatch that calls it).
//
//   y[m, n] = sum over blocks b, in order, of ((float)dw[n, b] * dx[m, b]) * (float)isum(m, n, b)
//   isum(m, n, b) = sum_{j < 32} (int32)xq[m, 32b + j] * (int32)w[n, 32b + j]   (exact)
//
// every float operation rounded as written (mul, mul, add: no FMA; build with
// -ffp-contract=off), so that numpy's float32 math of the same order gives the same bits.
//
// Layouts (all row-major):
//   xq  int8  [M, K]          activations quantized per row and block of 32
//   dx  f32   [M, K/32]       their scales
//   xs  int32 [M, K/32]       sum of each block of xq (the VNNI path's +128 correction)
//   w   int8  [N/16, K/4, 16, 4]: w[16t + i, 4q + j] at ((t * K/4 + q) * 16 + i) * 4 + j,
//             values in [-127, 127] (the AVX2 path's sign trick cannot negate -128)
//   dw  f16   [N/16, K/32, 16]: dw[16t + i, b] at (t * K/32 + b) * 16 + i (Q8_0's f16 scales)
//   y   f32   [M, N]
// N a multiple of 32, K a multiple of 32.
//
// Bare-metal C: no libc, no globals, no TLS (IREE's embedded ELF loader links it).
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define Q8_ROWS 4                 // rows of x per pass over a weight tile (registers)

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)

#define Q8_TILES_AT_ONCE 2  // two tiles share each broadcast of x: half the broadcasts a dot product

// Tiles [0, 2) (32 outputs; tile p's weights at wt + 16 K p, scales at dwt + 16 K/32 p) against
// rows [0, MC) of x: vpdpbusd takes u8 x s8, so the weights go in as w + 128 (one xor) and
// 128 * xs is taken off each block's i32 sum.
static inline __attribute__((always_inline)) void tile_rows(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xs,
    const int8_t* restrict wt, const uint16_t* restrict dwt, float* restrict y, size_t N, size_t K,
    size_t n0, const int MC) {
  const size_t blocks = K / 32;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[Q8_TILES_AT_ONCE][Q8_ROWS];
  for (int p = 0; p < Q8_TILES_AT_ONCE; ++p)
    for (int m = 0; m < MC; ++m) acc[p][m] = _mm512_setzero_ps();
  for (size_t b = 0; b < blocks; ++b) {
    __m512i isum[Q8_TILES_AT_ONCE][Q8_ROWS];
    for (int p = 0; p < Q8_TILES_AT_ONCE; ++p)
      for (int m = 0; m < MC; ++m) isum[p][m] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      __m512i wu[Q8_TILES_AT_ONCE];
      for (int p = 0; p < Q8_TILES_AT_ONCE; ++p)
        wu[p] = _mm512_xor_si512(_mm512_loadu_si512((const void*)(wt + p * 16 * K + (b * 8 + q) * 64)), flip);
      for (int m = 0; m < MC; ++m) {
        int32_t quad;
        __builtin_memcpy(&quad, x + m * K + b * 32 + q * 4, 4);
        __m512i xb = _mm512_set1_epi32(quad);
        for (int p = 0; p < Q8_TILES_AT_ONCE; ++p) isum[p][m] = _mm512_dpbusd_epi32(isum[p][m], wu[p], xb);
      }
    }
    for (int m = 0; m < MC; ++m) {
      __m512i correction = _mm512_set1_epi32(128 * xs[m * blocks + b]);
      __m512 d = _mm512_set1_ps(dx[m * blocks + b]);
      for (int p = 0; p < Q8_TILES_AT_ONCE; ++p) {
        __m512i exact = _mm512_sub_epi32(isum[p][m], correction);
        __m512 dwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dwt + p * 16 * blocks + b * 16)));
        __m512 scale = _mm512_mul_ps(dwv, d);
        acc[p][m] = _mm512_add_ps(acc[p][m], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(exact)));
      }
    }
  }
  for (int p = 0; p < Q8_TILES_AT_ONCE; ++p)
    for (int m = 0; m < MC; ++m) _mm512_storeu_ps(y + m * N + n0 + 16 * p, acc[p][m]);
}

#elif defined(__AVX2__)

#define Q8_TILES_AT_ONCE 1

// The same with AVX2, one tile at a time: per 8 outputs, vpmaddubsw of |x| (u8) against w with x's sign
// (llama.cpp's trick), then vpmaddwd with ones to i32.
static inline __attribute__((always_inline)) __m256i dot4(__m256i w, __m256i xb, __m256i ones) {
  __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(w, xb));
  return _mm256_madd_epi16(p, ones);
}

static inline __attribute__((always_inline)) void tile_rows(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xs,
    const int8_t* restrict wt, const uint16_t* restrict dwt, float* restrict y, size_t N, size_t K,
    size_t n0, const int MC) {
  (void)xs;
  const size_t blocks = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 lo[Q8_ROWS], hi[Q8_ROWS];
  for (int m = 0; m < MC; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (size_t b = 0; b < blocks; ++b) {
    __m256i slo[Q8_ROWS], shi[Q8_ROWS];
    for (int m = 0; m < MC; ++m) slo[m] = shi[m] = _mm256_setzero_si256();
    const int8_t* wb = wt + b * 8 * 64;
    for (int q = 0; q < 8; ++q) {
      __m256i w0 = _mm256_loadu_si256((const __m256i*)(wb + q * 64));
      __m256i w1 = _mm256_loadu_si256((const __m256i*)(wb + q * 64 + 32));
      for (int m = 0; m < MC; ++m) {
        int32_t quad;
        __builtin_memcpy(&quad, x + m * K + b * 32 + q * 4, 4);
        __m256i xb = _mm256_set1_epi32(quad);
        slo[m] = _mm256_add_epi32(slo[m], dot4(w0, xb, ones));
        shi[m] = _mm256_add_epi32(shi[m], dot4(w1, xb, ones));
      }
    }
    __m256 dlo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dwt + b * 16)));
    __m256 dhi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dwt + b * 16 + 8)));
    for (int m = 0; m < MC; ++m) {
      __m256 d = _mm256_set1_ps(dx[m * blocks + b]);
      lo[m] = _mm256_add_ps(lo[m], _mm256_mul_ps(_mm256_mul_ps(dlo, d), _mm256_cvtepi32_ps(slo[m])));
      hi[m] = _mm256_add_ps(hi[m], _mm256_mul_ps(_mm256_mul_ps(dhi, d), _mm256_cvtepi32_ps(shi[m])));
    }
  }
  for (int m = 0; m < MC; ++m) {
    _mm256_storeu_ps(y + m * N + n0, lo[m]);
    _mm256_storeu_ps(y + m * N + n0 + 8, hi[m]);
  }
}

#else
#error "q8_matmul needs AVX-512 VNNI (with BW) or AVX2"
#endif

// One MLIR memref as LLVM lowers it to a call: allocated and aligned pointers, offset (in
// elements), size, stride. The data starts at aligned + offset.
#define Q8_MEMREF(type, name) \
  type* name##_allocated, type* name, size_t name##_off, size_t name##_size, size_t name##_stride

// Workgroup `wg` computes tiles [tiles wg, tiles wg + tiles) (16 outputs each; fewer in the last
// workgroup) for every row of x.
void q8_matmul_workgroup(Q8_MEMREF(const int8_t, xq), Q8_MEMREF(const float, dx), Q8_MEMREF(const int32_t, xs),
                         Q8_MEMREF(const int8_t, w), Q8_MEMREF(const uint16_t, dw), Q8_MEMREF(float, y), size_t M,
                         size_t N, size_t K, size_t tiles, size_t wg) {
  xq += xq_off, dx += dx_off, xs += xs_off, w += w_off, dw += dw_off, y += y_off;
  const size_t blocks = K / 32;
  const size_t end = (wg + 1) * tiles < N / 16 ? (wg + 1) * tiles : N / 16;
  for (size_t t = wg * tiles; t < end; t += Q8_TILES_AT_ONCE) {
    const int8_t* wt = w + t * 16 * K;
    const uint16_t* dwt = dw + t * blocks * 16;
    size_t m = 0;
    for (; m + Q8_ROWS <= M; m += Q8_ROWS)
      tile_rows(xq + m * K, dx + m * blocks, xs + m * blocks, wt, dwt, y + m * N, N, K, t * 16, Q8_ROWS);
    switch (M - m) {
      case 3: tile_rows(xq + m * K, dx + m * blocks, xs + m * blocks, wt, dwt, y + m * N, N, K, t * 16, 3); break;
      case 2: tile_rows(xq + m * K, dx + m * blocks, xs + m * blocks, wt, dwt, y + m * N, N, K, t * 16, 2); break;
      case 1: tile_rows(xq + m * K, dx + m * blocks, xs + m * blocks, wt, dwt, y + m * N, N, K, t * 16, 1); break;
      default: break;
    }
  }
}
