"""The engine: one thread that owns the model and runs the queued requests, with
continuous batching on the device.

The text module (runtime/text.py) decodes up to `--max-batch` sequences at once over one
paged KV cache (runtime/kv_cache.py). Between two decode steps the engine admits waiting
requests while lanes and blocks are free (vision, then the prompt: its leading blocks found
in the prefix cache, the rest prefilled in chunks, then the first token); each step feeds
every running sequence its last token in one `decode` call. A sequence that finishes,
stops, fails or whose client went away gives its blocks back at once, before the next
step. (The HTTP side has refused a prompt the context cannot hold before it queued.)

When blocks run out: a request waits in the queue, in order, until a running sequence
gives blocks back (the pool holds at least one whole context, so the oldest always fits
once alone). A running sequence that needs a block at a decode step and finds none free
preempts the most recently started one: that one gives its blocks back and is resumed
later, first in line, by prefilling its prompt and the tokens it had (the prefix cache
keeps what it can of them); its client sees nothing but the delay.

Events go back to the request's asyncio queue: ("start", prompt_tokens), ("delta", text,
logprobs), ("done", finish_reason, usage) or ("error", ApiError). A score job (`classify`:
runtime/serve/rerank.py) ends at its prefill: ("start", prompt_tokens), then ("logits",
the last position's logits of its token ids); an embedding job (`pooled`:
runtime/serve/embeddings.py, `start_pooled`) likewise, then ("hidden", its last token's pooled
row [D]); it starts even while every lane decodes (`_admit_pooled`: it holds no lane), with
the embedding jobs right behind it, the short ones in one call.
"""

from __future__ import annotations

import asyncio
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from runtime.inputs.chat import Media, Prompt
from runtime.kv_cache import Blocks
from runtime.outputs import NonFiniteError, check_finite
from runtime.text import GenerateError
from runtime.sampling import Sampler, SamplingParams
from runtime.inputs.text_stream import TextStream
from runtime.serve.errors import ApiError
from runtime.serve.protocol import ChatRequest


@dataclass
class Sequence:
    """A running request: its blocks, how far it is, how it chooses and writes tokens."""
    job: "Job"
    prompt: object  # chat.Prompt
    blocks: Blocks
    max_new: int
    sampler: Sampler
    stream: TextStream
    eos: tuple
    constraint: object = None  # structured.Constraint: the grammar's token mask, when the request has one
    budget: object = None  # reasoning.ThinkingBudget, when the request has one
    length: int = 0  # cache slots filled: the next fed token's slot
    tokens: list = field(default_factory=list)  # tokens chosen; the last is fed at the next step
    at: float = 0.0  # when the last was chosen

    def __post_init__(self):
        self.length = int(self.prompt.ids.size)

    @property
    def count(self) -> int:
        return len(self.tokens)

    def resumed_prompt(self) -> Prompt:
        """The prompt and the tokens fed so far, as one prompt (a preempted sequence's)."""
        p, fed = self.prompt, np.asarray(self.tokens[:-1], np.int64)
        slots = np.arange(p.ids.size, p.ids.size + fed.size) + p.rope_delta
        return Prompt(np.concatenate([p.ids, fed]), np.concatenate([p.positions, np.repeat(slots[None], 3, 0)], 1),
                      p.rope_delta, p.visual, p.embeds, p.deepstack)


