// q8_matmul: y[M, N] = x[M, K] @ w[N, K]^T against activations quantized per row and block of
// 32 (llama.cpp's Q8_0), with weights in Q8_0 (int8), 6-bit or Q4_0 (4-bit codes) blocks of 32:
// llama.cpp's Q8_0 x Q8_0 and Q4_0 x Q8_0 math (and the same with 6-bit weights), one IREE
// workgroup's share, linked into IREE's embedded ELF executables through `hal.executable.objects`
// (kernels/q8_matmul.py writes the dispatch that calls it).
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
//   xs  int32 [M, K/32]       sum of each block of xq (the unsigned-weight paths' correction)
//   w, 8 bits: int8 [N/16, K/4, 16, 4]: w[16t + i, 4q + j] at ((t * K/4 + q) * 16 + i) * 4 + j,
//             values in [-127, 127] (the AVX2 path's sign trick cannot negate -128)
//   w, 4 bits: uint8 [N/16, K/32, 4, 16, 4] of codes u = w + 8 (w in [-8, 7]), two to a byte: the
//             byte at (((t * K/32 + b) * 4 + q) * 16 + i) * 4 + j holds u[16t + i, 32b + 4q + j] in its
//             low nibble and u[16t + i, 32b + 16 + 4q + j] in its high one (one 64-byte load, an and
//             and a shift give two steps of the 8-bit layout; 18 bytes a block with its scale, Q4_0's)
//   w, 6 bits: uint8, each tile's block 384 bytes, of codes u = w + 32 (w in [-32, 31]): first their low
//             4 bits as the 4-bit layout's 256 bytes, then their top 2 bits in [2, 16, 4] bytes: byte
//             row h (the block's 64-byte load 4 + h) holds step s = h + 2r's (inputs 4s..4s+3) at bits
//             2r..2r+1, r = 0..3 (26 bytes a block with its scale: 6.5 bits a weight)
//   w, Q6_K:  the 6-bit codes and GGUF's int8 scales per 16 inputs, a tile's super-block of 256 inputs
//             in 3328 bytes (Q6K_SUPER_BYTES, below; its d per 256 as dw [N/16, K/256, 16]): the
//             q6k_matmul_workgroup entry, its math at that entry
//   dw  f16   [N/16, K/32, 16]: dw[16t + i, b] at (t * K/32 + b) * 16 + i (the blocks' f16 scales)
//   y   f32   [M, N]
// N a multiple of 32, K a multiple of 32.
//
// Bare-metal C: no libc, no globals, no TLS (IREE's embedded ELF loader links it).
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

// Bytes of one tile's block of 32 inputs at `bits` a weight, and the offset the unsigned
// weights' sums carry (u = w + OFFSET: 128 for the 8-bit xor, 32 and 8 for the 6- and 4-bit codes).
// Loops over registers unrolled whole, so that their arrays stay in registers.
#define Q8_UNROLL _Pragma("GCC unroll 16")

#define BLOCK_BYTES(bits) (16 * 32 * (bits) / 8)
#define OFFSET(bits) (1 << ((bits) - 1))

// Q6_K (the q6k entry): one tile's super-block of 256 inputs is its 8 blocks' 6-bit codes (the
// 6-bit layout's 384 bytes each, 64-byte aligned), then their sub-scales int8 [8 blocks, 2 halves,
// 16 outputs] (256 bytes): 3328 bytes, 52 lines. Block b's codes and half h's 16 scales:
#define Q6K_SUPER_BYTES (8 * BLOCK_BYTES(6) + 256)
static inline __attribute__((always_inline)) const uint8_t* q6k_codes(const uint8_t* restrict wt, size_t b) {
  return wt + (b / 8) * Q6K_SUPER_BYTES + (b % 8) * BLOCK_BYTES(6);
}
static inline __attribute__((always_inline)) const int8_t* q6k_scales(const uint8_t* restrict wt, size_t b, int h) {
  return (const int8_t*)(wt + (b / 8) * Q6K_SUPER_BYTES + 8 * BLOCK_BYTES(6) + (b % 8) * 32 + h * 16);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)

#define Q8_TILES_AT_ONCE 2  // two tiles share each broadcast of x: half the broadcasts a dot product
// Tiles at once at one row (decode, reading weights from DRAM): Q8_0 two, Q4_0 one, a single
// stream of weights (benchmarks/lab/bench_q8_loop.py: Q4_0 x0.70-0.79 the time of two at once, Q8_0
// x1.09-1.15 with one); 6 bits one, as Q4_0 (x0.82-0.85 the time of two, both prefetched).
#define ONE_ROW_TILES(bits) ((bits) == 8 ? 2 : 1)
// Blocks (9 KB) of weights and scales tile_rows prefetches ahead at one row and 6 bits, past the
// range's end too: x0.77-1.01 (median of 7 runs x0.91) the time without (2 threads, from DRAM);
// 12 and 48 blocks the same as 24 (x1.00, x1.02).
#define Q6_ONE_ROW_AHEAD 24
// Rows of x per pass over the tiles: full_pass holds their sums, the previous block's and the
// accumulators, 24 zmm (6 or 8 rows a pass, unpipelined: x1.0 and x1.07 the time of 4 at 512 rows).
#define ROWS(bits) 4
#define Q8_ROWS_MAX 4

// The 6-bit codes' top 2 bits of step q in bits 4-5 of each byte (the rest cleared), out of its
// byte row `top` (bits 2 (q >> 1)): a 16-bit shift moves each byte's pair within its own byte's
// bits 4-5 (what crosses from the neighbour lands outside them, and the and clears it).
static inline __attribute__((always_inline)) __m512i top_bits(__m512i top, int q) {
  const int r = q >> 1;
  top = r == 0   ? _mm512_slli_epi16(top, 4)
        : r == 1 ? _mm512_slli_epi16(top, 2)
        : r == 3 ? _mm512_srli_epi16(top, 2)
                 : top;
  return _mm512_and_si512(top, _mm512_set1_epi8(0x30));
}

