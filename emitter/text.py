"""The Qwen3-VL language model as one module over a paged KV cache (emitter/kv_pages.py):
`prefill_<S>` per prompt bucket S, `decode_<B>` per lane count B, and `reset`, over the
same weight globals (a parameter archive, scope
`model`, keys the checkpoint names) and the same KV pools, mutable globals that stay on
the device between calls. `qwen3vl generate` runs one sequence of it, `qwen3vl serve` up
to `--max-batch` at once (its decode steps feed every running sequence one token).

A sequence is a block table [max_blocks] i32 (`TextShape.max_blocks`): slot s of it is
row s % BLOCK of block table[s // BLOCK]. A prompt runs as chunks (`prefill_chunks`), from
slot 0 or from the end of a prefix already in the cache (runtime/kv_cache.py), each the
smallest bucket that holds the rest, or the largest.

A call attends over the sequence's first L slots: the blocks of the table it is given, N
= L / BLOCK entries, N a run-time dimension (`SPAN_BLOCKS`): the runtime passes a table's
first N entries, as many as hold the slots in use, so a short chat in a long context reads
its own blocks of each layer's cache, not the context's, and one function serves every
length (one per span was ~35 entries of 28 layers at 2B to compile at the serve defaults).

prefill_<S> (a chunk of S tokens at slot `start`, over the sequence's first L slots):
  tokens        [S] i32        token ids (image pads included)
  visual        [S] i32        1 at the image-pad positions, else 0
  visual_embeds [S, D] f32     the image embeddings at those rows (zeros elsewhere)
  deepstack     [K, S, D] f32  DeepStack feature k at those rows (zeros elsewhere); added
                               to the hidden states after decoder layer k (absent when K = 0)
  positions     [3, S] i32     (t, h, w) M-RoPE position ids
  last          [] i32         index of the chunk's last real token
  start         [] i32         its first slot (a multiple of BLOCK; start + S <= L)
  table         [N] i32        the sequence's first N blocks (N <= max_blocks)
  -> logits [1, vocab] f32 of token `last`; K and V of rows 0..S-1 written to slots
  start..start+S-1 (rows past the prompt's end land in block 0 or in slots decode rewrites).
pool_<S> (only in a pooling module, `TextShape.pooled`: an embedding model's): prefill_<S>'s
  arguments and K/V writes, -> hidden [1, D] f32: the final RMSNorm of token `last`'s hidden
  state instead of its logits (the runtime runs a prompt's last chunk through it: last-token
  pooling; a generative module's entries, identity and MLIR are as without it); and
  pool_<S>x<B>, B such prompts' chunks of S rows in one call, S each of the lane buckets
  (`TextShape.lane_buckets`: the lane bucket and its tails; emitter/text_pool.py).
decode_<B> (B lanes, each one token of a sequence; L holds every lane's slot):
  tokens [B] i32, positions [3, B] i32, slots [B] i32 (lane i's token's slot = its text
  position), tables [B, N] i32 (each lane's sequence's first N blocks; distinct
  sequences, or a lane repeating another's inputs whole)
  -> logits [B, vocab] f32; each lane's K/V written at its slot, attending over its
  sequence's slots 0..slot. The runtime calls the smallest B that holds the running
  sequences, with the fewest blocks that hold the longest one's slot (`decode_blocks`);
  the masked slots a longer table adds contribute exact zeros (lanes equal each alone).
reset(fill [2 x layers] f32): see `reset_function`.

Per layer (transformers' Qwen3VLTextDecoderLayer): h = x + o(attn(rope(q_norm(q(n1))),
rope(k_norm(k(n1))), v(n1))), n1 = rms(x); y = h + down(silu(gate(n2)) * up(n2)),
n2 = rms(h); in a mixture-of-experts layer (`TextConfig.sparse`) y = h + moe(n2)
(emitter/experts.py). Then the final RMSNorm and lm_head (the embedding table when tied).
"""

from __future__ import annotations

from kernels import decode_attention, q8_matmul
from kernels.build import object_name

from . import experts, kernel_calls, quant
from .builder import Builder, Value
from .config import PARAMETER_SCOPE, ConfigError, WeightSpec
from .attention import grouped_attention, token_attention
from .kv_pages import BLOCK, SPAN, SPAN_BLOCKS, pool_shape, read_blocks, read_span, write_chunk, write_token
from .layers import apply_rotary, dequantized, gated_mlp, held, mrope_tables, project, rms_norm, rope_inv_freq
from .module import function
from .precision import Precision, for_graph
from .text_config import LM_HEAD, TEXT_PREFIX, TextConfig
from .text_shape import RESET, TextShape, decode_name, pool_name, prefill_name

