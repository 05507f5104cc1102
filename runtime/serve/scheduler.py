"""The engine: one thread that owns the model and runs the queued requests.

This engine is sequential: the text module holds one KV cache, so one sequence is
decoded at a time, start to end, and the next waiting request is admitted the moment it
ends (finished, stopped, failed or cancelled). A request whose client goes away is
cancelled at the next decode step. Events go back to the request's asyncio queue:
("start", prompt_tokens), ("delta", text, logprobs), ("done", finish_reason, usage) or
("error", ApiError).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ..chat import Media
from ..generate import GenerateError, stream_tokens
from ..sampling import Sampler, SamplingParams
from ..text_stream import TextStream
from .errors import ApiError
from .protocol import ChatRequest


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

    def __init__(self, generator, metrics, encode, max_waiting: int):
        self.generator, self.metrics, self.encode, self.max_waiting = generator, metrics, encode, max_waiting
        self.queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.waiting, self.current = 0, None
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
        with self.lock:
            if self.current is not None:
                self.current.cancelled.set()
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
        while (job := self.queue.get()) is not None:
            with self.lock:
                self.waiting -= 1
                self.metrics.waiting.set(self.waiting)
                self.current = job
            self.metrics.running.inc()
            try:
                outcome = self._run(job)
            except ApiError as e:
                outcome = "refused"
                job.send("error", e)
            except Exception as e:  # noqa: BLE001 - a request's fault never stops the engine
                outcome = "failed"
                job.send("error", _as_api_error(e))
            finally:
                self.metrics.running.dec()
                with self.lock:
                    self.current = None
            self.metrics.requests.labels(outcome).inc()

    def _run(self, job: Job) -> str:
        if job.cancelled.is_set():
            return "cancelled"
        gen, request = self.generator, job.request
        prompt = gen.prepare(request.messages, job.media, 1, encode=self.encode)
        room = gen.text.context - prompt.ids.size + 1
        max_new = min(request.max_tokens or room, room)
        job.send("start", int(prompt.ids.size))
        self.metrics.prompt_tokens.inc(int(prompt.ids.size))
        return self._decode(job, prompt, max_new)

    def _decode(self, job: Job, prompt, max_new: int) -> str:
        gen, request = self.generator, job.request
        stream = TextStream(gen.tokenizer, request.stop)
        sampler = Sampler(job.params, prompt.ids, gen.text.cfg.vocab_size)
        tokens, last = 0, None
        eos = () if request.ignore_eos else gen.tokenizer.eos_ids
        steps = stream_tokens(gen.text, prompt, sampler, max_new, eos)
        finish = "length"
        try:
            for token, logits in steps:
                now = time.monotonic()
                (self.metrics.per_token.observe(now - last) if last else self.metrics.ttft.observe(now - job.arrived))
                last, tokens = now, tokens + 1
                self.metrics.generated_tokens.inc()
                if job.cancelled.is_set():
                    return "cancelled"
                piece = stream.add(token)
                job.send("delta", piece, self._logprobs(job, logits, token) if request.logprobs else None)
                if token in eos or stream.stopped:
                    finish = "stop"
                    break
        finally:
            steps.close()
        job.send("delta", stream.flush(), None)
        usage = {"prompt_tokens": int(prompt.ids.size), "completion_tokens": tokens,
                 "total_tokens": int(prompt.ids.size) + tokens}
        job.send("done", finish, usage)
        return "finished"

    def _logprobs(self, job: Job, logits, token: int) -> dict:
        """OpenAI's logprobs entry of the chosen token, with the top alternatives."""
        chosen, top = Sampler.logprobs(logits, token, job.request.top_logprobs)
        return dict(self._token(token, chosen), top_logprobs=[self._token(i, lp) for i, lp in top])

    def _token(self, token: int, logprob: float) -> dict:
        text = self.generator.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _as_api_error(e: Exception) -> ApiError:
    """A failure inside a request as a 400 (its input) or 500 (anything else), one line."""
    message = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, GenerateError) and ("context" in message or "bucket" in message):
        return ApiError(message, "messages", code="context_length_exceeded")
    if isinstance(e, ValueError):
        return ApiError(message, "messages")
    return ApiError(f"internal error: {type(e).__name__}: {message}", status=500, code="internal_error")