// Step q (inputs 4q..4q+3 of the block) of one tile's block as unsigned bytes, 16 outputs x 4
// inputs: 8 bits, w + 128 (one xor); 4 bits, the codes' low nibbles (q < 4) or high ones; 6 bits,
// those 4 bits or'ed with the top 2 (`top_bits`) by one vpternlogd.
static inline __attribute__((always_inline)) __m512i unsigned_step(const uint8_t* restrict block, int q,
                                                                   const int bits) {
  if (bits == 8)
    return _mm512_xor_si512(_mm512_loadu_si512((const void*)(block + q * 64)), _mm512_set1_epi8((char)0x80));
  __m512i v = _mm512_loadu_si512((const void*)(block + (q & 3) * 64));
  v = q < 4 ? v : _mm512_srli_epi16(v, 4);
  if (bits == 4) return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
  __m512i top = top_bits(_mm512_loadu_si512((const void*)(block + 256 + (q & 1) * 64)), q);
  return _mm512_ternarylogic_epi32(v, top, _mm512_set1_epi8(0x0F), 0xEC);  // (v & 0x0F) | top
}

// Block b's i32 sums of tiles [0, P) x rows [0, MC) set to start: -OFFSET * xs, so that they end
// exact (integer math: the same bits as subtracting after, one broadcast a row rather than a
// subtraction a row and tile).
static inline __attribute__((always_inline)) void start_sums(__m512i isum[][Q8_ROWS_MAX], const int32_t* restrict xs,
                                                             size_t blocks, size_t b, const int P, const int MC,
                                                             const int bits) {
  Q8_UNROLL
  for (int m = 0; m < MC; ++m) {
    const __m512i start = _mm512_set1_epi32(-OFFSET(bits) * xs[m * blocks + b]);
    Q8_UNROLL
    for (int p = 0; p < P; ++p) isum[p][m] = start;
  }
}

// Step q of block b: one load (and unpacking) of each tile's weights, one broadcast of each row's
// 4 inputs, a vpdpbusd per tile and row.
static inline __attribute__((always_inline)) void dot_step(__m512i isum[][Q8_ROWS_MAX], const int8_t* restrict x,
                                                           const uint8_t* restrict wt, size_t K, size_t b, int q,
                                                           const int P, const int MC, const int bits) {
  const size_t blocks = K / 32;
  __m512i wu[Q8_TILES_AT_ONCE];
  Q8_UNROLL
  for (int p = 0; p < P; ++p) wu[p] = unsigned_step(wt + (p * blocks + b) * BLOCK_BYTES(bits), q, bits);
  Q8_UNROLL
  for (int m = 0; m < MC; ++m) {
    int32_t quad;
    __builtin_memcpy(&quad, x + m * K + b * 32 + q * 4, 4);
    __m512i xb = _mm512_set1_epi32(quad);
    Q8_UNROLL
    for (int p = 0; p < P; ++p) isum[p][m] = _mm512_dpbusd_epi32(isum[p][m], wu[p], xb);
  }
}

// One block's float epilogue for tile p, row m: acc += ((float)dw * dx) * (float)isum, rounded as
// documented at the top.
static inline __attribute__((always_inline)) __m512 block_epilogue(__m512 acc, __m512i isum, __m512 dwv, float dx) {
  __m512 scale = _mm512_mul_ps(dwv, _mm512_set1_ps(dx));
  return _mm512_add_ps(acc, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(isum)));
}

// Tiles [0, 2) (32 outputs; tile p's weights at wt + p * K/32 * BLOCK_BYTES, scales at dwt + 16 K/32 p)
// against rows [0, MC) of x, MC < ROWS (one row: decode; the rows a full pass leaves): vpdpbusd
// takes u8 x s8, so the weights go in unsigned and each block's i32 sum starts at -OFFSET * xs.
static inline __attribute__((always_inline)) void tile_rows(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xs,
    const uint8_t* restrict wt, const uint16_t* restrict dwt, float* restrict y, size_t N, size_t K,
    size_t n0, const int MC, const int bits) {
  const size_t blocks = K / 32;
  const int at_once = MC == 1 ? ONE_ROW_TILES(bits) : Q8_TILES_AT_ONCE;
  for (int p0 = 0; p0 < Q8_TILES_AT_ONCE; p0 += at_once) {
    // This group's tiles indexed from 0, so that the arrays' indices stay constants (registers).
    const uint8_t* wg = wt + p0 * blocks * BLOCK_BYTES(bits);
    const uint16_t* dwg = dwt + p0 * 16 * blocks;
    __m512 acc[Q8_TILES_AT_ONCE][Q8_ROWS_MAX];
    Q8_UNROLL
    for (int p = 0; p < at_once; ++p)
      Q8_UNROLL
      for (int m = 0; m < MC; ++m) acc[p][m] = _mm512_setzero_ps();
    for (size_t b = 0; b < blocks; ++b) {
      if (MC == 1 && bits == 6) {  // one row (decode): the tile's weights and scales prefetched ahead
        const uint8_t* ahead = wg + (b + Q6_ONE_ROW_AHEAD) * BLOCK_BYTES(6);
        Q8_UNROLL
        for (int l = 0; l < BLOCK_BYTES(6) / 64; ++l) _mm_prefetch((const char*)(ahead + 64 * l), _MM_HINT_T0);
        _mm_prefetch((const char*)(dwg + (b + Q6_ONE_ROW_AHEAD) * 16), _MM_HINT_T0);
      }
      __m512i isum[Q8_TILES_AT_ONCE][Q8_ROWS_MAX];
      start_sums(isum, xs, blocks, b, at_once, MC, bits);
      for (int q = 0; q < 8; ++q) dot_step(isum, x, wg, K, b, q, at_once, MC, bits);
      Q8_UNROLL
      for (int m = 0; m < MC; ++m) {
        Q8_UNROLL
        for (int p = 0; p < at_once; ++p) {
          __m512 dwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dwg + p * 16 * blocks + b * 16)));
          acc[p][m] = block_epilogue(acc[p][m], isum[p][m], dwv, dx[m * blocks + b]);
        }
      }
    }
    Q8_UNROLL
    for (int p = 0; p < at_once; ++p)
      Q8_UNROLL
      for (int m = 0; m < MC; ++m) _mm512_storeu_ps(y + m * N + n0 + 16 * (p0 + p), acc[p][m]);
  }
}

