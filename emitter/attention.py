"""Attention over packed images: the vision tower's two forms, as short functions over the builder.

A packed call holds several images (segments) in one bucket; each patch attends only to
the patches of its own segment. "dense" builds the [heads, B, B] scores with a [B, B]
segment mask; "blockwise" walks query chunks with an online softmax over only the key
chunks that share their segments, so memory per step is [heads, C, C] and the
cross-image blocks are never computed. `attention` is the block's whole attention
(fused [Q|K|V] projection, 2-D RoPE, either form, output projection). The language model's
grouped-query attention, over the KV cache in blocks, is `grouped_attention`; one new
token's, over keys read through a block table where they lie, is `token_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .builder import Builder, Value
from .dims import Dim
from .layers import activation_dtype, apply_rotary, cast, linear, matmul, softmax


def segment_mask(b: Builder, segment_ids: Value) -> Value:
    """Additive mask [B, B]: 0 where two patches share a segment, -inf elsewhere."""
    (n,) = segment_ids.shape
    rows = b.broadcast_in_dim(segment_ids, (n, n), [0], hint="seg_row")
    cols = b.broadcast_in_dim(segment_ids, (n, n), [1], hint="seg_col")
    same = b.compare("EQ", rows, cols, hint="same_segment")
    zero = b.constant(0.0, (n, n), hint="zero")
    return b.select(same, zero, b.constant(float("-inf"), (n, n), hint="neg_inf"), hint="mask")


# Attention forms. "dense": one [H, B, B] score tensor and the [B, B] segment mask, fastest
# for small buckets. "blockwise": a loop over query chunks of C rows, each attending with
# an online softmax, in a loop, over only the key chunks that hold its segments, so memory
# per step is [H, C, C] and the cross-image blocks are never computed (docs/history/performance-notebook.md,
# "Large inputs", has the measurements behind the threshold). Both loops are graph loops,
# so the graph is the same size for any row count, and the rows are a run-time dimension
# (a multiple of C). C is ATTENTION_CHUNK; half of it in buckets below 2 x ATTENTION_CHUNK
# patches, so that a 512 bucket holding two images skips their cross blocks (the 2B tower
# with two 256-patch images x1.09 in f32, x1.05 in bf16; x0.96 with one 512-patch image).
ATTENTION_FORMS = ("dense", "blockwise")
ATTENTION_CHUNK = 512
BLOCKWISE_FROM = 512  # patches: buckets of at least this many use the blockwise form
NO_SEGMENT = -1  # segment id of the rows padded up to a whole chunk (host ids are >= 0)
SOFTMAX_FLOOR = -3.0e38  # running max before any key: finite, so exp(floor - floor) is 1, never NaN


def attention_form(bucket: int) -> str:
    return "blockwise" if bucket >= BLOCKWISE_FROM else "dense"


def attention_chunk(bucket: int) -> int:
    """The blockwise form's chunk rows at `bucket`: ATTENTION_CHUNK, or half of it below two
    chunks (512 -> 256)."""
    return ATTENTION_CHUNK // 2 if bucket < 2 * ATTENTION_CHUNK else ATTENTION_CHUNK


def paced_key_loop(chunk: int) -> bool:
    """Whether the blockwise form's key loops at `chunk` rows make the host wait for each step.

    IREE runs a `stablehlo.while` on the host, which issues every step of a key loop without
    waiting for the device; each step's transient buffers (its [heads, C, C] scores and their
    exponentials, about 40 MB at C = 512 for the 2B tower) were freed only at the next wait,
    so one call held the transients of all its steps: (B/C)^2 a block. The 2B tower's peak
    RSS grew with the square of the bucket: 7.1 GB at 2048, killed at 24 GB at 4096. A
    condition that reads one element of the carried running max makes the host wait for each
    step before it issues the next, so only one step's transients are alive (2048: 3.0 GB,
    and faster: fewer pages faulted in). A wait costs about a millisecond, so 256-row chunks
    (bucket 512: at most 4 small steps a block, nothing held to speak of) are not paced:
    there it cost 3.6% of a shallow tower's time (docs/history/performance-notebook.md, "Large inputs")."""
    return chunk >= ATTENTION_CHUNK


