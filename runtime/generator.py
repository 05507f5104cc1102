"""The whole Qwen3-VL of a checkpoint on IREE: tokenizer and chat template
(runtime/inputs/tokenizer.py), the vision session for the images, M-RoPE positions
(runtime/inputs/prefill.py, runtime/inputs/chat.py), the language model's session
(runtime/text.py), greedy or sampled decoding (runtime/sampling.py; generation_config.json's
settings).

    from runtime.generator import Generator
    gen = Generator("path/to/checkpoint")
    result = gen.generate("Describe the image.", images=["a.jpg"], max_new_tokens=64)
    result.text, result.tokens, result.logits  # logits [new tokens, vocab] f32
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from emitter.precision import Precision, precision as precision_of

from runtime.artifact.iree_module import return_freed_memory
from runtime.checkpoints import gguf_text
from runtime.sampling import Sampler, SamplingParams, generation_defaults
from runtime.inputs.text_stream import TextStream
from runtime.sizing import default_context, fitting_context, vision_parts, weight_bytes
from runtime.text import (DEFAULT_CONTEXT, DEFAULT_PROMPT_BUCKETS, GenerateError, TextSession, checkpoint_precision,
                          run_tokens, timed)


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


class Generator:
    """The whole Qwen3-VL of a checkpoint folder on IREE: images and a prompt in, greedy
    tokens and text out. The vision session is opened on the first request with images.
    `context` None: each request gets the least context of CONTEXT_LADDER that holds it, up
    to `default_context` (generate's default; the KV cache then follows the request).
    `precision` None: the checkpoint's own (`checkpoint_precision`). `keep_vision` False:
    the vision session is let go once a request's media are encoded, before the language
    model is loaded (`qwen3vl generate`'s one answer: the tower's weights are then not
    resident beside the language model's; a later request with images loads it again).
    `pooling` (runtime/embedding.py's `Pooling`): an embedding model, its text module with
    the last-token pooling entries (`runtime.embedding.embed` runs them)."""

    def __init__(self, model_dir, buckets=DEFAULT_PROMPT_BUCKETS, context: int | None = DEFAULT_CONTEXT,
                 target: str | None = None, cache_dir=None, precision: Precision | str | None = "f32",
                 threads: int | None = None,
                 progress=None, kv_cache_dtype: str = "f32", lanes: int = 1, kv_blocks: int = 0,
                 prefix_cache: bool = True, keep_vision: bool = True, pooling=None):
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
                                 prefix_cache=prefix_cache, pooled=pooling is not None, **self.options)
        self.pooling = pooling  # runtime/embedding.py's Pooling of an embedding model (pool_<S> entries), or None
        self.limit = context
        self.text = TextSession(model_dir, context=context, **self.text_options)
        self._vision = None
        self.keep_vision = keep_vision
        self.sampling = generation_defaults(model_dir)  # greedy unless do_sample, as transformers

    @property
    def vision(self):
        """The vision session (the default buckets: any image size, one compile)."""
        if self._vision is None:
            from runtime.vision import VisionSession
            self._vision = VisionSession(self.model_dir, **dict(self.options, precision=self.options["precision"].tower))
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
                load = self.vision.artifact  # no session held here
                seconds["build"] += timed(load)[1]  # compiled or loaded outside the clock
                del load
                encode = lambda items: encode_joint(lambda: self.vision, items)  # noqa: E731
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

    def check_size(self, messages, template_kwargs=None) -> None:
        """Refuse (GenerateError) a chat whose text alone is too long for the context, from
        its strings' lengths (`ChatTokenizer.least_tokens`): nothing rendered or tokenized,
        so a huge message costs its length, not a tokenization."""
        least = self.tokenizer.least_tokens([messages, template_kwargs or {}])
        if least > self.text.context:
            raise GenerateError(f"messages: at least {least} tokens of text: longer than the context of "
                                f"{self.text.context} tokens (--context); give a shorter prompt")

    def check_prompt(self, messages, media=(), max_new_tokens: int = 1, template_kwargs=None) -> None:
        """Refuse (GenerateError) a chat the context cannot hold, from the text and the image
        headers alone: nothing decoded, encoded or compiled. A video's tokens are known only
        once its frames are decoded (`prepare` checks again then)."""
        from runtime.inputs.chat import image_tokens

        self.check_size(messages, template_kwargs)
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