// Rows [0, ROWS) against tiles [0, 2), as tile_rows at MC = ROWS, the epilogue software-pipelined:
// block b's 8 dot-product steps each carry the epilogue of one (tile, row) pair of block b - 1
// (8 pairs, 8 steps), so that its multiplies interleave with the dot products rather than follow
// them in a burst. Each accumulator still takes its blocks in order: the same bits.
// benchmarks/lab/bench_q8_loop.py at 512 rows: x0.935-0.94 the time of the unpipelined loop for Q8_0, x0.95 for
// Q4_0. What is left is mostly the multiplies: on Zen 5 vmulps shares vpdpbusd's two pipes (2 a
// block, row and tile against 8 vpdpbusd); without them the loop takes x0.87-0.89.
static inline __attribute__((always_inline)) void full_pass(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xs,
    const uint8_t* restrict wt, const uint16_t* restrict dwt, float* restrict y, size_t N, size_t K,
    size_t n0, const int bits) {
  enum { MC = ROWS(bits), P = Q8_TILES_AT_ONCE };
  _Static_assert(MC * P == 8, "one (tile, row) pair's epilogue a step");
  const size_t blocks = K / 32;
  __m512 acc[P][MC];
  __m512i prev[P][MC];
  Q8_UNROLL
  for (int p = 0; p < P; ++p)
    Q8_UNROLL
    for (int m = 0; m < MC; ++m) acc[p][m] = _mm512_setzero_ps(), prev[p][m] = _mm512_setzero_si512();
  __m512 dwv = _mm512_setzero_ps();
  for (size_t b = 0; b < blocks; ++b) {
    __m512i isum[P][Q8_ROWS_MAX];
    start_sums(isum, xs, blocks, b, P, MC, bits);
    Q8_UNROLL
    for (int q = 0; q < 8; ++q) {
      dot_step(isum, x, wt, K, b, q, P, MC, bits);
      if (b > 0) {  // pair (q / MC, q % MC) of block b - 1
        const int pp = q / MC, pm = q % MC;
        if (pm == 0) dwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dwt + pp * 16 * blocks + (b - 1) * 16)));
        acc[pp][pm] = block_epilogue(acc[pp][pm], prev[pp][pm], dwv, dx[pm * blocks + b - 1]);
      }
    }
    Q8_UNROLL
    for (int p = 0; p < P; ++p)
      Q8_UNROLL
      for (int m = 0; m < MC; ++m) prev[p][m] = isum[p][m];
  }
  Q8_UNROLL
  for (int p = 0; p < P; ++p) {
    dwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dwt + p * 16 * blocks + (blocks - 1) * 16)));
    Q8_UNROLL
    for (int m = 0; m < MC; ++m) {
      acc[p][m] = block_epilogue(acc[p][m], prev[p][m], dwv, dx[m * blocks + blocks - 1]);
      _mm512_storeu_ps(y + m * N + n0 + 16 * p, acc[p][m]);
    }
  }
}

// Q6_K: tiles [0, P) x rows [0, MC), P = 1 at one row (a single stream of weights, prefetched as
// the 6-bit tile_rows'), else 2. Each block's two halves (steps 0-3: inputs 0-15, 4-7: 16-31) are
// their own vpdpbusd sums, each started at -OFFSET(6) times its half's sum of x (xh, [M, K/16]):
// exact dot0, dot1 (|.| <= 16 x 32 x 127 < 2^16); s = sc0 dot0 + sc1 dot1 by vpmulld (|s| <= 2^24:
// exact in i32 and in f32), then block_epilogue with the super-block's d.
static inline __attribute__((always_inline)) void q6k_rows(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xh,
    const uint8_t* restrict wt, const uint16_t* restrict dt, float* restrict y, size_t N, size_t K,
    size_t n0, const int MC, const int P) {
  const size_t blocks = K / 32, supers = K / 256, tile_bytes = supers * Q6K_SUPER_BYTES;
  __m512 acc[Q8_TILES_AT_ONCE][Q8_ROWS_MAX];
  Q8_UNROLL
  for (int p = 0; p < P; ++p)
    Q8_UNROLL
    for (int m = 0; m < MC; ++m) acc[p][m] = _mm512_setzero_ps();
  for (size_t b = 0; b < blocks; ++b) {
    if (MC == 1) {
      const size_t ahead = b + Q6_ONE_ROW_AHEAD;
      Q8_UNROLL
      for (int p = 0; p < P; ++p) {
        const uint8_t* codes = q6k_codes(wt + p * tile_bytes, ahead);
        Q8_UNROLL
        for (int l = 0; l < BLOCK_BYTES(6) / 64; ++l) _mm_prefetch((const char*)(codes + 64 * l), _MM_HINT_T0);
        _mm_prefetch((const char*)q6k_scales(wt + p * tile_bytes, ahead, 0), _MM_HINT_T0);
        _mm_prefetch((const char*)(dt + p * 16 * supers + (ahead / 8) * 16), _MM_HINT_T0);
      }
    }
    __m512i s[Q8_TILES_AT_ONCE][Q8_ROWS_MAX];
    Q8_UNROLL
    for (int h = 0; h < 2; ++h) {
      __m512i isum[Q8_TILES_AT_ONCE][Q8_ROWS_MAX];
      Q8_UNROLL
      for (int m = 0; m < MC; ++m) {
        const __m512i start = _mm512_set1_epi32(-OFFSET(6) * xh[m * 2 * blocks + 2 * b + h]);
        Q8_UNROLL
        for (int p = 0; p < P; ++p) isum[p][m] = start;
      }
      Q8_UNROLL
      for (int q = 4 * h; q < 4 * h + 4; ++q) {
        __m512i wu[Q8_TILES_AT_ONCE];
        Q8_UNROLL
        for (int p = 0; p < P; ++p) wu[p] = unsigned_step(q6k_codes(wt + p * tile_bytes, b), q, 6);
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) {
          int32_t quad;
          __builtin_memcpy(&quad, x + m * K + b * 32 + q * 4, 4);
          const __m512i xb = _mm512_set1_epi32(quad);
          Q8_UNROLL
          for (int p = 0; p < P; ++p) isum[p][m] = _mm512_dpbusd_epi32(isum[p][m], wu[p], xb);
        }
      }
      Q8_UNROLL
      for (int p = 0; p < P; ++p) {
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q6k_scales(wt + p * tile_bytes, b, h)));
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) {
          const __m512i part = _mm512_mullo_epi32(isum[p][m], sc);
          s[p][m] = h ? _mm512_add_epi32(s[p][m], part) : part;
        }
      }
    }
    Q8_UNROLL
    for (int p = 0; p < P; ++p) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dt + p * 16 * supers + (b / 8) * 16)));
      Q8_UNROLL
      for (int m = 0; m < MC; ++m) acc[p][m] = block_epilogue(acc[p][m], s[p][m], dv, dx[m * blocks + b]);
    }
  }
  Q8_UNROLL
  for (int p = 0; p < P; ++p)
    Q8_UNROLL
    for (int m = 0; m < MC; ++m) _mm512_storeu_ps(y + m * N + n0 + 16 * p, acc[p][m]);
}
#define Q6K_ROWS 4  // rows a pass at more than one row (2 tiles x 4 rows: 24 zmm of sums and accumulators)
#define Q6K_TILES(MC) ((MC) == 1 ? 1 : 2)