EMBEDDING = "embed_tokens.weight"
MATMUL_SUFFIXES = ("proj.weight", EMBEDDING, LM_HEAD)


def text_weights(cfg: TextConfig, precision: Precision | str = "f32") -> list[WeightSpec]:
    """The decoder's weights in checkpoint order (HF names, shapes, dtypes the graph takes):
    under the bf16 precisions the projection matrices, the embedding table and lm_head are bf16;
    those quantized (`weight_layouts`: int8, int4, w8a8, an MLX checkpoint's own bits) are i8 / i4,
    transposed to [in, out], followed by their group scales (and an affine one's biases;
    emitter/quant.py)."""
    precision = for_graph(precision)
    shapes = weight_shapes(cfg)
    bf16, layouts = precision.weights == "bf16", weight_layouts(cfg, precision, [n for n, _ in shapes])
    specs = []
    for name, shape in shapes:
        if name in layouts:
            specs += layouts[name].specs(name, shape)
        else:
            matmul = bf16 and (name.endswith(MATMUL_SUFFIXES) or experts.is_expert(name))
            specs.append(WeightSpec(name, shape, "bf16" if matmul else "f32", "round_to_bf16" if matmul else "none"))
    return specs


def weight_shapes(cfg: TextConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of each of the decoder's weights, in checkpoint order."""
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
        ]
        if cfg.sparse(n):
            shapes += experts.sparse_shapes(cfg, q)
        else:
            shapes += [(q + "mlp.gate_proj.weight", (i, d)), (q + "mlp.up_proj.weight", (i, d)),
                       (q + "mlp.down_proj.weight", (d, i))]
    shapes.append((p + "norm.weight", (d,)))
    if not cfg.tie_word_embeddings:
        shapes.append((LM_HEAD, (cfg.vocab_size, d)))
    return shapes


def weight_layouts(cfg: TextConfig, precision: Precision | str, names) -> dict:
    """{name: quant.Layout} of the weights the graph takes quantized: under int8, int4, w8a8,
    q8_0 and q4_0 every matmul weight, in the precision's layout (`Precision.layout_for`: symmetric; w8a8
    in int8 with a scale per output channel; the table lm_head reads, int4's in int8; q8_0's and
    q4_0's packed for their kernel in blocks of 32, q4_0's lm_head table in 6 bits, an embedding
    table not read by lm_head in Q8_0's 8-bit tiles); a checkpoint run in its own bits
    (`cfg.native_weights`: MLX's, GGUF's) the ones it stores quantized, in their own bits,
    group and form (`quant.native_layouts`; a mixture of experts' stacks and router too).
    `names`: the config's weights. An affine weight that is no matmul weight of them: ConfigError."""
    precision = for_graph(precision)
    bits = precision.bits
    experts.check_precision(cfg, precision)
    if cfg.native_weights and bits:
        raise ConfigError(f"--precision {precision}: the checkpoint's weights are quantized and run in their "
                          "own bits (or expanded under f32)")
    layouts = quant.native_layouts(cfg.native_weights)
    odd = [name for name in layouts if name not in names
           or not (name.endswith(MATMUL_SUFFIXES) or experts.is_expert(name) or name.endswith(experts.ROUTER))]
    if odd:
        raise ConfigError(f"{odd[0]}: quantized in the checkpoint, but only the projections, the experts and their "
                          "router, the embedding table and lm_head can run quantized")
    if layouts or not bits:
        return layouts
    shapes = dict(weight_shapes(cfg))
    head = LM_HEAD if LM_HEAD in shapes else TEXT_PREFIX + EMBEDDING
    return {n: precision.layout_for(shapes[n], head=n == head, gathered=n.endswith(EMBEDDING))
            for n in names if n.endswith(MATMUL_SUFFIXES) or experts.is_expert(n)}


def kernel_isa(precision: Precision) -> str | None:
    """The ISA of the kernel objects a graph form of q8_0 or q4_0 links (q8_0 or q4_0 itself:
    the default target's), else None."""
    return precision.for_target().isa if precision.kernel else None


