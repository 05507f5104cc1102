"""The mixture-of-experts MLP of a qwen3_vl_moe decoder layer (transformers'
Qwen3VLMoeTextSparseMoeBlock), and the one place that knows how its expert weights are
stored.

    probs = softmax(x @ router.T)                   f32, over all E experts
    ids, top = the k largest probs                  (k = num_experts_per_tok)
    y = sum_r top[r] / sum(top) * down_e(silu(gate_e(x)) * up_e(x)),  e = ids[r]

Weights, by their names in a layer (transformers 5's own layout, [E, out, in]):
  mlp.gate.weight              [E, hidden]        the router
  mlp.experts.gate_up_proj     [E, 2 x I, hidden] gate rows first, then up
  mlp.experts.down_proj        [E, hidden, I]
Released files store the two expert tensors the other way round ([E, in, out]);
`orientation` tells the two apart by shape, and refuses a shape that fits both or neither.
mlx-vlm's checkpoints store them per projection (`switch_mlp`, [E, out, in] each, float or
affine-quantized: `switch_parts`), gate_proj and up_proj making gate_up_proj.

Float experts (f32, bf16) have two graph forms of the same sum (`moe_mlp`): decode gathers
each lane's chosen experts' weights and reads only those; a prompt chunk runs every expert
over every row and weights the unchosen by an exact zero. Q8_0 and Q4_0 experts (packed
stacks, quant.Layout) go through the block kernel's expert entry, the rows grouped by
expert (`_grouped`). MLX affine-quantized stacks run in their bits (q [E, in, out] i8 / i4,
scales and biases [E, out, in / group]) in the float forms, dequantized in the graph: decode
only the chosen experts' (gathered first), a chunk every expert's per call. Either way a
row's answer depends on that row alone.
"""

from __future__ import annotations

from . import kernel_calls
from .builder import Builder, Value
from .config import ConfigError
from .layers import (activation_dtype, cast, dequantized, held, per_call_weight, project, quantized_blocks, silu,
                     softmax)
from .quant import BlockWeight, QuantizedWeight

ROUTER = "mlp.gate.weight"
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
EXPERT_WEIGHTS = (GATE_UP, DOWN)
# mlx-vlm's layout (its sanitize, `switch_mlp`): one [E, out, in] stack per projection,
# quantized as such; the graph's gate_up_proj is the gate_proj stack's rows, then up_proj's.
SWITCH_PARTS = {GATE_UP: ("mlp.switch_mlp.gate_proj.weight", "mlp.switch_mlp.up_proj.weight"),
                DOWN: ("mlp.switch_mlp.down_proj.weight",)}


