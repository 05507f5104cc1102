"""What the chat and the completions routes share (runtime/serve/app.py, endpoints.py): a
job's events to its client, whole or as Server-Sent Events. A client that leaves cancels
its request at once: the handler waits on the job's next event or the connection's end,
whichever comes first, and answers 499.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from runtime.serve.scheduler import Job


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


class Departure:
    """Completes when the client closes its connection (its body already read): ASGI's
    `receive()` then says `http.disconnect`."""

    def __init__(self, request: Request):
        self.task = asyncio.ensure_future(self._wait(request.receive))

    @staticmethod
    async def _wait(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    def stop(self) -> None:
        self.task.cancel()


async def next_event(job: Job, gone: Departure | None):
    """The job's next event; if the client leaves first, the job is cancelled (the engine
    frees its lane before its next step) and ClientGone raised."""
    if gone is None:
        return await job.events.get()
    get = asyncio.ensure_future(job.events.get())
    await asyncio.wait((get, gone.task), return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    job.cancelled.set()
    raise ClientGone()


async def answers(request: Request, engine, jobs: list[Job], window: int, kind: str, fault) -> list | None:
    """(payload, prompt tokens) of each job's ("start", tokens) then (`kind`, payload) events,
    in order (the jobs of one /v1/embeddings or /v1/rerank request), at most `window` of them
    in the engine's queue at once; None if the client left. `fault(i, error)`: what job i's
    error event raises. Every job is cancelled at the end (a no-op for those done; the rest
    never start)."""
    gone, out = Departure(request), []
    try:
        queued = 0
        for i, job in enumerate(jobs):
            while queued < min(i + window, len(jobs)):
                engine.submit(jobs[queued])
                queued += 1
            tokens = 0
            while True:
                event = await next_event(job, gone)
                if event[0] == "start":
                    tokens = event[1]
                elif event[0] == kind:
                    out.append((event[1], tokens))
                    break
                else:
                    raise fault(i, event[1])
        return out
    except ClientGone:
        return None
    finally:
        gone.stop()
        for job in jobs:
            job.cancelled.set()


async def respond(request: Request, engine, job: Job, collect, stream, folder=None) -> Response:
    """The job submitted and answered: its first event (the prompt's tokens, or its error,
    raised through `folder.scrub`), then `collect(tokens, gone)` (the whole response) or,
    for a streamed request, `stream(tokens)` (the SSE body, which cleans up once it runs:
    cancels the job, closes the folder). A client gone before: 499, the job cancelled."""
    gone, streaming = Departure(request), False
    try:
        engine.submit(job)
        first = await next_event(job, gone)
        if first[0] == "error":
            raise folder.scrub(first[1]) if folder else first[1]
        if job.request.stream:
            streaming = True  # the stream watches its client, and cleans up, from here
            return StreamingResponse(stream(first[1]), media_type="text/event-stream")
        return await collect(first[1], gone)
    except ClientGone:
        return Response(status_code=499)  # nginx's "client closed request": no one reads it
    finally:
        gone.stop()
        if not streaming:
            if folder:
                folder.close()
            job.cancelled.set()  # a no-op once the job is done


def sse(value) -> str:
    return f"data: {json.dumps(value, ensure_ascii=False)}\n\n"


def fingerprint(generator) -> str | None:
    """system_fingerprint: the text module's artifact identity (its cache key), once built."""
    path = getattr(generator.text, "vmfb_path", None)
    return f"fp_{Path(path).stem[:16]}" if path else None
