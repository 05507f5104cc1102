"""The layers of the vision tower and of the language model as short functions over the builder.

Each takes the builder first and the values it works on; weights are looked up by
their checkpoint suffix in a `dict[str, Value]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .builder import Builder, Value
from .config import LAYER_NORM_EPS

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715


class Stages(dict):
    """The named stage values of one graph, recorded as the graph is built.

    A stage named in `kept` (the stages the diagnostics variant returns) is written out
    behind an optimization_barrier, and the graph goes on from the barrier's result. So
    no dispatch has to write a stage and a value computed from it at once, and each
    returned stage leaves its dispatch in one layout. (IREE 3.13's llvm-cpu codegen with
    data tiling fails on some matmul dispatches that write both the product and its
    successor, e.g. a merger's fc1 and GELU(fc1): "large vector sizes" on the unpack.)
    With nothing kept, the graph is exactly the plain one."""

    def __init__(self, b: Builder, kept=()):
        super().__init__()
        self.b, self.kept = b, frozenset(kept)

    def __call__(self, name: str, value: Value) -> Value:
        """Record `value` as stage `name`; returns the value the graph goes on with."""
        if name in self.kept:
            with self.b.stage(name):
                value = self.b.optimization_barrier(value, hint="kept")
        self[name] = value
        return value


def matmul(b: Builder, x: Value, y: Value, contract, batch=([], []), operand_dtype: str = "f32",
           hint: str = "matmul") -> Value:
    """dot_general with operands in `operand_dtype` (converted if needed) and an f32 result."""
    x, y = (v if v.dtype == operand_dtype else b.convert(v, operand_dtype, hint=f"{hint}_{operand_dtype}")
            for v in (x, y))
    return b.dot_general(x, y, contract=contract, batch=batch, hint=hint, result_dtype="f32")


def linear(b: Builder, x: Value, weight: Value, bias: Value, hint: str = "linear") -> Value:
    """x @ weight.T + bias for a [out, in] weight, as the checkpoint stores it; the
    matmul takes its operands in the weight's dtype (f32, or bf16 under that policy)."""
    y = matmul(b, x, weight, ([x.rank - 1], [1]), operand_dtype=weight.dtype, hint=hint + "_matmul")
    return b.add(y, b.broadcast_in_dim(bias, y.shape, [y.rank - 1], hint=hint + "_bias"), hint=hint)


def layer_norm(b: Builder, x: Value, weight: Value, bias: Value, eps: float = LAYER_NORM_EPS) -> Value:
    """LayerNorm over the last dim: centered variance, in f32."""
    rows, width = x.shape[:-1], x.shape[-1]
    keep = list(range(x.rank - 1))

    def mean(v, hint):
        total = b.reduce(v, [x.rank - 1], "add", hint=hint + "_sum")
        return b.broadcast_in_dim(b.divide(total, b.constant(width, rows), hint=hint), x.shape, keep, hint=hint)

    centered = b.subtract(x, mean(x, "mean"), hint="centered")
    variance = mean(b.multiply(centered, centered, hint="square"), "var")
    inv_std = b.rsqrt(b.add(variance, b.scalar(eps, variance, "eps")), hint="inv_std")
    normed = b.multiply(centered, inv_std, hint="normed")
    scaled = b.multiply(normed, b.broadcast_in_dim(weight, x.shape, [x.rank - 1]), hint="scaled")
    return b.add(scaled, b.broadcast_in_dim(bias, x.shape, [x.rank - 1]), hint="norm")


def gelu_tanh(b: Builder, x: Value) -> Value:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), PyTorch's gelu(approximate='tanh')."""
    cube = b.multiply(b.multiply(x, x, hint="x2"), x, hint="x3")
    inner = b.add(x, b.multiply(b.scalar(GELU_TANH_CUBIC, x), cube), hint="inner")
    t = b.tanh(b.multiply(b.scalar(SQRT_2_OVER_PI, x), inner))
    half_x = b.multiply(b.scalar(0.5, x), x, hint="half_x")
    return b.multiply(half_x, b.add(b.scalar(1.0, x), t), hint="gelu")