#elif defined(__AVX2__)

// Two tiles a pass, in parts of 8 outputs (ymm lanes), PARTS(bits) of them sharing each
// broadcast of x and ROWS(bits) rows each load of the weights, as many as the 16 ymm hold (the
// rows' block sums, the parts' weights, the broadcasts). Shared by 8 outputs rather than 16, the
// broadcasts cost x1.28 the time at 512 rows (8 bits); 4 parts x 2 rows (8 bits) and 4 x 4
// (4 bits) x1.0. At 8 bits the loop is bound by its vector ops (4 a part, row and step, two on
// the multiply pipes that the vmulps share), about 1.4 cycles a part, row and step on Zen 5.
// 6 bits, 3 rows (4 spilled: 8 i32 sums, 2 parts' codes and 3 constants): bench_q8_loop.py, 2
// threads, x0.76 the time at 4 rows, x0.66 at 3, x1.05 at 512 (1 thread); the 6-bit table is
// lm_head's, one row a lane.
// The 8-bit loop runs at about its op mix's throughput: 8 (part, row, step)s take 36.5 vector ops
// (the 4 above each, a block's epilogue of 4, the |x| copy), ~2.63 ns at 512 rows, where a stream
// of the same ops without dependences takes ~2.52 ns (Zen 5: vpsignb runs on 2 pipes, one of them
// the multiplies'). Tried at 512 rows (benchmarks/lab/bench_q8_loop.py, 1 thread, weights in cache;
// the same bits unless said): the epilogue software-pipelined as the AVX-512 full_pass's (the
// previous block's sums on the stack) x0.998-1.018, or bunched into steps 0-3, 4-7, 0-1, 0 or 2-5
// x0.99-1.02; |x| made a block ahead x1.00; weights prefetched 4 blocks ahead x0.99; 4 parts x 2
// rows x1.00; |w| rather than |x| x1.02; 1-3 of the rows' vpsignb as (w ^ s) - s, s = (x < 0),
// x1.03-1.11. |x| x (w ^ s) (a vpxor, any pipe) is exact with the sum started at the block's sum of
// |x| where x < 0 (pairs in [-32768, 32258]), but the starts cost: x1.015 with the masks and starts
// made once a pass (the xor alone x0.95, with a start's add x0.98: wrong bits). Without vpsignb
// (wrong bits) x0.88-0.89, without the epilogue's two vmulps x0.95.
// The i16 form (x and each part's step of w widened by vpmovsxbw, 2 vpmaddwd and 2 vpaddd a part,
// row and step, a vphaddd and vpermq a block; 1 part x 4 rows, the same bits) x1.19-1.20 (1 and 2
// threads): it trades vpsignb for a second vpaddd, 4.5 vector ops a part, row and step rather than 4.
#define Q8_TILES_AT_ONCE 2
#define PARTS(bits) 2
#define ROWS(bits) ((bits) == 6 ? 3 : 4)
#define Q8_ROWS_MAX 4

// The same with AVX2, per 8 outputs (part j: tile j / 2, its half j % 2) x 4 inputs a step:
// 8 bits, vpmaddubsw of |x| (u8, from a copy of the rows' block made once a block) against w
// with x's sign (llama.cpp's sign trick, the other way round: |x| x |w| <= 128 x 127, no
// saturation; at one row, |w| against x with w's sign, llama.cpp's way, x1.00-1.02 the time),
// vpmaddwd with ones to i32 every step; 4 bits, vpmaddubsw of the codes (u8, at most
// 15) against x, summed in i16 over the block's 8 steps (at most 8 x 2 x 15 x 127 = 30480: exact)
// and widened by one vpmaddwd a block, OFFSET * xs taken off after; 6 bits, vpmaddubsw of the
// codes (at most 63: 2 x 63 x 127 = 16002 a step, no saturation) widened by a vpmaddwd every
// step (8 steps' i16 sum would overflow), OFFSET * xs taken off after (one row: one_row).
// The 6-bit codes' top 2 bits of step q in bits 4-5 of each byte (the rest cleared), as the
// AVX-512 section's top_bits.
static inline __attribute__((always_inline)) __m256i top_bits(__m256i top, int q) {
  const int r = q >> 1;
  top = r == 0   ? _mm256_slli_epi16(top, 4)
        : r == 1 ? _mm256_slli_epi16(top, 2)
        : r == 3 ? _mm256_srli_epi16(top, 2)
                 : top;
  return _mm256_and_si256(top, _mm256_set1_epi8(0x30));
}