@dataclass
class Job:
    request: ChatRequest
    params: SamplingParams
    media: list[Media]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)
    prompt: object = None  # its chat.Prompt, once prepared
    classify: tuple | None = None  # token ids: a score job, answered by its prompt's last logits of these (rerank.py)
    pooled: bool = False  # an embedding job, answered by its prompt's pooled row (embeddings.py)

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """`submit(job)` queues a request (429 past `max_waiting`); the engine thread runs them."""

    def __init__(self, generator, metrics, encode, max_waiting: int, start_pooled=None):
        self.generator, self.metrics, self.encode, self.max_waiting = generator, metrics, encode, max_waiting
        self.start_pooled = start_pooled  # an embedding job's start (runtime/serve/embeddings.py), given by assemble
        self.text = generator.text
        self.lanes = self.text.lanes
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.held: deque = deque()  # taken from the queue, waiting for blocks: a Job, or a preempted Sequence
        self.running: list[Sequence] = []  # touched by the engine thread only
        self.stopping = False
        self._count_running()
        from runtime.serve.structured import Grammars
        Grammars.warm(generator.tokenizer, self.text.cfg.vocab_size)  # the grammars' tokenizer, built once
        self.thread = threading.Thread(target=self._loop, name="qwen3vl-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.waiting >= self.max_waiting:
                self.metrics.requests.labels("rejected").inc()
                raise ApiError(f"server busy: {self.waiting} requests already waiting (--max-waiting); retry later",
                               status=429, code="queue_full", headers={"Retry-After": "1"})
            self.waiting += 1
            self.metrics.waiting.set(self.waiting)
        self.queue.put(job)

    def cut(self) -> None:
        """Every request ends now with a 503 (the grace after SIGTERM is over): what waits at
        once, what runs at its next token. Returns at once."""
        self.stopping = True  # the engine thread cancels its running sequences at their next token
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self.lock:
                    self.waiting -= 1
                    self.metrics.waiting.set(self.waiting)
                job.cancelled.set()
                job.send("error", shutting_down())

    def stop(self) -> None:
        """Cancel what waits and what runs; the thread ends after the current step."""
        self.cut()
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        """Admit waiting requests while lanes and blocks are free, then one decode step for
        all running ones; wait for work when nothing runs."""
        while True:
            if not self._admit():
                return
            if self.running:
                self._guarded(list(self.running), self._step)

    def _next(self):
        """The next job or preempted sequence to start (held ones first; blocking while
        nothing runs); None at stop, False when there is none now."""
        if self.held:
            return self.held.popleft()
        try:
            job = self.queue.get(block=not self.running)
        except queue.Empty:
            return False
        if job is not None:
            with self.lock:
                self.waiting -= 1
                self.metrics.waiting.set(self.waiting)
        return job

    def _admit(self) -> bool:
        """Start waiting jobs while lanes and blocks are free; False at stop."""
        while len(self.running) < self.lanes:
            item = self._next()
            if item is None:
                return False
            if item is False:
                return True
            start = self._resume if isinstance(item, Sequence) else self._start
            if self._guarded([item], lambda _: start(item)) is False:
                self.held.appendleft(item)  # no blocks: it waits, first in line, until some come back
                return True
        return self._admit_pooled()

    def _admit_pooled(self) -> bool:
        """While every lane decodes: the embedding jobs at the head of the line still start
        (a prefill each, their lane given back at once); the first other one waits for a
        lane where it is, in order. False at stop."""
        while True:
            if not getattr(self.head(), "pooled", False):
                return True
            item = self._next()
            if item is None:
                return False
            if item is False:
                return True
            if self._guarded([item], lambda _: self._start(item)) is False:
                self.held.appendleft(item)
                return True

    def head(self):
        """The next job or sequence in line (held ones first), not taken; None when none."""
        if self.held:
            return self.held[0]
        with self.queue.mutex:
            return self.queue.queue[0] if self.queue.queue else None

    def take_pooled(self, most: int) -> list:
        """Up to `most` embedding jobs from the head of the line, in order (none past another job)."""
        taken = []
        while len(taken) < most and getattr(self.head(), "pooled", False):
            taken.append(self._next())
        return taken

    def _guarded(self, items, work):
        """`work(items)`, its result; an exception ends `items` (jobs or sequences) with an
        error, the engine goes on (and the result is None)."""
        try:
            return work(items)
        except Exception as e:  # noqa: BLE001 - a request's fault never stops the engine
            error = e if isinstance(e, ApiError) else as_api_error(e)
            for item in items:
                job = item.job if isinstance(item, Sequence) else item
                job.send("error", error)
                self._end(item, "refused" if error.status < 500 else "failed")

    def _start(self, job: Job) -> bool:
        """Vision, then the prompt into blocks (found in the prefix cache, or prefilled), then
        the first token; False (the prompt kept) if the blocks are not free now."""
        if job.cancelled.is_set():
            self.metrics.requests.labels("cancelled").inc()
            return True
        if job.pooled:  # it and the embedding jobs behind it: runtime/serve/embeddings.py
            return self.start_pooled(self, job)
        gen, request = self.generator, job.request
        if job.prompt is None:
            job.prompt = gen.prepare(request.messages, job.media, 1, encode=self.encode,
                                     template_kwargs=request.agents.template_kwargs if request.agents else None)
        prompt = job.prompt
        placed = self.text.admit(prompt)
        if placed is None:
            return False
        blocks, start = placed
        room = gen.text.context - prompt.ids.size + 1
        seq = Sequence(job, prompt, blocks, min(request.max_tokens or room, room), Sampler(job.params, prompt.ids,
                       gen.text.cfg.vocab_size), TextStream(gen.tokenizer, request.stop),
                       () if request.ignore_eos else gen.tokenizer.eos_ids, constraint(request), budget(request))
        self.running.append(seq)  # ended with its blocks given back if the prefill fails
        self.metrics.prefix_hit_tokens.inc(start)
        self.metrics.prompt_tokens.inc(int(prompt.ids.size))
        logits = self.text.prefill_blocks(blocks, prompt, start)
        job.send("start", int(prompt.ids.size))
        self._count_running()
        if job.classify is not None:  # a score job: no token chosen, the logits asked for are its answer
            check_finite("logits", logits, "the language model")
            job.send("logits", np.asarray(logits)[list(job.classify)].copy())
            self._end(seq, "finished")
            return True
        self._advance(seq, logits)
        return True

    def _resume(self, seq: Sequence) -> bool:
        """A preempted sequence back into blocks: its prompt and fed tokens prefilled (its last
        token is fed at the next step); False if the blocks are not free now."""
        if seq.job.cancelled.is_set() or self.stopping:
            self._advance(seq, None)
            return True
        prompt = seq.resumed_prompt()
        placed = self.text.admit(prompt)
        if placed is None:
            return False
        seq.blocks, start = placed
        self.running.append(seq)
        self.text.prefill_blocks(seq.blocks, prompt, start)
        self._count_running()
        return True

    def _make_room(self) -> None:
        """Every running sequence with a block for its next slot, preempting the most recently
        started ones while blocks are short."""
        for seq in list(self.running):
            while seq in self.running and not self.text.grow(seq.blocks, seq.length + 1):
                victim = self.running.pop()
                self.text.release(victim.blocks)
                self.held.appendleft(victim)
                self.metrics.preemptions.inc()

    def _step(self, sequences) -> None:
        """One decode call for the running sequences, each fed its last token."""
        self._make_room()
        sequences = list(self.running)
        if not sequences:
            return
        self.metrics.batch_size.observe(len(sequences))
        start = time.perf_counter()
        logits = self.text.decode_batch([seq.blocks for seq in sequences], [seq.tokens[-1] for seq in sequences],
                                        [seq.length + seq.prompt.rope_delta for seq in sequences],
                                        [seq.length for seq in sequences])
        for seq, row in zip(sequences, logits):
            seq.length += 1
            self._guarded([seq], lambda _: self._advance(seq, row))  # one lane's fault ends it alone
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        self._count_running()

    def _advance(self, seq: "Sequence", logits) -> None:
        """Choose `seq`'s next token from `logits`, send it, and end the sequence when it is done
        (or cancelled: its row is free before the next step)."""
        job, request = seq.job, seq.job.request
        if job.cancelled.is_set() or self.stopping or logits is None:
            if self.stopping:
                job.send("error", shutting_down())
            return self._end(seq, "cancelled")
        check_finite("logits", logits, "the language model")  # no token from an overflowed row
        allowed = seq.constraint.mask(logits) if seq.constraint else logits
        forced = seq.budget.forced() if seq.budget else None
        if forced is not None:  # the reasoning's budget is spent: `</think>` now
            allowed = np.where(np.arange(allowed.shape[-1]) == forced, np.float32(0), np.float32(-np.inf))
        token = seq.sampler.choose(allowed)
        if seq.constraint:
            seq.constraint.accept(token)
        if seq.budget:
            seq.budget.accept(token)
        now = time.monotonic()
        (self.metrics.per_token.observe(now - seq.at) if seq.count else self.metrics.ttft.observe(now - job.arrived))
        seq.at = now
        seq.tokens.append(token)
        self.metrics.generated_tokens.inc()
        # logprobs list the tokens whose bytes make the text: a special token (EOS too) is not in it
        listed = request.logprobs and token not in self.generator.tokenizer.special_ids
        job.send("delta", seq.stream.add(token), self._logprobs(job, logits, token) if listed else None)
        done = token in seq.eos or seq.stream.stopped or (seq.constraint is not None and seq.constraint.done)
        finish = "stop" if done else "length" if seq.count == seq.max_new else None
        if finish:
            job.send("delta", seq.stream.flush(), None)
            job.send("done", finish, {"prompt_tokens": int(seq.prompt.ids.size), "completion_tokens": seq.count,
                                      "total_tokens": int(seq.prompt.ids.size) + seq.count})
            self._end(seq, "finished")

    def _end(self, item, outcome: str) -> None:
        """`item` (a sequence, or a job) out of the running ones, its blocks given back; its
        outcome counted."""
        job = item.job if isinstance(item, Sequence) else item
        for seq in [seq for seq in self.running if seq.job is job]:  # a held (preempted) one holds no blocks
            self.running.remove(seq)
            self.text.release(seq.blocks)
        self._count_running()
        self.metrics.requests.labels(outcome).inc()

    def _count_running(self) -> None:
        """The running-sequences and KV-cache gauges."""
        pool = self.text.pool
        self.metrics.running.set(len(self.running))
        self.metrics.kv_blocks_used.set(pool.used)
        self.metrics.kv_blocks_free.set(len(pool.free))
        self.metrics.kv_usage.set(pool.used / pool.usable)

    def _logprobs(self, job: Job, logits, token: int) -> dict:
        """OpenAI's logprobs entry of the chosen token, with the top alternatives."""
        chosen, top = Sampler.logprobs(logits, token, job.request.top_logprobs)
        return dict(self._token(token, chosen), top_logprobs=[self._token(i, lp) for i, lp in top])

    def _token(self, token: int, logprob: float) -> dict:
        tokenizer = self.generator.tokenizer
        return {"token": tokenizer.decode([token], skip_special_tokens=False), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token))}


