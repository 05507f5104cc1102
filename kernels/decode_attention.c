// One new token's attention over a paged KV cache, for one layer and one KV head per workgroup
// (kernels/decode_attention.py): scores, softmax and the weighted sum of V in one pass over the
// blocks the sequence's block table names, read where they lie in the page pool.
//
// Pools [kv_heads, blocks, 16, head_dim] (f32 or bf16), q [kv_heads, groups, head_dim] f32,
// the token's own k and v [kv_heads, head_dim] as the cache stores them (it is not in it yet), the table
// [span_blocks] i32 and the token's slot (keys 0..slot-1 of the span are its context). The math,
// in f32 and in this order (kernels/decode_attention.py `reference` is the same, in numpy):
//   s = (q . k) * scale for the own key first, then for each block's rows in order;
//   an online softmax per block: m' = max(m, the block's scores), the running sum and
//   accumulator times exp(m - m') when m grows, then per row p = exp(s - m'), sum += p,
//   acc += p v (each head_dim lane in order); out = acc / sum.
// Dot products: 16 partial sums over head_dim (lane i sums elements i, i + 16, ...), then
// added as a tree (8 + 8, 4 + 4, 2 + 2, 1 + 1). exp: Cephes' expf (range reduction by ln 2
// in two parts, a degree-5 polynomial), no libm in IREE's bare-metal objects.
#include <stddef.h>
#include <stdint.h>

#define ROWS 16   // slots a block holds (emitter/kv_pages.py BLOCK)
#define LANES 16  // partial sums of a dot product
#define MAX_GROUPS 8
#define MAX_HEAD_DIM 256

static inline __attribute__((always_inline)) float bits_f32(uint32_t u) {
  union { uint32_t u; float f; } v = {u};
  return v.f;
}

static inline __attribute__((always_inline)) float exp_f32(float x) {
  if (x < -87.33654f) return 0.0f;  // below the least normal's log: the graph's softmax is 0 there too
  float n = (float)(int32_t)(x * 1.44269504088896341f + (x < 0.0f ? -0.5f : 0.5f));
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  return p * bits_f32((uint32_t)((int32_t)n + 127) << 23);
}

static inline __attribute__((always_inline)) float load(const void* restrict base, size_t i, int bf16) {
  if (bf16) return bits_f32((uint32_t)((const uint16_t*)base)[i] << 16);
  return ((const float*)base)[i];
}

// q . k over head_dim d (a multiple of LANES), k element i at k_base[k0 + i].
static inline __attribute__((always_inline)) float dot(const float* restrict q, const void* restrict k_base,
                                                        size_t k0, size_t d, int bf16) {
  float part[LANES] = {0};
  for (size_t i = 0; i < d; i += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += q[i + l] * load(k_base, k0 + i + l, bf16);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] = part[l] + part[l + w];
  return part[0];
}

static inline __attribute__((always_inline)) void head(
    const float* restrict q, const void* restrict own_k, const void* restrict own_v, const void* restrict k_pool,
    const void* restrict v_pool, const int32_t* restrict table, int32_t slot, float* restrict out, size_t blocks,
    size_t groups, size_t d, size_t span_blocks, float scale, size_t h, int bf16) {
  float peak[MAX_GROUPS], sum[MAX_GROUPS], acc[MAX_GROUPS][MAX_HEAD_DIM], s[MAX_GROUPS][ROWS];
  const float* qh = q + h * groups * d;
  for (size_t g = 0; g < groups; ++g) {  // the token's own key and value first
    peak[g] = dot(qh + g * d, own_k, h * d, d, bf16) * scale;
    sum[g] = 1.0f;
    for (size_t i = 0; i < d; ++i) acc[g][i] = load(own_v, h * d + i, bf16);
  }
  size_t seen = slot < 0 ? 0 : (size_t)slot;
  if (seen > span_blocks * ROWS) seen = span_blocks * ROWS;
  for (size_t j = 0; j * ROWS < seen; ++j) {
    const size_t rows = seen - j * ROWS < ROWS ? seen - j * ROWS : ROWS;
    const size_t block = (size_t)(uint32_t)table[j] < blocks ? (size_t)(uint32_t)table[j] : blocks - 1;
    const size_t first = (h * blocks + block) * ROWS * d;  // element of the block's row 0
    for (size_t r = 0; r < rows; ++r)  // each K row read once for every query head of the group
      for (size_t g = 0; g < groups; ++g) s[g][r] = dot(qh + g * d, k_pool, first + r * d, d, bf16) * scale;
    for (size_t g = 0; g < groups; ++g) {
      float top = peak[g];
      for (size_t r = 0; r < rows; ++r) top = s[g][r] > top ? s[g][r] : top;
      if (top > peak[g]) {
        const float c = exp_f32(peak[g] - top);
        sum[g] *= c;
        for (size_t i = 0; i < d; ++i) acc[g][i] *= c;
        peak[g] = top;
      }
      for (size_t r = 0; r < rows; ++r) {
        s[g][r] = exp_f32(s[g][r] - peak[g]);
        sum[g] += s[g][r];
      }
    }
    for (size_t r = 0; r < rows; ++r)  // each V row read once for every query head of the group
      for (size_t g = 0; g < groups; ++g)
        for (size_t i = 0; i < d; ++i) acc[g][i] += s[g][r] * load(v_pool, first + r * d + i, bf16);
  }
  for (size_t g = 0; g < groups; ++g)
    for (size_t i = 0; i < d; ++i) out[(h * groups + g) * d + i] = acc[g][i] / sum[g];
}

// One MLIR memref as LLVM lowers it to a call (as kernels/q8_matmul.c): allocated and aligned
// pointers, offset (in elements), size, stride.
#define MEMREF(type, name) \
  type* name##_allocated, type* name, size_t name##_off, size_t name##_size, size_t name##_stride

#define ATTENTION_ENTRY(name, pool_type, bf16)                                                                  \
  void name(MEMREF(const float, q), MEMREF(const pool_type, own_k), MEMREF(const pool_type, own_v),            \
            MEMREF(const pool_type, k_pool), MEMREF(const pool_type, v_pool), MEMREF(const int32_t, table),     \
            MEMREF(const int32_t, slot), MEMREF(float, out), size_t blocks, size_t groups, size_t d,            \
            size_t scale_bits, size_t wg) {                                                                     \
    if (d == 128) /* Qwen3-VL's head_dim: loops of a constant length */                                       \
      head(q + q_off, own_k + own_k_off, own_v + own_v_off, k_pool + k_pool_off, v_pool + v_pool_off,          \
           table + table_off, slot[slot_off], out + out_off, blocks, groups, 128, table_size,                  \
           bits_f32((uint32_t)scale_bits), wg, bf16);                                                         \
    else                                                                                                        \
      head(q + q_off, own_k + own_k_off, own_v + own_v_off, k_pool + k_pool_off, v_pool + v_pool_off,          \
           table + table_off, slot[slot_off], out + out_off, blocks, groups, d, table_size,                    \
           bits_f32((uint32_t)scale_bits), wg, bf16);                                                         \
  }
ATTENTION_ENTRY(decode_attention_f32, float, 0)
ATTENTION_ENTRY(decode_attention_bf16, uint16_t, 1)