def sparse_shapes(cfg, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a sparse layer's MLP weights (`prefix`: the layer's), in checkpoint
    order, the experts as the graph takes them ([E, out, in])."""
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return [(prefix + ROUTER, (e, d)), (prefix + GATE_UP, (e, 2 * i, d)), (prefix + DOWN, (e, d, i))]


def is_expert(name: str) -> bool:
    """A stacked expert tensor ([E, out, in]) of some layer."""
    return name.endswith(EXPERT_WEIGHTS)


def switch_parts(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the stacks mlx-vlm's switch_mlp stores the expert tensor `name` (of
    the graph's `shape`, [E, out, in]; any prefix kept) as, in their order along out: gate_proj
    then up_proj for gate_up_proj, down_proj for down_proj. Each [E, out / parts, in]."""
    suffix = next(s for s in EXPERT_WEIGHTS if name.endswith(s))
    parts = SWITCH_PARTS[suffix]
    e, out, n_in = shape
    return [(name[: -len(suffix)] + part, (e, out // len(parts), n_in)) for part in parts]


def orientation(name: str, stored: tuple[int, ...], shape: tuple[int, ...], where: str = "") -> bool:
    """Whether an expert tensor stored as `stored` is the transpose of the graph's `shape`
    ([E, out, in]): False when stored as is (transformers 5's save), True when [E, in, out]
    (the released files). ConfigError naming the tensor for a shape that fits neither, or
    both (out == in: the layout cannot be told)."""
    stored, shape = tuple(stored), tuple(shape)
    flipped = (shape[0], shape[2], shape[1])
    fits = [layout for layout, s in (("[E, out, in]", shape), ("[E, in, out]", flipped)) if stored == s]
    suffix = f" (in {where})" if where else ""
    if len(fits) == 2:
        raise ConfigError(f"{name}: stored shape {list(stored)} is both [E, out, in] and [E, in, out] "
                          f"(out = in = {shape[1]}): the expert layout cannot be told{suffix}")
    if not fits:
        raise ConfigError(f"{name}: stored shape {list(stored)}: expected {list(shape)} ([E, out, in]) or "
                          f"{list(flipped)} ([E, in, out]), from the config's num_experts, hidden_size and "
                          f"moe_intermediate_size{suffix}")
    return fits[0] == "[E, in, out]"


def route(b: Builder, x: Value, router: Value, k: int) -> tuple[Value, Value]:
    """(ids [T, k] i32, weights [T, k] f32) of rows x [T, D]: the k most probable experts in
    order (a tie to the lower index, as torch.topk), their probabilities renormalized to sum
    to 1. The rank of each expert is how many others beat it, so no sort is needed."""
    probs = softmax(b, project(b, x, router, "router"))
    t, e = probs.shape
    cube = (t, e, e)
    mine, other = (b.broadcast_in_dim(probs, cube, dims, hint="router_p") for dims in ([0, 1], [0, 2]))
    me, them = (b.iota(cube, axis, hint="expert") for axis in (1, 2))
    beats = b.bit_or(b.compare("GT", other, mine, hint="beats"),
                     b.bit_and(b.compare("EQ", other, mine), b.compare("LT", them, me), hint="tie"), hint="beats")
    one, zero = b.constant(1, cube, "i32"), b.constant(0, cube, "i32")
    rank = b.reduce(b.select(beats, one, zero, hint="beats"), [2], hint="rank")  # [T, E]
    slots = (t, k, e)
    chosen = b.compare("EQ", b.broadcast_in_dim(rank, slots, [0, 2], hint="rank"), b.iota(slots, 1, hint="slot"),
                       hint="chosen")
    ids = b.reduce(b.select(chosen, b.iota(slots, 2, hint="expert"), b.constant(0, slots, "i32")), [2], hint="ids")
    top = b.reduce(b.select(chosen, b.broadcast_in_dim(probs, slots, [0, 2]), b.constant(0.0, slots)), [2],
                   hint="top")
    total = b.broadcast_in_dim(b.reduce(top, [1], hint="top_sum"), (t, k), [0], hint="top_sum")
    return ids, b.divide(top, total, hint="route_weights")


def moe_mlp(b: Builder, x: Value, w: dict, cfg, gathered: bool) -> Value:
    """A sparse layer's MLP of rows x [T, D] (`w`: the layer's weights by their names here):
    `gathered` (decode: each lane's chosen experts read alone; the same form at every lane
    count, so a lane's bits do not depend on its neighbours), else every expert over every
    row (a prompt chunk). Affine-quantized stacks (an MLX checkpoint in its bits,
    `quant.QuantizedWeight` [E, ...]) take the same two forms over weights dequantized in
    the graph: decode the chosen experts' q, scales and biases gathered and only those
    dequantized (`_chosen`); a chunk every expert's, dequantized per call (`_every`)."""
    ids, weights = route(b, x, w[ROUTER], cfg.num_experts_per_tok)
    if isinstance(w[GATE_UP], BlockWeight):
        return _grouped(b, x, ids, weights, w, cfg.moe_intermediate_size)
    if gathered:
        t, k = ids.shape
        flat = b.reshape(ids, (t * k,), hint="ids")
        stacks = {name: _chosen(b, w[name], flat, (t, k)) for name in EXPERT_WEIGHTS}
        return _gathered(b, x, weights, stacks, cfg.moe_intermediate_size)
    return _every_expert(b, x, ids, weights, {name: _every(b, w[name]) for name in EXPERT_WEIGHTS},
                         cfg.moe_intermediate_size)


def _chosen(b: Builder, stack, flat: Value, lanes: tuple[int, int]) -> tuple[Value, int]:
    """(the chosen experts' weights [T, k, ...], the axis of their inputs) of a stack, for
    each (row, slot)'s expert in `flat` [T * k]: gathered along E as stored ([.., out, in]);
    a quantized stack's q, scales and biases gathered (behind a barrier: `held`, so that IREE
    keeps no relaid copy of the globals) and those alone dequantized, [.., in, out]."""
    if isinstance(stack, QuantizedWeight):
        parts = [b.gather_slices(v, 0, flat, hint="experts_" + part)
                 for v, part in zip(held(b, stack).parts, ("q", "scales", "biases"))]
        picked, axis = dequantized(b, parts[0], parts[1], "experts", *parts[2:]), -2
    else:
        picked, axis = b.gather_slices(stack, 0, flat, hint="experts"), -1
    return b.reshape(picked, (*lanes, *picked.shape[1:]), hint="experts"), axis


def _every(b: Builder, stack) -> tuple[Value, int]:
    """(every expert's weights [E, ...], the axis of their inputs): a float stack as stored
    ([E, out, in]); a quantized one dequantized per call ([E, in, out]; `per_call_weight`,
    so that IREE keeps no resident f32 copy of the experts)."""
    if isinstance(stack, QuantizedWeight):
        w = per_call_weight(b, stack)
        return dequantized(b, w.q, w.scales, "experts", w.biases), -2
    return stack, -1


def _gated(b: Builder, h: Value, i: int) -> Value:
    """silu(gate) * up of the experts' [.., 2 x I] outputs (gate first)."""
    last = h.rank - 1
    start, mid, end = [0] * h.rank, list(h.shape), list(h.shape)
    mid[last] = i
    up_start = list(start)
    up_start[last] = i
    gate, up = b.slice(h, start, mid, hint="gate"), b.slice(h, up_start, end, hint="up")
    return b.multiply(silu(b, gate), up, hint="gated")


def _gathered(b: Builder, x: Value, weights: Value, stacks: dict, i: int) -> Value:
    """Each (row, slot)'s expert read on its own: the k chosen experts' weights of each row
    (`stacks`: each name's [T, k, ...] and the axis of its inputs, `_chosen`)."""
    (gate_up, gate_up_in), (down, down_in) = stacks[GATE_UP], stacks[DOWN]
    dtype = activation_dtype(b, gate_up)
    h = b.dot_general(cast(b, x, dtype), gate_up, contract=([1], [4 + gate_up_in]), batch=([0], [0]),
                      hint="gate_up", result_dtype="f32")  # [T, k, 2I]
    out = b.dot_general(cast(b, _gated(b, h, i), dtype), down, contract=([2], [4 + down_in]),
                        batch=([0, 1], [0, 1]), hint="down", result_dtype="f32")  # [T, k, D]
    return b.dot_general(weights, out, contract=([1], [1]), batch=([0], [0]), hint="experts_sum",
                         result_dtype="f32")


def _every_expert(b: Builder, x: Value, ids: Value, weights: Value, stacks: dict, i: int) -> Value:
    """Every expert over every row, each row's unchosen experts weighted by an exact zero
    (`stacks`: each name's [E, ...] and the axis of its inputs, `_every`)."""
    t, k = ids.shape
    (gate_up, gate_up_in), (down, down_in) = stacks[GATE_UP], stacks[DOWN]
    e = gate_up.shape[0]
    dtype = activation_dtype(b, gate_up)
    h = b.dot_general(cast(b, x, dtype), gate_up, contract=([1], [3 + gate_up_in]), hint="gate_up",
                      result_dtype="f32")  # [T, E, 2I]
    out = b.dot_general(cast(b, _gated(b, h, i), dtype), down, contract=([2], [3 + down_in]), batch=([1], [0]),
                        hint="down", result_dtype="f32")  # [E, T, D]
    slots = (t, k, e)
    chosen = b.compare("EQ", b.broadcast_in_dim(ids, slots, [0, 1], hint="ids"), b.iota(slots, 2, hint="expert"),
                       hint="chosen")
    spread = b.reduce(b.select(chosen, b.broadcast_in_dim(weights, slots, [0, 1]), b.constant(0.0, slots)), [1],
                      hint="route_weights")  # [T, E]
    return b.dot_general(spread, out, contract=([1], [0]), batch=([0], [1]), hint="experts_sum", result_dtype="f32")


def _grouped(b: Builder, x: Value, ids: Value, weights: Value, w: dict, i: int) -> Value:
    """q8_0 / q4_0 experts through the block kernel's expert entry (ggml's mul_mat_id): the
    (row, slot) pairs sorted by expert (stable: a pair's place is the pairs of lower experts
    plus the earlier pairs of its own), each expert's rows contracted against its weights,
    read once a call; the outputs taken back to pair order and summed by the route weights.
    The same form at every row count; a pair's outputs are its row's alone."""
    t, k = ids.shape
    p = t * k
    flat = b.reshape(ids, (p,), hint="ids")
    square = (p, p)
    mine, other = (b.broadcast_in_dim(flat, square, [dim], hint="pair_expert") for dim in (0, 1))
    me, them = (b.iota(square, dim, hint="pair") for dim in (0, 1))
    before = b.bit_or(b.compare("LT", other, mine), b.bit_and(b.compare("EQ", other, mine), b.compare("LT", them, me)),
                      hint="before")
    one, zero = b.constant(1, square, "i32"), b.constant(0, square, "i32")
    place = b.reduce(b.select(before, one, zero), [1], hint="place")  # [P]: pair p's row in expert order
    # the token of each sorted row: pair p = token * k + slot sits at row place[p]
    at = b.compare("EQ", b.broadcast_in_dim(place, square, [1], hint="place"), b.iota(square, 0, hint="row"))
    token = b.divide(b.iota(square, 1, hint="pair"), b.constant(k, square, "i32"), hint="token")
    rows = b.reduce(b.select(at, token, zero), [1], hint="sorted_tokens")
    gate_up, down = w[GATE_UP], w[DOWN]
    e = gate_up.q.shape[0]
    edges = (e + 1, p)
    offsets = b.reduce(b.select(b.compare("LT", b.broadcast_in_dim(flat, edges, [1], hint="ids"),
                                          b.iota(edges, 0, hint="expert")),
                                b.constant(1, edges, "i32"), b.constant(0, edges, "i32")), [1], hint="offsets")
    chosen = _experts_with_rows(b, offsets, kernel_calls.chosen_count(p, e))

    def contract(v: Value, weight: BlockWeight, hint: str) -> Value:
        return kernel_calls.expert_matmul(b, *quantized_blocks(b, v, hint + "_x"), offsets, chosen, weight.q,
                                          weight.scales, weight.kernel, hint)

    sorted_x = b.gather_rows(x, rows, hint="sorted_rows")
    out = contract(_gated(b, contract(sorted_x, gate_up, "gate_up"), i), down, "down")  # [P, D], expert order
    pairs = b.reshape(b.gather_rows(out, place, hint="pair_rows"), (t, k, out.shape[1]), hint="pair_rows")
    return b.dot_general(weights, pairs, contract=([1], [1]), batch=([0], [0]), hint="experts_sum",
                         result_dtype="f32")


def _experts_with_rows(b: Builder, offsets: Value, g: int) -> Value:
    """[G] i32: the experts with rows (offsets [E + 1] as `_grouped` makes them), in order,
    then -1s: the kernel starts workgroups for these alone (a decode step's k of E)."""
    e = offsets.shape[0] - 1
    present = b.compare("GT", b.slice(offsets, [1], [e + 1]), b.slice(offsets, [0], [e]), hint="present")  # [E]
    square = (e, e)
    earlier = b.bit_and(b.broadcast_in_dim(present, square, [1], hint="present"),
                        b.compare("LT", b.iota(square, 1), b.iota(square, 0)), hint="earlier")
    rank = b.reduce(b.select(earlier, b.constant(1, square, "i32"), b.constant(0, square, "i32")), [1],
                    hint="chosen_rank")  # [E]: chosen experts before e
    slots = (g, e)
    at = b.bit_and(b.broadcast_in_dim(present, slots, [1], hint="present"),
                   b.compare("EQ", b.broadcast_in_dim(rank, slots, [1], hint="chosen_rank"), b.iota(slots, 0)),
                   hint="chosen_at")
    named = b.reduce(b.select(at, b.add(b.iota(slots, 1), b.constant(1, slots, "i32")), b.constant(0, slots, "i32")),
                     [1], hint="chosen")
    return b.subtract(named, b.constant(1, (g,), "i32"), hint="chosen")


def check_precision(cfg, precision) -> None:
    """Experts run in f32, bf16, or through the block kernel (q8_0, q4_0); the other
    quantized precisions have no expert form."""
    if cfg.moe and precision.bits and not precision.kernel:
        raise ConfigError(f"--precision {precision}: the mixture-of-experts language model runs in f32, bf16, "
                          "q8_0 or q4_0")
