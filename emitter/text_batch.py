"""The language model for serving several sequences at once (continuous batching): one
module whose KV cache has `rows` rows, one per sequence, over the same weights as
emitter/text.py's module (same archive, scope `model`).

prefill_<S> and prefill_<C>_<L>: emitter/text.py's arguments and `row` [] i32
  -> logits [1, vocab] of token `last`; the chunk's K/V written into cache row `row` (a
  first chunk at slots 0..S-1, a later one at start..start+C-1, attending over the row).
decode_batch_<B> for B in 1, 2, 4, ... below R, and R (`lane_counts`), and
decode_batch_<B>_<L> for each shorter attention span L (emitter/text.py's decode_<L>):
  tokens [B] i32, positions [3, B] i32, slots [B] i32, rows [B] i32 (lane i: a sequence in
  cache row rows[i]; its token's text position = its cache slot; rows distinct, or a lane
  repeating another's inputs whole)
  -> logits [B, vocab] f32; each lane's K/V written to its row at its slot, its attention
  over that row's slots 0..slot (read from the row's first L slots, every slot <= L). The
  runtime calls the smallest B that holds the running sequences and the shortest L that
  holds the longest; a spare lane repeats lane 0 (the same K/V written twice), so no row
  that is not running is touched.
copy_prompt_<L> for each span L: source [] i32, target [] i32 -> done [] i32; slots
  0..L-1 of every layer's cache row `source` copied into row `target` (a prompt already
  prefilled, shared with a new sequence: the prompt cache, runtime/serve/scheduler.py).
reset: see `reset_function`.

Every weight matmul (projections, MLP, lm_head) runs once for all B lanes, so a step reads
the weights once; attention is per lane, over its own row.
"""

from __future__ import annotations

from .attention import grouped_attention
from .builder import Value
from .module import function
from .text import (TextGraph, attention_spans, cache_slots, check_text_shapes, chunk_spans, prefill_function,
                   render_text_module, span_mask)
from .text_config import TextConfig

DECODE_BATCH = "decode_batch"
RESET = "reset"
COPY_PROMPT = "copy_prompt"


def decode_batch_inputs(lanes: int) -> list[tuple[str, tuple, str]]:
    return [("tokens", (lanes,), "i32"), ("positions", (3, lanes), "i32"), ("slots", (lanes,), "i32"),
            ("rows", (lanes,), "i32")]


def decode_name(lanes: int, span: int, context: int) -> str:
    return f"{DECODE_BATCH}_{lanes}" + (f"_{span}" if span != context else "")


def copy_name(bucket: int) -> str:
    return f"{COPY_PROMPT}_{bucket}"


def lane_counts(rows: int) -> list[int]:
    """The decode entries a module of `rows` rows has: 1, 2, 4, ... below `rows`, and `rows`."""
    counts = [1 << i for i in range(rows.bit_length()) if 1 << i < rows]
    return counts + [rows]


def check_rows(rows) -> int:
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"--max-batch {rows!r}: expected a positive number of sequences")
    return rows


def decode_batch_function(cfg: TextConfig, context: int, rows: int, lanes: int, precision: str = "f32",
                          span: int | None = None, kv_dtype: str = "f32") -> tuple[dict, list]:
    """decode_batch_<lanes>[_<span>] over a cache of `rows` rows: lane i reads and writes
    row `rows[i]`, attending over its first `span` slots (default: all)."""
    span = span or context
    g = TextGraph(cfg, context, precision, rows, kv_dtype)
    b = g.b
    inputs = {name: g.argument(name, shape, dtype) for name, shape, dtype in decode_batch_inputs(lanes)}
    with b.stage("embed"):
        x = g.embed(inputs["tokens"])

    def scalar(name: str, i: int) -> Value:
        return b.reshape(b.slice(inputs[name], (i,), (i + 1,)), (), hint=name[:-1])

    slots = [scalar("slots", i) for i in range(lanes)]
    cache_rows = [scalar("rows", i) for i in range(lanes)]

    def masks() -> list[Value]:  # per lane: its row's slots before its slot, then its own new token
        return [span_mask(b, slot, span) for slot in slots]

    def lane(value: Value, i: int, axis: int) -> Value:
        start, limit = [0] * len(value.shape), list(value.shape)
        start[axis], limit[axis] = i, i + 1
        return b.slice(value, tuple(start), tuple(limit), hint="lane")

    def row(cache: Value, i: int) -> Value:
        return g.read(g.prefix(cache, span, cache_rows[i]))

    def attend(n, q, k, v, lane_masks):
        # As emitter/text.py's decode: attention reads the cache as loaded plus the new K/V,
        # and the update is ordered after it (one barrier).
        loaded = [b.load_state(state) for state in g.cache[n]]
        own_k, own_v = g.attended(k, v)
        contexts = [grouped_attention(b, lane(q, i, 0), [row(loaded[0], i), lane(own_k, i, 1)],
                                      [row(loaded[1], i), lane(own_v, i, 1)], lane_masks[i]) for i in range(lanes)]
        context = contexts[0] if lanes == 1 else b.concatenate(contexts, 0, hint="context")
        *loaded, context = b.optimization_barriers([*loaded, context], hint="attended")
        for state, cache, value in zip(g.cache[n], loaded, (k, v)):
            value = g.stored(value)
            for i in range(lanes):
                update = b.reshape(lane(value, i, 1), (1, value.shape[0], 1, value.shape[2]), hint="update")
                cache = b.dynamic_update_slice(cache, update, [cache_rows[i], g.zero, slots[i], g.zero],
                                               hint="cache")
            b.store_state(cache, state)
        return context

    x = g.decoder(x, inputs["positions"], masks, attend)
    return g.function(decode_name(lanes, span, context), g.logits(x)), b.globals


