"""The layers of the vision tower and of the language model as short functions over the builder.

Each takes the builder first and the values it works on; weights are looked up by
their checkpoint suffix in a `dict[str, Value]`.
"""

from __future__ import annotations

import math

import numpy as np

from .builder import Builder, Value
from .dims import Dim
from .config import LAYER_NORM_EPS
from . import quant
from .kernel_calls import block_matmul, is_q6_k
from kernels.q8_matmul import SUB

from .quant import BLOCK, BlockWeight, QuantizedWeight

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


def cast(b: Builder, x: Value, dtype: str, hint: str = "cast") -> Value:
    """x in `dtype`: converted, unless it already is."""
    return x if x.dtype == dtype else b.convert(x, dtype, hint=hint)


def matmul(b: Builder, x: Value, y: Value, contract, batch=([], []), operand_dtype: str = "f32",
           hint: str = "matmul") -> Value:
    """dot_general with operands in `operand_dtype` (converted if needed) and an f32 result."""
    x, y = (cast(b, v, operand_dtype, f"{hint}_{operand_dtype}") for v in (x, y))
    return b.dot_general(x, y, contract=contract, batch=batch, hint=hint, result_dtype="f32")


def activation_dtype(b: Builder, weight: Value | QuantizedWeight) -> str:
    """The dtype a matmul against `weight` takes its activations in: the graph's
    (`Builder.activations`, "f32" under the bf16-f32 precision), else the weight's (f32 for
    a quantized one). Integer activations ("i8", w8a8) are the quantized weights' alone
    (`integer_project`): a float weight beside them takes its own dtype."""
    graph = b.activations if b.activations != "i8" else None
    return graph or ("f32" if isinstance(weight, QuantizedWeight) else weight.dtype)


def weight_matmul(b: Builder, x: Value, weight: Value, hint: str, weight_first: bool = False) -> Value:
    """x @ weight.T for an [out, in] weight as stored, f32 result; x cast to
    `activation_dtype`. The weight itself is never converted: a conversion of a weight
    global is hoisted by IREE into a resident full-size copy, where a bf16 weight beside
    f32 activations is widened inside the matmul. `weight_first`: weight @ x.T instead."""
    dtype = activation_dtype(b, weight)
    x = cast(b, x, dtype, f"{hint}_{dtype}")
    if weight_first:
        return b.dot_general(weight, x, ([1], [x.rank - 1]), hint=hint, result_dtype="f32")
    return b.dot_general(x, weight, ([x.rank - 1], [1]), hint=hint, result_dtype="f32")


def linear(b: Builder, x: Value, weight: Value | QuantizedWeight, bias: Value, hint: str = "linear") -> Value:
    """x @ weight.T + bias for a [out, in] weight, as the checkpoint stores it (f32, or bf16
    under the bf16 precisions; `weight_matmul`), or quantized (`quantized_project`)."""
    if isinstance(weight, QuantizedWeight):
        y = quantized_project(b, x, weight, hint + "_matmul")
    else:
        y = weight_matmul(b, x, weight, hint + "_matmul")
    return b.add(y, b.broadcast_in_dim(bias, y.shape, [y.rank - 1], hint=hint + "_bias"), hint=hint)


def square(b: Builder, x: Value) -> Value:
    """x * x, written |x| * |x| (the same bits): IREE 3.13 takes a sum over x * x for a
    contraction and lowers it to a scalar FMA per element; over |x| * |x| it is a vector
    reduction (a 2B LayerNorm's second pass about 20% faster, docs/history/performance-notebook.md, "RoPE fused,
    squares that vectorize")."""
    magnitude = b.abs(x, hint="magnitude")
    return b.multiply(magnitude, magnitude, hint="square")


