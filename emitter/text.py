"""The Qwen3-VL language model as one module: `prefill_<S>` per prompt bucket S, the later
chunks of a long prompt (`prefill_<C>_<L>`) and `decode`, over the same weight globals (a
parameter archive, scope `model`, keys the checkpoint names) and the same KV cache, mutable
globals that stay on the device between calls (`[kv_heads, slots, head_dim]` per layer, K
and V; `cache_slots`: the context rounded up to a whole chunk).

A prompt of n tokens runs as chunks (`prefill_chunks`): one `prefill_<S>` when it fits the
largest bucket C, else chunks of C tokens, the first a `prefill_<C>` and each later one a
`prefill_<C>_<L>` at its start slot, attending over the cache the earlier chunks wrote.

prefill_<S> (a prompt's first chunk, padded to S tokens; S <= slots):
  tokens        [S] i32        token ids (image pads included)
  visual        [S] i32        1 at the image-pad positions, else 0
  visual_embeds [S, D] f32     the image embeddings at those rows (zeros elsewhere)
  deepstack     [K, S, D] f32  DeepStack feature k at those rows (zeros elsewhere); added
                               to the hidden states after decoder layer k (absent when K = 0)
  positions     [3, S] i32     (t, h, w) M-RoPE position ids
  last          [] i32         index of the last real token
  -> logits [1, vocab] f32 of token `last`; K and V of rows 0..S-1 written to cache slots 0..S-1.
prefill_<C>_<L> (a later chunk of C = the largest bucket, for each span L >= C), the same
  arguments and `start` [] i32 (the chunk's first slot, a multiple of C, at most L):
  -> logits of token `last` of the chunk; K and V of its rows written to slots start..start+C-1,
  each row attending over the cache's slots 0..start-1 (read from its first L) and the
  chunk's rows up to its own.
decode, and decode_<L> for each shorter span L (`attention_spans`):
  token [1] i32, positions [3, 1] i32, slot [] i32 (its cache slot = its text position)
  -> logits [1, vocab] f32; its K and V written to cache slot `slot`, attention over 0..slot.
  `decode` attends over the whole cache (slots past `slot` masked), `decode_<L>` over its
  first L slots only (slot <= L): a step reads L slots of each layer's cache, not the
  context's, so a short chat in a long context decodes as fast as in a short one.

Per layer (transformers' Qwen3VLTextDecoderLayer): h = x + o(attn(rope(q_norm(q(n1))),
rope(k_norm(k(n1))), v(n1))), n1 = rms(x); y = h + down(silu(gate(n2)) * up(n2)),
n2 = rms(h). Then the final RMSNorm and lm_head (the embedding table when tied).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import __version__
from .builder import Builder, Value
from .config import PARAMETER_SCOPE, PRECISION_NOTES, WeightSpec, activation_dtype, check_precision, weight_dtype
from .attention import grouped_attention
from .layers import apply_rotary, gated_mlp, mrope_tables, project, rms_norm, rope_inv_freq
from .module import function, render
from .text_config import LM_HEAD, TEXT_PREFIX, TextConfig

MODULE_NAME = "qwen3vl_text"
DECODE = "decode"
SHORTEST_SPAN = 512  # the shortest attention span a decode function has
MATMUL_SUFFIXES = ("proj.weight", "embed_tokens.weight", LM_HEAD)


class TextShapeError(ValueError):
    """A prompt bucket or context the graph cannot be built for."""


def prefill_name(bucket: int, span: int | None = None) -> str:
    """`prefill_<bucket>` (a first chunk), or `prefill_<bucket>_<span>` (a later one)."""
    return f"prefill_{bucket}" + (f"_{span}" if span else "")


def cache_slots(context: int, buckets) -> int:
    """The KV cache's slots: the context rounded up to a whole chunk (the largest bucket),
    so that a prompt's last chunk, padded, is written inside the cache."""
    chunk = max(buckets)
    return -(-context // chunk) * chunk


def chunk_spans(buckets, slots: int) -> tuple[int, ...]:
    """The spans a later chunk may attend over: those of `attention_spans` at least a chunk."""
    return tuple(span for span in attention_spans(slots) if span >= max(buckets))


@dataclass(frozen=True)
class Chunk:
    start: int  # its first cache slot (= text position)
    size: int  # the function's rows (the bucket; real rows: min(size, n - start))
    span: int | None  # None: a first chunk (`prefill_<size>`); else `prefill_<size>_<span>`

    @property
    def name(self) -> str:
        return prefill_name(self.size, self.span)


def prefill_chunks(n: int, buckets, slots: int) -> list[Chunk]:
    """The calls that prefill a prompt of n tokens: the smallest bucket that holds it, or
    chunks of the largest bucket C (each later chunk over the shortest span that holds the
    slots before it)."""
    buckets = sorted(buckets)
    if n <= buckets[-1]:
        return [Chunk(0, next(b for b in buckets if b >= n), None)]
    c = buckets[-1]
    return [Chunk(start, c, span_for(start, slots) if start else None) for start in range(0, n, c)]


def attention_spans(context: int) -> tuple[int, ...]:
    """The cache spans a decode step may attend over: 512, 1024, ... below the context,
    then the context."""
    spans, span = [], SHORTEST_SPAN
    while span < context:
        spans.append(span)
        span *= 2
    return (*spans, context)


def span_for(slot: int, context: int) -> int:
    """The shortest span that holds cache slots 0..slot-1."""
    return next(span for span in attention_spans(context) if span >= slot)


def decode_name(span: int, context: int) -> str:
    return DECODE if span == context else f"{DECODE}_{span}"


def cache_span(b: Builder, cache: Value, span: int, axis: int) -> Value:
    """The first `span` slots of a KV cache along its slot `axis` (the whole cache when
    that is all of it), copied out behind a barrier: fused into the attention's data-tiling
    pack, the slice became one vector op too large for IREE 3.13's CPU codegen."""
    if span == cache.shape[axis]:
        return cache
    limit = list(cache.shape)
    limit[axis] = span
    return b.optimization_barriers([b.slice(cache, (0,) * cache.rank, tuple(limit), hint="span")], hint="span")[0]


def span_mask(b: Builder, slot: Value, span: int) -> Value:
    """Additive [1, span + 1]: the span's slots before `slot`, then the new token's own."""
    keys = b.iota((1, span + 1), 1, hint="key")
    seen = b.compare("LT", keys, b.broadcast_in_dim(slot, (1, span + 1), [], hint="slot"))
    own = b.compare("EQ", keys, b.constant(span, (1, span + 1), "i32"), hint="own")
    seen = b.select(own, own, seen, hint="seen")
    return b.select(seen, b.constant(0.0, (1, span + 1)), b.constant(float("-inf"), (1, span + 1)), hint="mask")


def check_text_shapes(buckets, context: int) -> tuple[tuple[int, ...], int]:
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise TextShapeError(f"--context {context!r}: expected a positive number of tokens")
    out = []
    for bucket in buckets:
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 < bucket <= context:
            raise TextShapeError(f"prompt bucket {bucket!r}: expected a positive token count <= the context {context}")
        if bucket not in out:
            out.append(bucket)
    if not out:
        raise TextShapeError("prompt buckets: expected at least one")
    return tuple(sorted(out)), context


KV_DTYPES = ("f32", "bf16")
KV_CACHE_HELP = ("KV cache element type: bf16 halves the cache's memory, its keys and values rounded to bf16 "
                 "(docs/text.md gives the distance from f32).")


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise TextShapeError(f"--kv-cache-dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    return kv_dtype


def text_weights(cfg: TextConfig, precision: str = "f32") -> list[WeightSpec]:
    """The decoder's weights in checkpoint order (HF names, shapes, dtypes the graph takes):
    under the bf16 precisions the projection matrices, the embedding table and lm_head are bf16."""
    check_precision(precision)
    d, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    p = TEXT_PREFIX
    shapes = [(p + "embed_tokens.weight", (cfg.vocab_size, d))]
    for n in range(cfg.num_hidden_layers):
        q = f"{p}layers.{n}."
        shapes += [
            (q + "input_layernorm.weight", (d,)), (q + "post_attention_layernorm.weight", (d,)),
            (q + "self_attn.q_proj.weight", (cfg.num_attention_heads * hd, d)),
            (q + "self_attn.k_proj.weight", (cfg.num_key_value_heads * hd, d)),
            (q + "self_attn.v_proj.weight", (cfg.num_key_value_heads * hd, d)),
            (q + "self_attn.o_proj.weight", (d, cfg.num_attention_heads * hd)),
            (q + "self_attn.q_norm.weight", (hd,)), (q + "self_attn.k_norm.weight", (hd,)),
            (q + "mlp.gate_proj.weight", (i, d)), (q + "mlp.up_proj.weight", (i, d)),
            (q + "mlp.down_proj.weight", (d, i)),
        ]
    shapes.append((p + "norm.weight", (d,)))
    if not cfg.tie_word_embeddings:
        shapes.append((LM_HEAD, (cfg.vocab_size, d)))
    bf16 = weight_dtype(precision) == "bf16"
    return [WeightSpec(name, shape, "bf16" if bf16 and name.endswith(MATMUL_SUFFIXES) else "f32",
                       "round_to_bf16" if bf16 and name.endswith(MATMUL_SUFFIXES) else "none")
            for name, shape in shapes]


def prefill_inputs(cfg: TextConfig, bucket: int, deepstack_layers: int) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of prefill_<bucket>'s arguments, in order."""
    d = cfg.hidden_size
    deepstack = [("deepstack", (deepstack_layers, bucket, d), "f32")] if deepstack_layers else []
    return [("tokens", (bucket,), "i32"), ("visual", (bucket,), "i32"), ("visual_embeds", (bucket, d), "f32"),
            *deepstack, ("positions", (3, bucket), "i32"), ("last", (), "i32")]


DECODE_INPUTS = [("token", (1,), "i32"), ("positions", (3, 1), "i32"), ("slot", (), "i32")]


class TextGraph:
    """One function's builder with the weights and KV cache bound (same globals, same order,
    in every function of the module)."""

    def __init__(self, cfg: TextConfig, context: int, precision: str, rows: int = 0, kv_dtype: str = "f32"):
        self.cfg, self.context, self.b = cfg, context, Builder(activations=activation_dtype(precision))
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.inputs: dict[str, Value] = {}
        self.w = {s.name: self.b.parameter(s.name.removeprefix(TEXT_PREFIX), s.shape, s.dtype, key=s.name,
                                           scope=PARAMETER_SCOPE) for s in text_weights(cfg, precision)}
        cache = (rows,) * bool(rows) + (cfg.num_key_value_heads, context, cfg.head_dim)  # rows: one per sequence
        self.cache = [(self.b.state(f"layers.{n}.k_cache", cache, kv_dtype),
                       self.b.state(f"layers.{n}.v_cache", cache, kv_dtype)) for n in range(cfg.num_hidden_layers)]

    def stored(self, x: Value) -> Value:
        """K or V as the cache holds them (`kv_dtype`)."""
        return x if self.kv_dtype == "f32" else self.b.convert(x, self.kv_dtype, hint="kv_stored")

    def read(self, x: Value) -> Value:
        """A cache read (or a K/V `stored` gives) as the attention takes it, f32."""
        return x if x.dtype == "f32" else self.b.convert(x, "f32", hint="kv_read")

    def attended(self, k: Value, v: Value) -> tuple[Value, Value]:
        """A chunk's own K/V as every later reader of the cache sees them: rounded to
        `kv_dtype` (a no-op in f32), so that a token's keys are the same whichever call reads them."""
        return self.read(self.stored(k)), self.read(self.stored(v))

    def argument(self, name, shape, dtype) -> Value:
        self.inputs[name] = self.b.argument(name, shape, dtype)
        return self.inputs[name]

    def prefix(self, cache: Value, span: int, row: Value | None = None) -> Value:
        """The first `span` slots of a loaded layer cache, [kv_heads, span, head_dim]: of row
        `row` when the cache has rows (copied out behind a barrier unless it is the whole
        row: see `cache_span`)."""
        if row is None:
            return cache_span(self.b, cache, span, 1)
        b, shape = self.b, (cache.shape[1], span, cache.shape[3])
        zero = b.constant(0, (), "i32", hint="zero")
        picked = b.reshape(b.dynamic_slice(cache, [row, zero, zero, zero], (1, *shape), hint="row"), shape,
                           hint="row")
        return picked if span == cache.shape[2] else b.optimization_barriers([picked], hint="span")[0]

    def layer_weights(self, n: int) -> dict:
        prefix = f"{TEXT_PREFIX}layers.{n}."
        return {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}

    def embed(self, tokens: Value) -> Value:
        table = self.w[TEXT_PREFIX + "embed_tokens.weight"]
        rows = self.b.gather_rows(table, tokens, hint="embed")
        return rows if rows.dtype == "f32" else self.b.convert(rows, "f32", hint="embed")

    def qkv(self, x: Value, w: dict, cos: Value, sin: Value) -> tuple[Value, Value, Value]:
        """q [S, H, hd], and k, v [KVH, S, hd]: projected, q/k RMS-normed per head, roped."""
        b, cfg = self.b, self.cfg
        s = x.shape[0]

        def heads(name, count):
            return b.reshape(project(b, x, w[f"self_attn.{name}_proj.weight"], name), (s, count, cfg.head_dim),
                             hint=name)

        q = apply_rotary(b, rms_norm(b, heads("q", cfg.num_attention_heads), w["self_attn.q_norm.weight"],
                                     cfg.rms_norm_eps), cos, sin)
        k = apply_rotary(b, rms_norm(b, heads("k", cfg.num_key_value_heads), w["self_attn.k_norm.weight"],
                                     cfg.rms_norm_eps), cos, sin)
        v = heads("v", cfg.num_key_value_heads)
        return q, b.transpose(k, [1, 0, 2], hint="k"), b.transpose(v, [1, 0, 2], hint="v")

    def decoder(self, x: Value, positions: Value, make_mask, attend, after_layer=None) -> Value:
        """The decoder over input embeddings `x` [S, D] at M-RoPE `positions` [3, S]: the
        rotary tables, the additive mask (`make_mask()`), then every layer, `attend(n, q, k,
        v, mask)` storing layer n's K/V and returning its context [S, H*hd], and
        `after_layer(n, x)` (DeepStack) on each layer's output. `self.zero` is an i32 0."""
        cos, sin = self.rope(positions)
        with self.b.stage("mask"):
            mask = make_mask()
        self.zero = self.b.constant(0, (), "i32", hint="zero")
        for n in range(self.cfg.num_hidden_layers):
            x = self.layer(n, x, cos, sin, lambda q, k, v: attend(n, q, k, v, mask))
            if after_layer:
                x = after_layer(n, x)
        return x

    def layer(self, n: int, x: Value, cos: Value, sin: Value, attend) -> Value:
        """One decoder layer; `attend(q, k, v)` stores K/V and returns the context [S, H*hd]."""
        b, w, eps = self.b, self.layer_weights(n), self.cfg.rms_norm_eps
        with b.stage(f"layers.{n}.attn"):
            q, k, v = self.qkv(rms_norm(b, x, w["input_layernorm.weight"], eps), w, cos, sin)
            x = b.add(x, project(b, attend(q, k, v), w["self_attn.o_proj.weight"], "o"), hint="residual")
        with b.stage(f"layers.{n}.mlp"):
            return b.add(x, gated_mlp(b, rms_norm(b, x, w["post_attention_layernorm.weight"], eps), w),
                         hint="residual")

    def logits(self, row: Value) -> Value:
        """Final RMSNorm and lm_head of one row [1, D] -> [1, vocab]."""
        b = self.b
        with b.stage("lm_head"):
            normed = rms_norm(b, row, self.w[TEXT_PREFIX + "norm.weight"], self.cfg.rms_norm_eps)
            head = self.w.get(LM_HEAD, self.w[TEXT_PREFIX + "embed_tokens.weight"])
            return project(b, normed, head, "lm_head")

    def rope(self, positions: Value) -> tuple[Value, Value]:
        with self.b.stage("rope"):
            return mrope_tables(self.b, positions, rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta),
                                self.cfg.mrope_section)

    def function(self, name: str, logits: Value) -> dict:
        return function(self.b, name, [("logits", logits)])


def causal_mask(b: Builder, s: int) -> Value:
    """Additive [S, S]: 0 where key <= query, -inf after."""
    rows, cols = b.iota((s, s), 0, hint="query"), b.iota((s, s), 1, hint="key")
    return b.select(b.compare("LE", cols, rows, hint="causal"), b.constant(0.0, (s, s), hint="zero"),
                    b.constant(float("-inf"), (s, s), hint="neg_inf"), hint="mask")


def chunk_mask(b: Builder, start: Value, span: int, s: int) -> Value:
    """Additive [S, span + S] of a later chunk: the span's slots before `start`, then the
    chunk's own rows causally."""
    shape = (s, span + s)
    rows, cols = b.iota(shape, 0, hint="query"), b.iota(shape, 1, hint="key")
    cached = b.compare("LT", cols, b.broadcast_in_dim(start, shape, [], hint="start"), hint="cached")
    own = b.subtract(cols, b.constant(span, shape, "i32"), hint="own_key")
    causal = b.compare("LE", own, rows, hint="causal")
    seen = b.select(b.compare("LT", cols, b.constant(span, shape, "i32")), cached, causal, hint="seen")
    return b.select(seen, b.constant(0.0, shape, hint="zero"), b.constant(float("-inf"), shape, hint="neg_inf"),
                    hint="mask")


def prefill_function(cfg: TextConfig, bucket: int, context: int, deepstack_layers: int,
                     precision: str = "f32", rows: int = 0, span: int | None = None,
                     kv_dtype: str = "f32") -> tuple[dict, list[str]]:
    """prefill_<bucket> (a first chunk), or with `span` prefill_<bucket>_<span> (a later
    chunk, at an extra i32 argument `start`); with `rows`, over a KV cache of that many rows,
    the sequence's K/V written into row `row` (an extra i32 argument; text_batch.py).
    `context` is the cache's slots; the cache holds `kv_dtype`."""
    g = TextGraph(cfg, context, precision, rows, kv_dtype)
    b = g.b
    arguments = prefill_inputs(cfg, bucket, deepstack_layers) + [("start", (), "i32")] * bool(span) + \
        [("row", (), "i32")] * bool(rows)
    inputs = {name: g.argument(name, shape, dtype) for name, shape, dtype in arguments}
    d = cfg.hidden_size
    with b.stage("embed"):
        visual = b.compare("NE", inputs["visual"], b.constant(0, (bucket,), "i32"), hint="visual")
        visual = b.broadcast_in_dim(visual, (bucket, d), [0], hint="visual")
        x = b.select(visual, inputs["visual_embeds"], g.embed(inputs["tokens"]), hint="inputs_embeds")
    rest = (cfg.num_key_value_heads, context - bucket, cfg.head_dim)

    def first(n, q, k, v, mask):
        if rows:
            for state, value in zip(g.cache[n], (k, v)):  # slots past S keep an old sequence's: decode masks them
                update = b.reshape(g.stored(value), (1, *value.shape), hint="row")
                b.store_state(b.dynamic_update_slice(b.load_state(state), update, [inputs["row"], *[g.zero] * 3],
                                                     hint="cache"), state)
            own_k, own_v = g.attended(k, v)
            return grouped_attention(b, q, [own_k], [own_v], mask)
        for state, value in zip(g.cache[n], (k, v)):  # a new sequence: the cache is rewritten whole
            value = g.stored(value)
            whole = b.concatenate([value, b.constant(0.0, rest, value.dtype, hint="empty")], 1, hint="cache") \
                if rest[1] else value
            b.store_state(whole, state)
        own_k, own_v = g.attended(k, v)
        return grouped_attention(b, q, [own_k], [own_v], mask)

    def later(n, q, k, v, mask):
        # As decode: the cache as loaded (its first `span` slots, of row `row`) plus the
        # chunk's own K/V as a second block; the update ordered after the attention.
        loaded = [b.load_state(state) for state in g.cache[n]]
        keys, values = (g.read(g.prefix(cache, span, inputs.get("row"))) for cache in loaded)
        own_k, own_v = g.attended(k, v)
        context_ = grouped_attention(b, q, [keys, own_k], [values, own_v], mask)
        *loaded, context_ = b.optimization_barriers([*loaded, context_], hint="attended")
        at = [g.zero, inputs["start"], g.zero]
        for state, cache, value in zip(g.cache[n], loaded, (k, v)):
            value = g.stored(value)
            if rows:
                value = b.reshape(value, (1, *value.shape), hint="row")
            b.store_state(b.dynamic_update_slice(cache, value, [inputs["row"], *at] if rows else at, hint="cache"),
                          state)
        return context_

    def deepstack(n, x):
        if n >= deepstack_layers:
            return x
        with b.stage(f"deepstack.{n}"):
            feature = b.reshape(b.slice(inputs["deepstack"], (n, 0, 0), (n + 1, bucket, d)), (bucket, d))
            return b.add(x, feature, hint="deepstack")  # zero off the visual rows: x + 0 = x

    make_mask = (lambda: chunk_mask(b, inputs["start"], span, bucket)) if span else lambda: causal_mask(b, bucket)
    x = g.decoder(x, inputs["positions"], make_mask, later if span else first, deepstack)
    with b.stage("last"):
        row = b.dynamic_slice(x, [inputs["last"], g.zero], (1, d), hint="last")
    return g.function(prefill_name(bucket, span), g.logits(row)), b.globals


def decode_function(cfg: TextConfig, context: int, precision: str = "f32",
                    span: int | None = None, kv_dtype: str = "f32") -> tuple[dict, list[str]]:
    """`decode` (span None: the whole cache) or `decode_<span>`."""
    span = span or context
    g = TextGraph(cfg, context, precision, kv_dtype=kv_dtype)
    b = g.b
    inputs = {name: g.argument(name, shape, dtype) for name, shape, dtype in DECODE_INPUTS}
    with b.stage("embed"):
        x = g.embed(inputs["token"])

    def attend(n, q, k, v, mask):
        # Attention reads the cache as loaded plus the new K/V as a second block, never the
        # updated cache: reading the stored value in the same call gave wrong results (IREE 3.13).
        # The update is ordered after the attention (one barrier over both caches and the
        # context): while the loaded value was still to be read, IREE copied each whole cache
        # before updating it (2 x 16 MB per layer per token at 2B widths and 4096 slots).
        loaded = [b.load_state(state) for state in g.cache[n]]
        keys, values = (g.read(cache_span(b, cache, span, 1)) for cache in loaded)
        own_k, own_v = g.attended(k, v)
        context = grouped_attention(b, q, [keys, own_k], [values, own_v], mask)
        *loaded, context = b.optimization_barriers([*loaded, context], hint="attended")
        for state, cache, value in zip(g.cache[n], loaded, (k, v)):
            b.store_state(b.dynamic_update_slice(cache, g.stored(value), [g.zero, inputs["slot"], g.zero],
                                                 hint="cache"), state)
        return context

    x = g.decoder(x, inputs["positions"], lambda: span_mask(b, inputs["slot"], span), attend)
    return g.function(decode_name(span, context), g.logits(x)), b.globals


def emit_text_module(cfg: TextConfig, buckets, context: int, deepstack_layers: int, precision: str = "f32",
                     title: str = "", kv_dtype: str = "f32") -> str:
    """MLIR text of the language-model module: `prefill_<S>` for each bucket S,
    `prefill_<C>_<L>` for each chunk span L, `decode` and `decode_<L>` for each shorter
    span L, over shared weight globals and KV-cache globals of `cache_slots` slots
    (deterministic: same input, same bytes)."""
    buckets, context = check_text_shapes(buckets, context)
    slots = cache_slots(context, buckets)
    entries = [prefill_function(cfg, s, slots, deepstack_layers, precision, kv_dtype=kv_dtype) for s in buckets] + \
        [prefill_function(cfg, buckets[-1], slots, deepstack_layers, precision, span=span, kv_dtype=kv_dtype)
         for span in chunk_spans(buckets, slots)] + \
        [decode_function(cfg, slots, precision, span, kv_dtype) for span in attention_spans(slots)]
    name = "Qwen3-VL language model" + (f" ({title})" if title else "")
    return render_text_module(cfg, name, entries, buckets, context, deepstack_layers, precision, kv_dtype)


def render_text_module(cfg: TextConfig, name: str, entries, buckets, context: int, deepstack_layers: int,
                       precision: str, kv_dtype: str = "f32") -> str:
    """The language-model module of `entries` ((function, globals) pairs, every one over the
    same globals) under a header naming it `name` and its shapes."""
    functions, shared = [], None
    for entry, globals_ in entries:
        assert shared is None or globals_ == shared, "every entry reads the same globals"
        functions.append(entry)
        shared = globals_
    header = (f"// {name}, prompt buckets {', '.join(map(str, buckets))}, context {context}, "
              f"{deepstack_layers} DeepStack layers{PRECISION_NOTES[precision]}"
              f"{'' if kv_dtype == 'f32' else f', KV cache in {kv_dtype}'}.\n"
              f"// Emitted by qwen3vl-iree {__version__}; do not edit by hand.\n"
              f"// text config: {', '.join(f'{k}={v}' for k, v in cfg.to_dict().items())}\n")
    return render(MODULE_NAME, header, shared, functions)