static inline __attribute__((always_inline)) __m256i step_weights(const uint8_t* restrict block, int q,
                                                                  const int bits) {
  if (bits == 8) return _mm256_loadu_si256((const __m256i*)(block + q * 64));
  __m256i v = _mm256_loadu_si256((const __m256i*)(block + (q & 3) * 64));
  v = _mm256_and_si256(q < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  if (bits == 4) return v;
  return _mm256_or_si256(v, top_bits(_mm256_loadu_si256((const __m256i*)(block + 256 + (q & 1) * 64)), q));
}

typedef int32_t q8_quad __attribute__((may_alias));  // 4 bytes of x (or |x|) read as one

// x's 4 bytes at `at`, in every i32 lane.
static inline __attribute__((always_inline)) __m256i broadcast_quad(const void* at) {
  int32_t quad;
  __builtin_memcpy(&quad, at, 4);
  return _mm256_set1_epi32(quad);
}

// one_row's prefetch at 4 bits: Q4_ONE_ROW_AHEAD blocks (8 KB of weights). benchmarks/lab/bench_q8_loop.py
// (Zen 5, 2 threads, against tile_rows' one-row loop, whose work is the same unprefetched: x1.00
// with the weights in L3): x0.82-0.95 the time, the plain read at 35-46 GB/s; 4 blocks ahead
// x1.13, 8 about x1.0, 16-128 x0.82-0.98 (deeper better the slower the read); 16, 24 and 48 x1.00-1.14
// the time of 32; a prefetch a 128 bytes rather than a line x1.14; T1 or NTA hints as T0.
#define Q4_ONE_ROW_AHEAD 32
// Q8_0 at one row (tile_rows) the same, 12 blocks (6 KB) ahead: x0.85-0.88 the time without,
// 4 blocks ahead x0.91-0.94, 8 x1.01-1.03 the time of 12, 16 and 24 x1.09-1.12.
#define Q8_ONE_ROW_AHEAD 12
#define Q8_ONE_ROW4 1  // this ISA's section has one_row (`workgroup`, shared by both, calls it at M = 1, 4 and 6 bits)
// x's block at xb split as vpmaddubsw pairs its inputs (4j, 4j+1 into the low i16 of each output's
// i32, 4j+2, 4j+3 into the high one): -OFFSET(4) times each half's sum of x, two i16 in one i32
// (at most 8 x 16 x 127 = 16256 each), the start of every output's two i16 sums of the block.
static inline __attribute__((always_inline)) int32_t start_pair(const int8_t* restrict xb) {
  __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi8(OFFSET(4)), _mm256_loadu_si256((const __m256i*)xb));
  __m128i h = _mm_add_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  h = _mm_add_epi16(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi16(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(_mm_sub_epi16(_mm_setzero_si128(), h));
}

// x's block at xb split as one_row's 6-bit i16 sums pair its inputs: for steps 0-3 (inputs 0-15) and
// 4-7 (16-31), -OFFSET(6) times the sum of the 8 inputs each i16 half of an output's i32 takes
// (4j, 4j+1 low, 4j+2, 4j+3 high; at most 32 x 8 x 127 = 32512), two i16 in one i32 each: the
// starts of every output's i16 sums of the two halves of the block, at the low and high 32 bits.
static inline __attribute__((always_inline)) int64_t start_halves(const int8_t* restrict xb) {
  __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi8(OFFSET(6)), _mm256_loadu_si256((const __m256i*)xb));
  p = _mm256_add_epi16(p, _mm256_shuffle_epi32(p, 0x4E));  // each 128-bit half's 4 i32 summed
  p = _mm256_add_epi16(p, _mm256_shuffle_epi32(p, 0xB1));
  p = _mm256_sub_epi16(_mm256_setzero_si256(), p);
  return (int64_t)(uint32_t)_mm256_cvtsi256_si32(p) | (int64_t)_mm256_extract_epi32(p, 4) << 32;
}

// Block b's exact i32 sums of one tile's two parts (outputs 0-7 in i0, 8-15 in i1) at one row:
// its weights at wb, x's block at xb, the block's start (start_pair or start_halves).
//
// 4 bits: the i16 sums start at start_pair rather than 0, so that no OFFSET * xs comes off after
// (a broadcast and a vpsubd a part a block): each i16 half then ends at the exact sum of w x over
// its 16 inputs, |.| <= 16 x 8 x 127 = 16256, so the wrapping vpaddw (products at most 2 x 15 x
// 127, no vpmaddubsw saturation) lands on it exactly and vpmaddwd adds the halves into the exact
// isum: the same bits. x0.975-1.017 (median of 7 runs 0.978) the time with the weights in L3 (1
// thread), the same from DRAM (x0.99-1.00).
// 6 bits: step_weights' codes, weights and scales prefetched Q6_ONE_ROW_AHEAD blocks ahead. The i16
// sums of each half of the block (4 steps) start at start_halves, so that each ends at the exact
// sum of w x over its 8 inputs, |.| <= 8 x 32 x 127 = 32512 (the wrapping vpaddw of products of
// at most 2 x 63 x 127, unsaturated, lands on it), widened by one vpmaddwd a half: the exact isum
// with no OFFSET * xs to take off. benchmarks/lab/bench_q8_loop.py (2 threads, from DRAM): without the
// prefetches x1.11-1.21 the time; 8, 16, 32, 48, 64 and 96 blocks ahead and T1 hints within
// x0.96-1.03 of 24. Cheaper unpacking would not help there: dropping the top bits' shift and and
// (wrong codes, the same bytes) took x0.99-1.02 the time from DRAM (x0.83 with the weights in L3).
#define Q6_ONE_ROW_AHEAD 24
#define ONE_ROW_AHEAD(bits) ((bits) == 4 ? Q4_ONE_ROW_AHEAD : Q6_ONE_ROW_AHEAD)
static inline __attribute__((always_inline)) void one_row_block(__m256i* restrict i0, __m256i* restrict i1,
                                                                const uint8_t* restrict wb,
                                                                const int8_t* restrict xb, int64_t start,
                                                                const int bits) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (bits == 4) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i s0 = _mm256_set1_epi32((int32_t)start), s1 = s0;
    Q8_UNROLL
    for (int q = 0; q < 4; ++q) {
      __m256i v0 = _mm256_loadu_si256((const __m256i*)(wb + q * 64));
      __m256i v1 = _mm256_loadu_si256((const __m256i*)(wb + q * 64 + 32));
      __m256i xl = broadcast_quad(xb + q * 4), xh = broadcast_quad(xb + 16 + q * 4);
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(v0, low), xl));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(v1, low), xl));
      __asm__("" : "+x"(s0), "+x"(s1));  // one running sum a register (else gcc spills a tree of products)
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), xh));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), xh));
      __asm__("" : "+x"(s0), "+x"(s1));
    }
    *i0 = _mm256_madd_epi16(s0, ones);
    *i1 = _mm256_madd_epi16(s1, ones);
    return;
  }
  __m256i a0 = _mm256_setzero_si256(), a1 = a0;
  Q8_UNROLL
  for (int h = 0; h < 2; ++h) {
    __m256i s0 = _mm256_set1_epi32((int32_t)(start >> (32 * h))), s1 = s0;
    Q8_UNROLL
    for (int q = 4 * h; q < 4 * h + 4; ++q) {
      __m256i xq = broadcast_quad(xb + q * 4);
      s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(step_weights(wb, q, 6), xq));
      s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(step_weights(wb + 32, q, 6), xq));
      __asm__("" : "+x"(s0), "+x"(s1));  // one running sum a register
    }
    a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(s0, ones));
    a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(s1, ones));
  }
  *i0 = a0;
  *i1 = a1;
}