def kernel_object(precision: Precision, cfg: TextConfig | None = None) -> str | None:
    """The file name of the block kernel's object a graph links (kernels/build.py
    `object_name`): a graph form of q8_0 or q4_0 (`kernel_isa`), or a checkpoint whose own
    packed weights run on it (`quant.native_kernel_isa`); else None."""
    isa = kernel_isa(precision) or (quant.native_kernel_isa(cfg.native_weights) if cfg else None)
    return None if isa is None else object_name(isa, q8_matmul.SOURCE)


def attention_object(cfg: TextConfig, shape: "TextShape", precision: Precision) -> str | None:
    """The file name of the attention kernels' object (kernels/decode_attention.py) a graph
    form of q8_0 or q4_0, or a checkpoint whose own packed weights run on the block kernel,
    links for its one-token attention, and for a chunk's where `chunk_fits` (the block
    kernel's ISA: `kernel_object`'s); None for other precisions (their graphs are the same
    for every target), or a shape the kernel does not take."""
    isa = kernel_isa(precision) or quant.native_kernel_isa(cfg.native_weights)
    if isa is None or not decode_attention.fits(cfg.groups, cfg.head_dim, shape.kv_dtype):
        return None
    return object_name(isa, decode_attention.SOURCE)


class TextGraph:
    """One function's builder with the weights and KV cache bound (same globals, same order,
    in every function of the module)."""

    def __init__(self, cfg: TextConfig, shape: "TextShape", precision: Precision, decoding: bool = False):
        self.cfg, self.shape, self.b = cfg, shape, Builder(activations=precision.activation_dtype)
        self.decoding = decoding  # one token a lane (a sparse layer reads only its chosen experts)
        self.kv_dtype = shape.kv_dtype
        self.inputs: dict[str, Value] = {}
        self.w = quant.grouped({s.name: self.b.parameter(s.name.removeprefix(TEXT_PREFIX), s.shape, s.dtype,
                                                         key=s.name, scope=PARAMETER_SCOPE)
                                for s in text_weights(cfg, precision)}, kernel_object(precision, cfg))
        self.attention_kernel = attention_object(cfg, shape, precision)
        pool = pool_shape(cfg.num_key_value_heads, shape.blocks, cfg.head_dim)
        self.pages = [(self.b.state(f"layers.{n}.k_pages", pool, shape.kv_dtype),
                       self.b.state(f"layers.{n}.v_pages", pool, shape.kv_dtype)) for n in range(cfg.num_hidden_layers)]

    def stored(self, x: Value) -> Value:
        """K or V as the cache holds them (`kv_dtype`)."""
        return x if self.kv_dtype == "f32" else self.b.convert(x, self.kv_dtype, hint="kv_stored")

    def read(self, x: Value) -> Value:
        """A cache read (or a K/V `stored` gives) as the attention takes it, f32."""
        return x if x.dtype == "f32" else self.b.convert(x, "f32", hint="kv_read")

    def argument(self, name, shape, dtype) -> Value:
        self.inputs[name] = self.b.argument(name, shape, dtype)
        return self.inputs[name]

    def attend(self, n: int, q: Value, k: Value, v: Value, table: Value, start: Value, mask: Value) -> Value:
        """Layer n's attention of one chunk (or one lane's token): `attend_lanes` of one."""
        return self.attend_lanes(n, [(q, k, v, table, start, mask)])[0]

    def attend_lanes(self, n: int, lanes: list[tuple]) -> list[Value]:
        """Layer n's attention of each lane's chunk, (q, k, v, table, start, mask), over its
        sequence's cache, after every lane's own K/V (at slots start..) is written to the
        pools. The keys and values are the sequence's first L slots, the blocks of `table`
        (L the mask's width). A chunk lays its own K/V over slots start.., one array in slot
        order, so that a row's sums run over the same keys in the same order however its
        prompt was chunked (a prefix-cache hit rounds as a miss). One token (decode; its mask
        hides its own slot) attends over the cache where it lies and over its own K/V beside
        it (`token_attention`; in the q8_0 and q4_0 graphs the kernel of
        kernels/decode_attention.py, one dispatch for the same math).

        The writes come first and the attention reads the pools they give: the data orders
        them, so IREE updates each pool in place and keeps the whole step in one queue
        submission. (Reading the pools as loaded and writing after made IREE copy each
        whole pool, unless a barrier ordered them; a barrier split the step into a
        submission a layer, the host waiting on each.)"""
        b = self.b
        pools = [b.load_state(state) for state in self.pages[n]]
        stored = [(self.stored(k), self.stored(v)) for _, k, v, *_ in lanes]
        for (_, _, _, table, start, _), kv in zip(lanes, stored):
            write = write_token if kv[0].shape[1] == 1 else write_chunk
            pools = [write(b, pool, table, start, x) for pool, x in zip(pools, kv)]
        for state, pool in zip(self.pages[n], pools):
            b.store_state(pool, state)
        return [self.attention(pools, q, *kv, table, start, mask)
                for (q, _, _, table, start, mask), kv in zip(lanes, stored)]

    def attention(self, pools: list[Value], q: Value, k: Value, v: Value, table: Value, start: Value,
                  mask: Value) -> Value:
        """A chunk's attention over the K/V `pools` (its own K/V written there) and its own
        K/V `k`, `v` as the pools store them (`stored`: rounded to `kv_dtype`, so that a
        token's keys are the same whichever call reads them)."""
        b = self.b
        if self.attention_kernel:
            if q.shape[0] == 1:
                return kernel_calls.token_attention(b, self.attention_kernel, q, *pools, table, start, k, v)
            if decode_attention.chunk_fits(self.cfg.groups, self.cfg.head_dim, self.kv_dtype):
                return kernel_calls.chunk_attention(b, self.attention_kernel, q, *pools, table, start)
        own = self.read(k), self.read(v)
        if q.shape[0] == 1:
            cached = [self.read(read_blocks(b, pool, table)) for pool in pools]
            return token_attention(b, q, *cached, mask, *own)
        keys, values = (b.dynamic_update_slice(self.read(read_span(b, pool, table)), x,
                                               [self.zero, start, self.zero], hint="own_kv")
                        for pool, x in zip(pools, own))
        # At static spans, fused into the data-tiling pack, a slice of the cache became one
        # vector op too large for its CPU codegen, at a run-time one not.
        return grouped_attention(b, q, [keys], [values], mask)

    def layer_weights(self, n: int) -> dict:
        prefix = f"{TEXT_PREFIX}layers.{n}."
        return {k[len(prefix):]: v for k, v in self.w.items() if k.startswith(prefix)}

    def embed(self, tokens: Value) -> Value:
        table = self.w[TEXT_PREFIX + "embed_tokens.weight"]
        if isinstance(table, quant.QuantizedWeight):  # the rows (q's columns) dequantized
            table = held(self.b, table)
            biases = None if table.biases is None else self.b.gather_rows(table.biases, tokens, hint="embed_biases")
            columns = dequantized(self.b, self.b.gather_slices(table.q, 1, tokens, hint="embed_q"),
                                  self.b.gather_rows(table.scales, tokens, hint="embed_scales"), "embed", biases)
            return self.b.transpose(columns, [1, 0], hint="embed")
        if isinstance(table, quant.BlockWeight):  # q8_0: rows out of the kernel's tiles
            return kernel_calls.block_rows(self.b, table.q, table.scales, tokens, hint="embed")
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
            normed = rms_norm(b, x, w["post_attention_layernorm.weight"], eps)
            mlp = (experts.moe_mlp(b, normed, w, self.cfg, gathered=self.decoding) if self.cfg.sparse(n)
                   else gated_mlp(b, normed, w))
            return b.add(x, mlp, hint="residual")

    def logits(self, row: Value) -> Value:
        """Final RMSNorm and lm_head of rows [R, D] (prefill's last, decode's lanes) -> [R, vocab]."""
        b = self.b
        with b.stage("lm_head"):
            normed = rms_norm(b, row, self.w[TEXT_PREFIX + "norm.weight"], self.cfg.rms_norm_eps)
            head = self.w.get(LM_HEAD, self.w[TEXT_PREFIX + "embed_tokens.weight"])
            logits = project(b, normed, head, "lm_head")
            if logits.shape[-1] != self.cfg.vocab_size:  # a packed table's zero rows (quant.Layout pad_rows)
                logits = b.slice(logits, [0, 0], [logits.shape[0], self.cfg.vocab_size], hint="vocab")
            return logits

    def pooled(self, row: Value) -> Value:
        """Final RMSNorm of one row [1, D] (an embedding model's last-token pooling)."""
        with self.b.stage("pooled"):
            return rms_norm(self.b, row, self.w[TEXT_PREFIX + "norm.weight"], self.cfg.rms_norm_eps)

    def rope(self, positions: Value) -> tuple[Value, Value]:
        with self.b.stage("rope"):
            return mrope_tables(self.b, positions, rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta),
                                self.cfg.mrope_section)

    def function(self, name: str, logits: Value) -> dict:
        return function(self.b, name, [("logits", logits)])