def copy_prompt_function(cfg: TextConfig, bucket: int, context: int, rows: int,
                         precision: str = "f32", kv_dtype: str = "f32") -> tuple[dict, list]:
    """copy_prompt_<bucket>: the first `bucket` slots of cache row `source` into row `target`."""
    g = TextGraph(cfg, context, precision, rows, kv_dtype)
    b = g.b
    source, target = g.argument("source", (), "i32"), g.argument("target", (), "i32")
    zero = b.constant(0, (), "i32", hint="zero")
    for state in (state for pair in g.cache for state in pair):
        cache = b.load_state(state)
        prompt = b.dynamic_slice(cache, [source, zero, zero, zero], (1, cache.shape[1], bucket, cache.shape[3]),
                                 hint="prompt")
        b.store_state(b.dynamic_update_slice(cache, prompt, [target, zero, zero, zero], hint="cache"), state)
    return function(b, copy_name(bucket), [("done", b.constant(0, (), "i32", hint="done"))]), b.globals


def reset_function(cfg: TextConfig, context: int, rows: int, precision: str = "f32",
                   kv_dtype: str = "f32") -> tuple[dict, list]:
    """`reset(fill [2 x layers] f32)`: each KV-cache global stored whole, global j with
    `fill[j]` (zeros from the caller). Called once after loading. Until then every cache
    global holds IREE's one shared zero buffer, and slot-wise updates of it write through
    to all of them (IREE 3.13; emitter/text.py's prefill stores each layer's own whole
    cache first, so its decode never sees this). One argument per global: values that
    are equal would be merged into one buffer again."""
    g = TextGraph(cfg, context, precision, rows, kv_dtype)
    b = g.b
    states = [state for pair in g.cache for state in pair]
    fill = g.argument("fill", (len(states),), "f32")
    for j, state in enumerate(states):
        value = g.stored(b.reshape(b.slice(fill, (j,), (j + 1,)), (), hint="fill"))
        b.store_state(b.broadcast_in_dim(value, state[1].shape, [], hint="empty"), state)
    return function(b, RESET, [("done", b.constant(0, (), "i32", hint="done"))]), b.globals


def emit_batch_module(cfg: TextConfig, buckets, context: int, rows: int, deepstack_layers: int,
                      precision: str = "f32", kv_dtype: str = "f32") -> str:
    """MLIR text of the batched module: `prefill_<S>` into a row for each bucket S and
    `prefill_<C>_<L>` for each chunk span L (emitter/text.py), `copy_prompt_<L>` and
    `decode_batch_<B>[_<L>]` for each lane count B and span L, and `reset`, over a cache of
    `cache_slots` slots a row, in `kv_dtype` (deterministic: same input, same bytes)."""
    buckets, context = check_text_shapes(buckets, context)
    rows = check_rows(rows)
    slots = cache_slots(context, buckets)
    kv = dict(precision=precision, kv_dtype=kv_dtype)
    entries = [prefill_function(cfg, s, slots, deepstack_layers, rows=rows, **kv) for s in buckets] + \
        [prefill_function(cfg, buckets[-1], slots, deepstack_layers, rows=rows, span=span, **kv)
         for span in chunk_spans(buckets, slots)] + \
        [decode_batch_function(cfg, slots, rows, n, span=span, **kv) for span in attention_spans(slots)
         for n in lane_counts(rows)] + \
        [copy_prompt_function(cfg, span, slots, rows, **kv) for span in attention_spans(slots)] + \
        [reset_function(cfg, slots, rows, **kv)]
    return render_text_module(cfg, f"Qwen3-VL language model, batched: {rows} KV-cache rows", entries, buckets,
                              context, deepstack_layers, precision, kv_dtype)
