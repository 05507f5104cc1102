"""Image(s) and prompt in, answer out: the Qwen3-VL language model on IREE.

- `TextSession`: the language model of a checkpoint folder, compiled once into one module
  (`prefill_<S>` per prompt bucket, the later chunks of a longer prompt, and `decode`, see
  emitter/text.py) from the artifact
  cache; weights read from a memory-mapped archive in the cache (packed by IREE at load,
  then the mapped pages let go: no host copy stays); the KV cache lives in the module's
  globals, on the device, between calls. Only the logits row of each call comes back to
  the host.
- the token loops over a session (`stream_tokens`, `run_tokens`, `greedy`), and the precision
  a checkpoint's language model is built in (`checkpoint_precision`, `text_precision`).

The whole model (tokenizer, chat template, the vision session, sampling) is
runtime/generator.py's `Generator`; what the weights and the KV cache take, runtime/sizing.py.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import iree.runtime as rt

from emitter import quant
from emitter.identity import text_artifact_fields
from emitter.targets import DEFAULT_TARGET
from emitter.kv_pages import BLOCK
from emitter.precision import NATIVE, PRECISIONS, Precision, precision as precision_of
from emitter.text import prefill_inputs, text_weights
from emitter.text_module import emit_text_module
from emitter.text_shape import (MODULE_NAME, RESET, TextShape, TextShapeError, decode_blocks, decode_name, lane_counts,
                                pool_name, prefill_chunks)

from runtime.artifact.archive import release_mapped_pages
from runtime.artifact.build import compiled_module
from runtime.artifact.cache import ArtifactCache, load_verified
from runtime.artifact.compiler import resolve_precision
from runtime.artifact.iree_module import (LoadedModule, device_config, invoke, parameters_module,
                                          return_freed_memory)
from runtime.outputs import check_finite
from runtime.sampling import Sampler, SamplingParams
from runtime.artifact.archive import cached_text_archive, open_text_archive
from runtime.checkpoints.text import native_weights, model_text_config as load_text_config, text_entries
from runtime.checkpoints.vision import CheckpointError
from runtime.kv_cache import BlockPool, Blocks, block_keys

DEFAULT_PROMPT_BUCKETS = (128, 512)  # a longer prompt runs in chunks of the largest
# an embedding model's (runtime/embedding.py): its items are mostly short (a query or a caption
# with its instruction, 20-60 tokens), so a 64-token bucket halves their padding (2B f32, Zen 5:
# text items 1.07 against 0.54 a second), and a 16-token one takes a rest's tail (an image
# item's 78 rows as 64 + 16, not 128: 0.45 against 0.36 items a second, 2B f32, Zen 4;
# docs/performance.md, Embeddings against transformers)
POOLING_PROMPT_BUCKETS = (16, 64, 128, 512)
DEFAULT_CONTEXT = 4096  # the least default context (and a TextSession's when none is given)
CONTEXT_LADDER = (4096, 8192, 16384, 32768)  # generate takes the least that holds its request


class GenerateError(ValueError):
    """A request the model cannot serve (prompt too long, bad token id); one line."""


class TextSession:
    """The language model of `model_dir` on an IREE device, over one paged KV cache
    (emitter/text.py, runtime/kv_cache.py): up to `lanes` sequences decode together. The
    one-sequence calls (`prefill`, then `decode`) run one sequence of it, `qwen3vl
    generate`'s; a new `prefill` ends the previous one. The module is compiled (or found in
    the cache) and loaded on the first call."""

    def __init__(self, model_dir, buckets=DEFAULT_PROMPT_BUCKETS, context: int = DEFAULT_CONTEXT,
                 deepstack_layers: int = 0, target: str | None = None, cache_dir=None,
                 precision: Precision | str = "f32",
                 progress=None, config: rt.Config | None = None, kv_cache_dtype: str = "f32", lanes: int = 1,
                 kv_blocks: int = 0, prefix_cache: bool = True, pooled: bool = False):
        self.cfg, self.token_ids = load_text_config(model_dir)
        if pooled:  # an embedding checkpoint may hold no lm_head (runtime/embedding.py)
            from runtime.embedding import headless
            self.cfg = headless(model_dir, self.cfg)
        try:
            self.shape = TextShape(tuple(buckets), context, lanes, kv_blocks, kv_cache_dtype, pooled)
        except TextShapeError as e:
            raise GenerateError(str(e)) from None
        self.cfg.check_context(self.context)
        self.target = target or DEFAULT_TARGET
        self.progress = progress or (lambda message: None)
        self.deepstack_layers = deepstack_layers
        self.cfg, self.precision = text_precision(model_dir, self.cfg, precision_of(precision), self.target,
                                                  self.progress)
        text_entries(model_dir, self.cfg)  # every weight stored (headers only; read when the archive is written)
        text_weights(self.cfg, self.precision)  # a width the quantization group does not divide: one line, now
        self.model_dir, self.seconds = Path(model_dir), {}
        self.cache = ArtifactCache(cache_dir)
        self.config = config or device_config(self.target)
        self.pool = BlockPool(self.shape.blocks, prefix_cache)
        self._module = None
        self.sequence: Blocks | None = None  # the one-sequence calls'
        self.length = 0  # its tokens in the KV cache

    buckets = property(lambda self: self.shape.buckets)
    context = property(lambda self: self.shape.context)
    slots = property(lambda self: self.shape.slots)
    lanes = property(lambda self: self.shape.lanes)
    kv_cache_dtype = property(lambda self: self.shape.kv_dtype)

    @property
    def module(self):
        """The compiled module (built through the cache and loaded on first use), over the
        weight archive (written into the cache on first use of this checkpoint content)."""
        if self._module is None:
            self.parameters, self.seconds["load"] = timed(self._open_weights)
            self.vmfb_path, self.seconds["build"] = timed(self._build)
            self._module, self.seconds["upload"] = timed(self._load)
        return self._module

    def build(self) -> None:
        """The weight archive and the module's vmfb into the cache (or found there), nothing
        loaded: a driver's work before its workers open them."""
        self.archive_path = cached_text_archive(self.model_dir, self.cfg, self.precision, self.cache, self.progress)
        self.vmfb_path = self._build()

    def _open_weights(self) -> rt.ParameterIndex:
        """The weight archive from the cache (written on a miss), memory-mapped and checked."""
        self.archive_path = cached_text_archive(self.model_dir, self.cfg, self.precision, self.cache, self.progress)
        return open_text_archive(self.archive_path, self.cfg, self.precision)

    def _load(self):
        """Load the module over the archive (`LoadedModule`: out of memory is one line); IREE
        packs the weights now, after which the archive's mapped pages are let go (pages read
        later fault back from the file). Then the KV pools are stored whole once (`reset`),
        and the heap the load freed is given back (`return_freed_memory`: 1.15 GB at 2B
        int8 and q8_0 that `keep_freed_memory` would otherwise keep resident)."""
        self._loaded = LoadedModule(load_verified(self.vmfb_path), config=self.config, function=None,
                                    module_name=MODULE_NAME, modules=[parameters_module(self.config, self.parameters)])
        release_mapped_pages(self.parameters)
        self._reset(self._loaded.module)
        return_freed_memory()
        return self._loaded.module

    def _reset(self, module) -> None:
        """Every KV pool stored whole once (emitter/text.py's `reset_function`)."""
        invoke(module[RESET], np.zeros(2 * self.cfg.num_hidden_layers, np.float32))

    def _build(self):
        """The module's vmfb through the artifact cache (`build.compiled_module`)."""
        graph = emit_text_module(self.cfg, self.shape, self.deepstack_layers, self.precision)
        fields = text_artifact_fields(self.cfg, self.shape, self.deepstack_layers, self.precision, self.target,
                                      graph)
        kv = "" if self.kv_cache_dtype == "f32" else f" in {self.kv_cache_dtype}"
        detail = (f"prompt buckets {', '.join(map(str, self.buckets))}, context {self.context}, {self.lanes} "
                  f"lanes, KV cache {self.shape.blocks} blocks{kv}")
        path, _ = compiled_module(self.cache, fields, lambda: graph, self.target, "language model", detail,
                                  self.progress)
        return path

    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """A prompt and answer this session can hold; GenerateError (before any compile) if not."""
        if prompt_tokens > self.context:
            raise GenerateError(f"prompt of {prompt_tokens} tokens: longer than the context of {self.context} "
                                "tokens (--context); give a shorter prompt or smaller images")
        if prompt_tokens + max_new_tokens - 1 > self.context:
            raise GenerateError(f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens: more than the "
                                f"context of {self.context} tokens (--context)")

    def _logits(self, result) -> np.ndarray:
        """A call's logits on the host, [rows, vocab]; ValueError if any is NaN or inf (no
        token is chosen from an overflowed row)."""
        logits = np.array(result.to_host(), dtype=np.float32, copy=True)
        check_finite("logits", logits, "the language model")
        return logits

    # -- sequences of the paged cache -------------------------------------------

    def admit(self, prompt) -> tuple[Blocks, int] | None:
        """Blocks for a new sequence holding `prompt` (a `chat.Prompt`): its leading full
        blocks found in the prefix cache (at least its last token is left to prefill) and
        fresh ones for the rest; with the slot its prefill starts at. None when too few
        blocks are free (nothing taken)."""
        n = int(prompt.ids.size)
        keys = block_keys(prompt, n // BLOCK)
        shared = self.pool.share(keys[:(n - 1) // BLOCK])
        start = len(shared) * BLOCK
        if prefill_chunks(n, self.shape, start) is None:  # the last chunk would end past the slots
            keep = start // self.buckets[-1] * self.buckets[-1] // BLOCK
            self.pool.release(shared[keep:])
            shared, start = shared[:keep], keep * BLOCK
        fresh = -(-n // BLOCK) - len(shared)
        if not self.pool.can_take(fresh):
            self.pool.release(shared)
            return None
        self.pool.hit_tokens += start
        return Blocks(shared + self.pool.take(fresh), len(shared), keys), start

    def prefill_blocks(self, seq: Blocks, prompt, start: int, pooled: bool = False) -> np.ndarray:
        """Prefill `prompt`'s slots start.. into `seq` chunk by chunk; its full blocks are
        then keyed for the prefix cache. The logits [vocab] of its last token (`pooled`: its
        final normed hidden state [D] instead, the last chunk run by `pool_<S>`)."""
        ids = np.asarray(prompt.ids, np.int64).reshape(-1)
        self._check_ids(ids)
        if pooled and not self.shape.pooled:
            raise GenerateError("this language model was built without pooling entries (an embedding model's); "
                                "open it with pooling (serve --pooling last)")
        table = self.pool.table(seq, self.shape.max_blocks)
        chunks = prefill_chunks(ids.size, self.shape, start)
        for chunk in chunks:
            args = self.prefill_arguments(chunk, ids, prompt.positions, prompt.visual, prompt.embeds,
                                          prompt.deepstack)
            name = pool_name(chunk.size) if pooled and chunk is chunks[-1] else chunk.name
            result = invoke(self.module[name], *args, np.array(chunk.start, np.int32), table[:chunk.blocks])
        if pooled:
            hidden = np.array(result.to_host(), dtype=np.float32, copy=True).reshape(-1)
            check_finite("hidden state", hidden, "the language model")
            self.pool.remember(seq.ids[seq.keyed:len(seq.keys)], seq.keys[seq.keyed:])
            return hidden
        logits = self._logits(result).reshape(-1)
        self.pool.remember(seq.ids[seq.keyed:len(seq.keys)], seq.keys[seq.keyed:])
        return logits

    def grow(self, seq: Blocks, slots: int) -> bool:
        """`seq` covering `slots` slots, a block taken if needed; False if none is free."""
        if slots <= seq.slots:
            return True
        if not self.pool.can_take(1):
            return False
        seq.ids += self.pool.take(1)
        return True

    def release(self, seq: Blocks) -> None:
        self.pool.release(seq.ids)
        seq.ids = []

    def decode_batch(self, seqs: list[Blocks], tokens, rope_positions, slots) -> np.ndarray:
        """One step for the sequences `seqs` (distinct, each covering its slot): seqs[i] is
        fed `tokens[i]` at text position (cache slot) `slots[i]` and M-RoPE position
        `rope_positions[i]`; their logits [len(seqs), vocab]. Runs the smallest `decode_<B>`
        that holds them, over the blocks that hold the longest (bit for bit what each alone
        gives, tested); spare lanes repeat lane 0 (its write, twice)."""
        n = len(seqs)
        lanes = next(b for b in lane_counts(self.lanes) if b >= n)
        pad = lambda values: np.concatenate([np.asarray(values, np.int32).reshape(n),  # noqa: E731
                                             np.repeat(np.asarray(values, np.int32).reshape(n)[:1], lanes - n)])
        tokens, slots, rope = pad(tokens), pad(slots), pad(rope_positions)
        if slots.max() >= self.context:
            raise GenerateError(f"context of {self.context} tokens is full; give a larger --context")
        self._check_ids(tokens)
        blocks = decode_blocks(slots)
        tables = np.stack([self.pool.table(seqs[i if i < n else 0], blocks) for i in range(lanes)])
        positions = np.repeat(rope.reshape(1, lanes), 3, axis=0)
        result = invoke(self.module[decode_name(lanes)], tokens, positions, slots, tables)
        return np.array(result.to_host(), dtype=np.float32, copy=True).reshape(lanes, -1)[:n]

    # -- one sequence (generate) -------------------------------------------------

    def pooled_row(self, prompt) -> np.ndarray:
        """The final normed hidden state [D] of `prompt`'s last token (a `chat.Prompt`;
        `prefill_blocks` pooled), its blocks given back after (the prefix cache keeps them)."""
        self.check_request(int(prompt.ids.size), 1)
        if self.sequence is not None:
            self.release(self.sequence)
            self.sequence = None
        seq, start = self.admit(prompt)  # the pool holds a whole context: never None here
        try:
            return self.prefill_blocks(seq, prompt, start, pooled=True)
        finally:
            self.release(seq)

    def prefill(self, input_ids, position_ids, visual_positions=None, image_embeds=None,
                deepstack_features=None) -> np.ndarray:
        """Start the one sequence with this prompt (ids [n], M-RoPE ids [3, n]; image embeds
        [M, D] and DeepStack features [K, M, D] at `visual_positions` [M]), chunk by chunk;
        the logits [vocab] of its last token."""
        from runtime.inputs.chat import Prompt

        ids = np.asarray(input_ids, np.int64).reshape(-1)
        self.check_request(ids.size, 1)
        if self.sequence is not None:
            self.release(self.sequence)
        prompt = Prompt(ids, np.asarray(position_ids), 0, visual_positions, image_embeds, deepstack_features)
        self.sequence, start = self.admit(prompt)  # the pool holds a whole context: never None here
        logits = self.prefill_blocks(self.sequence, prompt, start)
        self.length = int(ids.size)
        return logits

    def prefill_arguments(self, chunk, ids, position_ids, visual_positions=None, image_embeds=None,
                          deepstack_features=None) -> list[np.ndarray]:
        """The data arguments of `chunk`'s call (a `prefill_chunks` entry; `start` and
        `table` follow them) for the prompt's rows chunk.start.. (ids [n] and the rest as
        `prefill` takes them), in order; the visual rows that fall in the chunk are placed at
        their rows in it."""
        n, d, s, start = ids.size, self.cfg.hidden_size, chunk.size, chunk.start
        real = min(s, n - start)
        tokens = np.zeros(s, np.int32)
        tokens[:real] = ids[start:start + real]
        visual = np.zeros(s, np.int32)
        embeds = np.zeros((s, d), np.float32)
        deepstack = np.zeros((self.deepstack_layers, s, d), np.float32)
        if visual_positions is not None and len(visual_positions):
            rows = np.asarray(visual_positions, np.int64)
            inside = (rows >= start) & (rows < start + real)
            local = rows[inside] - start
            visual[local] = 1
            embeds[local] = np.asarray(image_embeds)[inside]
            if deepstack_features is not None:
                deepstack[:, local] = np.asarray(deepstack_features)[:self.deepstack_layers][:, inside]
        positions = np.zeros((3, s), np.int32)
        positions[:, :real] = np.asarray(position_ids)[:, start:start + real]
        args = {"tokens": tokens, "visual": visual, "visual_embeds": embeds, "deepstack": deepstack,
                "positions": positions, "last": np.array(real - 1, np.int32)}
        names = [name for name, _, _ in prefill_inputs(self.cfg, self.shape, s, self.deepstack_layers)]
        return [args[name] for name in names if name in args]

    def decode(self, token: int, rope_position: int) -> np.ndarray:
        """Feed the one sequence a token (text position `self.length`, M-RoPE position
        `rope_position` on all three rows); the logits [vocab] of the next."""
        if self.sequence is None:
            raise GenerateError("decode: no prompt prefilled yet; call prefill first")
        if self.length >= self.context:
            raise GenerateError(f"context of {self.context} tokens is full; give a larger --context")
        self._check_ids(np.array([token]))
        self.grow(self.sequence, self.length + 1)  # the pool holds a whole context: always room
        logits = self.decode_batch([self.sequence], [token], [rope_position], [self.length])[0]
        check_finite("logits", logits, "the language model")
        self.length += 1
        return logits

    def _check_ids(self, ids: np.ndarray) -> None:
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise GenerateError(f"token id {int(bad[0])}: outside the vocabulary [0, {self.cfg.vocab_size})")


def stream_tokens(text: TextSession, prompt, sampler, max_new_tokens: int, eos_ids=()):
    """Prefill `prompt` (a `chat.Prompt`), then one token per decode step until an EOS id
    or `max_new_tokens`: yields (token, logits), the logits the model gave (the sampler
    chose from them after its penalties and warpers). Closing the generator early leaves
    the KV cache to the next prefill."""
    text.check_request(prompt.ids.size, max_new_tokens)
    logits = text.prefill(prompt.ids, prompt.positions, prompt.visual, prompt.embeds, prompt.deepstack)
    for step in range(1, max_new_tokens + 1):
        token = sampler.choose(logits)
        yield token, logits
        if token in eos_ids or step == max_new_tokens:
            return
        logits = text.decode(token, text.length + prompt.rope_delta)


def run_tokens(text: TextSession, prompt, sampler, max_new_tokens: int, eos_ids=(), on_token=None):
    """`stream_tokens` to the end: (tokens, logits [steps, vocab], seconds {prefill,
    decode}); `on_token(id)` hears each new token as it is chosen."""
    start = time.perf_counter()
    tokens, rows, seconds = [], [], {}
    for token, logits in stream_tokens(text, prompt, sampler, max_new_tokens, eos_ids):
        if not tokens:
            seconds["prefill"] = time.perf_counter() - start
            start = time.perf_counter()
        tokens.append(token)
        rows.append(logits)
        if on_token:
            on_token(token)
    seconds["decode"] = time.perf_counter() - start
    vocab = text.cfg.vocab_size
    return tokens, np.stack(rows) if rows else np.zeros((0, vocab), np.float32), seconds


def greedy(text: TextSession, input_ids, position_ids, rope_delta: int, max_new_tokens: int, eos_ids=(),
           visual_positions=None, image_embeds=None, deepstack_features=None, on_token=None,
           repetition_penalty: float = 1.0):
    """Prefill, then greedy decoding (`run_tokens`), the choice made after the repetition
    penalty as transformers' RepetitionPenaltyLogitsProcessor makes it."""
    from runtime.inputs.chat import Prompt

    ids = np.asarray(input_ids).reshape(-1)
    prompt = Prompt(ids, position_ids, rope_delta, visual_positions, image_embeds, deepstack_features)
    sampler = Sampler(SamplingParams(repetition_penalty=repetition_penalty), ids, text.cfg.vocab_size)
    return run_tokens(text, prompt, sampler, max_new_tokens, eos_ids, on_token)


def checkpoint_precision(model_dir) -> Precision:
    """The language model's precision when none is asked, the one place it is decided: native
    for a checkpoint that stores quantized weights in bits that run as stored (MLX's 8 or 4;
    a GGUF's quantized types: `native_weights`), else f32."""
    cfg, _ = load_text_config(model_dir)
    try:
        native_weights(model_dir, cfg)
    except CheckpointError:
        return PRECISIONS["f32"]
    return NATIVE


def text_precision(model_dir, cfg, precision: Precision, target: str, progress=None):
    """(config, precision) the language model is built with for the `precision` asked:
    native runs the checkpoint's quantized weights in their bits, the rest f32; the others
    as `resolve_precision` has them (bf16-f32 unless bf16 dots pay on `target`)."""
    if precision.native:
        entries = native_weights(model_dir, cfg)
        if any(form == [quant.PACKED] for _, _, _, *form in entries):  # experts on the block kernel of `target`
            entries = quant.with_kernel_isa(entries, PRECISIONS["q8_0"].for_target(target).isa)
        cfg, precision = replace(cfg, native_weights=entries), PRECISIONS["f32"]
    return cfg, resolve_precision(precision, target, progress)


def timed(fn) -> tuple:
    """(fn(), the seconds it took)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start