def shutting_down() -> ApiError:
    return ApiError("server shutting down: requests still in flight past the --grace period are ended", status=503,
                    code="shutting_down")


def constraint(request):
    """The request's grammar as a matcher of its own (structured.Constraint), or None."""
    grammar = getattr(request.answer, "grammar", None)
    if grammar is None:
        return None
    from runtime.serve.structured import Constraint
    return Constraint(*grammar)


def budget(request):
    """The request's reasoning budget as a counter of its own (reasoning.ThinkingBudget), or None."""
    spec = getattr(request.answer, "budget", None)
    if spec is None:
        return None
    from runtime.serve.reasoning import ThinkingBudget
    return ThinkingBudget(spec[0], request.answer.think_open, spec[1], spec[2])


def as_api_error(e: Exception) -> ApiError:
    """A failure inside a request as a 400 (its input) or 500 (anything else), one line."""
    message = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, GenerateError) and ("context" in message or "bucket" in message):
        return ApiError(message, "messages", code="context_length_exceeded")
    if isinstance(e, NonFiniteError):
        return ApiError(message, status=500, code="model_overflow")
    if isinstance(e, ValueError):  # a medium's fault names its URL's parameter first
        named = re.match(r"(messages\[\d+\]\.content\[\d+\]\.\w+\.url): ", message)
        return ApiError(message, named.group(1) if named else "messages")
    return ApiError(f"internal error: {type(e).__name__}: {message}", status=500, code="internal_error")
