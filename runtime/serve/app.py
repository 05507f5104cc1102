"""The HTTP side: OpenAI's chat completions API over the engine (FastAPI).

POST /v1/chat/completions (streamed as Server-Sent Events or not), GET /v1/models,
GET /health, GET /metrics; the rest (GET /v1/models/{id}, POST /v1/completions, /tokenize,
/detokenize) in runtime/serve/endpoints.py. Every refusal is OpenAI's error object with a
4xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from runtime.inputs.chat import Media
from runtime.sampling import SamplingError
from runtime.serve.answer import Answer, resolve
from runtime.serve.endpoints import add_routes
from runtime.serve.errors import ApiError
from runtime.serve.image_budget import ImageBudget
from runtime.serve.media import MediaFolder
from runtime.serve.protocol import check_logit_bias, parse_chat_request
from runtime.serve.scheduler import Job, as_api_error


@dataclass
class Limits:
    api_key: str | None = None
    allowed_local_media: str | None = None
    max_body_bytes: int = 32 << 20
    max_media: int = 8
    max_image_pixels: int = 64 << 20
    image_budget: ImageBudget = ImageBudget()  # --image-min-tokens / --image-max-tokens


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(generator, engine, metrics, model_id: str, limits: Limits, on_ready=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        if on_ready:
            on_ready()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error_response(ApiError(f"{request.method} {request.url.path}: {e.detail}", status=e.status_code))

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if limits.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {limits.api_key}".encode()):
                return error_response(ApiError("missing or wrong API key: expected the header "
                                               "'Authorization: Bearer <key>' with the server's --api-key",
                                               status=401, code="invalid_api_key",
                                               headers={"WWW-Authenticate": "Bearer"}))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_page():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(time.time()),
                                            "owned_by": "qwen3vl-iree"}]}

    add_routes(app, generator, engine, model_id, limits)  # /v1/models/{id}, /v1/completions, /tokenize, ...

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request, limits.max_body_bytes)
        job, folder = make_job(body, generator, model_id, limits)
        try:
            await refuse_early(generator, job)
            engine.submit(job)
            first = await next_event(job, request)
        except BaseException:
            folder.close()
            job.cancelled.set()
            raise
        if first[0] == "error":
            folder.close()
            raise first[1]
        reply = Reply(model_id, job.request, first[1])
        if job.request.stream:
            return StreamingResponse(stream(job, reply, folder), media_type="text/event-stream")
        try:
            return await collect(job, reply, request)
        finally:
            folder.close()

    return app


async def read_json(request: Request, limit: int):
    """The body as JSON: 413 past `limit` bytes (before reading it all), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"request body of {declared} bytes: more than the {limit} this server accepts "
                       "(--max-body-mb)", status=413, code="body_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ApiError(f"request body: more than the {limit} bytes this server accepts (--max-body-mb)",
                           status=413, code="body_too_large")
    try:
        return json.loads(bytes(data))
    except ValueError as e:
        raise ApiError(f"request body: not valid JSON ({e})", code="invalid_json") from None


def make_job(body, generator, model_id: str, limits: Limits) -> tuple[Job, MediaFolder]:
    """The checked request as a job; its media written to files (ApiError on any fault)."""
    request = parse_chat_request(body, limits.max_media)
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(f"model: {model!r}: this server serves {model_id!r}", "model", 404, "model_not_found")
    vocab = generator.text.cfg.vocab_size
    check_logit_bias(request.sampling, vocab)
    request.answer = resolve(request, generator.tokenizer, vocab)
    request.fingerprint = fingerprint(generator)
    try:
        params = generator.sampling.with_overrides(**request.sampling)
    except SamplingError as e:
        raise ApiError(str(e), str(e).split(" ")[0]) from None
    policy = limits.image_budget.for_request(body, generator.policy)
    folder = MediaFolder(limits.allowed_local_media, limits.max_image_pixels)
    try:
        media = [Media(kind, folder.path(url, kind, param), name=param, policy=policy if kind == "image" else None)
                 for kind, url, param in request.media]
    except BaseException:
        folder.close()
        raise
    return Job(request, params, media, asyncio.get_running_loop()), folder


def fingerprint(generator) -> str | None:
    """system_fingerprint: the text module's artifact identity (its cache key), once built."""
    from pathlib import Path

    path = getattr(generator.text, "vmfb_path", None)
    return f"fp_{Path(path).stem[:16]}" if path else None


async def refuse_early(generator, job: Job) -> None:
    """A prompt the context cannot hold, or an image whose header is not one, refused
    before the job queues: from the text and the image headers, nothing decoded (a
    video's tokens are counted once its frames are, in the engine)."""
    try:
        await asyncio.to_thread(generator.check_prompt, job.request.messages, job.media, 1,
                                job.request.agents.template_kwargs)
    except ValueError as e:
        raise as_api_error(e) from None


async def next_event(job: Job, request: Request | None):
    """The job's next event; a client that went away cancels it (polled every 0.25 s)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), 0.25)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                job.cancelled.set()
                raise asyncio.CancelledError("client disconnected") from None


class Reply:
    """The response's shapes: one completion or its chunks."""

    def __init__(self, model_id: str, request, prompt_tokens: int):
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self.model, self.request, self.prompt_tokens = model_id, request, prompt_tokens
        self.text, self.logprobs = [], []
        self.answer = Answer(request.answer)

    def head(self) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model,
                "system_fingerprint": self.request.fingerprint}

    def chunk(self, delta: dict, logprobs=None, finish=None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                  "finish_reason": finish}
        return sse(dict(self.head(), object="chat.completion.chunk", choices=[choice]))

    def completion(self, finish: str, usage: dict) -> dict:
        logprobs = {"content": self.logprobs} if self.request.logprobs else None
        message = self.answer.message("".join(self.text))
        return dict(self.head(), object="chat.completion", usage=usage,
                    choices=[{"index": 0, "message": message, "logprobs": logprobs,
                              "finish_reason": self.answer.finish_reason(finish)}])


def sse(value) -> str:
    return f"data: {json.dumps(value, ensure_ascii=False)}\n\n"


async def collect(job: Job, reply: Reply, request: Request) -> JSONResponse:
    while True:
        event = await next_event(job, request)
        if event[0] == "delta":
            reply.text.append(event[1])
            if event[2]:
                reply.logprobs.append(event[2])
        elif event[0] == "done":
            return JSONResponse(reply.completion(event[1], event[2]))
        else:
            raise event[1]


async def stream(job: Job, reply: Reply, folder: MediaFolder):
    """The SSE body; a client gone away (this generator cancelled) cancels the job."""
    pending = []
    try:
        yield reply.chunk({"role": "assistant", "content": ""})
        while True:
            event = await next_event(job, None)
            if event[0] == "delta":
                pending += [event[2]] if event[2] else []
                for delta in reply.answer.feed(event[1]) if event[1] else []:
                    yield reply.chunk(delta, pending)
                    pending = []
            elif event[0] == "done":
                for delta in reply.answer.finish():
                    yield reply.chunk(delta, pending)
                    pending = []
                yield reply.chunk({}, pending, reply.answer.finish_reason(event[1]))
                if job.request.include_usage:
                    yield sse(dict(reply.head(), object="chat.completion.chunk", choices=[], usage=event[2]))
                break
            else:
                yield sse(event[1].body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()
        folder.close()