def layer_norm(b: Builder, x: Value, weight: Value, bias: Value, eps: float = LAYER_NORM_EPS) -> Value:
    """LayerNorm over the last dim: centered variance, in f32. The centered rows are written
    twice, x - mean for the output and x + (-mean) for the variance (the same values), so
    that IREE forms them inside each of its two passes instead of writing a centered copy
    out between them (docs/history/performance-notebook.md, "RoPE fused, squares that vectorize")."""
    rows, width = x.shape[:-1], x.shape[-1]
    keep = list(range(x.rank - 1))

    def mean(v, hint):
        total = b.reduce(v, [x.rank - 1], "add", hint=hint + "_sum")
        return b.broadcast_in_dim(b.divide(total, b.constant(width, rows), hint=hint), x.shape, keep, hint=hint)

    mu = mean(x, "mean")
    variance = mean(square(b, b.add(x, b.negate(mu, hint="neg_mean"), hint="deviation")), "var")
    inv_std = b.rsqrt(b.add(variance, b.scalar(eps, variance, "eps")), hint="inv_std")
    normed = b.multiply(b.subtract(x, mu, hint="centered"), inv_std, hint="normed")
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


def rope_inv_freq(dim: int, theta: float) -> np.ndarray:
    """1 / theta^(arange(0, dim, 2) / dim), in f32 like transformers (the vision tower's
    2-D rotary takes dim = head_dim / 2, the language model's M-RoPE dim = head_dim)."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)


def rotary_tables(b: Builder, rope_pos: Value, inv_freq, head_dim: int) -> tuple[Value, Value]:
    """cos and sin [B, head_dim] from (row, col) ids [2, B]: angles cat(row*f, col*f) twice."""
    _, n = rope_pos.shape
    quarter = head_dim // 4
    pos = b.convert(rope_pos, "f32", hint="pos")
    freq = b.broadcast_in_dim(b.constant_array(inv_freq, hint="inv_freq"), (2, n, quarter), [2], hint="inv_freq")
    angles = b.multiply(b.broadcast_in_dim(pos, (2, n, quarter), [0, 1]), freq, hint="angles")
    half = b.reshape(b.transpose(angles, [1, 0, 2]), (n, head_dim // 2), hint="angles")
    # cat(half, half) as a broadcast over a new axis, not a concatenate: with run-time rows
    # IREE 3.13 fused a concatenate into the rotation as a per-element branch, in scalar
    # code (the 2B tower at 512 patches 5% slower); a broadcast fuses as a plain read.
    full = b.reshape(b.broadcast_in_dim(half, (n, 2, head_dim // 2), [0, 2], hint="angles"), (n, head_dim),
                     hint="angles")
    return b.cosine(full, hint="cos"), b.sine(full, hint="sin")


def apply_rotary(b: Builder, x: Value, cos: Value, sin: Value) -> Value:
    """x*cos + rotate_half(x)*sin on [B, heads, head_dim]; cos/sin are [B, head_dim].
    Computed over [B, heads, 2, head_dim/2] (the halves on an axis of their own), with
    rotate_half(x) = cat(-x2, x1) a select along that axis between the two halves
    broadcast over it: every operand is then read through a broadcast, so the rotation
    fuses into its consumer (a concatenate or a reverse is a dispatch of its own in IREE 3.13)."""
    n, heads, d = x.shape
    halves = (n, heads, 2, d // 2)
    x = b.reshape(x, halves, hint="halves")

    def half(i, hint):
        part = b.reshape(b.slice(x, (0, 0, i, 0), (n, heads, i + 1, d // 2), hint=hint), (n, heads, d // 2), hint=hint)
        return b.broadcast_in_dim(part, halves, [0, 1, 3], hint=hint)

    def table(t, hint):
        return b.broadcast_in_dim(b.reshape(t, (n, 2, d // 2), hint=hint), halves, [0, 2, 3], hint=hint)

    first = b.compare("EQ", b.iota(halves, 2, hint="half"), b.constant(0, halves, "i32"), hint="first_half")
    rotated = b.select(first, b.negate(half(1, "x2"), hint="neg_x2"), half(0, "x1"), hint="rotated")
    x_cos = b.multiply(x, table(cos, "cos"), hint="x_cos")
    roped = b.add(x_cos, b.multiply(rotated, table(sin, "sin"), hint="rotated_sin"), hint="roped")
    return b.reshape(roped, (n, heads, d), hint="roped")


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
        # Written out before fc1: with run-time rows, IREE 3.13's llvm-cpu failed to compile the
        # norm fused through the grouping reshape into fc1's packing ("stack allocations need
        # to be hoisted"). The merger's input is a quarter of a block's; the copy costs little.
        grouped = b.optimization_barrier(b.reshape(normed, grouped_shape, hint="grouped"), hint="grouped")
    fc1 = stages(f"{name}.fc1", linear(b, grouped, w["linear_fc1.weight"], w["linear_fc1.bias"], "fc1"))
    act = stages(f"{name}.act", gelu_erf(b, fc1))
    return linear(b, act, w["linear_fc2.weight"], w["linear_fc2.bias"], "fc2")


# -- the language model's layers ---------------------------------------------------------


def project(b: Builder, x: Value, weight: Value | QuantizedWeight, hint: str = "proj") -> Value:
    """x @ weight.T for a bias-free [out, in] weight (`weight_matmul`; a quantized one:
    `quantized_project`). One
    row [1, in] is computed as weight @ x.T: IREE's data tiling then packs the weight in
    the layout the many-row form packs it in, so a module with both (prefill and decode)
    holds one packed copy; as x @ weight.T it packed a second, transposed one. Decode
    time (2B widths, 2 layers, bf16, medians): the same for the layers' projections, but
    lm_head [vocab, hidden] in this form took about 1.35x its time as x @ weight.T, which
    instead needs a transposed transient at load (1.2 GB at 2B): memory chosen here."""
    if isinstance(weight, QuantizedWeight):
        return quantized_project(b, x, weight, hint)
    if isinstance(weight, BlockWeight):
        return block_project(b, x, weight, hint)
    if x.shape[0] != 1 or x.rank != 2:
        return weight_matmul(b, x, weight, hint)
    column = weight_matmul(b, x, weight, hint, weight_first=True)
    return b.reshape(column, (1, weight.shape[0]), hint=hint)


def block_project(b: Builder, x: Value, weight: BlockWeight, hint: str) -> Value:
    """x @ weight.T, f32 [..., N], through the block kernel of its bits (Q8_0, Q4_0, q4_0's
    6-bit lm_head, or GGUF's Q6_K: emitter/kernel_calls.py `block_matmul`), every row count (decode's lanes and
    prefill's chunks alike): x quantized per row and block of 32 here (`quantized_blocks`)."""
    rows = x.shape[:-1]
    flat = b.reshape(cast(b, x, "f32", hint + "_f32"), (int(np.prod(rows)), x.shape[-1]), hint=hint + "_rows")
    q = b.reshape(weight.q, (weight.q.shape[0] * weight.q.shape[1],), hint=hint + "_tiles")
    scales = b.reshape(weight.scales, (weight.scales.shape[0] * weight.scales.shape[1],), hint=hint + "_tile_scales")
    summed = SUB if is_q6_k(weight.q, weight.scales) else BLOCK  # Q6_K: x's sums per half block
    y = block_matmul(b, *quantized_blocks(b, flat, hint + "_x", summed), q, scales, weight.kernel, hint)
    return y if x.rank == 2 else b.reshape(y, (*rows, weight.shape[0]), hint=hint)


def quantized_blocks(b: Builder, x: Value, hint: str, summed: int = BLOCK) -> tuple[Value, Value, Value]:
    """(xq [M, K] i8, scales [M, K/32] f32, sums [M, K/summed] i32) of f32 x [M, K]:
    `quantize_groups` per row and block of 32 (numpy's: `quant.block_activations`), the codes
    summed per block (or per half block, `summed` 16: a Q6_K weight's, kernels/q8_matmul.py
    `half_sums`)."""
    m, k = x.shape
    xq3, dx = quantize_groups(b, b.reshape(x, (m, k // BLOCK, BLOCK), hint=hint + "_blocks"), hint)
    parts = xq3 if summed == BLOCK else b.reshape(xq3, (m, k // summed, summed), hint=hint + "_halves")
    xs = b.reduce(b.convert(parts, "i32", hint=hint + "_i32"), [2], "add", hint=hint + "_sums")
    return b.reshape(xq3, (m, k), hint=hint + "_i8"), dx, xs


# Rows up to which a quantized projection runs split-K (decode's lanes, prefill's last row);
# more rows (prefill chunks, 16 and up) dequantize into the ordinary matmul.
SPLIT_K_ROWS = 8


def held(b: Builder, weight: QuantizedWeight) -> QuantizedWeight:
    """q, the scales (and any biases) behind one barrier: IREE hoists nothing that reads
    them into module initialization (e.g. a relaid copy of q for a gather of its columns)."""
    return QuantizedWeight(*b.optimization_barriers(weight.parts, hint="packed"))


def per_call_weight(b: Builder, weight: QuantizedWeight) -> QuantizedWeight:
    """The weight for a dequantization made per call: its scales (and any biases) plus this
    call's zero (`Builder.call_zero`), so that nothing of the dequantization depends on
    globals alone; else IREE hoists it into module initialization, resident f32 copies of
    weight size (the dequantized weight; the scales broadcast to the weight's shape).
    Without an argument to give the zero, `held`. Through `held` alone, at 2B widths every
    int8 prefill call grew the process by 64 MiB blocks that IREE 3.13's transient pool
    kept (0.13 GB a 500-token call; docs/history/performance-notebook.md, "Peak RSS of one answer at equal
    bits")."""
    zero = b.call_zero()
    if zero is None:
        return held(b, weight)

    def per_call(v: Value, hint: str) -> Value:
        return b.add(wide_scales(b, v, hint), b.broadcast_in_dim(zero, v.shape, [], hint=hint), hint=hint)

    biases = None if weight.biases is None else per_call(weight.biases, "per_call_biases")
    return QuantizedWeight(weight.q, per_call(weight.scales, "per_call_scales"), biases)


def dequantized(b: Builder, q: Value, scales: Value, hint: str, biases: Value | None = None) -> Value:
    """q * scale (+ bias) of its group, f32 [K, N] (the numbers of `quant.dequantize`,
    transposed), for q [K, N] (i8 or i4, as stored), scales and any biases [N, G]: a weight,
    or columns of the embedding table. A stack (q [E, K, N], scales [E, N, G]: experts),
    each the same: [E, K, N]."""
    *stack, k, n = q.shape
    g = scales.shape[-1]
    s = len(stack)
    dims = [*range(s), s + 2, s]  # scales [.., N, G] along the groups' [.., G, K / G, N]
    wide = b.convert(b.reshape(q, (*stack, g, k // g, n), hint=hint + "_groups"), "f32", hint=hint + "_wide")
    scaled = b.multiply(wide, b.broadcast_in_dim(wide_scales(b, scales, hint), wide.shape, dims,
                                                 hint=hint + "_scales"), hint=hint)
    if biases is not None:
        scaled = b.add(scaled, b.broadcast_in_dim(biases, wide.shape, dims, hint=hint + "_biases"), hint=hint)
    return b.reshape(scaled, (*stack, k, n), hint=hint)


def wide_scales(b: Builder, scales: Value, hint: str) -> Value:
    """A quantized weight's group scales in f32 (stored f32, or bf16: `quant.Layout.scales`)."""
    return cast(b, scales, "f32", hint + "_scales_f32")


def quantized_project(b: Builder, x: Value, weight: QuantizedWeight, hint: str = "proj") -> Value:
    """x @ weight.T for a quantized [N, K] weight (emitter/quant.py: q stored [K, N]), f32 [M, N].

    Up to SPLIT_K_ROWS rows, split-K, so that the dispatch reads q in its bits: x [M, K] as
    [G, M, g]; one dot_general of it (f32) against q as [G, g, N] (i8 or i4, widened inside the
    contraction), batching over the groups G, gives the groups' partial sums [G, M, N];
    each times its group's scale (a symmetric weight's as a division, `group_scaled`; an
    affine weight's as a product, plus its group's bias times the sum of x over the group),
    then summed over G. (Dequantize-then-dot makes IREE 3.13
    write the whole f32 weight each call, and so do a `convert` that a transpose separates
    from the dot and a reduce form in place of the dot_general: docs/text.md, "int8 and
    int4 weights".) More rows: the weight dequantized per call (`dequantized`) into the
    ordinary matmul. Under integer activations (`Builder.activations` "i8", `--precision w8a8`)
    every row count: `integer_project` (at 512 rows too it took half the time of the
    dequantized matmul: docs/history/performance-notebook.md, "Integer activations")."""
    if b.activations == "i8" and x.rank == 2:
        return integer_project(b, x, weight, hint)
    if x.rank != 2 or isinstance(x.shape[0], Dim) or x.shape[0] > SPLIT_K_ROWS:  # run-time rows: many
        w = per_call_weight(b, weight)
        w_t = dequantized(b, w.q, w.scales, hint + "_weight", w.biases)
        return b.dot_general(cast(b, x, "f32", hint + "_f32"), w_t, ([x.rank - 1], [0]), hint=hint,
                             result_dtype="f32")
    (m, k), (n, _), g = x.shape, weight.shape, weight.scales.shape[1]
    x3 = b.transpose(b.reshape(cast(b, x, "f32", hint + "_f32"), (m, g, k // g), hint=hint + "_groups"), [1, 0, 2],
                     hint=hint + "_groups")
    q3 = b.reshape(weight.q, (g, k // g, n), hint=hint + "_q")
    partial = b.dot_general(x3, q3, ([2], [1]), ([0], [0]), hint=hint + "_partial", result_dtype="f32")
    if weight.biases is None:
        return b.reduce(group_scaled(b, partial, weight.scales, hint), [0], "add", hint=hint)
    scales = b.broadcast_in_dim(wide_scales(b, weight.scales, hint), partial.shape, [2, 0], hint=hint + "_scales")
    scaled = b.multiply(partial, scales, hint=hint + "_scaled")
    sums = b.broadcast_in_dim(b.reduce(x3, [2], "add", hint=hint + "_sums"), partial.shape, [0, 1],
                              hint=hint + "_sums")
    offsets = b.multiply(sums, b.broadcast_in_dim(weight.biases, partial.shape, [2, 0], hint=hint + "_biases"),
                         hint=hint + "_offsets")
    return b.reduce(b.add(scaled, offsets, hint=hint + "_affine"), [0], "add", hint=hint)


def group_scaled(b: Builder, partial: Value, scales: Value, hint: str) -> Value:
    """The split-K partial sums [G, M, N] each times its group's scale (scales [N, G]), as
    partial / (1 / scale) (within an ulp of the product). Not as partial * scale: that
    multiply and the sum over G that follows read to IREE 3.13 as a contraction, which
    data tiling then encodes, and at 2-8 rows the encoding of its operand, fused into the
    dispatch of the split-K dot, made that dot vectorize along the rows instead of N: 47 ms in
    place of 1.5 ms for a 6144x2048 int8 projection at 4 rows (docs/history/performance-notebook.md,
    "Quantized decode at several lanes"). The reciprocals depend on globals only: IREE
    hoists them into module initialization, a resident f32 copy the size of the scales
    (1/16 of an int8 weight's bytes, 1/8 of an int4 one's), so a call reads them as it read
    the scales."""
    inverse = b.divide(b.constant(1.0, scales.shape, hint=hint + "_one"), wide_scales(b, scales, hint),
                       hint=hint + "_inverse")
    return b.divide(partial, b.broadcast_in_dim(inverse, partial.shape, [2, 0], hint=hint + "_inverse"),
                    hint=hint + "_scaled")


def quantized_activations(b: Builder, x: Value, group: int, hint: str = "x") -> tuple[Value, Value]:
    """(xq [G, M, g] i8, its scales [G, M] f32) of f32 x [M, K], per row and group of `group`
    inputs: scale = max|x| / 127, xq = round-half-even(x * (127 / max|x|)), with max|x| taken
    as at least 1e-30 (an all-zero group: zeros). `quant.quantize_activations` is the same math."""
    m, k = x.shape
    g = k // group
    x3 = b.transpose(b.reshape(x, (m, g, group), hint=hint + "_groups"), [1, 0, 2], hint=hint + "_groups")
    return quantize_groups(b, x3, hint)


def quantize_groups(b: Builder, x3: Value, hint: str = "x") -> tuple[Value, Value]:
    """(x3 quantized to i8, its scales [A, B] f32) of f32 x3 [A, B, g], per group of the g
    inputs along the last dim (`quantized_activations`' math)."""
    outer = x3.shape[:2]
    amax = b.maximum(b.reduce(b.abs(x3, hint=hint + "_abs"), [2], "maximum", hint=hint + "_amax"),
                     b.constant(quant.ACTIVATION_FLOOR, outer, hint=hint + "_floor"), hint=hint + "_amax")
    levels = b.constant(float(quant.levels(8)), outer, hint=hint + "_levels")
    inverse = b.broadcast_in_dim(b.divide(levels, amax, hint=hint + "_inverse"), x3.shape, [0, 1],
                                 hint=hint + "_inverse")
    xq = b.convert(b.round_even(b.multiply(x3, inverse, hint=hint + "_scaled"), hint=hint + "_rounded"), "i8",
                   hint=hint + "_i8")
    return xq, b.divide(amax, levels, hint=hint + "_scale")


def integer_project(b: Builder, x: Value, weight: QuantizedWeight, hint: str = "proj") -> Value:
    """x @ weight.T, f32 [M, N], in integers: x quantized to i8 per row and weight group
    (`quantized_activations`), an i8 x i8 (or i8 x i4) -> i32 `dot_general` against q as
    [G, g, N] batched over the groups, each group's i32 sums in f32 times its x scale and its
    weight scale, summed over the groups. With one group (`--precision w8a8`: a scale per
    output channel, all K inputs) it is one i8 x i8 -> i32 matmul, which IREE's data tiling
    runs in VNNI (`vpdpwssd`; docs/history/performance-notebook.md, "Integer activations")."""
    (k, n), g = weight.q.shape, weight.scales.shape[1]
    xq, x_scales = quantized_activations(b, cast(b, x, "f32", hint + "_f32"), k // g, hint + "_x")
    q3 = b.reshape(weight.q, (g, k // g, n), hint=hint + "_q")
    sums = b.dot_general(xq, q3, ([2], [1]), ([0], [0]), hint=hint + "_i32", result_dtype="i32")
    partial = b.convert(sums, "f32", hint=hint + "_partial")
    scales = b.multiply(b.broadcast_in_dim(x_scales, partial.shape, [0, 1], hint=hint + "_x_scales"),
                        b.broadcast_in_dim(wide_scales(b, weight.scales, hint), partial.shape, [2, 0],
                                           hint=hint + "_scales"),
                        hint=hint + "_scales")
    return b.reduce(b.multiply(partial, scales, hint=hint + "_scaled"), [0], "add", hint=hint)


def rms_norm(b: Builder, x: Value, weight: Value, eps: float) -> Value:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dim, in f32 (transformers' RMSNorm)."""
    rows, width, keep = x.shape[:-1], x.shape[-1], list(range(x.rank - 1))
    total = b.reduce(square(b, x), [x.rank - 1], "add", hint="sum_sq")
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
