"""A/B timing of graph variants and compiler flags, alternating in one process.

Each variant is (emit function, extra flags). Graph variants are written here as
alternative layer functions patched into the emitter for the emission only, so the
emitter keeps one implementation; a variant that wins moves into emitter/layers.py or attention.py.

    .venv/bin/python benchmarks/lab/ab_variants.py baseline no_data_tiling --preset qwen3-vl-2b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime.bench.vision import alternate, processed_images, ratio_figures, shallower, vision_flops  # noqa: E402
from emitter import attention as forms, layers, vision  # noqa: E402
from emitter.attention import key_ranges  # noqa: E402
from emitter.config import PRESETS, weight_schema  # noqa: E402
from runtime.artifact.compiler import compile_mlir  # noqa: E402
from runtime.inputs.packing import host_inputs  # noqa: E402
from runtime.checkpoints.synthetic import random_vision_weights  # noqa: E402


@contextmanager
def patched(module, name, replacement):
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


def attention_no_transpose(b, x, w, cos, sin, mask, num_heads):
    """Scores and context contract over the head axis in place: no q/k/v transposes."""
    n, hidden = x.shape
    head_dim = hidden // num_heads
    qkv = b.reshape(layers.linear(b, x, w["attn.qkv.weight"], w["attn.qkv.bias"], "qkv"), (n, 3, num_heads, head_dim))

    def part(i, name, rope):
        p = b.reshape(b.slice(qkv, (0, i, 0, 0), (n, i + 1, num_heads, head_dim)), (n, num_heads, head_dim), hint=name)
        return layers.apply_rotary(b, p, cos, sin) if rope else p

    q, k, v = part(0, "q", True), part(1, "k", True), part(2, "v", False)
    scores = b.dot_general(q, k, contract=([2], [2]), batch=([1], [1]), hint="scores")  # [H, B, B]
    scores = b.multiply(scores, b.scalar(head_dim ** -0.5, scores, "scale"), hint="scores")
    scores = b.add(scores, b.broadcast_in_dim(mask, scores.shape, [1, 2]), hint="scores")
    context = b.dot_general(layers.softmax(b, scores), v, contract=([2], [0]), batch=([0], [1]), hint="context")
    context = b.reshape(b.transpose(context, [1, 0, 2]), (n, hidden), hint="context")
    return layers.linear(b, context, w["attn.proj.weight"], w["attn.proj.bias"], "proj")


def attention_core_removed(b, x, w, cos, sin, mask, num_heads):
    """Diagnostic only (wrong output): qkv and proj kept, scores/softmax/context dropped,
    to measure what the attention core costs."""
    n, hidden = x.shape
    qkv = layers.linear(b, x, w["attn.qkv.weight"], w["attn.qkv.bias"], "qkv")
    v = b.slice(qkv, (0, 2 * hidden), (n, 3 * hidden), hint="v")
    return layers.linear(b, v, w["attn.proj.weight"], w["attn.proj.bias"], "proj")


def attention_lean_softmax(b, x, w, cos, sin, mask, num_heads):
    """q scaled before the scores (B*D multiplies, not B*B) and the softmax division
    deferred to the context (B*D divisions, not B*B)."""
    n, hidden = x.shape
    head_dim = hidden // num_heads
    qkv = b.reshape(layers.linear(b, x, w["attn.qkv.weight"], w["attn.qkv.bias"], "qkv"), (n, 3, num_heads, head_dim))

    def head_major(i, name, rope):
        part = b.reshape(b.slice(qkv, (0, i, 0, 0), (n, i + 1, num_heads, head_dim)), (n, num_heads, head_dim), hint=name)
        if rope:
            part = layers.apply_rotary(b, part, cos, sin)
        return b.transpose(part, [1, 0, 2], hint=name)

    q, k, v = head_major(0, "q", True), head_major(1, "k", True), head_major(2, "v", False)
    q = b.multiply(q, b.scalar(head_dim ** -0.5, q, "scale"), hint="q_scaled")
    scores = b.dot_general(q, k, contract=([2], [2]), batch=([0], [0]), hint="scores")
    scores = b.add(scores, b.broadcast_in_dim(mask, scores.shape, [1, 2]), hint="scores")
    last, keep = 2, [0, 1]
    peak = b.broadcast_in_dim(b.reduce(scores, [last], "maximum", hint="peak"), scores.shape, keep, hint="peak")
    e = b.exponential(b.subtract(scores, peak, hint="shifted"), hint="exp")
    denom = b.broadcast_in_dim(b.reduce(e, [last], "add", hint="denom"), (num_heads, n, head_dim), keep, hint="denom")
    context = b.divide(b.dot_general(e, v, contract=([2], [1]), batch=([0], [0]), hint="context"), denom, hint="context")
    context = b.reshape(b.transpose(context, [1, 0, 2]), (n, hidden), hint="context")
    return layers.linear(b, context, w["attn.proj.weight"], w["attn.proj.bias"], "proj")


def gelu_removed(b, x):
    """Diagnostic only (wrong output): what the blocks' tanh GELU costs."""
    return x