// One row (decode) at 4 or 6 bits: tiles [t0, t1) in order, a tile's two parts a pass (a single
// stream of weights, as tile_rows at one row), the f32 accumulators in registers, the weights
// and scales prefetched ONE_ROW_AHEAD(bits) blocks ahead, past the range's end too (into the next
// workgroup's: stopping at the end took x1.02-1.04 the time at 4 bits).
#define Q4_CHUNK 256  // blocks of x whose starts one_row keeps at once (2 KB of stack)
static inline __attribute__((always_inline)) void one_row(
    const int8_t* restrict x, const float* restrict dx, const uint8_t* restrict w, const uint16_t* restrict dw,
    float* restrict y, size_t K, size_t t0, size_t t1, const int bits) {
  const size_t blocks = K / 32;
  int64_t start[Q4_CHUNK];
  for (size_t c0 = 0; c0 < blocks; c0 += Q4_CHUNK) {
    const size_t c1 = c0 + Q4_CHUNK < blocks ? c0 + Q4_CHUNK : blocks;
    for (size_t b = c0; b < c1; ++b) start[b - c0] = bits == 4 ? start_pair(x + b * 32) : start_halves(x + b * 32);
    for (size_t t = t0; t < t1; ++t) {
      const uint8_t* wt = w + t * blocks * BLOCK_BYTES(bits);
      const uint16_t* d = dw + t * 16 * blocks;
      __m256 acc0 = c0 ? _mm256_loadu_ps(y + 16 * t) : _mm256_setzero_ps();
      __m256 acc1 = c0 ? _mm256_loadu_ps(y + 16 * t + 8) : _mm256_setzero_ps();
      for (size_t b = c0; b < c1; ++b) {
        const uint8_t* wb = wt + b * BLOCK_BYTES(bits);
        Q8_UNROLL
        for (int l = 0; l < BLOCK_BYTES(bits) / 64; ++l)
          _mm_prefetch((const char*)(wb + ONE_ROW_AHEAD(bits) * BLOCK_BYTES(bits) + 64 * l), _MM_HINT_T0);
        _mm_prefetch((const char*)(d + (b + ONE_ROW_AHEAD(bits)) * 16), _MM_HINT_T0);
        __m256i i0, i1;
        one_row_block(&i0, &i1, wb, x + b * 32, start[b - c0], bits);
        const __m256 dxv = _mm256_set1_ps(dx[b]);
        __m256 sc0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + b * 16))), dxv);
        __m256 sc1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + b * 16 + 8))), dxv);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(sc0, _mm256_cvtepi32_ps(i0)));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(sc1, _mm256_cvtepi32_ps(i1)));
      }
      _mm256_storeu_ps(y + 16 * t, acc0);
      _mm256_storeu_ps(y + 16 * t + 8, acc1);
    }
  }
}

// Rows [0, MC) of x against the two tiles' 4 parts, PARTS(bits) at a time; the f32 accumulators
// live in y (a load and a store a block, row and part: the registers go to the sums), the float
// math the documented order.
static inline __attribute__((always_inline)) void tile_rows(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xs,
    const uint8_t* restrict wt, const uint16_t* restrict dwt, float* restrict y, size_t N, size_t K,
    size_t n0, const int MC, const int bits) {
  enum { PARTS_MAX = 4 };
  const int parts = PARTS(bits);
  const int abs_x = bits == 8 && MC > 1;  // one row: |w| a part and step, as many abs as |x| takes
  const size_t blocks = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  Q8_UNROLL
  for (int m = 0; m < MC; ++m)
    Q8_UNROLL
    for (int j = 0; j < 2 * Q8_TILES_AT_ONCE; ++j) _mm256_storeu_ps(y + m * N + n0 + 8 * j, _mm256_setzero_ps());
  for (int j0 = 0; j0 < 2 * Q8_TILES_AT_ONCE; j0 += parts) {
    for (size_t b = 0; b < blocks; ++b) {
      if (MC == 1 && bits == 8) {  // one row (decode): the tile's weights and scales prefetched as one_row's
        const uint8_t* ahead = wt + ((j0 / 2) * blocks + b + Q8_ONE_ROW_AHEAD) * BLOCK_BYTES(8);
        Q8_UNROLL
        for (int l = 0; l < BLOCK_BYTES(8) / 64; ++l) _mm_prefetch((const char*)(ahead + 64 * l), _MM_HINT_T0);
        _mm_prefetch((const char*)(dwt + (j0 / 2) * 16 * blocks + (b + Q8_ONE_ROW_AHEAD) * 16), _MM_HINT_T0);
      }
      // 8 bits: |x| of the rows' block, once for all the parts' steps (one abs a row and block
      // rather than one a part and step: the weights' |w| took 1 in 17 of the loop's vector ops)
      uint8_t ax[Q8_ROWS_MAX][32] __attribute__((aligned(32)));
      if (abs_x)
        Q8_UNROLL
        for (int m = 0; m < MC; ++m)
          _mm256_store_si256((__m256i*)ax[m], _mm256_abs_epi8(_mm256_loadu_si256((const __m256i*)(x + m * K + b * 32))));
      __m256i s[PARTS_MAX][Q8_ROWS_MAX];
      Q8_UNROLL
      for (int j = 0; j < parts; ++j)
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) s[j][m] = _mm256_setzero_si256();
      Q8_UNROLL
      for (int q = 0; q < 8; ++q) {
        __m256i w[PARTS_MAX], aw[PARTS_MAX];
        Q8_UNROLL
        for (int j = 0; j < parts; ++j) {
          const int part = j0 + j;
          w[j] = step_weights(wt + ((part / 2) * blocks + b) * BLOCK_BYTES(bits) + (part % 2) * 32, q, bits);
          aw[j] = bits == 8 && !abs_x ? _mm256_abs_epi8(w[j]) : w[j];
        }
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) {
          __m256i xb = broadcast_quad(x + m * K + b * 32 + q * 4);
          __m256i xa = xb;
          if (abs_x)  // from memory: gcc otherwise takes it out of the abs's register with shuffles
            __asm__("vpbroadcastd %1, %0" : "=x"(xa) : "m"(*(const q8_quad*)(ax[m] + q * 4)));
          Q8_UNROLL
          for (int j = 0; j < parts; ++j) {
            if (abs_x)
              s[j][m] = _mm256_add_epi32(
                  s[j][m], _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w[j], xb)), ones));
            else if (bits == 8)
              s[j][m] = _mm256_add_epi32(
                  s[j][m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xb, w[j])), ones));
            else if (bits == 6)
              s[j][m] = _mm256_add_epi32(s[j][m], _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], xb), ones));
            else
              s[j][m] = _mm256_add_epi16(s[j][m], _mm256_maddubs_epi16(w[j], xb));
            __asm__("" : "+x"(s[j][m]));  // one running sum a register (else gcc keeps every step's product)
          }
        }
      }
      Q8_UNROLL
      for (int j = 0; j < parts; ++j) {
        const int part = j0 + j;
        __m256 dwv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dwt + (part / 2) * 16 * blocks + b * 16 + (part % 2) * 8)));
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) {
          __m256i exact = s[j][m];
          if (bits == 4) exact = _mm256_madd_epi16(exact, ones);  // the block's i16 sums widened
          if (bits != 8)  // the codes' offset taken off
            exact = _mm256_sub_epi32(exact, _mm256_set1_epi32(OFFSET(bits) * xs[m * blocks + b]));
          float* acc = y + m * N + n0 + 8 * part;
          __m256 scale = _mm256_mul_ps(dwv, _mm256_set1_ps(dx[m * blocks + b]));
          _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_mul_ps(scale, _mm256_cvtepi32_ps(exact))));
        }
      }
    }
  }
}

