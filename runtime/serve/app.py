"""The HTTP side: OpenAI's chat completions API over the engine (FastAPI).

POST /v1/chat/completions (streamed as Server-Sent Events or not), GET /v1/models,
GET /health, GET /metrics; the rest (GET /v1/models/{id}, POST /v1/completions, /tokenize,
/detokenize) in runtime/serve/endpoints.py; POST /v1/responses, translated into this chat
path, in runtime/serve/responses.py. Every response that is not a success is
OpenAI's error object with a 4xx/5xx status (the Host, API-key and Content-Type checks and
the catch-all are in `guard`; the body's bounds in `body`). A client that leaves cancels
its request at once (`respond`, shared with /v1/completions).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from runtime.inputs.chat import Media
from runtime.sampling import SamplingError
from runtime.serve.body import read_json
from runtime.serve.errors import ApiError, shown
from runtime.serve.guard import LOOPBACK, Guard
from runtime.serve.answer import Answer, resolve
from runtime.serve.endpoints import add_routes
from runtime.serve.embeddings import add_embedding_routes
from runtime.serve import responses
from runtime.serve.image_budget import ImageBudget
from runtime.serve.media import MediaFolder
from runtime.serve.protocol import check_logit_bias, parse_chat_request
from runtime.serve.rerank import add_rerank_routes
from runtime.serve.respond import Departure, fingerprint, next_event, respond, sse
from runtime.serve.scheduler import Job, as_api_error
from runtime.serve.webui import add_web_ui


@dataclass
class Limits:
    api_key: str | None = None
    allowed_local_media: str | None = None
    max_body_bytes: int = 32 << 20
    max_media: int = 8
    max_image_pixels: int = 64 << 20
    allowed_hosts: frozenset | None = frozenset(LOOPBACK)  # Host header values answered; None: any
    image_budget: ImageBudget = ImageBudget()  # --image-min-tokens / --image-max-tokens
    thinking_token_budget: int | None = None  # --thinking-token-budget: a request's default
    web_ui: bool = True  # GET /: the chat page (runtime/serve/webui.py); --no-web-ui: off
    reranker: object = None  # rerank.Classifier when the model is served as a reranker (/v1/rerank, /score)


def error_response(e: ApiError) -> Response:
    return Response(e.json(), status_code=e.status, headers=e.headers, media_type="application/json")


def create_app(generator, engine, metrics, model_id: str, limits: Limits, on_ready=None) -> FastAPI:
    """The routes behind the guard (inside Starlette's own error middleware, which would
    answer a crash with text/plain: the guard answers it first)."""
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
        return error_response(ApiError(f"{request.method} {shown(request.url.path)}: {e.detail}",
                                       status=e.status_code))

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

    async def checked(request: Request, translate=None) -> tuple[Job, MediaFolder]:
        """The request as a job, refused (and counted) at its first fault, before it queues;
        `translate`: another API's body into a chat body (/v1/responses)."""
        try:
            body = await read_json(request, limits.max_body_bytes)
            job, folder = make_job(translate(body) if translate else body, generator, model_id, limits)
        except ApiError:
            metrics.requests.labels("refused").inc()
            raise
        try:
            await refuse_early(generator, job, folder)
        except BaseException as e:
            folder.close()
            if isinstance(e, ApiError):
                metrics.requests.labels("refused").inc()
            raise
        return job, folder

    add_routes(app, generator, engine, model_id, limits)  # /v1/models/{id}, /v1/completions, /tokenize, ...
    add_embedding_routes(app, generator, engine, model_id, limits)  # /v1/embeddings (an embedding model's)
    add_rerank_routes(app, generator, engine, model_id, limits)  # /v1/rerank, /rerank, /score, /v1/score
    responses.add_routes(app, engine, model_id, checked)  # /v1/responses, over this chat path

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        job, folder = await checked(request)
        return await respond(request, engine, job,
                             lambda tokens, gone: collect(job, Reply(model_id, job.request, tokens), gone, folder),
                             lambda tokens: stream(job, Reply(model_id, job.request, tokens), folder), folder)

    if limits.web_ui:
        add_web_ui(app)  # GET / and /web/*: the chat page, behind the same guard
    app.add_middleware(Guard, api_key=limits.api_key, hosts=limits.allowed_hosts, metrics=metrics)
    return app


def make_job(body, generator, model_id: str, limits: Limits) -> tuple[Job, MediaFolder]:
    """The checked request as a job; its media written to files (ApiError on any fault)."""
    request = parse_chat_request(body, limits.max_media)  # a special token typed in it is text (ChatTokenizer)
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(f"model: {shown(model)}: this server serves {model_id!r}", "model", 404, "model_not_found")
    try:  # a chat too long for the context, refused from its length before anything renders or tokenizes it
        generator.check_size(request.messages, {"tools": request.agents.tools, **request.agents.template_kwargs})
    except ValueError as e:
        raise as_api_error(e) from None
    vocab = generator.text.cfg.vocab_size
    check_logit_bias(request.sampling, vocab)
    if request.thinking_token_budget is None:
        request.thinking_token_budget = limits.thinking_token_budget
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


async def refuse_early(generator, job: Job, folder: MediaFolder) -> None:
    """A prompt the context cannot hold, or an image whose header is not one, refused
    before the job queues: from the text and the image headers, nothing decoded (a
    video's tokens are counted once its frames are, in the engine)."""
    try:
        await asyncio.to_thread(generator.check_prompt, job.request.messages, job.media, 1,
                                job.request.agents.template_kwargs)
    except ValueError as e:
        raise folder.scrub(as_api_error(e)) from None


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


async def collect(job: Job, reply: Reply, gone: Departure, folder: MediaFolder) -> JSONResponse:
    while True:
        event = await next_event(job, gone)
        if event[0] == "delta":
            reply.text.append(event[1])
            if event[2]:
                reply.logprobs.append(event[2])
        elif event[0] == "done":
            return JSONResponse(reply.completion(event[1], event[2]))
        else:
            raise folder.scrub(event[1])


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
                yield sse(folder.scrub(event[1]).body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()
        folder.close()