def gelu_tanh_via_exp(b, x):
    """tanh(u) = 1 - 2 / (exp(2u) + 1): one exp and one divide instead of IREE's tanh."""
    cube = b.multiply(b.multiply(x, x, hint="x2"), x, hint="x3")
    inner = b.add(x, b.multiply(b.scalar(layers.GELU_TANH_CUBIC, x), cube), hint="inner")
    two_u = b.multiply(b.scalar(2 * layers.SQRT_2_OVER_PI, x), inner)
    # 0.5 x (1 + tanh u) = x - x / (exp(2u) + 1)
    denom = b.add(b.exponential(two_u), b.scalar(1.0, x))
    return b.subtract(x, b.divide(x, denom), hint="gelu")


def softmax_over(b, scores, axis, lanes=None):
    """Softmax over `axis`; with `lanes`, each reduction in two steps over [..., K/lanes,
    lanes] (across vectors first, then the lanes), so that neither is an in-order reduction
    along the contiguous dim."""
    keep = [d for d in range(scores.rank) if d != axis]

    def reduce(x, kind, hint):
        if lanes:  # across the vectors first: [..., K] -> [..., K/lanes, lanes] -> [..., lanes]
            x = b.reduce(b.reshape(x, (*x.shape[:axis], x.shape[axis] // lanes, lanes), hint=hint), [axis], kind,
                         hint=hint)
        return b.broadcast_in_dim(b.reduce(x, [axis], kind, hint=hint), scores.shape, keep, hint=hint)

    e = b.exponential(b.subtract(scores, reduce(scores, "maximum", "peak"), hint="shifted"), hint="exp")
    return b.divide(e, reduce(e, "add", "denom"), hint="probs")


def dense_keys_major(b, q, k, v, mask, operand_dtype):
    """Dense attention with the scores [H, keys, queries]: the softmax reduces over dim 1,
    which IREE vectorizes across queries (its reductions along the contiguous dim are
    scalar, in order)."""
    scores = forms.masked_scores(b, k, q, mask, operand_dtype)  # the segment mask is symmetric
    return layers.matmul(b, softmax_over(b, scores, 1), v, ([1], [1]), ([0], [0]), operand_dtype, hint="context")


def dense_split_softmax(b, q, k, v, mask, operand_dtype):
    """Dense attention whose softmax reduces across 16-float vectors, then within them."""
    scores = forms.masked_scores(b, q, k, mask, operand_dtype)
    return layers.matmul(b, softmax_over(b, scores, 2, lanes=16), v, ([2], [1]), ([0], [0]), operand_dtype,
                         hint="context")


def online_softmax_step_keys_major(b, q, k, v, mask, peak, denom, acc, operand_dtype):
    """`attention.online_softmax_step` with the scores laid out [heads, K, Q] (k q^T): the max
    and the sum reduce over dim 1, across query lanes, not along the contiguous dim."""
    scores = forms.masked_scores(b, k, q, b.transpose(mask, [1, 0]), operand_dtype)
    new_peak = b.maximum(peak, b.reduce(scores, [1], "maximum", hint="chunk_peak"), hint="peak")
    e = b.exponential(b.subtract(scores, b.broadcast_in_dim(new_peak, scores.shape, [0, 2]), hint="shifted"),
                      hint="exp")
    e = layers.cast(b, e, operand_dtype, f"exp_{operand_dtype}")
    summed = b.reduce(layers.cast(b, e, "f32", "exp_f32"), [1], "add", hint="chunk_denom")
    rescale = b.exponential(b.subtract(peak, new_peak, hint="peak_change"), hint="rescale")
    denom = b.add(b.multiply(denom, rescale), summed, hint="denom")
    term = layers.matmul(b, e, v, ([1], [1]), ([0], [0]), operand_dtype, hint="chunk_context")
    acc = b.add(b.multiply(acc, b.broadcast_in_dim(rescale, acc.shape, [0, 1]), hint="acc"), term, hint="acc")
    return [new_peak, denom, acc]


def apply_rotary_halves(b, x, cos, sin):
    """`layers.apply_rotary` as its two halves, cat(x1 c - x2 s, x2 c + x1 s): no negated,
    concatenated copy of x."""
    n, heads, d = x.shape

    def half(v, i, hint):
        return b.slice(v, (0,) * (v.rank - 1) + (i * d // 2,), v.shape[:-1] + ((i + 1) * d // 2,), hint=hint)

    def table(t, i, hint):
        return b.broadcast_in_dim(half(t, i, hint), (n, heads, d // 2), [0, 2], hint=hint)

    x1, x2 = half(x, 0, "x1"), half(x, 1, "x2")
    first = b.subtract(b.multiply(x1, table(cos, 0, "cos")), b.multiply(x2, table(sin, 0, "sin")), hint="roped")
    second = b.add(b.multiply(x2, table(cos, 1, "cos")), b.multiply(x1, table(sin, 1, "sin")), hint="roped")
    return b.concatenate([first, second], 2, hint="roped")


def apply_rotary_broadcast(b, x, cos, sin):
    """`layers.apply_rotary` with no rotated copy: out[.., j, :] = x1 A[j] + x2 B[j] over a new
    halves axis j, A = (cos1, sin2), B = (-sin1, cos2), so every operand is read through a
    broadcast (x1 c - x2 s and x1 s + x2 c, the same products and sums as x c + rot(x) s)."""
    n, heads, d = x.shape
    h = d // 2

    def half(v, i, hint):
        lead = v.shape[:-1]
        return b.reshape(b.slice(v, (0,) * (v.rank - 1) + (i * h,), lead + ((i + 1) * h,), hint=hint),
                         lead + (1, h), hint=hint)

    table_a = b.concatenate([half(cos, 0, "cos1"), half(sin, 1, "sin2")], 1, hint="rot_a")
    table_b = b.concatenate([b.negate(half(sin, 0, "sin1"), hint="neg_sin1"), half(cos, 1, "cos2")], 1, hint="rot_b")
    shape = (n, heads, 2, h)

    def spread(v, dims, hint):
        return b.broadcast_in_dim(v, shape, dims, hint=hint)

    x1 = spread(b.reshape(half(x, 0, "x1"), (n, heads, h)), [0, 1, 3], "x1")
    x2 = spread(b.reshape(half(x, 1, "x2"), (n, heads, h)), [0, 1, 3], "x2")
    out = b.add(b.multiply(x1, spread(table_a, [0, 2, 3], "rot_a")),
                b.multiply(x2, spread(table_b, [0, 2, 3], "rot_b")), hint="roped")
    return b.reshape(out, x.shape, hint="roped")


def apply_rotary_concat(b, x, cos, sin):
    """The earlier `layers.apply_rotary`: rotate_half as a concatenate of -x2 and x1."""
    n, heads, d = x.shape
    first = b.slice(x, (0, 0, 0), (n, heads, d // 2), hint="x1")
    second = b.slice(x, (0, 0, d // 2), (n, heads, d), hint="x2")
    rotated = b.concatenate([b.negate(second, hint="neg_x2"), first], 2, hint="rotated")
    cos = b.broadcast_in_dim(cos, x.shape, [0, 2], hint="cos")
    sin = b.broadcast_in_dim(sin, x.shape, [0, 2], hint="sin")
    return b.add(b.multiply(x, cos, hint="x_cos"), b.multiply(rotated, sin, hint="rotated_sin"), hint="roped")


def square_as_product(b, x):
    """The earlier square, x * x: a sum over it is a contraction to IREE 3.13, lowered to one
    scalar FMA per element (`layers.square` writes it |x| * |x|)."""
    return b.multiply(x, x, hint="square")


def behind_barrier(layer):
    """`layer` with its output behind an optimization barrier."""
    return lambda b, *args: b.optimization_barrier(layer(b, *args))


# The block's attention and MLP outputs behind a barrier before their residual adds: IREE then
# cannot make the residual the accumulator of the proj and fc2 matmuls (which packs it into
# the tiled layout first), and the add is a dispatch of its own.
RESIDUAL_APART = ((vision, "attention", behind_barrier(vision.attention)), (vision, "mlp", behind_barrier(vision.mlp)))


def blockwise_256(b, segment_ids, form):
    """The blockwise form with 256-row chunks at any bucket: at 512 with two 256-patch images
    it skips the cross-image blocks the dense form computes."""
    return key_ranges(b, segment_ids, 256)


def dense_form(b, segment_ids, form):
    """The dense form at any bucket (the [B, B] segment mask)."""
    return forms.segment_mask(b, segment_ids)


DENSE = (vision, "attention_inputs", dense_form)
VARIANTS = {  # name -> (graph patches, extra flags[, weight binding]); binding default: parameters
    "baseline": ((), []),
    "arguments": ((), [], "arguments"),
    "no_data_tiling": ((), ["--iree-opt-data-tiling=false"]),
    "ukernels": ((), ["--iree-llvmcpu-enable-ukernels=all"]),
    "mmt4d": ((), ["--iree-llvmcpu-enable-ukernels=mmt4d"]),
    "O3": ((), ["--iree-opt-level=O3"]),
    "no_transpose_attention": (((vision, "attention", attention_no_transpose), DENSE), []),
    "lean_softmax": (((vision, "attention", attention_lean_softmax), DENSE), []),
    "diag_no_gelu": (((layers, "gelu_tanh", gelu_removed),), []),
    "gelu_via_exp": (((layers, "gelu_tanh", gelu_tanh_via_exp),), []),
    "diag_no_attention_core": (((vision, "attention", attention_core_removed),), []),
    "dense": ((DENSE,), []),
    "blockwise_256": (((vision, "attention_inputs", blockwise_256),), []),
    "softmax_keys_major": ((DENSE, (forms, "dense_attention", dense_keys_major)), []),
    "softmax_split_lanes": ((DENSE, (forms, "dense_attention", dense_split_softmax)), []),
    "residual_apart": (RESIDUAL_APART, []),
    "rotary_halves": (((forms, "apply_rotary", apply_rotary_halves),), []),
    "rotary_broadcast": (((forms, "apply_rotary", apply_rotary_broadcast),), []),
    "rotary_concat": (((forms, "apply_rotary", apply_rotary_concat),), []),
    "square_as_product": (((layers, "square", square_as_product),), []),
    "blockwise_keys_major": (((forms, "online_softmax_step", online_softmax_step_keys_major),), []),
}


def variant_name(text: str) -> str:
    """An argparse type: a name from VARIANTS, or `flags:--a,--b`."""
    if text in VARIANTS or text.startswith("flags:"):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(VARIANTS)}, or flags:--a,--b")


def variant(name):
    """A named variant, or `flags:--a,--b` for the baseline graph with extra flags."""
    if name.startswith("flags:"):
        return (), name[len("flags:"):].split(",")
    return VARIANTS[name][:2]


def binding(name) -> str:
    spec = VARIANTS.get(name, ())
    return spec[2] if len(spec) > 2 else "parameters"


def emit(cfg, bucket, name, precision):
    with ExitStack() as stack:
        for patch in variant(name)[0]:
            stack.enter_context(patched(*patch))
        return vision.emit_vision_module(cfg, bucket, precision=precision, weights=binding(name))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", type=variant_name, help=f"{', '.join(VARIANTS)}, or flags:--flag1,--flag2")
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--bucket", type=int, default=512)
    p.add_argument("--images", default="256x256,256x256")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--depth", type=int, help="only the first N blocks (same kernels, less memory and time)")
    args = p.parse_args(argv)

    import iree.runtime as rt
    from runtime.checkpoints.vision import weights_in_order
    from runtime.artifact.iree_module import LoadedModule, device_config, parameters_module
    from runtime.vision import set_thread_count
    from emitter.vision import graph_weights

    cfg = shallower(PRESETS[args.preset], args.depth)
    pixels, grid_thw = processed_images([tuple(int(v) for v in s.split("x")) for s in args.images.split(",")])
    grids = [tuple(int(v) for v in g) for g in grid_thw]
    weights = random_vision_weights(cfg, seed=0)
    set_thread_count(args.threads)
    config = device_config("llvm-cpu")  # as a session makes it: glibc keeps freed transients
    ordered = weights_in_order({n: weights[n].reshape(s) for n, s in weight_schema(cfg)}, cfg, args.precision)
    params = parameters_module(config, [(w.name, a) for w, a in zip(graph_weights(cfg, args.precision), ordered)])
    device_weights = [rt.asdevicearray(config.device, a) for a in ordered] \
        if any(binding(name) == "arguments" for name in args.variants) else []
    inputs = [rt.asdevicearray(config.device, x) for x in host_inputs(pixels, grids, cfg, args.bucket)]
    programs, outputs = {}, {}
    for name in args.variants:
        start = time.perf_counter()
        arguments = binding(name) == "arguments"
        module = LoadedModule(compile_mlir(emit(cfg, args.bucket, name, args.precision), extra_flags=variant(name)[1]),
                              config=config, modules=[] if arguments else [params])
        print(f"{name}: compiled and loaded in {time.perf_counter() - start:.1f} s", flush=True)
        programs[name] = lambda m=module, a=arguments: m(*inputs, *(device_weights if a else []))[0]
        outputs[name] = programs[name]()
    load = os.getloadavg()[0]
    times = alternate(programs, 1, args.repeats)
    flops = vision_flops(cfg, grids)
    base, first = args.variants[0], outputs[args.variants[0]]
    print(f"{args.preset} (depth {cfg.depth}), bucket {args.bucket}, {args.precision}, {args.threads} threads, "
          f"random order per round, 1 warm-up + {args.repeats} rounds, load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for name in args.variants:
        r = ratio_figures(times, base, name)
        m = statistics.median(times[name])
        diff = float(np.linalg.norm(outputs[name] - first) / np.linalg.norm(first))
        print(f"{name:<40} {m:7.3f} s (min {min(times[name]):.3f}, max {max(times[name]):.3f})  "
              f"{flops / m / 1e9:5.0f} GFLOP/s  x{r['ratio']:5.2f} vs {base} (rounds {r['min']:.2f}-{r['max']:.2f})"
              f"  rel diff {diff:.1e}")


if __name__ == "__main__":
    main()