def position_mask(b: Builder, start: Value, s: int, span, own: bool = True) -> Value:
    """Additive [S, span]: row i (slot start + i) sees the slots up to its own (`own`
    false: before it)."""
    shape = (s, span)
    rows = b.add(b.iota(shape, 0, hint="query"), b.broadcast_in_dim(start, shape, [], hint="start"), hint="slot")
    seen = b.compare("LE" if own else "LT", b.iota(shape, 1, hint="key"), rows, hint="seen")
    return b.select(seen, b.constant(0.0, shape, hint="zero"), b.constant(float("-inf"), shape, hint="neg_inf"),
                    hint="mask")


def prefill_inputs(cfg: TextConfig, shape: TextShape, bucket: int, deepstack_layers: int) -> list[tuple]:
    """(name, shape, dtype) of prefill_<bucket>'s arguments, in order (the table's length a
    run-time dim, `SPAN_BLOCKS`)."""
    d = cfg.hidden_size
    deepstack = [("deepstack", (deepstack_layers, bucket, d), "f32")] if deepstack_layers else []
    return [("tokens", (bucket,), "i32"), ("visual", (bucket,), "i32"), ("visual_embeds", (bucket, d), "f32"),
            *deepstack, ("positions", (3, bucket), "i32"), ("last", (), "i32"), ("start", (), "i32"),
            ("table", (SPAN_BLOCKS,), "i32")]


