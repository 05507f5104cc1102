// One new token's attention over a paged KV cache, for one layer and one KV head per workgroup
// (kernels/decode_attention.py): scores, softmax and the weighted sum of V in one pass over the
// blocks the sequence's block table names, read where they lie in the page pool. And a chunk's
// (prefill): each of its rows the same math as that token's alone, in the same order, so that
// a prompt's rows equal what decoding its tokens one at a time would give (`chunk_attention`).
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
#define MAX_CHUNK_HEAD_DIM 128  // a chunk's tile keeps 4 [ROWS][head_dim] f32 arrays on the stack

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

// Vectors (GCC's vector extensions): VL lanes of f32, as many as the ISA's registers hold.
#if defined(__AVX512F__)  // 32 vector registers
#define VL 16  // rows a vector holds
#define KEYS_AT_ONCE 8  // keys a pass of the scores takes
#define PV_STEP 8  // head_dim elements a pass of the weighted V sum takes
#else  // 16
#define VL 8
#define KEYS_AT_ONCE 4
#define PV_STEP 4
#endif
#define NV (ROWS / VL)  // vectors of a tile's rows
#define GROUPS_AT_ONCE 2
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));

static inline __attribute__((always_inline)) vf splat(float x) { return (vf){0} + x; }
static inline __attribute__((always_inline)) vf pick(vi mask, vf yes, vf no) {
  return (vf)(((vi)yes & mask) | ((vi)no & ~mask));
}
static inline __attribute__((always_inline)) int any(vi mask) {
  union { vi v; uint64_t u[VL / 2]; } m = {mask};
  uint64_t bits = 0;
  for (int i = 0; i < VL / 2; ++i) bits |= m.u[i];
  return bits != 0;
}

// exp_f32, lane by lane, the same operations.
static inline __attribute__((always_inline)) vf exp_v(vf x) {
  const vf half = pick(x < splat(0.0f), splat(-0.5f), splat(0.5f));
  const vf n = __builtin_convertvector(__builtin_convertvector(x * splat(1.44269504088896341f) + half, vi), vf);
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  const vf y = p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
  return pick(x < splat(-87.33654f), splat(0.0f), y);
}