def gelu_erf(b: Builder, x: Value) -> Value:
    """Exact GELU: x/2 (1 + erf(x / sqrt 2))."""
    e = b.erf(b.multiply(x, b.scalar(1.0 / math.sqrt(2.0), x)))
    half_x = b.multiply(x, b.scalar(0.5, x), hint="half_x")
    return b.multiply(half_x, b.add(b.scalar(1.0, x), e), hint="gelu")


def softmax(b: Builder, scores: Value) -> Value:
    """Softmax over the last dim, max-subtracted."""
    last, keep = scores.rank - 1, list(range(scores.rank - 1))
    peak = b.broadcast_in_dim(b.reduce(scores, [last], "maximum", hint="peak"), scores.shape, keep, hint="peak")
    e = b.exponential(b.subtract(scores, peak, hint="shifted"), hint="exp")
    total = b.broadcast_in_dim(b.reduce(e, [last], "add", hint="denom"), scores.shape, keep, hint="denom")
    return b.divide(e, total, hint="probs")


def rotary_tables(b: Builder, rope_pos: Value, inv_freq, head_dim: int) -> tuple[Value, Value]:
    """cos and sin [B, head_dim] from (row, col) ids [2, B]: angles cat(row*f, col*f) twice."""
    _, n = rope_pos.shape
    quarter = head_dim // 4
    pos = b.convert(rope_pos, "f32", hint="pos")
    freq = b.broadcast_in_dim(b.constant_array(inv_freq, hint="inv_freq"), (2, n, quarter), [2], hint="inv_freq")
    angles = b.multiply(b.broadcast_in_dim(pos, (2, n, quarter), [0, 1]), freq, hint="angles")
    half = b.reshape(b.transpose(angles, [1, 0, 2]), (n, head_dim // 2), hint="angles")
    full = b.concatenate([half, half], 1, hint="angles")
    return b.cosine(full, hint="cos"), b.sine(full, hint="sin")


def apply_rotary(b: Builder, x: Value, cos: Value, sin: Value) -> Value:
    """x*cos + rotate_half(x)*sin on [B, heads, head_dim]; cos/sin are [B, head_dim]."""
    n, heads, d = x.shape
    first = b.slice(x, (0, 0, 0), (n, heads, d // 2), hint="x1")
    second = b.slice(x, (0, 0, d // 2), (n, heads, d), hint="x2")
    rotated = b.concatenate([b.negate(second, hint="neg_x2"), first], 2, hint="rotated")
    cos = b.broadcast_in_dim(cos, x.shape, [0, 2], hint="cos")
    sin = b.broadcast_in_dim(sin, x.shape, [0, 2], hint="sin")
    return b.add(b.multiply(x, cos, hint="x_cos"), b.multiply(rotated, sin, hint="rotated_sin"), hint="roped")


def segment_mask(b: Builder, segment_ids: Value) -> Value:
    """Additive mask [B, B]: 0 where two patches share a segment, -inf elsewhere."""
    (n,) = segment_ids.shape
    rows = b.broadcast_in_dim(segment_ids, (n, n), [0], hint="seg_row")
    cols = b.broadcast_in_dim(segment_ids, (n, n), [1], hint="seg_col")
    same = b.compare("EQ", rows, cols, hint="same_segment")
    zero = b.constant(0.0, (n, n), hint="zero")
    return b.select(same, zero, b.constant(float("-inf"), (n, n), hint="neg_inf"), hint="mask")


# Attention forms. "dense": one [H, B, B] score tensor and the [B, B] segment mask, fastest
# for small buckets. "blockwise": query chunks of C rows (unrolled), each attending with
# an online softmax, in a loop, over only the key chunks that hold its segments, so memory
# per step is [H, C, C] and the cross-image blocks are never computed (docs/performance.md,
# "Large inputs", has the measurements behind the threshold). C is ATTENTION_CHUNK, or
# larger past 8192 patches so that a block unrolls at most MAX_QUERY_CHUNKS chunks:
# iree-compile's time grows faster than the number of unrolled chunks (the 2B graph at
# 8192, 16 chunks a block, compiled in 3 min; at 16384, 32 a block, not in 14).
ATTENTION_FORMS = ("dense", "blockwise")
ATTENTION_CHUNK = 512
MAX_QUERY_CHUNKS = 16
BLOCKWISE_FROM = 1024  # patches: buckets of at least this many use the blockwise form
NO_SEGMENT = -1  # segment id of the rows padded up to a whole chunk (host ids are >= 0)
SOFTMAX_FLOOR = -3.0e38  # running max before any key: finite, so exp(floor - floor) is 1, never NaN


def attention_form(bucket: int) -> str:
    return "blockwise" if bucket >= BLOCKWISE_FROM else "dense"


def attention_chunk(bucket: int) -> int:
    """The blockwise form's chunk rows at `bucket`: ATTENTION_CHUNK, or the multiple of it
    that keeps the query chunks at MAX_QUERY_CHUNKS or fewer (16384 -> 1024)."""
    chunks = -(-bucket // ATTENTION_CHUNK)
    return ATTENTION_CHUNK * -(-chunks // MAX_QUERY_CHUNKS)


def attention_inputs(b: Builder, segment_ids: Value, form: str):
    """What every block's attention reads beside q/k/v, built once per call: the [B, B]
    mask (dense) or the `KeyRanges` (blockwise)."""
    return segment_mask(b, segment_ids) if form == "dense" else key_ranges(b, segment_ids)


def dense_attention(b: Builder, q: Value, k: Value, v: Value, mask: Value, operand_dtype: str) -> Value:
    """softmax(q k^T / sqrt(d) + mask) v on [heads, B, head_dim], with one [heads, B, B] score tensor."""
    head_dim = q.shape[2]
    scores = matmul(b, q, k, ([2], [2]), ([0], [0]), operand_dtype, hint="scores")
    scores = b.multiply(scores, b.scalar(head_dim ** -0.5, scores, "scale"), hint="scores")
    scores = b.add(scores, b.broadcast_in_dim(mask, scores.shape, [1, 2]), hint="scores")
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
    neg_first = b.select(same, b.negate(index, hint="neg_index"), b.constant(-n, (c, n), "i32"), hint="first")
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


def key_ranges(b: Builder, segment_ids: Value, chunk: int | None = None) -> KeyRanges:
    """`key_chunk_range` of every query chunk, in a loop (one [chunk, P] comparison at a
    time); `chunk` defaults to `attention_chunk` of the bucket."""
    (n,) = segment_ids.shape
    chunk = chunk or attention_chunk(n)
    padded = -(-n // chunk) * chunk
    segments = _pad_rows(b, segment_ids, 0, padded - n, NO_SEGMENT, "segments")
    count = padded // chunk

    def body(i, first, end):
        seg_q = b.dynamic_slice(segments, [b.multiply(i, _i32(b, chunk, "chunk"), hint="q_start")], (chunk,),
                                hint="seg_q")
        lo, hi = key_chunk_range(b, seg_q, segments, chunk)
        first = b.dynamic_update_slice(first, b.reshape(lo, (1,)), [i], hint="first_chunks")
        end = b.dynamic_update_slice(end, b.reshape(hi, (1,)), [i], hint="end_chunks")
        return [b.add(i, _i32(b, 1, "one")), first, end]

    zeros = b.constant(0, (count,), "i32", hint="chunks")
    _, first, end = b.while_loop([_i32(b, 0, "zero"), zeros, zeros],
                                 lambda i, *_: b.compare("LT", i, _i32(b, count, "count"), hint="more_queries"),
                                 body, hint="ranges")
    return KeyRanges(segments, first, end, chunk)


def blockwise_attention(b: Builder, q: Value, k: Value, v: Value, ranges: KeyRanges, operand_dtype: str) -> Value:
    """The same attention as `dense_attention` with the segment mask, query chunk by query
    chunk (unrolled): each chunk of `chunk` queries runs an online softmax (running max,
    rescaled sums) in a loop over the key chunks in its segments' range, each masked by segment. Memory per step is
    [heads, chunk, chunk]; work is the diagonal blocks only. Rows are padded to a whole
    chunk with segment NO_SEGMENT, which no real row shares."""
    heads, n, d = q.shape
    segments, chunk = ranges.segments, ranges.chunk
    (padded,) = segments.shape
    q, k, v = (_pad_rows(b, x, 1, padded - n, 0.0, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    zero = _i32(b, 0, "zero")

    def chunk_of(x, start, hint):
        """Rows [start, start + chunk) of x [heads, rows, d], copied out: IREE 3.13's llvm-cpu
        fails ("large vector sizes") when the slice fuses into the matmul's packing."""
        return b.optimization_barrier(b.dynamic_slice(x, [zero, start, zero], (heads, chunk, d), hint=hint), hint=hint)

    def query_chunk(i):
        """Chunk i's context [heads, chunk, d]: its key chunks in a loop, the softmax online."""
        rows = (i * chunk, (i + 1) * chunk)
        q_c = b.optimization_barrier(b.slice(q, (0, rows[0], 0), (heads, rows[1], d), hint="q_chunk"), hint="q_chunk")
        seg_q = b.slice(segments, (rows[0],), (rows[1],), hint="seg_q")
        first = b.reshape(b.slice(ranges.first, (i,), (i + 1,)), (), hint="first_chunk")
        end = b.reshape(b.slice(ranges.end, (i,), (i + 1,)), (), hint="end_chunk")
        init = [first, b.constant(SOFTMAX_FLOOR, (heads, chunk), hint="peak"),
                b.constant(0.0, (heads, chunk), hint="denom"), b.constant(0.0, (heads, chunk, d), hint="acc")]
        _, _, denom, acc = b.while_loop(init, lambda j, *_: b.compare("LT", j, end, hint="more_keys"),
                                        lambda j, peak, denom, acc: key_chunk(q_c, seg_q, j, peak, denom, acc),
                                        hint="keys")
        return b.divide(acc, b.broadcast_in_dim(denom, acc.shape, [0, 1]), hint="context")

    def key_chunk(q_c, seg_q, j, peak, denom, acc):
        start = b.multiply(j, _i32(b, chunk, "chunk"), hint="k_start")
        k_c, v_c = chunk_of(k, start, "k_chunk"), chunk_of(v, start, "v_chunk")
        seg_k = b.dynamic_slice(segments, [start], (chunk,), hint="seg_k")
        same = b.compare("EQ", b.broadcast_in_dim(seg_q, (chunk, chunk), [0]),
                         b.broadcast_in_dim(seg_k, (chunk, chunk), [1]), hint="same_segment")
        mask = b.select(same, b.constant(0.0, (chunk, chunk)), b.constant(float("-inf"), (chunk, chunk)),
                        hint="mask")
        scores = matmul(b, q_c, k_c, ([2], [2]), ([0], [0]), operand_dtype, hint="scores")
        scores = b.multiply(scores, b.scalar(d ** -0.5, scores, "scale"), hint="scores")
        scores = b.add(scores, b.broadcast_in_dim(mask, scores.shape, [1, 2]), hint="scores")
        new_peak = b.maximum(peak, b.reduce(scores, [2], "maximum", hint="chunk_peak"), hint="peak")
        e = b.exponential(b.subtract(scores, b.broadcast_in_dim(new_peak, scores.shape, [0, 1]), hint="shifted"),
                          hint="exp")
        rescale = b.exponential(b.subtract(peak, new_peak, hint="peak_change"), hint="rescale")
        denom = b.add(b.multiply(denom, rescale), b.reduce(e, [2], "add", hint="chunk_denom"), hint="denom")
        term = matmul(b, e, v_c, ([2], [1]), ([0], [0]), operand_dtype, hint="chunk_context")
        acc = b.add(b.multiply(acc, b.broadcast_in_dim(rescale, acc.shape, [0, 1]), hint="acc"), term, hint="acc")
        return [b.add(j, _i32(b, 1, "one")), new_peak, denom, acc]

    # Query chunks unrolled, not a loop: a loop carrying the [heads, P, d] output copied it at
    # every step and kept the copies (attention alone at 16384: 1.4-2.2 GB of peak, 0.76 unrolled).
    contexts = [query_chunk(i) for i in range(padded // chunk)]
    out = contexts[0] if len(contexts) == 1 else b.concatenate(contexts, 1, hint="context")
    return out if padded == n else b.slice(out, (0, 0, 0), (heads, n, d), hint="context")


def attention(b: Builder, x: Value, w: dict, cos: Value, sin: Value, segments: Value, num_heads: int) -> Value:
    """Packed multi-head self-attention with fused [Q|K|V] projection and 2-D RoPE; the
    score and context matmuls take their operands in the attention weights' dtype.
    `segments` is what `attention_inputs` gave: the [B, B] mask (dense form) or the
    `KeyRanges` (blockwise form)."""
    n, hidden = x.shape
    head_dim = hidden // num_heads
    operand_dtype = w["attn.qkv.weight"].dtype
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


def mlp(b: Builder, x: Value, w: dict) -> Value:
    up = linear(b, x, w["mlp.linear_fc1.weight"], w["mlp.linear_fc1.bias"], "fc1")
    return linear(b, gelu_tanh(b, up), w["mlp.linear_fc2.weight"], w["mlp.linear_fc2.bias"], "fc2")


def merger(b: Builder, x: Value, w: dict, merge_unit: int, postshuffle_norm: bool, stages: Stages,
           name: str) -> Value:
    """Patch merger: group `merge_unit` patches into one row, LayerNorm (before or after
    grouping), then fc2(gelu_erf(fc1(.)))."""
    n, hidden = x.shape
    grouped_shape = (n // merge_unit, hidden * merge_unit)
    if postshuffle_norm:
        normed = stages(f"{name}.norm", layer_norm(b, b.reshape(x, grouped_shape, hint="grouped"),
                                                   w["norm.weight"], w["norm.bias"]))
        grouped = normed
    else:
        normed = stages(f"{name}.norm", layer_norm(b, x, w["norm.weight"], w["norm.bias"]))
        grouped = b.reshape(normed, grouped_shape, hint="grouped")
    fc1 = stages(f"{name}.fc1", linear(b, grouped, w["linear_fc1.weight"], w["linear_fc1.bias"], "fc1"))
    act = stages(f"{name}.act", gelu_erf(b, fc1))
    return linear(b, act, w["linear_fc2.weight"], w["linear_fc2.bias"], "fc2")


# -- the language model's layers ---------------------------------------------------------


def project(b: Builder, x: Value, weight: Value, hint: str = "proj") -> Value:
    """x @ weight.T for a bias-free [out, in] weight, operands in the weight's dtype. One
    row [1, in] is computed as weight @ x.T: IREE's data tiling then packs the weight in
    the layout the many-row form packs it in, so a module with both (prefill and decode)
    holds one packed copy; as x @ weight.T it packed a second, transposed one. Decode
    time (2B widths, 2 layers, bf16, medians): the same for the layers' projections, but
    lm_head [vocab, hidden] in this form took about 1.35x its time as x @ weight.T, which
    instead needs a transposed transient at load (1.2 GB at 2B): memory chosen here."""
    if x.shape[0] != 1 or x.rank != 2:
        return matmul(b, x, weight, ([x.rank - 1], [1]), operand_dtype=weight.dtype, hint=hint)
    column = matmul(b, weight, x, ([1], [1]), operand_dtype=weight.dtype, hint=hint)
    return b.reshape(column, (1, weight.shape[0]), hint=hint)


def rms_norm(b: Builder, x: Value, weight: Value, eps: float) -> Value:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, in f32 (transformers' RMSNorm)."""
    rows, width, keep = x.shape[:-1], x.shape[-1], list(range(x.rank - 1))
    total = b.reduce(b.multiply(x, x, hint="square"), [x.rank - 1], "add", hint="sum_sq")
    mean = b.divide(total, b.constant(width, rows), hint="mean_sq")
    inv = b.rsqrt(b.add(mean, b.scalar(eps, mean, "eps")), hint="inv_rms")
    normed = b.multiply(x, b.broadcast_in_dim(inv, x.shape, keep, hint="inv_rms"), hint="normed")
    return b.multiply(b.broadcast_in_dim(weight, x.shape, [x.rank - 1], hint="weight"), normed, hint="rms")


def silu(b: Builder, x: Value) -> Value:
    """x / (1 + exp(-x)), as PyTorch's CPU kernel computes it."""
    return b.divide(x, b.add(b.scalar(1.0, x), b.exponential(b.negate(x))), hint="silu")


def gated_mlp(b: Builder, x: Value, w: dict) -> Value:
    """down(silu(gate(x)) * up(x))."""
    gate = silu(b, project(b, x, w["mlp.gate_proj.weight"], "gate"))
    up = project(b, x, w["mlp.up_proj.weight"], "up")
    return project(b, b.multiply(gate, up, hint="gated"), w["mlp.down_proj.weight"], "down")


def mrope_tables(b: Builder, positions: Value, inv_freq, mrope_section) -> tuple[Value, Value]:
    """cos and sin [S, head_dim] from (t, h, w) position ids [3, S], interleaved M-RoPE:
    frequency j takes the h row when j % 3 == 1 and j < 3*section[1], the w row when
    j % 3 == 2 and j < 3*section[2], else the t row; then cat(angles, angles)."""
    _, n = positions.shape
    half = len(inv_freq)
    rows = np.zeros((3, half), np.float32)
    for j in range(half):
        r = 1 if j % 3 == 1 and j < 3 * mrope_section[1] else 2 if j % 3 == 2 and j < 3 * mrope_section[2] else 0
        rows[r, j] = 1.0
    pos = b.broadcast_in_dim(b.convert(positions, "f32", hint="pos"), (3, n, half), [0, 1], hint="pos")
    pick = b.broadcast_in_dim(b.reshape(b.constant_array(rows.reshape(-1), hint="rows"), (3, half)),
                              (3, n, half), [0, 2], hint="rows")
    chosen = b.reduce(b.multiply(pos, pick, hint="picked"), [0], "add", hint="pos")  # exact: p + 0 + 0
    freq = b.broadcast_in_dim(b.constant_array(inv_freq, hint="inv_freq"), (n, half), [1], hint="inv_freq")
    angles = b.multiply(chosen, freq, hint="angles")
    full = b.concatenate([angles, angles], 1, hint="angles")
    return b.cosine(full, hint="cos"), b.sine(full, hint="sin")


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
        x = matmul(b, q, k, ([2], [2]), ([0], [0]), hint="scores")
        x = b.reshape(b.multiply(x, b.scalar(d ** -0.5, x, "scale"), hint="scores"), (kv_heads, groups, s, t))
        block_mask = mask if len(keys) == 1 else b.slice(mask, (0, start), (s, start + t), hint="mask")
        scores.append(b.add(x, b.broadcast_in_dim(block_mask, x.shape, [2, 3], hint="mask"), hint="masked"))
        start += t
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