def decode_inputs(lanes: int) -> list[tuple]:
    return [("tokens", (lanes,), "i32"), ("positions", (3, lanes), "i32"), ("slots", (lanes,), "i32"),
            ("tables", (lanes, SPAN_BLOCKS), "i32")]


def prefill_function(cfg: TextConfig, shape: TextShape, bucket: int, deepstack_layers: int,
                     precision: Precision | str = "f32", pooled: bool = False) -> tuple[dict, list[str]]:
    """prefill_<bucket>: a chunk of `bucket` tokens at slot `start` of a sequence, over the
    slots of the blocks its table names (`pooled`: pool_<bucket>, the same chunk returning its
    last token's normed hidden state)."""
    g = TextGraph(cfg, shape, for_graph(precision))
    b = g.b
    inputs = {name: g.argument(name, dims, dtype)
              for name, dims, dtype in prefill_inputs(cfg, shape, bucket, deepstack_layers)}
    b.bind(SPAN_BLOCKS.base, b.dimension_size(inputs["table"], 0, hint="span_blocks"))
    d = cfg.hidden_size
    with b.stage("embed"):
        visual = b.compare("NE", inputs["visual"], b.constant(0, (bucket,), "i32"), hint="visual")
        visual = b.broadcast_in_dim(visual, (bucket, d), [0], hint="visual")
        x = b.select(visual, inputs["visual_embeds"], g.embed(inputs["tokens"]), hint="inputs_embeds")

    def deepstack(n, x):
        if n >= deepstack_layers:
            return x
        with b.stage(f"deepstack.{n}"):
            feature = b.reshape(b.slice(inputs["deepstack"], (n, 0, 0), (n + 1, bucket, d)), (bucket, d))
            return b.add(x, feature, hint="deepstack")  # zero off the visual rows: x + 0 = x

    x = g.decoder(x, inputs["positions"], lambda: position_mask(b, inputs["start"], bucket, SPAN),
                  lambda n, q, k, v, mask: g.attend(n, q, k, v, inputs["table"], inputs["start"], mask), deepstack)
    with b.stage("last"):
        row = b.dynamic_slice(x, [inputs["last"], g.zero], (1, d), hint="last")
    if pooled:
        return function(b, pool_name(bucket), [("hidden", g.pooled(row))]), b.globals
    return g.function(prefill_name(bucket), g.logits(row)), b.globals