def attention_inputs(b: Builder, segment_ids: Value, form: str, chunk: int):
    """What every block's attention reads beside q/k/v, built once per call: the [B, B]
    mask (dense) or the `KeyRanges` of `chunk`-row chunks (blockwise)."""
    return segment_mask(b, segment_ids) if form == "dense" else key_ranges(b, segment_ids, chunk)


def scaled_scores(b: Builder, q: Value, k: Value, operand_dtype: str = "f32") -> Value:
    """q k^T / sqrt(d): [heads, Q, K] from q [heads, Q, d], k [heads, K, d]."""
    scores = matmul(b, q, k, ([2], [2]), ([0], [0]), operand_dtype, hint="scores")
    return b.multiply(scores, b.scalar(q.shape[2] ** -0.5, scores, "scale"), hint="scores")


def masked_scores(b: Builder, q: Value, k: Value, mask: Value, operand_dtype: str) -> Value:
    """q k^T / sqrt(d) + mask: [heads, Q, K] from q [heads, Q, d], k [heads, K, d], mask [Q, K]."""
    scores = scaled_scores(b, q, k, operand_dtype)
    return b.add(scores, b.broadcast_in_dim(mask, scores.shape, [1, 2]), hint="scores")


def dense_attention(b: Builder, q: Value, k: Value, v: Value, mask: Value, operand_dtype: str) -> Value:
    """softmax(q k^T / sqrt(d) + mask) v on [heads, B, head_dim], with one [heads, B, B] score tensor."""
    scores = masked_scores(b, q, k, mask, operand_dtype)
    return matmul(b, softmax(b, scores), v, ([2], [1]), ([0], [0]), operand_dtype, hint="context")


def _i32(b: Builder, value: int, hint: str = "const") -> Value:
    return b.constant(value, (), "i32", hint=hint)


def _pad_rows(b: Builder, x: Value, axis: int, rows: int, fill, hint: str) -> Value:
    """x with `rows` rows of `fill` appended along `axis`."""
    if rows == 0:
        return x
    shape = list(x.shape)
    shape[axis] = rows
    return b.concatenate([x, b.constant(fill, shape, x.dtype, hint=hint + "_pad")], axis, hint=hint)


def key_chunk_range(b: Builder, seg_q: Value, segments: Value, chunk: int) -> tuple[Value, Value]:
    """[first, end) key chunks holding every key that shares a segment with the queries
    `seg_q` [C]: the span from the first to the last matching key (exact for any ids; for
    the host's contiguous segments it is just those segments)."""
    (c,), (n,) = seg_q.shape, segments.shape
    same = b.compare("EQ", b.broadcast_in_dim(seg_q, (c, n), [0], hint="seg_q"),
                     b.broadcast_in_dim(segments, (c, n), [1], hint="seg_k"), hint="same_segment")
    index = b.iota((c, n), 1, hint="key_index")
    past = b.broadcast_in_dim(b.negate(b.size(n), hint="no_key"), (c, n), [], hint="no_key")
    neg_first = b.select(same, b.negate(index, hint="neg_index"), past, hint="first")
    after_last = b.select(same, b.add(index, b.constant(1, (c, n), "i32")), b.constant(0, (c, n), "i32"),
                          hint="last")
    first = b.negate(b.reduce(neg_first, [0, 1], "maximum", hint="first"), hint="first")
    end = b.reduce(after_last, [0, 1], "maximum", hint="end")
    size = _i32(b, chunk, "chunk")
    return (b.divide(first, size, hint="first_chunk"),
            b.divide(b.add(end, _i32(b, chunk - 1)), size, hint="end_chunk"))


@dataclass(frozen=True)
class KeyRanges:
    """The blockwise form's view of the segments, the same for every block: the segment ids
    padded to whole chunks with NO_SEGMENT [P], and for each query chunk the [first, end)
    key chunks it attends to [P / chunk]."""
    segments: Value
    first: Value
    end: Value
    chunk: int

    @property
    def count(self):
        """Query chunks: an int, or a run-time Dim."""
        return self.first.shape[0]


