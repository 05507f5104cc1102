"""Image(s) and prompt in, answer out: the Qwen3-VL language model on IREE.

- `TextSession`: the language model of a checkpoint folder, compiled once into one module
  (`prefill_<S>` per prompt bucket, the later chunks of a longer prompt, and `decode`, see
  emitter/text.py) from the artifact
  cache; weights read from a memory-mapped archive in the cache (packed by IREE at load,
  then the mapped pages let go: no host copy stays); the KV cache lives in the module's
  globals, on the device, between calls. Only the logits row of each call comes back to
  the host.
- `Generator`: the whole model: tokenizer and chat template (runtime/inputs/tokenizer.py), the
  vision session for the images, M-RoPE positions (runtime/inputs/prefill.py, runtime/inputs/chat.py),
  greedy or sampled decoding (runtime/sampling.py; generation_config.json's settings).

    from runtime.text import Generator
    gen = Generator("path/to/checkpoint")
    result = gen.generate("Describe the image.", images=["a.jpg"], max_new_tokens=64)
    result.text, result.tokens, result.logits  # logits [new tokens, vocab] f32
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import iree.runtime as rt

from emitter.identity import text_artifact_fields
from emitter.targets import DEFAULT_TARGET
from emitter.kv_pages import BLOCK
from emitter.precision import NATIVE, PRECISIONS, Precision, precision as precision_of
from emitter.text import emit_text_module, prefill_inputs, text_weights
from emitter.vision import graph_weights
from emitter.text_shape import (MODULE_NAME, RESET, TextShape, TextShapeError, decode_blocks, decode_name, lane_counts,
                                prefill_chunks)

from runtime.artifact.archive import release_mapped_pages, spec_bytes
from runtime.artifact.build import compiled_module, vision_source
from runtime.artifact.cache import ArtifactCache, load_verified
from runtime.artifact.compiler import resolve_precision
from runtime.artifact.iree_module import (LoadedModule, device_config, invoke, parameters_module,
                                          return_freed_memory)
from runtime.outputs import check_finite
from runtime.sampling import Sampler, SamplingParams, generation_defaults
from runtime.inputs.text_stream import TextStream
from runtime.artifact.archive import cached_text_archive, open_text_archive
from runtime.checkpoints import gguf_text, gguf_vision
from runtime.checkpoints.text import native_weights, model_text_config as load_text_config, text_entries
from runtime.checkpoints.vision import CheckpointError
from runtime.kv_cache import BlockPool, Blocks, block_keys

DEFAULT_PROMPT_BUCKETS = (128, 512)  # a longer prompt runs in chunks of the largest
DEFAULT_CONTEXT = 4096  # the least default context (and a TextSession's when none is given)
CONTEXT_LADDER = (4096, 8192, 16384, 32768)  # generate takes the least that holds its request


class GenerateError(ValueError):
    """A request the model cannot serve (prompt too long, bad token id); one line."""


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable of /proc/meminfo; free pages elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_token_bytes(cfg, kv_dtype: str = "f32") -> int:
    """Bytes of KV cache one token takes, all layers, K and V."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (2 if kv_dtype == "bf16" else 4)


def kv_memory(resident: int = 0) -> float:
    """Bytes the KV cache may take by default: half of the memory available now less
    `resident`, the bytes of the weights that will be loaded beside it (`weight_bytes`)."""
    return max(0, available_memory() - resident) * 0.5