// A full pass: ROWS(bits) rows, as tile_rows.
static inline __attribute__((always_inline)) void full_pass(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xs,
    const uint8_t* restrict wt, const uint16_t* restrict dwt, float* restrict y, size_t N, size_t K,
    size_t n0, const int bits) {
  tile_rows(x, dx, xs, wt, dwt, y, N, K, n0, ROWS(bits), bits);
}

// Q6_K with AVX2: one tile (its two parts of 8 outputs) and rows [0, MC) a pass, the f32
// accumulators in y (as tile_rows'). Each half block's i32 sum of vpmaddubsw (codes at most 63)
// widened by vpmaddwd every step, less OFFSET(6) times the half's sum of x (xh): the exact
// dot; s = sc0 dot0 + sc1 dot1 by vpmulld, then the block's float epilogue with the
// super-block's d (the AVX-512 q6k_rows' math). One row: the weights, sub-scales and d
// prefetched Q6_ONE_ROW_AHEAD blocks ahead.
static inline __attribute__((always_inline)) void q6k_rows(
    const int8_t* restrict x, const float* restrict dx, const int32_t* restrict xh,
    const uint8_t* restrict wt, const uint16_t* restrict dt, float* restrict y, size_t N, size_t K,
    size_t n0, const int MC, const int P) {
  (void)P;
  const size_t blocks = K / 32, supers = K / 256;
  const __m256i ones = _mm256_set1_epi16(1);
  Q8_UNROLL
  for (int m = 0; m < MC; ++m)
    Q8_UNROLL
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(y + m * N + n0 + 8 * j, _mm256_setzero_ps());
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* codes = q6k_codes(wt, b);
    if (MC == 1) {
      const size_t ahead = b + Q6_ONE_ROW_AHEAD;
      Q8_UNROLL
      for (int l = 0; l < BLOCK_BYTES(6) / 64; ++l)
        _mm_prefetch((const char*)(q6k_codes(wt, ahead) + 64 * l), _MM_HINT_T0);
      _mm_prefetch((const char*)q6k_scales(wt, ahead, 0), _MM_HINT_T0);
      _mm_prefetch((const char*)(dt + (ahead / 8) * 16), _MM_HINT_T0);
    }
    __m256i s[2][Q8_ROWS_MAX];
    Q8_UNROLL
    for (int h = 0; h < 2; ++h) {
      __m256i isum[2][Q8_ROWS_MAX];
      Q8_UNROLL
      for (int j = 0; j < 2; ++j)
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) isum[j][m] = _mm256_setzero_si256();
      Q8_UNROLL
      for (int q = 4 * h; q < 4 * h + 4; ++q) {
        __m256i w[2];
        Q8_UNROLL
        for (int j = 0; j < 2; ++j) w[j] = step_weights(codes + 32 * j, q, 6);
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) {
          const __m256i xb = broadcast_quad(x + m * K + b * 32 + q * 4);
          Q8_UNROLL
          for (int j = 0; j < 2; ++j) {
            isum[j][m] = _mm256_add_epi32(isum[j][m], _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], xb), ones));
            __asm__("" : "+x"(isum[j][m]));  // one running sum a register
          }
        }
      }
      Q8_UNROLL
      for (int j = 0; j < 2; ++j) {
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q6k_scales(wt, b, h) + 8 * j)));
        Q8_UNROLL
        for (int m = 0; m < MC; ++m) {
          const __m256i exact = _mm256_sub_epi32(isum[j][m], _mm256_set1_epi32(OFFSET(6) * xh[m * 2 * blocks + 2 * b + h]));
          const __m256i part = _mm256_mullo_epi32(exact, sc);
          s[j][m] = h ? _mm256_add_epi32(s[j][m], part) : part;
        }
      }
    }
    Q8_UNROLL
    for (int j = 0; j < 2; ++j) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dt + (b / 8) * 16 + 8 * j)));
      Q8_UNROLL
      for (int m = 0; m < MC; ++m) {
        float* acc = y + m * N + n0 + 8 * j;
        const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[m * blocks + b]));
        _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_mul_ps(scale, _mm256_cvtepi32_ps(s[j][m]))));
      }
    }
  }
}
#define Q6K_ROWS 2  // rows a pass (2 parts x 2 rows: 4 half sums and 4 combined, 16 ymm in all)
#define Q6K_TILES(MC) 1

#else
#error "q8_matmul needs AVX-512 VNNI (with BW) or AVX2"
#endif

// One MLIR memref as LLVM lowers it to a call: allocated and aligned pointers, offset (in
// elements), size, stride. The data starts at aligned + offset.
#define Q8_MEMREF(type, name) \
  type* name##_allocated, type* name, size_t name##_off, size_t name##_size, size_t name##_stride

// Workgroup `wg` computes tiles [tiles wg, tiles wg + tiles) (16 outputs each; fewer in the last
// workgroup) for every row of x, its weights `bits` wide.
static inline __attribute__((always_inline)) void workgroup(
    const int8_t* restrict xq, const float* restrict dx, const int32_t* restrict xs, const uint8_t* restrict w,
    const uint16_t* restrict dw, float* restrict y, size_t M, size_t N, size_t K, size_t tiles, size_t wg,
    const int bits) {
  const size_t blocks = K / 32;
  const size_t end = (wg + 1) * tiles < N / 16 ? (wg + 1) * tiles : N / 16;
#ifdef Q8_ONE_ROW4
  if (M == 1 && bits != 8) {
    if (wg * tiles < end) one_row(xq, dx, w, dw, y, K, wg * tiles, end, bits);
    return;
  }
#endif
  for (size_t t = wg * tiles; t < end; t += Q8_TILES_AT_ONCE) {
    const uint8_t* wt = w + t * blocks * BLOCK_BYTES(bits);
    const uint16_t* dwt = dw + t * blocks * 16;
    size_t m = 0;
    for (; m + ROWS(bits) <= M; m += ROWS(bits))
      full_pass(xq + m * K, dx + m * blocks, xs + m * blocks, wt, dwt, y + m * N, N, K, t * 16, bits);
    switch (M - m) {  // the remaining rows, each count its own unrolled loop
#define Q8_REST(r) \
  case r: if (r < ROWS(bits)) tile_rows(xq + m * K, dx + m * blocks, xs + m * blocks, wt, dwt, y + m * N, N, K, t * 16, r, bits); break;
      Q8_REST(1) Q8_REST(2) Q8_REST(3)
#undef Q8_REST
      default: break;
    }
  }
}