def _padded(n, chunk: int):
    """Rows padded to whole chunks: a run-time count of rows is one already (the host pads it)."""
    if isinstance(n, Dim):
        if n.scale % chunk:
            raise ValueError(f"run-time rows {n} are not whole chunks of {chunk}")
        return n
    return -(-n // chunk) * chunk


def key_ranges(b: Builder, segment_ids: Value, chunk: int) -> KeyRanges:
    """`key_chunk_range` of every query chunk of `chunk` rows, in a loop (one [chunk, P]
    comparison at a time)."""
    (n,) = segment_ids.shape
    padded = _padded(n, chunk)
    segments = segment_ids if padded == n else _pad_rows(b, segment_ids, 0, padded - n, NO_SEGMENT, "segments")
    count = padded // chunk

    def body(i, first, end):
        seg_q = b.dynamic_slice(segments, [b.multiply(i, _i32(b, chunk, "chunk"), hint="q_start")], (chunk,),
                                hint="seg_q")
        lo, hi = key_chunk_range(b, seg_q, segments, chunk)
        first = b.dynamic_update_slice(first, b.reshape(lo, (1,)), [i], hint="first_chunks")
        end = b.dynamic_update_slice(end, b.reshape(hi, (1,)), [i], hint="end_chunks")
        return [first, end]

    zeros = b.constant(0, (count,), "i32", hint="chunks")
    first, end = b.for_loop(b.size(count), [zeros, zeros], body, hint="ranges")
    return KeyRanges(segments, first, end, chunk)


def online_softmax_step(b: Builder, q: Value, k: Value, v: Value, mask: Value, peak: Value, denom: Value,
                        acc: Value, operand_dtype: str) -> list[Value]:
    """One key chunk of the online softmax: (peak, denom, acc) [heads, Q], [heads, Q],
    [heads, Q, d] carried over q [heads, Q, d], k and v [heads, K, d] and the additive
    mask [Q, K]. exp(scores - peak) is rounded to the operand dtype once: the context
    matmul and the denominator read the same rounded weights."""
    scores = masked_scores(b, q, k, mask, operand_dtype)
    new_peak = b.maximum(peak, b.reduce(scores, [2], "maximum", hint="chunk_peak"), hint="peak")
    e = b.exponential(b.subtract(scores, b.broadcast_in_dim(new_peak, scores.shape, [0, 1]), hint="shifted"),
                      hint="exp")
    e = cast(b, e, operand_dtype, f"exp_{operand_dtype}")
    summed = b.reduce(cast(b, e, "f32", "exp_f32"), [2], "add", hint="chunk_denom")
    rescale = b.exponential(b.subtract(peak, new_peak, hint="peak_change"), hint="rescale")
    denom = b.add(b.multiply(denom, rescale), summed, hint="denom")
    term = matmul(b, e, v, ([2], [1]), ([0], [0]), operand_dtype, hint="chunk_context")
    acc = b.add(b.multiply(acc, b.broadcast_in_dim(rescale, acc.shape, [0, 1]), hint="acc"), term, hint="acc")
    return [new_peak, denom, acc]


def blockwise_attention(b: Builder, q: Value, k: Value, v: Value, ranges: KeyRanges, operand_dtype: str) -> Value:
    """The same attention as `dense_attention` with the segment mask, in a loop over query
    chunks: each chunk of `chunk` queries runs an online softmax (running max, rescaled
    sums) in a loop over the key chunks in its segments' range, each masked by segment.
    Memory per step is [heads, chunk, chunk]; work is the diagonal blocks only. Static
    rows are padded to a whole chunk with segment NO_SEGMENT, which no real row shares; a
    run-time row count is whole chunks already.

    q, k and v enter the loop in the matmul operand dtype (under the bf16 policy the chunk
    copies are bf16 and no step converts them again); `online_softmax_step` is one key chunk."""
    q, k, v = (cast(b, x, operand_dtype, f"{name}_{operand_dtype}") for x, name in ((q, "q"), (k, "k"), (v, "v")))
    heads, n, d = q.shape
    segments, chunk, count = ranges.segments, ranges.chunk, ranges.count
    (padded,) = segments.shape
    if padded != n:
        q, k, v = (_pad_rows(b, x, 1, padded - n, 0.0, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    zero = _i32(b, 0, "zero")

    # Chunk-major copies [chunks, heads, chunk, d] of q, k and v, written out once per block
    # behind one barrier, so that a chunk is a slice of the leading dim. IREE 3.13's llvm-cpu
    # fails ("large vector sizes") when a row slice of [heads, rows, d] fuses into the
    # matmul's packing, and each barrier makes the host wait for the device.
    q, k, v = b.optimization_barriers(
        [b.transpose(b.reshape(x, (heads, count, chunk, d)), [1, 0, 2, 3], hint=name + "_chunks")
         for x, name in ((q, "q"), (k, "k"), (v, "v"))], hint="chunks")

    def chunk_of(x, j, hint):
        """Chunk j of a chunk-major x, [heads, chunk, d]."""
        return b.reshape(b.dynamic_slice(x, [j, zero, zero, zero], (1, heads, chunk, d), hint=hint),
                         (heads, chunk, d), hint=hint)

    def query_chunk(i, out):
        """`out` with chunk i's context [1, heads, chunk, d] written: its key chunks in a loop,
        the softmax online; rounded to the operand dtype (the output projection reads it so)."""
        q_c = chunk_of(q, i, "q_chunk")
        seg_q = b.dynamic_slice(segments, [b.multiply(i, _i32(b, chunk, "chunk"), hint="q_start")], (chunk,),
                                hint="seg_q")
        first = b.reshape(b.dynamic_slice(ranges.first, [i], (1,)), (), hint="first_chunk")
        end = b.reshape(b.dynamic_slice(ranges.end, [i], (1,)), (), hint="end_chunk")
        init = [first, b.constant(SOFTMAX_FLOOR, (heads, chunk), hint="peak"),
                b.constant(0.0, (heads, chunk), hint="denom"), b.constant(0.0, (heads, chunk, d), hint="acc")]
        _, _, denom, acc = b.while_loop(init, lambda j, peak, *_: more_keys(j, end, peak),
                                        lambda j, peak, denom, acc: key_chunk(q_c, seg_q, j, peak, denom, acc),
                                        hint="keys")
        context = b.divide(acc, b.broadcast_in_dim(denom, acc.shape, [0, 1]), hint="context")
        context = b.reshape(cast(b, context, operand_dtype, f"context_{operand_dtype}"), (1, heads, chunk, d),
                            hint="context")
        return b.dynamic_update_slice(out, context, [i, zero, zero, zero], hint="contexts")

    def more_keys(j, end, peak):
        """j < end; in a paced loop (`paced_key_loop`) also waiting for the device's running max."""
        more = b.compare("LT", j, end, hint="more_keys")
        if not paced_key_loop(chunk):
            return more
        # The running max starts at SOFTMAX_FLOOR and only grows (a NaN compares false), so
        # `below` is always false and the condition is `more`, bit for bit; but the host reads
        # one element of the device's carried state before it issues the next step.
        first = b.reshape(b.slice(peak, (0, 0), (1, 1), hint="watched"), (), hint="watched")
        below = b.compare("LT", first, b.constant(SOFTMAX_FLOOR, hint="floor"), hint="below_floor")
        return b.select(below, b.constant(0, (), "i1", hint="false"), more, hint="more_keys")

    def key_chunk(q_c, seg_q, j, peak, denom, acc):
        k_c, v_c = chunk_of(k, j, "k_chunk"), chunk_of(v, j, "v_chunk")
        start = b.multiply(j, _i32(b, chunk, "chunk"), hint="k_start")
        seg_k = b.dynamic_slice(segments, [start], (chunk,), hint="seg_k")
        same = b.compare("EQ", b.broadcast_in_dim(seg_q, (chunk, chunk), [0]),
                         b.broadcast_in_dim(seg_k, (chunk, chunk), [1]), hint="same_segment")
        mask = b.select(same, b.constant(0.0, (chunk, chunk)), b.constant(float("-inf"), (chunk, chunk)),
                        hint="mask")
        carried = online_softmax_step(b, q_c, k_c, v_c, mask, peak, denom, acc, operand_dtype)
        return [b.add(j, _i32(b, 1, "one")), *carried]

    contexts = b.constant(0.0, (count, heads, chunk, d), operand_dtype, hint="contexts")
    (out,) = b.for_loop(b.size(count), [contexts], query_chunk, hint="queries")
    out = b.reshape(b.transpose(out, [1, 0, 2, 3], hint="context"), (heads, padded, d), hint="context")
    return out if padded == n else b.slice(out, (0, 0, 0), (heads, n, d), hint="context")


def attention(b: Builder, x: Value, w: dict, cos: Value, sin: Value, segments: Value, num_heads: int) -> Value:
    """Packed multi-head self-attention with fused [Q|K|V] projection and 2-D RoPE; the
    score and context matmuls take their operands in the projections' activation dtype.
    `segments` is what `attention_inputs` gave: the [B, B] mask (dense form) or the
    `KeyRanges` (blockwise form)."""
    n, hidden = x.shape
    head_dim = hidden // num_heads
    operand_dtype = activation_dtype(b, w["attn.qkv.weight"])
    qkv = b.reshape(linear(b, x, w["attn.qkv.weight"], w["attn.qkv.bias"], "qkv"), (n, 3, num_heads, head_dim))

    def head_major(i, name, rope):
        part = b.reshape(b.slice(qkv, (0, i, 0, 0), (n, i + 1, num_heads, head_dim)), (n, num_heads, head_dim),
                         hint=name)
        if rope:
            part = apply_rotary(b, part, cos, sin)
        return b.transpose(part, [1, 0, 2], hint=name)  # [heads, B, head_dim]

    q, k, v = head_major(0, "q", True), head_major(1, "k", True), head_major(2, "v", False)
    if isinstance(segments, KeyRanges):
        context = blockwise_attention(b, q, k, v, segments, operand_dtype)
    else:
        context = dense_attention(b, q, k, v, segments, operand_dtype)
    context = b.reshape(b.transpose(context, [1, 0, 2]), (n, hidden), hint="context")
    return linear(b, context, w["attn.proj.weight"], w["attn.proj.bias"], "proj")


# -- the language model's grouped-query attention over its KV cache ----------------------


def grouped_attention(b: Builder, q: Value, keys: list[Value], values: list[Value], mask: Value) -> Value:
    """Attention of queries q [S, H, D] over blocks of keys/values [KVH, T_i, D]: one
    softmax over all T = sum T_i keys, computed block by block (shared max, summed
    denominators) so that no block is copied and no dispatch holds a whole score row; H/KVH
    query heads per KV head (query head h reads KV head h // (H/KVH)); additive mask
    [S, T]. Returns [S, H*D]."""
    s, heads, d = q.shape
    kv_heads = keys[0].shape[0]
    groups = heads // kv_heads
    q = b.reshape(b.transpose(b.reshape(q, (s, kv_heads, groups, d)), [1, 2, 0, 3]), (kv_heads, groups * s, d),
                  hint="q_grouped")
    scores, start = [], 0
    for k in keys:
        t = k.shape[1]
        x = b.reshape(scaled_scores(b, q, k), (kv_heads, groups, s, t))
        block_mask = mask if len(keys) == 1 else b.slice(mask, (0, start), (s, start + t), hint="mask")
        scores.append(b.add(x, b.broadcast_in_dim(block_mask, x.shape, [2, 3], hint="mask"), hint="masked"))
        start = t if len(keys) == 1 else start + t  # one block may have a run-time length
    if len(scores) == 1:
        probs = b.reshape(softmax(b, scores[0]), (kv_heads, groups * s, start), hint="probs")
        context = matmul(b, probs, values[0], ([2], [1]), ([0], [0]), hint="context")
    else:
        peaks = [b.reduce(x, [3], "maximum", hint="peak") for x in scores]
        peak = peaks[0]
        for p in peaks[1:]:
            peak = b.maximum(peak, p, hint="peak")
        context = total = None
        for x, v in zip(scores, values):
            e = b.exponential(b.subtract(x, b.broadcast_in_dim(peak, x.shape, [0, 1, 2]), hint="shifted"), hint="exp")
            part = b.reduce(e, [3], "add", hint="denom")
            term = matmul(b, b.reshape(e, (kv_heads, groups * s, x.shape[3])), v, ([2], [1]), ([0], [0]),
                          hint="context")
            total = part if total is None else b.add(total, part, hint="denom")
            context = term if context is None else b.add(context, term, hint="context")
        denom = b.broadcast_in_dim(b.reshape(total, (kv_heads, groups * s)), context.shape, [0, 1], hint="denom")
        context = b.divide(context, denom, hint="context")
    context = b.transpose(b.reshape(context, (kv_heads, groups, s, d)), [2, 0, 1, 3], hint="context")
    return b.reshape(context, (s, heads * d), hint="context")


def power_of_two_split(scale: float) -> tuple[float, float]:
    """(2^e, rest) with 2^e * rest == f32(scale) exactly, 2^e the largest power of two not
    above it: x * 2^e rounds nothing (barring underflow), so (sum of x * 2^e) * rest equals
    (sum of x) * scale bit for bit, summed in the same order."""
    f32 = float(np.float32(scale))
    power = 2.0 ** math.floor(math.log2(f32))
    return power, f32 / power


def token_attention(b: Builder, q: Value, keys: Value, values: Value, mask: Value, own_k: Value,
                    own_v: Value) -> Value:
    """One token's grouped-query attention: q [1, H, D] over the cache's keys/values [KVH,
    *slots, D] (the slots in one dim or several, e.g. [blocks, 16]; additive mask [1, L]
    over them in order, the token's own slot masked out) and its own k, v [KVH, 1, D], one
    softmax over both. Products and sums as elementwise ops and reductions, not matmuls,
    and each product carries a power-of-two factor (`power_of_two_split`): IREE then sees no
    contraction, so a cache read through a block table (a gather) fuses into the product
    and is read where it lies, never copied into a packed layout. Returns [1, H*D]."""
    _, heads, d = q.shape
    kv_heads, *slots, _ = keys.shape
    groups = heads // kv_heads
    q = b.reshape(q, (kv_heads, groups, d), hint="q_grouped")
    wide = (kv_heads, groups, *slots, d)
    over = list(range(2, 2 + len(slots)))  # the slot dims of the scores
    cache_dims = [0, *over, len(wide) - 1]
    inside, after = power_of_two_split(d ** -0.5)

    def dot(x: Value, y: Value) -> Value:
        prod = b.multiply(x, y, hint="qk")
        prod = b.reduce(b.multiply(prod, b.scalar(inside, prod, "scale_inside"), hint="qk"), [x.rank - 1],
                        hint="scores")
        return b.multiply(prod, b.scalar(after, prod, "scale"), hint="scores")

    scores = dot(b.broadcast_in_dim(q, wide, [0, 1, len(wide) - 1], hint="q_wide"),
                 b.broadcast_in_dim(keys, wide, cache_dims, hint="k_wide"))
    scores = b.add(scores, b.broadcast_in_dim(b.reshape(mask, tuple(slots)), scores.shape, over, hint="mask"),
                   hint="masked")
    own = dot(q, b.broadcast_in_dim(b.reshape(own_k, (kv_heads, d)), q.shape, [0, 2], hint="own_k"))
    peak = b.maximum(b.reduce(scores, over, "maximum", hint="peak"), own, hint="peak")
    e = b.exponential(b.subtract(scores, b.broadcast_in_dim(peak, scores.shape, [0, 1]), hint="shifted"), hint="exp")
    e_own = b.exponential(b.subtract(own, peak, hint="shifted"), hint="exp")
    denom = b.add(b.reduce(e, over, hint="denom"), e_own, hint="denom")
    weighted = b.multiply(b.broadcast_in_dim(e, wide, list(range(len(wide) - 1)), hint="p_wide"),
                          b.broadcast_in_dim(values, wide, cache_dims, hint="v_wide"), hint="pv")
    weighted = b.multiply(weighted, b.scalar(2.0, weighted, "pv_inside"), hint="pv")  # undone below, exactly
    summed = b.reduce(weighted, over, hint="context")
    summed = b.multiply(summed, b.scalar(0.5, summed, "pv_after"), hint="context")
    context = b.add(summed,
                    b.multiply(b.broadcast_in_dim(e_own, q.shape, [0, 1], hint="own_p"),
                               b.broadcast_in_dim(b.reshape(own_v, (kv_heads, d)), q.shape, [0, 2], hint="own_v"),
                               hint="own_context"), hint="context")
    context = b.divide(context, b.broadcast_in_dim(denom, q.shape, [0, 1], hint="denom"), hint="context")
    return b.reshape(context, (1, heads * d), hint="context")