def decode_function(cfg: TextConfig, shape: TextShape, lanes: int, precision: Precision | str = "f32"
                    ) -> tuple[dict, list]:
    """decode_<lanes>: one token for each of `lanes` sequences, lane i at slot slots[i] of
    the sequence whose first blocks are tables[i]. Every weight matmul (projections,
    MLP, lm_head) runs once for all lanes, so a step reads the weights once; attention is
    per lane, over its own sequence."""
    g = TextGraph(cfg, shape, for_graph(precision), decoding=True)
    b = g.b
    inputs = {name: g.argument(name, dims, dtype) for name, dims, dtype in decode_inputs(lanes)}
    b.bind(SPAN_BLOCKS.base, b.dimension_size(inputs["tables"], 1, hint="span_blocks"))
    with b.stage("embed"):
        x = g.embed(inputs["tokens"])

    def scalar(name: str, i: int) -> Value:
        return b.reshape(b.slice(inputs[name], (i,), (i + 1,)), (), hint=name[:-1])

    slots = [scalar("slots", i) for i in range(lanes)]
    tables = [b.reshape(b.slice(inputs["tables"], (i, 0), (i + 1, SPAN_BLOCKS)) if lanes > 1 else inputs["tables"],
                        (SPAN_BLOCKS,), hint="table") for i in range(lanes)]

    def lane(value: Value, i: int, axis: int) -> Value:
        start, limit = [0] * value.rank, list(value.shape)
        start[axis], limit[axis] = i, i + 1
        return b.slice(value, tuple(start), tuple(limit), hint="lane")

    def attend(n, q, k, v, masks):
        contexts = g.attend_lanes(n, [(lane(q, i, 0), lane(k, i, 1), lane(v, i, 1), tables[i], slots[i], masks[i])
                                      for i in range(lanes)])
        return contexts[0] if lanes == 1 else b.concatenate(contexts, 0, hint="context")

    masks = lambda: [position_mask(b, slot, 1, SPAN, own=False) for slot in slots]  # noqa: E731
    x = g.decoder(x, inputs["positions"], masks, attend)
    return g.function(decode_name(lanes), g.logits(x)), b.globals


def reset_function(cfg: TextConfig, shape: TextShape, precision: Precision | str = "f32") -> tuple[dict, list]:
    """`reset(fill [2 x layers] f32)`: each KV pool stored whole, pool j with `fill[j]`
    (zeros from the caller). Called once after loading. Until then every pool holds IREE's
    one shared zero buffer, and slot-wise updates of it write through to all of them (IREE
    3.13). One argument per global: values that are equal would be merged into one buffer
    again."""
    g = TextGraph(cfg, shape, for_graph(precision))
    b = g.b
    states = [state for pair in g.pages for state in pair]
    fill = g.argument("fill", (len(states),), "f32")
    for j, state in enumerate(states):
        value = g.stored(b.reshape(b.slice(fill, (j,), (j + 1,)), (), hint="fill"))
        b.store_state(b.broadcast_in_dim(value, state[1].shape, [], hint="empty"), state)
    return function(b, RESET, [("done", b.constant(0, (), "i32", hint="done"))]), b.globals


def chunk_module(obj: str | None, rows: int, kv_heads: int, groups: int, head_dim: int, blocks: int,
                 kv_dtype: str) -> str:
    """A chunk's attention alone as a module's MLIR (`main`: q [rows, H, D], the K and V pools,
    the table of run-time length and the start -> the context): through the kernel object
    `obj`, or with `obj` None the graph form it replaces in the q8_0 and q4_0 graphs
    (`grouped_attention` over the slots the table names, masked past each row's own), for the
    tests and benchmarks that hold one against the other."""
    from .vision import render_module

    b = Builder()
    q = b.argument("q", (rows, kv_heads * groups, head_dim))
    pools = [b.argument(n, (kv_heads, blocks, BLOCK, head_dim), kv_dtype) for n in ("k_pool", "v_pool")]
    table, start = b.argument("table", (SPAN_BLOCKS,), "i32"), b.argument("start", (), "i32")
    b.bind(SPAN_BLOCKS.base, b.dimension_size(table, 0))
    if obj is None:
        f32 = lambda x: b.convert(x, "f32") if kv_dtype != "f32" else x  # noqa: E731
        keys, values = (f32(read_span(b, p, table)) for p in pools)
        out = grouped_attention(b, q, [keys], [values], position_mask(b, start, rows, SPAN))
    else:
        out = kernel_calls.chunk_attention(b, obj, q, *pools, table, start)
    return render_module(b, [("out", out)], title="chunk attention, " + ("kernel" if obj else "graph form"))
