"""The engine: one thread that owns the model and runs the queued requests, with
continuous batching on the device.

The text module (runtime/text_batch.py) holds a KV cache of `--max-batch` rows. Between
two decode steps the engine admits waiting requests into free rows (vision, then the
prompt prefilled into the row or found in the prompt cache, then the first token); each
step feeds every running row its last token in one `decode_batch` call. A sequence that
finishes, stops, fails or whose client went away leaves its row at once, before the next
step. (The HTTP side has refused a prompt the context cannot hold before it queued.)

The prompt cache: a row keeps the prompt last prefilled into it (slots 0..n-1; decoding
writes only past them) and that prefill's logits, running or not. A request whose prompt
is the same (ids, positions and visual rows, bit for bit) takes that row if it is free, or
has the prompt copied into a free row (`copy_prompt`), and starts from the kept logits: the
same cache and logits a prefill would give, at no prefill cost.

Events go back to the request's asyncio queue: ("start", prompt_tokens), ("delta", text,
logprobs), ("done", finish_reason, usage) or ("error", ApiError).
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from runtime.inputs.chat import Media
from runtime.outputs import NonFiniteError, check_finite
from runtime.text import GenerateError
from runtime.sampling import Sampler, SamplingParams
from runtime.inputs.text_stream import TextStream
from runtime.serve.errors import ApiError
from runtime.serve.protocol import ChatRequest


@dataclass
class Sequence:
    """A running request: its cache row, how far it is, how it chooses and writes tokens."""
    job: "Job"
    prompt: object  # chat.Prompt
    row: int
    max_new: int
    sampler: Sampler
    stream: TextStream
    eos: tuple
    length: int = 0  # cache slots filled: the next fed token's slot
    count: int = 0  # tokens chosen
    last: int = 0  # the last chosen token, fed at the next step
    at: float = 0.0  # when it was chosen

    def __post_init__(self):
        self.length = int(self.prompt.ids.size)


@dataclass
class Job:
    request: ChatRequest
    params: SamplingParams
    media: list[Media]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """`submit(job)` queues a request (429 past `max_waiting`); the engine thread runs them."""

    def __init__(self, generator, metrics, encode, max_waiting: int, prompt_cache: bool = True):
        self.generator, self.metrics, self.encode, self.max_waiting = generator, metrics, encode, max_waiting
        self.rows = generator.text.rows
        self.prompt_cache = prompt_cache
        self.prompts: dict[int, tuple[bytes, np.ndarray]] = {}  # row -> (prompt key, its prefill's logits)
        self.used = [0.0] * self.rows  # when each row was last given a sequence
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.running: dict[int, Sequence] = {}  # row -> its sequence; touched by the engine thread only
        self.stopping = False
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

    def stop(self) -> None:
        """Cancel what waits and what runs; the thread ends after the current step."""
        self.stopping = True  # the engine thread cancels its running sequences at their next token
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.send("error", ApiError("server shutting down", status=503, code="shutting_down"))
        self.queue.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        """Admit waiting requests into free rows, then one decode step for all running ones;
        wait for work when nothing runs."""
        while True:
            if not self._admit():
                return
            if self.running:
                self._guarded(list(self.running.values()), self._step)

    def _admit(self) -> bool:
        """Start waiting jobs while rows are free (blocking while nothing runs); False at stop."""
        while len(self.running) < self.rows:
            try:
                job = self.queue.get(block=not self.running)
            except queue.Empty:
                return True
            if job is None:
                return False
            with self.lock:
                self.waiting -= 1
                self.metrics.waiting.set(self.waiting)
            self._guarded([job], lambda jobs: self._start(job))
        return True

    def _guarded(self, jobs, work) -> None:
        """`work`; an exception ends `jobs` (their sequences) with an error, the engine goes on."""
        try:
            work(jobs)
        except Exception as e:  # noqa: BLE001 - a request's fault never stops the engine
            error = e if isinstance(e, ApiError) else as_api_error(e)
            for item in jobs:
                job = item.job if isinstance(item, Sequence) else item
                job.send("error", error)
                self._end(job, "refused" if error.status < 500 else "failed")

    def _start(self, job: Job) -> None:
        """Vision, then the prompt into a free row (prefilled, or from the prompt cache), then
        the first token."""
        if job.cancelled.is_set():
            self.metrics.requests.labels("cancelled").inc()
            return
        gen, request = self.generator, job.request
        prompt = gen.prepare(request.messages, job.media, 1, encode=self.encode)
        row, logits = self._place(prompt)
        room = gen.text.context - prompt.ids.size + 1
        seq = Sequence(job, prompt, row, min(request.max_tokens or room, room), Sampler(job.params, prompt.ids,
                       gen.text.cfg.vocab_size), TextStream(gen.tokenizer, request.stop),
                       () if request.ignore_eos else gen.tokenizer.eos_ids)
        job.send("start", int(prompt.ids.size))
        self.metrics.prompt_tokens.inc(int(prompt.ids.size))
        self.running[row] = seq
        self._count_running()
        self._advance(seq, logits.copy())

    def _place(self, prompt) -> tuple[int, np.ndarray]:
        """A free row holding `prompt` and the logits of its last token: a row that already
        holds it, a copy of one that does, or a prefill. Free rows that keep no prompt are
        taken first, then the least recently used."""
        text, free = self.generator.text, [r for r in range(self.rows) if r not in self.running]
        key = prompt_key(prompt) if self.prompt_cache else None
        held = [r for r, (k, _) in self.prompts.items() if k == key] if key else []
        row = next((r for r in held if r in free), None)
        if row is not None:
            logits = self.prompts[row][1]
        else:
            row = min(free, key=lambda r: (r in self.prompts, self.used[r]))
            self.prompts.pop(row, None)  # its slots are about to be rewritten
            if held:
                text.copy_prompt(held[0], row, int(prompt.ids.size))
                logits = self.prompts[held[0]][1]
            else:
                logits = text.prefill_row(row, prompt)
        if held:
            self.metrics.prompt_cache_hits.inc()
        if key:
            self.prompts[row] = (key, logits)
        self.used[row] = time.monotonic()
        return row, logits

    def _step(self, sequences) -> None:
        """One decode call for the running sequences, each fed its last token."""
        self.metrics.batch_size.observe(len(sequences))
        start = time.perf_counter()
        logits = self.generator.text.decode_batch([seq.row for seq in sequences], [seq.last for seq in sequences],
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
        if job.cancelled.is_set() or self.stopping:
            if self.stopping:
                job.send("error", ApiError("server shutting down", status=503, code="shutting_down"))
            return self._end(seq, "cancelled")
        check_finite("logits", logits, "the language model")  # no token from an overflowed row
        token = seq.sampler.choose(logits)
        now = time.monotonic()
        (self.metrics.per_token.observe(now - seq.at) if seq.count else self.metrics.ttft.observe(now - job.arrived))
        seq.at, seq.count, seq.last = now, seq.count + 1, token
        self.metrics.generated_tokens.inc()
        job.send("delta", seq.stream.add(token), self._logprobs(job, logits, token) if request.logprobs else None)
        finish = "stop" if token in seq.eos or seq.stream.stopped else "length" if seq.count == seq.max_new else None
        if finish:
            job.send("delta", seq.stream.flush(), None)
            job.send("done", finish, {"prompt_tokens": int(seq.prompt.ids.size), "completion_tokens": seq.count,
                                      "total_tokens": int(seq.prompt.ids.size) + seq.count})
            self._end(seq, "finished")

    def _end(self, item, outcome: str) -> None:
        """`item` (a sequence, or a job) out of its row, if it holds one; its outcome counted."""
        job = item.job if isinstance(item, Sequence) else item
        for row, seq in list(self.running.items()):
            if seq.job is job:
                del self.running[row]
        self._count_running()
        self.metrics.requests.labels(outcome).inc()

    def _count_running(self) -> None:
        """The running-sequences and KV-usage gauges (slots held / all rows' context)."""
        self.metrics.running.set(len(self.running))
        held = sum(seq.length for seq in self.running.values())
        self.metrics.kv_usage.set(held / (self.rows * self.generator.text.context))

    def _logprobs(self, job: Job, logits, token: int) -> dict:
        """OpenAI's logprobs entry of the chosen token, with the top alternatives."""
        chosen, top = Sampler.logprobs(logits, token, job.request.top_logprobs)
        return dict(self._token(token, chosen), top_logprobs=[self._token(i, lp) for i, lp in top])

    def _token(self, token: int, logprob: float) -> dict:
        tokenizer = self.generator.tokenizer
        return {"token": tokenizer.decode([token], skip_special_tokens=False), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token))}


def prompt_key(prompt) -> bytes:
    """A digest of everything a prefill reads: ids, M-RoPE positions, visual rows and
    their embeddings (two prompts with the same key fill a cache row identically)."""
    digest = hashlib.blake2b(digest_size=32)
    for part in (prompt.ids, prompt.positions, np.int64(prompt.rope_delta), prompt.visual, prompt.embeds,
                 prompt.deepstack):
        if part is not None:
            data = np.ascontiguousarray(part)
            digest.update(f"{data.dtype}{data.shape}".encode())
            digest.update(data.tobytes())
    return digest.digest()


def as_api_error(e: Exception) -> ApiError:
    """A failure inside a request as a 400 (its input) or 500 (anything else), one line."""
    message = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, GenerateError) and ("context" in message or "bucket" in message):
        return ApiError(message, "messages", code="context_length_exceeded")
    if isinstance(e, NonFiniteError):
        return ApiError(message, status=500, code="model_overflow")
    if isinstance(e, ValueError):
        return ApiError(message, "messages")
    return ApiError(f"internal error: {type(e).__name__}: {message}", status=500, code="internal_error")