// The entries (kernels/q8_matmul.py `ENTRIES`): Q8_0, 6-bit and Q4_0 weights, against Q8_0 x.
#define Q8_ENTRY(name, bits)                                                                                  \
  void name(Q8_MEMREF(const int8_t, xq), Q8_MEMREF(const float, dx), Q8_MEMREF(const int32_t, xs),             \
            Q8_MEMREF(const uint8_t, w), Q8_MEMREF(const uint16_t, dw), Q8_MEMREF(float, y), size_t M, size_t N, \
            size_t K, size_t tiles, size_t wg) {                                                              \
    workgroup(xq + xq_off, dx + dx_off, xs + xs_off, w + w_off, dw + dw_off, y + y_off, M, N, K, tiles, wg,  \
              bits);                                                                                          \
  }
Q8_ENTRY(q8_matmul_workgroup, 8)
Q8_ENTRY(q6_matmul_workgroup, 6)
Q8_ENTRY(q4_matmul_workgroup, 4)

// Q6_K weights (GGUF's, in its bits): y[m, n] = sum over blocks b of 32, in order, of
// ((float)d[n, b / 8] * dx[m, b]) * (float)(sc[n, 2b] * dot0 + sc[n, 2b + 1] * dot1), dot0 and dot1
// the exact i32 sums of the block's two halves of 16 (6-bit codes -32..31 against xq), sc the
// int8 sub-scales, d the f16 scale of each 256 inputs; w in the Q6K_SUPER_BYTES layout, d f16
// [N/16, K/256, 16], xh int32 [M, K/16] the halves' sums of xq. K a multiple of 256.
void q6k_matmul_workgroup(Q8_MEMREF(const int8_t, xq), Q8_MEMREF(const float, dx), Q8_MEMREF(const int32_t, xh),
                          Q8_MEMREF(const uint8_t, w), Q8_MEMREF(const uint16_t, d), Q8_MEMREF(float, y), size_t M,
                          size_t N, size_t K, size_t tiles, size_t wg) {
  const int8_t* x = xq + xq_off;
  const float* dxs = dx + dx_off;
  const int32_t* xs = xh + xh_off;
  const uint8_t* wb = w + w_off;
  const uint16_t* db = d + d_off;
  float* out = y + y_off;
  const size_t blocks = K / 32, supers = K / 256, tile_bytes = supers * Q6K_SUPER_BYTES;
  const size_t end = (wg + 1) * tiles < N / 16 ? (wg + 1) * tiles : N / 16;
  for (size_t t = wg * tiles; t < end; t += Q8_TILES_AT_ONCE) {
    if (M == 1) {
      for (size_t u = t; u < t + Q8_TILES_AT_ONCE; u += Q6K_TILES(1))
        q6k_rows(x, dxs, xs, wb + u * tile_bytes, db + u * 16 * supers, out, N, K, u * 16, 1, Q6K_TILES(1));
      continue;
    }
    for (size_t u = t; u < t + Q8_TILES_AT_ONCE; u += Q6K_TILES(Q6K_ROWS)) {
      const uint8_t* wt = wb + u * tile_bytes;
      const uint16_t* dt = db + u * 16 * supers;
      size_t m = 0;
      for (; m + Q6K_ROWS <= M; m += Q6K_ROWS)
        q6k_rows(x + m * K, dxs + m * blocks, xs + 2 * m * blocks, wt, dt, out + m * N, N, K, u * 16, Q6K_ROWS,
                 Q6K_TILES(Q6K_ROWS));
      switch (M - m) {
#define Q6K_REST(r) \
  case r: if (r < Q6K_ROWS) q6k_rows(x + m * K, dxs + m * blocks, xs + 2 * m * blocks, wt, dt, out + m * N, N, K, u * 16, r, Q6K_TILES(Q6K_ROWS)); break;
        Q6K_REST(1) Q6K_REST(2) Q6K_REST(3)
#undef Q6K_REST
        default: break;
      }
    }
  }
}

// Mixture-of-experts (emitter/experts.py): the rows of x sorted by expert, expert e's rows
// [offsets[e], offsets[e + 1]); w and dw stacks of E experts' packed weights, each as above;
// chosen[G] the experts some row chose, in order, then -1s (G = min(E, rows)). Workgroup wg
// computes expert chosen[wg / chunks]'s rows against its tiles [tiles (wg % chunks), ...): each
// chosen expert's weights read once a call, however many rows chose it (ggml's mul_mat_id), an
// expert no row chose not at all, and no workgroup started for it. Each row's outputs are the
// one-matrix entry's bits.
#define Q8_EXPERTS_ENTRY(name, bits)                                                                           \
  void name(Q8_MEMREF(const int8_t, xq), Q8_MEMREF(const float, dx), Q8_MEMREF(const int32_t, xs),             \
            Q8_MEMREF(const int32_t, offsets), Q8_MEMREF(const int32_t, chosen), Q8_MEMREF(const uint8_t, w),  \
            Q8_MEMREF(const uint16_t, dw), Q8_MEMREF(float, y), size_t N, size_t K, size_t tiles, size_t chunks, \
            size_t wg) {                                                                                       \
    const int32_t* off = offsets + offsets_off;                                                                \
    const int32_t expert = chosen[chosen_off + wg / chunks];                                                   \
    if (expert < 0) return;                                                                                    \
    const size_t e = (size_t)expert, first = (size_t)off[e], blocks = K / 32;                                  \
    const size_t rows = (size_t)off[e + 1] - first;                                                            \
    if (rows == 0) return;                                                                                     \
    workgroup(xq + xq_off + first * K, dx + dx_off + first * blocks, xs + xs_off + first * blocks,             \
              w + w_off + e * (N * K * (bits) / 8), dw + dw_off + e * (N * blocks), y + y_off + first * N, rows, \
              N, K, tiles, wg % chunks, bits);                                                                 \
  }
Q8_EXPERTS_ENTRY(q8_experts_workgroup, 8)
Q8_EXPERTS_ENTRY(q4_experts_workgroup, 4)