// q . k over head_dim d (a multiple of LANES), k element i at k_base[k0 + i]: LANES partial
// sums (lane l sums elements l, l + 16, ...) held as one vector (two at VL 8), then their tree
// by halves (8 + 8, 4 + 4, 2 + 2, 1 + 1).
typedef float v16 __attribute__((vector_size(4 * LANES)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t v16u __attribute__((vector_size(2 * LANES)));
typedef uint32_t v16i __attribute__((vector_size(4 * LANES)));
#ifndef PV_VECTORS
#define PV_VECTORS 8  // accumulator vectors (VL lanes) a pass of `head`'s weighted V sum holds
#endif
typedef uint16_t vu __attribute__((vector_size(2 * VL)));
typedef uint32_t vw __attribute__((vector_size(4 * VL)));

static inline __attribute__((always_inline)) void load_v(vf* restrict out, const void* restrict base, size_t i,
                                                         int bf16) {
  if (bf16) {
    vu raw;
    __builtin_memcpy(&raw, (const uint16_t*)base + i, sizeof raw);
    *out = (vf)(__builtin_convertvector(raw, vw) << 16);
  } else {
    __builtin_memcpy(out, (const float*)base + i, sizeof *out);
  }
}

// (Through a pointer: a 64-byte vector's return value would be an ABI question on AVX2.)
static inline __attribute__((always_inline)) void load16(v16* restrict out, const void* restrict base, size_t i,
                                                         int bf16) {
  if (bf16) {
    v16u raw;
    __builtin_memcpy(&raw, (const uint16_t*)base + i, sizeof raw);
    *out = (v16)(__builtin_convertvector(raw, v16i) << 16);
  } else {
    __builtin_memcpy(out, (const float*)base + i, sizeof *out);
  }
}

static inline __attribute__((always_inline)) float dot_v(const float* restrict q, const void* restrict k_base,
                                                          size_t k0, size_t d, int bf16) {
  v16 part, qv, kv;
  load16(&qv, q, 0, 0);
  load16(&kv, k_base, k0, bf16);
  part = qv * kv;
  for (size_t i = LANES; i < d; i += LANES) {
    load16(&qv, q, i, 0);
    load16(&kv, k_base, k0 + i, bf16);
    part += qv * kv;
  }
  const v8 eight = __builtin_shufflevector(part, part, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(part, part, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

static inline __attribute__((always_inline)) void head(
    const float* restrict q, const void* restrict own_k, const void* restrict own_v, const void* restrict k_pool,
    const void* restrict v_pool, const int32_t* restrict table, int32_t slot, float* restrict out, size_t blocks,
    size_t groups, size_t d, size_t span_blocks, float scale, size_t h, int bf16) {
  float peak[MAX_GROUPS], sum[MAX_GROUPS], acc[MAX_GROUPS][MAX_HEAD_DIM], s[MAX_GROUPS][ROWS] = {{0}};
  float wide[ROWS * MAX_HEAD_DIM] __attribute__((aligned(64)));  // a bf16 block's V rows, widened
  const float* qh = q + h * groups * d;
  for (size_t g = 0; g < groups; ++g) {  // the token's own key and value first
    peak[g] = dot_v(qh + g * d, own_k, h * d, d, bf16) * scale;
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
      for (size_t g = 0; g < groups; ++g) s[g][r] = dot_v(qh + g * d, k_pool, first + r * d, d, bf16) * scale;
    for (size_t g = 0; g < groups; ++g) {
      float top = peak[g];
      for (size_t r = 0; r < rows; ++r) top = s[g][r] > top ? s[g][r] : top;
      if (top > peak[g]) {
        const float c = exp_f32(peak[g] - top);
        sum[g] *= c;
        for (size_t i = 0; i < d; ++i) acc[g][i] *= c;
        peak[g] = top;
      }
      for (int w = 0; w < ROWS / VL; ++w) {  // exp_f32 of each row's, VL rows at once (past `rows`: unused)
        vf x;
        __builtin_memcpy(&x, &s[g][w * VL], sizeof x);
        x = exp_v(x - splat(peak[g]));
        __builtin_memcpy(&s[g][w * VL], &x, sizeof x);
      }
      for (size_t r = 0; r < rows; ++r) sum[g] += s[g][r];
    }
    const float* vf32 = (const float*)v_pool + (bf16 ? 0 : first);  // the block's V rows in f32
    if (bf16) {  // widened once for all the group's heads (exact)
      for (size_t i = 0; i < rows * d; i += VL) load_v((vf*)&wide[i], v_pool, first + i, 1);
      vf32 = wide;
    }
    for (size_t g = 0; g < groups; ++g)  // a head's accumulator, PV_VECTORS at a time, in registers over the rows
      for (size_t j0 = 0; j0 < d / VL; j0 += PV_VECTORS) {
        vf a[PV_VECTORS], vv;
        for (int j = 0; j < PV_VECTORS; ++j) __builtin_memcpy(&a[j], &acc[g][(j0 + j) * VL], sizeof a[j]);
        for (size_t r = 0; r < rows; ++r) {
          const vf p = splat(s[g][r]);
          for (int j = 0; j < PV_VECTORS; ++j) {
            load_v(&vv, vf32, r * d + (j0 + j) * VL, 0);
            a[j] += p * vv;
          }
        }
        for (int j = 0; j < PV_VECTORS; ++j) __builtin_memcpy(&acc[g][(j0 + j) * VL], &a[j], sizeof a[j]);
      }
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


// -- a chunk's attention ------------------------------------------------------------------------
// A chunk of `rows` tokens at slots start.. (start a multiple of ROWS), whose own K/V the pools
// already hold: row i (slot p = start + i) attends to slots 0..p exactly as `head` does for a
// token at slot p whose own k, v are the pools' row p: the own key first, then blocks 0.. in
// order, the last one holding only the slots before p. A workgroup is one KV head and one tile
// of ROWS rows (one block of slots), and keeps its rows in vector lanes: the scores of a key are
// one vector over the rows, the sums and the accumulator ([head_dim] vectors) likewise, so every
// lane does `head`'s operations in `head`'s order. The tile's own block ends the walk: there
// key r is one of row i's keys for i > r only, and the other lanes keep their values (selects).
// Query heads go GROUPS_AT_ONCE at a time, each block's K and V read (and widened) once for them.
// `dot_v` of each lane's query (qt: [d][NV], lane = row) with key rows k [ROWS][d] f32, times
// scale: s[r][w]. Partial sum l of every key first (elements l, l + 16, ... of the lanes'
// queries held in registers across the keys), then each key's partials as `dot_v`'s tree.
static inline __attribute__((always_inline)) void block_scores(const vf* restrict qt, const float* restrict k,
                                                               size_t d, float scale, vf s[ROWS][NV]) {
  for (int w = 0; w < NV; ++w) {
    vf part[LANES][ROWS];
    for (int l = 0; l < LANES; ++l) {
      vf qv[MAX_CHUNK_HEAD_DIM / LANES];
      for (size_t i = 0; i < d / LANES; ++i) qv[i] = qt[(i * LANES + l) * NV + w];
      for (size_t r = 0; r < ROWS; r += KEYS_AT_ONCE) {  // as many independent chains of adds
        vf a[KEYS_AT_ONCE];
        for (int x = 0; x < KEYS_AT_ONCE; ++x) a[x] = splat(0.0f);
        for (size_t i = 0; i < d / LANES; ++i)
          for (int x = 0; x < KEYS_AT_ONCE; ++x) a[x] += qv[i] * k[(r + x) * d + i * LANES + l];
        for (int x = 0; x < KEYS_AT_ONCE; ++x) part[l][r + x] = a[x];
      }
    }
    for (int x = LANES / 2; x > 0; x /= 2)
      for (int l = 0; l < x; ++l)
        for (size_t r = 0; r < ROWS; ++r) part[l][r] = part[l][r] + part[l + x][r];
    for (size_t r = 0; r < ROWS; ++r) s[r][w] = part[0][r] * scale;
  }
}

// One block's keys and values (f32 [ROWS][d]) into the lanes' online softmax of one query head
// (qt, peak, sum, at). `diagonal`: the tile's own block, key r a key of the lanes i > r only.
static inline __attribute__((always_inline)) void block_step(
    const vf* restrict qt, const float* restrict k, const float* restrict v, size_t d, float scale,
    vf* restrict peak, vf* restrict sum, vf* restrict at, int diagonal) {
  vf s[ROWS][NV];
  vi seen[ROWS][NV];
  const size_t rows = diagonal ? ROWS - 1 : ROWS;  // a tile's last row sees its block's first 15
  block_scores(qt, k, d, scale, s);  // the diagonal's 16th key too: no lane sees it
  for (size_t r = 0; r < rows; ++r)
    for (int w = 0; w < NV; ++w) {
      vi lane;
      for (int l = 0; l < VL; ++l) lane[l] = w * VL + l;
      seen[r][w] = diagonal ? lane > (vi){0} + (int32_t)r : (vi){0} - 1;
    }
  for (int w = 0; w < NV; ++w) {
    vf top = peak[w];
    for (size_t r = 0; r < rows; ++r) top = pick(seen[r][w] & (s[r][w] > top), s[r][w], top);
    const vi grew = top > peak[w];
    if (any(grew)) {  // where a lane's max grew: its sum and accumulator times exp(m - m'); else times 1
      const vf c = pick(grew, exp_v(peak[w] - top), splat(1.0f));
      sum[w] *= c;
      for (size_t i = 0; i < d; ++i) at[i * NV + w] *= c;
      peak[w] = top;
    }
    for (size_t r = 0; r < rows; ++r) {
      s[r][w] = exp_v(s[r][w] - top);
      sum[w] = pick(seen[r][w], sum[w] + s[r][w], sum[w]);
    }
  }
  for (size_t i = 0; i < d; i += PV_STEP)  // PV_STEP elements' sums at once: as many chains of adds
    for (int w = 0; w < NV; ++w) {
      vf a[PV_STEP];
      for (int e = 0; e < PV_STEP; ++e) a[e] = at[(i + e) * NV + w];
      for (size_t r = 0; r < rows; ++r)
        for (int e = 0; e < PV_STEP; ++e)
          a[e] = diagonal ? pick(seen[r][w], a[e] + s[r][w] * v[r * d + i + e], a[e]) : a[e] + s[r][w] * v[r * d + i + e];
      for (int e = 0; e < PV_STEP; ++e) at[(i + e) * NV + w] = a[e];
    }
}

// Block `block`'s K or V rows of a KV head, from element `first` of the pool, as f32 [ROWS][d].
static inline __attribute__((always_inline)) void widen_block(const void* restrict pool, size_t first, size_t d,
                                                              float* restrict out, int bf16) {
  for (size_t i = 0; i < ROWS * d; ++i) out[i] = load(pool, first + i, bf16);
}

// A hint to fetch block rows from element `first` of a pool: the table's blocks lie anywhere,
// 4-8 KB each, too short for the hardware's prefetcher to learn before the block is read.
static inline __attribute__((always_inline)) void prefetch_block(const void* pool, size_t first, size_t d, int bf16) {
  const char* bytes = (const char*)pool + first * (bf16 ? 2 : 4);
  for (size_t b = 0; b < ROWS * d * (bf16 ? 2 : 4); b += 64) __builtin_prefetch(bytes + b);
}

// x [ROWS][d] (row r at x + r * stride) into lanes: out [d][NV] vectors, row r in lane r.
static inline __attribute__((always_inline)) void to_lanes(const float* restrict x, size_t stride, size_t d,
                                                           vf* restrict out) {
  for (size_t i = 0; i < d; ++i)
    for (int w = 0; w < NV; ++w) {
      float lanes[VL];
      for (int l = 0; l < VL; ++l) lanes[l] = x[(w * VL + l) * stride + i];
      __builtin_memcpy(&out[i * NV + w], lanes, sizeof(vf));
    }
}

static inline __attribute__((always_inline)) void chunk_tile(
    const float* restrict q, const void* restrict k_pool, const void* restrict v_pool,
    const int32_t* restrict table, int32_t start, float* restrict out, size_t blocks, size_t groups, size_t d,
    size_t kv_heads, size_t span_blocks, float scale, size_t h, size_t tile, int bf16) {
  vf qt[GROUPS_AT_ONCE][MAX_CHUNK_HEAD_DIM * NV], at[GROUPS_AT_ONCE][MAX_CHUNK_HEAD_DIM * NV];
  vf peak[GROUPS_AT_ONCE][NV], sum[GROUPS_AT_ONCE][NV];
  float k[ROWS * MAX_CHUNK_HEAD_DIM], v[ROWS * MAX_CHUNK_HEAD_DIM];
  const size_t heads = kv_heads * groups, stride = heads * d;  // q's and out's rows
  const size_t own = (size_t)(start < 0 ? 0 : start) / ROWS + tile;  // the tile's block of slots
  const size_t last = own < span_blocks ? own : span_blocks - 1;
  const size_t diag = (size_t)(uint32_t)table[last] < blocks ? (size_t)(uint32_t)table[last] : blocks - 1;
  const size_t diag_first = (h * blocks + diag) * ROWS * d;
  for (size_t g0 = 0; g0 < groups; g0 += GROUPS_AT_ONCE) {
    const size_t gn = groups - g0 < GROUPS_AT_ONCE ? groups - g0 : GROUPS_AT_ONCE;
    // The own keys and values: the tile's block, row r in lane r.
    widen_block(k_pool, diag_first, d, k, bf16);
    widen_block(v_pool, diag_first, d, v, bf16);
    for (size_t g = 0; g < gn; ++g) {
      const float* rows_q = q + (tile * ROWS * heads + h * groups + g0 + g) * d;
      to_lanes(rows_q, stride, d, qt[g]);
      to_lanes(k, d, d, at[g]);  // the own keys, for their scores
      for (int w = 0; w < NV; ++w) {
        vf part[LANES];
        for (int l = 0; l < LANES; ++l) part[l] = splat(0.0f);
        for (size_t i = 0; i < d; i += LANES)
          for (int l = 0; l < LANES; ++l) part[l] += qt[g][(i + l) * NV + w] * at[g][(i + l) * NV + w];
        for (int x = LANES / 2; x > 0; x /= 2)
          for (int l = 0; l < x; ++l) part[l] = part[l] + part[l + x];
        peak[g][w] = part[0] * scale;
        sum[g][w] = splat(1.0f);
      }
      to_lanes(v, d, d, at[g]);  // the own values: the accumulator's start
    }
    for (size_t j = 0; j < last; ++j) {  // the blocks before the tile's: every row sees them whole
      const size_t block = (size_t)(uint32_t)table[j] < blocks ? (size_t)(uint32_t)table[j] : blocks - 1;
      const size_t first = (h * blocks + block) * ROWS * d;
      // the next block's K and V (j + 1 <= last: the tile's own at the end) into the cache while this one is summed
      const size_t next = (size_t)(uint32_t)table[j + 1] < blocks ? (size_t)(uint32_t)table[j + 1] : blocks - 1;
      prefetch_block(k_pool, (h * blocks + next) * ROWS * d, d, bf16);
      prefetch_block(v_pool, (h * blocks + next) * ROWS * d, d, bf16);
      const float *kb = (const float*)k_pool + first, *vb = (const float*)v_pool + first;
      if (bf16) {
        widen_block(k_pool, first, d, k, 1);
        widen_block(v_pool, first, d, v, 1);
        kb = k, vb = v;
      }
      for (size_t g = 0; g < gn; ++g) block_step(qt[g], kb, vb, d, scale, peak[g], sum[g], at[g], 0);
    }
    if (last == own) {  // the tile's own block: row r sees its rows 0..r-1
      widen_block(k_pool, diag_first, d, k, bf16);
      widen_block(v_pool, diag_first, d, v, bf16);
      for (size_t g = 0; g < gn; ++g) block_step(qt[g], k, v, d, scale, peak[g], sum[g], at[g], 1);
    }
    for (size_t g = 0; g < gn; ++g) {
      float* rows_out = out + (tile * ROWS * heads + h * groups + g0 + g) * d;
      for (size_t i = 0; i < d; ++i)
        for (int w = 0; w < NV; ++w) {
          const vf o = at[g][i * NV + w] / sum[g][w];
          for (int l = 0; l < VL; ++l) rows_out[(w * VL + l) * stride + i] = o[l];
        }
    }
  }
}

#define CHUNK_ENTRY(name, pool_type, bf16)                                                                     \
  void name(MEMREF(const float, q), MEMREF(const pool_type, k_pool), MEMREF(const pool_type, v_pool),          \
            MEMREF(const int32_t, table), MEMREF(const int32_t, start), MEMREF(float, out), size_t blocks,      \
            size_t groups, size_t d, size_t kv_heads, size_t tiles, size_t scale_bits, size_t wg) {            \
    const size_t h = wg % kv_heads, tile = tiles - 1 - wg / kv_heads; /* the longest rows first */             \
    if (d == 128)                                                                                               \
      chunk_tile(q + q_off, k_pool + k_pool_off, v_pool + v_pool_off, table + table_off, start[start_off],     \
                 out + out_off, blocks, groups, 128, kv_heads, table_size, bits_f32((uint32_t)scale_bits), h,  \
                 tile, bf16);                                                                                   \
    else                                                                                                        \
      chunk_tile(q + q_off, k_pool + k_pool_off, v_pool + v_pool_off, table + table_off, start[start_off],     \
                 out + out_off, blocks, groups, d, kv_heads, table_size, bits_f32((uint32_t)scale_bits), h,    \
                 tile, bf16);                                                                                   \
  }
CHUNK_ENTRY(chunk_attention_f32, float, 0)
CHUNK_ENTRY(chunk_attention_bf16, uint16_t, 1)
