"""The endpoints beside chat: `GET /v1/models/{id}`, `POST /v1/completions` (a raw prompt,
the same engine, sampling and structured output, streamed or not), and vLLM's
`POST /tokenize` and `POST /detokenize`. `add_routes(app, ...)` mounts them.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.inputs.chat import build_prompt
from runtime.sampling import SamplingError
from runtime.serve import protocol
from runtime.serve.agents import AgentFields, _constraints
from runtime.serve.answer import AnswerSpec
from runtime.serve.body import read_json
from runtime.serve.errors import ApiError, shown
from runtime.serve.respond import fingerprint, next_event, respond, sse
from runtime.serve.scheduler import Job, as_api_error

COMPLETION_FIELDS = ("prompt", "model", "n", "stream", "stream_options", "max_tokens", "stop", "ignore_eos",
                     "logit_bias", "echo", *protocol.SAMPLING_FIELDS, *protocol.IGNORED, "response_format",
                     "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
DEFAULT_MAX_TOKENS = 16  # OpenAI's for /v1/completions


def add_routes(app, generator, engine, model_id: str, limits) -> None:
    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise ApiError(f"model {shown(name)}: this server serves {model_id!r}", "model", 404, "model_not_found")
        return {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "qwen3vl-iree"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request, limits.max_body_bytes)
        job = completion_job(body, generator, model_id)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_id, "system_fingerprint": job.request.fingerprint}
        return await respond(request, engine, job, lambda tokens, gone: collect_completion(job, head, gone),
                             lambda tokens: stream_completion(job, head))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_json(request, limits.max_body_bytes)
        ids = await asyncio.to_thread(tokenize_body, body, generator)
        return {"count": len(ids), "max_model_len": generator.text.context, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_json(request, limits.max_body_bytes)
        tokens = _token_ids(body.get("tokens") if isinstance(body, dict) else None, "tokens",
                            generator.text.cfg.vocab_size)
        return {"prompt": generator.tokenizer.decode(tokens, skip_special_tokens=False)}


def _choice(text: str, finish=None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


async def collect_completion(job: Job, head: dict, gone) -> JSONResponse:
    pieces = [job.request.echo]
    while True:
        event = await next_event(job, gone)
        if event[0] == "delta":
            pieces.append(event[1])
        elif event[0] == "done":
            return JSONResponse(dict(head, choices=[_choice("".join(pieces), event[1])], usage=event[2]))
        else:
            raise event[1]


async def stream_completion(job: Job, head: dict):
    """The SSE body of a /v1/completions stream; a client gone away cancels the job."""
    try:
        if job.request.echo:
            yield sse(dict(head, choices=[_choice(job.request.echo)]))
        while True:
            event = await next_event(job, None)
            if event[0] == "delta" and event[1]:
                yield sse(dict(head, choices=[_choice(event[1])]))
            elif event[0] == "done":
                yield sse(dict(head, choices=[_choice("", event[1])]))
                if job.request.include_usage:
                    yield sse(dict(head, choices=[], usage=event[2]))
                break
            elif event[0] == "error":
                yield sse(event[1].body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()


def _token_ids(value, param: str, vocab: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(f"{param}: expected a list of token ids", param)
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise ApiError(f"{param}: {bad[0]}: not a token id of this vocabulary [0, {vocab})", param)
    return value


def _prompt_ids(body: dict, generator) -> tuple[np.ndarray, str]:
    """The prompt's ids (a string tokenized as is, or token ids) and its text."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        try:
            return generator.tokenizer.encode(prompt), prompt
        except ValueError as e:
            raise ApiError(f"prompt: {e}", "prompt") from None
    if isinstance(prompt, list) and prompt:
        ids = _token_ids(prompt, "prompt", generator.text.cfg.vocab_size)
        return np.asarray(ids, np.int64), generator.tokenizer.decode(ids, skip_special_tokens=False)
    raise ApiError("prompt: expected a non-empty string or list of token ids (one prompt per request)", "prompt")


def completion_job(body, generator, model_id: str) -> Job:
    """A /v1/completions body as a job whose prompt is already built (no template)."""
    from runtime.serve.structured import Grammars

    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    protocol._refused(body, COMPLETION_FIELDS)
    if body.get("model") is not None and body["model"] != model_id:
        raise ApiError(f"model: {shown(body['model'])}: this server serves {model_id!r}", "model", 404,
                       "model_not_found")
    ids, text = _prompt_ids(body, generator)
    sampling = protocol.sampling_overrides(body)
    vocab = generator.text.cfg.vocab_size
    protocol.check_logit_bias(sampling, vocab)
    max_tokens = protocol._number(body, "max_tokens", int, 1, None) or DEFAULT_MAX_TOKENS
    constraints = _constraints(body)
    if len(constraints) > 1:
        raise ApiError(f"{constraints[1][2]}: one constraint per request", constraints[1][2])
    request = protocol.ChatRequest([], [], sampling, max_tokens,
                                   protocol._stop(body), protocol._flag(body, "stream"), protocol._include_usage(body),
                                   ignore_eos=protocol._flag(body, "ignore_eos"), agents=AgentFields())
    request.echo = text if protocol._flag(body, "echo") else ""
    request.answer, request.fingerprint = AnswerSpec(), fingerprint(generator)
    if constraints:
        kind, value, param = constraints[0]
        grammars = Grammars.of(generator.tokenizer, vocab)
        try:
            request.answer.grammar = (grammars, grammars.compile(kind, value, param))
        except ValueError as e:
            raise ApiError(str(e), param) from None
    try:
        params = generator.sampling.with_overrides(**request.sampling)
        generator.text.check_request(int(ids.size), 1)
    except SamplingError as e:
        raise ApiError(str(e), str(e).split(" ")[0]) from None
    except ValueError as e:
        raise as_api_error(e) from None
    job = Job(request, params, [], asyncio.get_running_loop())
    job.prompt = build_prompt(ids, generator.text.token_ids, generator.vision_cfg.spatial_merge_size, [], None)
    return job


def tokenize_body(body, generator) -> list[int]:
    """vLLM's /tokenize: {prompt} tokenized as is, or {messages} rendered by the template
    (text only; `add_generation_prompt`, default true)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if "messages" in body:
        messages, media = protocol._messages(body)
        if media:
            raise ApiError("messages: /tokenize takes text only (an image's token count depends on its size)",
                           "messages")
        add = body.get("add_generation_prompt", True)
        try:
            text, typed = generator.tokenizer.render_chat(messages, add_generation_prompt=bool(add),
                                                          **(body.get("chat_template_kwargs") or {}))
        except ValueError as e:
            raise ApiError(f"messages: {' '.join(str(e).split())}", "messages") from None
        return generator.tokenizer.encode(text, typed).tolist()  # typed special tokens as text, as the chat
    return _prompt_ids(body, generator)[0].tolist()