def default_context(model_dir, kv_dtype: str = "f32", resident: int = 0) -> tuple[int, str]:
    """The context when `--context` is not given: the ladder's top (32768), at most the
    checkpoint's max_position_embeddings and what `kv_memory(resident)` holds for one
    sequence (a multiple of 512, at least 4096); and why."""
    cfg, _ = load_text_config(model_dir)
    fits = int(kv_memory(resident) // kv_token_bytes(cfg, kv_dtype)) // 512 * 512
    limits = [(CONTEXT_LADDER[-1], "the default ceiling"),
              (cfg.max_position_embeddings, "the model's max_position_embeddings"),
              (max(fits, DEFAULT_CONTEXT), "what half the memory the weights leave holds")]
    return min(limits)


def fitting_context(tokens: int, limit: int) -> int:
    """The least context of the ladder that holds `tokens`, at most `limit` (generate's)."""
    return next((c for c in CONTEXT_LADDER if c >= tokens and c <= limit), limit)


def kv_blocks(model_dir, buckets, context: int, lanes: int, kv_dtype: str = "f32",
              memory_gb: float | None = None, resident: int = 0) -> tuple[int, str]:
    """The KV pool's block count for `--kv-cache-memory` (GB), or by default a whole context
    for each of `lanes` sequences, at most `kv_memory(resident)` and at least one context;
    and a line saying what was chosen."""
    cfg, _ = load_text_config(model_dir)
    try:
        shape = TextShape(tuple(buckets), context, lanes, 0, kv_dtype)
    except TextShapeError as e:
        raise GenerateError(str(e)) from None
    block_bytes = kv_token_bytes(cfg, kv_dtype) * BLOCK
    least = shape.max_blocks + 1
    if memory_gb is not None:
        if not memory_gb > 0:
            raise GenerateError(f"--kv-cache-memory {memory_gb}: expected a positive number of GB")
        blocks = int(memory_gb * 1e9 // block_bytes)
        if blocks < least:
            raise GenerateError(f"--kv-cache-memory {memory_gb}: {blocks} blocks of {BLOCK} tokens, fewer than one "
                                f"context of {context} tokens needs ({least}, {least * block_bytes / 1e9:.3f} GB)")
        why = "--kv-cache-memory"
    else:
        blocks = max(least, min(shape.blocks, int(kv_memory(resident) // block_bytes)))
        why = ("a whole context per --max-batch sequence" if blocks == shape.blocks else
               f"half the memory the weights ({resident / 1e9:.2f} GB) leave")
    return blocks, (f"{blocks} blocks of {BLOCK} tokens ({blocks * block_bytes / 1e9:.2f} GB, {kv_dtype}; "
                    f"{(blocks - 1) * BLOCK} tokens in all, {why})")


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
                 kv_blocks: int = 0, prefix_cache: bool = True):
        self.cfg, self.token_ids = load_text_config(model_dir)
        try:
            self.shape = TextShape(tuple(buckets), context, lanes, kv_blocks, kv_cache_dtype)
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
        path, _ = compiled_module(self.cache, fields, lambda: graph, self.target, "text model", detail, self.progress)
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

    def prefill_blocks(self, seq: Blocks, prompt, start: int) -> np.ndarray:
        """Prefill `prompt`'s slots start.. into `seq` chunk by chunk; its full blocks are
        then keyed for the prefix cache. The logits [vocab] of its last token."""
        ids = np.asarray(prompt.ids, np.int64).reshape(-1)
        self._check_ids(ids)
        table = self.pool.table(seq, self.shape.max_blocks)
        for chunk in prefill_chunks(ids.size, self.shape, start):
            args = self.prefill_arguments(chunk, ids, prompt.positions, prompt.visual, prompt.embeds,
                                          prompt.deepstack)
            result = invoke(self.module[chunk.name], *args, np.array(chunk.start, np.int32), table[:chunk.blocks])
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


@dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int]
    text: str
    logits: np.ndarray  # [new tokens, vocab] f32: the logits each new token was chosen from
    seconds: dict[str, float] = field(default_factory=dict)  # vision, prefill, decode; build: compile or load
    input_ids: np.ndarray | None = None  # the prompt's token ids, image pads expanded

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "text": self.text,
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()}}


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


def vision_parts(model_dir):
    """(vision config, image policy, video policy) of a checkpoint: a folder's, an mmproj's
    beside a GGUF text file (`gguf_vision.vision_parts`), or Nones for a GGUF text file alone
    (no vision tower)."""
    from emitter.config import load_model_config
    from emitter.policy import load_policy
    from emitter.video_policy import load_video_policy

    mmproj = gguf_vision.mmproj_file(model_dir)
    if mmproj:
        return gguf_vision.vision_parts(mmproj)
    if gguf_text.is_gguf(model_dir):
        return None, None, None
    cfg = load_model_config(model_dir)
    return cfg, load_policy(model_dir, cfg), load_video_policy(model_dir, cfg)


def text_precision(model_dir, cfg, precision: Precision, target: str, progress=None):
    """(config, precision) the language model is built with for the `precision` asked:
    native runs the checkpoint's quantized weights in their bits, the rest f32; the others
    as `resolve_precision` has them (bf16-f32 unless bf16 dots pay on `target`)."""
    if precision.native:
        cfg, precision = replace(cfg, native_weights=native_weights(model_dir, cfg)), PRECISIONS["f32"]
    return cfg, resolve_precision(precision, target, progress)


def weight_bytes(model_dir, precision: Precision | str | None, target: str | None = None, vision: bool = True) -> int:
    """Bytes the weights take resident once loaded: the language model's at `precision`
    (None: the checkpoint's own) and, with `vision`, the tower's beside it (at
    `Precision.tower`). What the KV cache's default size leaves them (`kv_memory`)."""
    precision = precision_of(precision) if precision else checkpoint_precision(model_dir)
    cfg, text = text_precision(model_dir, load_text_config(model_dir)[0], precision, target or DEFAULT_TARGET)
    total = sum(map(spec_bytes, text_weights(cfg, text)))
    if vision and vision_parts(model_dir)[0] is not None:
        tower_cfg, _, tower, *_ = vision_source(str(model_dir), None, precision.tower)
        total += sum(map(spec_bytes, graph_weights(tower_cfg, tower)))
    return total


class Generator:
    """The whole Qwen3-VL of a checkpoint folder on IREE: images and a prompt in, greedy
    tokens and text out. The vision session is opened on the first request with images.
    `context` None: each request gets the least context of CONTEXT_LADDER that holds it, up
    to `default_context` (generate's default; the KV cache then follows the request).
    `precision` None: the checkpoint's own (`checkpoint_precision`). `keep_vision` False:
    the vision session is let go once a request's media are encoded, before the language
    model is loaded (`qwen3vl generate`'s one answer: the tower's weights are then not
    resident beside the language model's; a later request with images loads it again)."""

    def __init__(self, model_dir, buckets=DEFAULT_PROMPT_BUCKETS, context: int | None = DEFAULT_CONTEXT,
                 target: str | None = None, cache_dir=None, precision: Precision | str | None = "f32",
                 threads: int | None = None,
                 progress=None, kv_cache_dtype: str = "f32", lanes: int = 1, kv_blocks: int = 0,
                 prefix_cache: bool = True, keep_vision: bool = True):
        from runtime.vision import set_thread_count
        from runtime.inputs.tokenizer import ChatTokenizer

        if threads is not None:
            set_thread_count(threads)
        self.model_dir = Path(model_dir)
        self.vision_cfg, self.policy, self.video_policy = vision_parts(model_dir)
        text_only = self.vision_cfg is None
        self.tokenizer = ChatTokenizer(model_dir)
        if precision is None:
            precision = checkpoint_precision(model_dir)
            if precision.native and progress:
                progress("precision: native (the checkpoint's quantized weights in their bits; --precision f32 "
                         "expands them)")
        precision = precision_of(precision)
        self.options = dict(target=target, cache_dir=cache_dir, precision=precision, progress=progress)
        self.fits = context is None  # the context fitted to each request
        if self.fits:
            context = default_context(model_dir, kv_cache_dtype, weight_bytes(model_dir, precision, target,
                                                                             vision=keep_vision))[0]
        deepstack = (gguf_text.deepstack_layers(model_dir) if text_only
                     else len(self.vision_cfg.deepstack_visual_indexes))
        self.text_options = dict(buckets=buckets, deepstack_layers=deepstack,
                                 kv_cache_dtype=kv_cache_dtype, lanes=lanes, kv_blocks=kv_blocks,
                                 prefix_cache=prefix_cache, **self.options)
        self.limit = context
        self.text = TextSession(model_dir, context=context, **self.text_options)
        self._vision = None
        self.keep_vision = keep_vision
        self.sampling = generation_defaults(model_dir)  # greedy unless do_sample, as transformers

    @property
    def vision(self):
        """The vision session (the default bucket ladder, or the one `vision_for` chose)."""
        if self._vision is None:
            self._vision = self.vision_for(0)
        return self._vision

    def vision_for(self, patches: int):
        """A vision session with a bucket that holds an image of `patches` patches: the
        default ladder, extended when an image is larger than its top (`ladder_for`)."""
        from emitter.identity import ladder_for

        from runtime.vision import VisionSession

        buckets = ladder_for([patches])
        if self._vision is None or self._vision.buckets[-1] < patches:
            self._vision = VisionSession(self.model_dir, buckets=buckets,
                                         **dict(self.options, precision=self.options["precision"].tower))
        return self._vision

    def prepare(self, messages, media=(), max_new_tokens: int = 1, encode=None, template_kwargs=None):
        """The `chat.Prompt` of `messages` (media: `chat.Media` in prompt order), checked
        against the context before any compile (callers refuse what `check_prompt` can tell
        before decoding anything); `encode(processed)` gives each medium's
        rows (default: one tower call for all, `chat.encode_joint`); `template_kwargs`: the
        chat template's other variables (`tools`, `enable_thinking`). Its `seconds` hold
        vision (processing and encoding) and build (compiling or loading)."""
        from runtime.inputs.chat import build_prompt, encode_joint, process_media, prompt_ids

        seconds = {"vision": 0.0, "build": 0.0}
        start = time.perf_counter()
        self._check_vision(media)
        processed = process_media(media, self.policy, self.video_policy, self.vision_cfg.merge_unit) if media else []
        seconds["vision"] = time.perf_counter() - start
        ids = prompt_ids(self.tokenizer, self.text.token_ids, messages, processed, template_kwargs)
        self.text.check_request(ids.size, max_new_tokens)  # before any compile
        self._fit_context(ids.size + max_new_tokens)
        rows = None
        if processed:
            if encode is None:
                load = self.vision_for(max(m.patches for m in processed)).artifact  # no session held here
                seconds["build"] += timed(load)[1]  # compiled or loaded outside the clock
                del load
                encode = lambda items: encode_joint(self.vision_for, items)  # noqa: E731
            start = time.perf_counter()
            rows = encode(processed)
            seconds["vision"] += time.perf_counter() - start
            if not self.keep_vision:
                self.release_vision()
        seconds["build"] += timed(lambda: self.text.module)[1]  # likewise
        merge = self.vision_cfg.spatial_merge_size if self.vision_cfg else 1  # no media, no grids to merge
        prompt = build_prompt(ids, self.text.token_ids, merge, processed, rows)
        prompt.seconds = seconds
        return prompt

    def release_vision(self) -> None:
        """Let the vision session go (its module, packed weights and mapped archive) and
        give the freed pages back to the kernel; the next request with media opens it again.
        A collection first: the session sits in reference cycles, so dropping the reference
        alone frees it only at the interpreter's next collection."""
        import gc

        self._vision = None
        gc.collect()
        return_freed_memory()

    def _check_vision(self, media) -> None:
        """GenerateError for images or videos given to a model without its vision tower (a
        GGUF text file given alone, without its mmproj)."""
        if media and self.vision_cfg is None:
            raise GenerateError(f"--model {self.model_dir}: a GGUF text file alone has no vision tower for the "
                                f"{media[0].kind}; expected its mmproj GGUF too (llama.cpp's --mmproj)")

    def _fit_context(self, tokens: int) -> None:
        """With a fitted context: the text session of the least ladder context that holds
        `tokens` (compiled on first use, cached like any other)."""
        if not self.fits:
            return
        context = fitting_context(tokens, self.limit)
        if context != self.text.context:
            self.text = TextSession(self.model_dir, context=context, **self.text_options)

    def check_prompt(self, messages, media=(), max_new_tokens: int = 1, template_kwargs=None) -> None:
        """Refuse (GenerateError) a chat the context cannot hold, from the text and the image
        headers alone: nothing decoded, encoded or compiled. A video's tokens are known only
        once its frames are decoded (`prepare` checks again then)."""
        from runtime.inputs.chat import image_tokens

        self._check_vision(media)
        counts = [image_tokens([m], self.policy, self.vision_cfg.merge_unit) for m in media if m.kind == "image"]
        try:  # a too-large image is refused before its prompt is even rendered
            self.text.check_request(sum(counts), 1)
        except GenerateError as e:
            raise GenerateError(f"the images alone: {e}") from None
        if any(m.kind == "video" for m in media):
            return
        ids = self.tokenizer.messages_ids(messages, self.text.token_ids, counts, template_kwargs=template_kwargs)
        self.text.check_request(ids.size, max_new_tokens)

    def generate(self, prompt: str, images=(), max_new_tokens: int = 64, on_text=None, videos=(),
                 sampling: SamplingParams | None = None) -> Generation:
        """The answer to one user message (the images in order, then the videos, then
        `prompt`), greedy or sampled as `sampling` says (default: generation_config.json's);
        `on_text(piece)` hears the answer's text as it grows."""
        from runtime.inputs.chat import Media
        from runtime.inputs.tokenizer import user_message

        if max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens {max_new_tokens}: expected 1 or more")
        media = [Media("image", p) for p in images] + [Media("video", v) for v in videos]
        messages = user_message(prompt, len(images), len(videos))
        self.check_prompt(messages, media, max_new_tokens)  # before any image is decoded
        chat = self.prepare(messages, media, max_new_tokens)
        streamer = TextStream(self.tokenizer, emit=on_text) if on_text else None
        sampler = Sampler(sampling or self.sampling, chat.ids, self.text.cfg.vocab_size)
        tokens, logits, timing = run_tokens(self.text, chat, sampler, max_new_tokens, self.tokenizer.eos_ids,
                                            streamer)
        if streamer:
            streamer.flush()
        seconds = dict(chat.seconds, **timing)
        return Generation(int(chat.ids.size), tokens, self.tokenizer.decode(tokens), logits, seconds, chat.ids)


def timed(fn) -> tuple:
    """(fn(), the seconds it took)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start
