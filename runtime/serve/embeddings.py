"""OpenAI's `POST /v1/embeddings` over an embedding model (Qwen3-VL-Embedding: the server
started on a checkpoint whose sentence-transformers files say last-token pooling, or with
`--pooling last`), plus vLLM's multimodal form. `add_embedding_routes(app, ...)` mounts it.

- `input`: a string, a list of strings, a list of token ids or a list of such lists: one
  vector each, in order. A string is embedded in the model card's format
  (runtime/embedding.py `item_messages`): the instruction (`instruction`, default "Represent
  the user's input.") as the system message, the string as the user turn, the generation
  prompt; token ids are taken as the whole prompt, as given.
- `messages` (vLLM's chat form, instead of `input`): one item, a chat with image and video
  parts as /v1/chat/completions takes them, the instruction as its system message when it
  has none; rendered with the generation prompt.
- `dimensions` (Matryoshka: the first N values, then normalized), `encoding_format` float or
  base64 (little-endian f32, as OpenAI's client decodes it), `usage` {prompt_tokens,
  total_tokens}.

Each item is a job of the engine (runtime/serve/scheduler.py, `Job.pooled`), started between
decode steps, even while every lane decodes (`start_pooled`, on the engine's thread): it and
the embedding jobs right behind it in line, as many as the module's batched entry has lanes,
are prepared and placed in blocks (a shared prefix, e.g. the instruction, found in the prefix
cache); those whose rests are planned in lane buckets (`runtime.embedding.lane_plan`: chunks of
the lane bucket and its tails, e.g. an image item's 64 + 16 rows) are prefilled and pooled together,
step by step, a step's chunks of one size in calls of exactly B of them (`pool_<S>x<B>`,
emitter/text_pool.py; runtime/embedding.py `pooled_rows`, `lane_groups`: no spare lane), the others each alone. At
most WINDOW (or the lanes, if more) of a request's items wait in the queue at once. Nothing is tokenized or decoded
on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
import uuid
from dataclasses import dataclass

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.embedding import (PoolingError, check_dimensions, finish, item_messages, lane_plan, pooled_rows,
                               with_instruction)
from runtime.inputs.chat import Media, build_prompt
from runtime.serve import protocol
from runtime.serve.body import read_json
from runtime.serve.errors import ApiError, shown
from runtime.serve.media import MediaFolder
from runtime.serve.respond import answers
from runtime.serve.scheduler import Job, as_api_error

FIELDS = ("input", "messages", "model", "dimensions", "encoding_format", "instruction", "mm_processor_kwargs",
          *protocol.IGNORED)
ENCODINGS = ("float", "base64")
WINDOW = 2  # a request's items queued at once, at least (the lanes, if more: one batched call's worth)


@dataclass
class Items:
    jobs: list[Job]
    params: list[str]  # the field each job's item came from (errors name it)
    folder: MediaFolder
    dimensions: int | None
    encoding: str


def _check_model(body: dict, generator, model_id: str) -> None:
    if body.get("model") is not None and body["model"] != model_id:
        raise ApiError(f"model: {shown(body['model'])}: this server serves {model_id!r}", "model", 404,
                       "model_not_found")
    if generator.pooling is None:
        raise ApiError(f"model: {model_id!r} is served as a generative model, not an embedding model: start the "
                       "server with --pooling last (or serve a checkpoint whose modules.json says last-token pooling)",
                       "model", code="model_not_embedding")


def _token_ids(value, param: str, vocab: int) -> list[int] | None:
    """`value` as token ids (None if it is not a list of integers); out of range: ApiError."""
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value):
        return None
    bad = [t for t in value if not 0 <= t < vocab]
    if bad:
        raise ApiError(f"{param}: token id {bad[0]}: outside the vocabulary [0, {vocab})", param)
    return value


def input_items(value, vocab: int) -> list[tuple[str, str | list[int]]]:
    """OpenAI's `input` as (param, text or token ids) items, in order."""
    expected = "expected a non-empty string, a non-empty list of them, or token ids (a list, or a list of lists)"
    if isinstance(value, str):
        if not value:
            raise ApiError(f"input: an empty string; {expected}", "input")
        return [("input", value)]
    if not isinstance(value, list) or not value:
        raise ApiError(f"input: {shown(value)}: {expected}", "input")
    ids = _token_ids(value, "input", vocab)
    if ids is not None:
        return [("input", ids)]
    items = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if isinstance(item, str) and item:
            items.append((param, item))
        elif (ids := _token_ids(item, param, vocab)) is not None:
            items.append((param, ids))
        else:
            raise ApiError(f"{param}: {shown(item)}: expected a non-empty string or a non-empty list of token ids",
                           param)
    return items


def parse(body, generator, limits, model_id: str, loop) -> Items:
    """The checked request as embedding jobs, their media written (ApiError at the first fault)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    protocol._refused(body, FIELDS)
    _check_model(body, generator, model_id)
    try:
        dimensions = check_dimensions(body.get("dimensions"), generator.text.cfg.hidden_size, "dimensions:")
    except PoolingError as e:
        raise ApiError(str(e), "dimensions") from None
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise ApiError(f"encoding_format: {shown(encoding)}: expected 'float' or 'base64'", "encoding_format")
    instruction = body.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise ApiError(f"instruction: {shown(instruction)}: expected a string", "instruction")
    if ("input" in body) == ("messages" in body):
        raise ApiError("input: expected exactly one of input (OpenAI's) and messages (vLLM's chat form)", "input")
    folder = MediaFolder(limits.allowed_local_media, limits.max_image_pixels)
    jobs, params = [], []
    try:
        if "messages" in body:
            messages, found = protocol._messages(body)
            if len(found) > limits.max_media:
                raise ApiError(f"messages: {len(found)} images and videos: more than the {limits.max_media} this "
                               "server accepts (--max-media)", "messages", code="too_many_media")
            policy = limits.image_budget.for_request(body, generator.policy)
            media = [Media(kind, folder.path(url, kind, param), name=param, policy=policy if kind == "image" else None)
                     for kind, url, param in found]
            request = protocol.ChatRequest(with_instruction(messages, instruction), found, {}, 1)
            jobs.append(Job(request, generator.sampling, media, loop, pooled=True))
            params.append("messages")
        else:
            for param, item in input_items(body["input"], generator.text.cfg.vocab_size):
                if isinstance(item, str):
                    request = protocol.ChatRequest(item_messages([{"type": "text", "text": item}], instruction), [],
                                                   {}, 1)
                    job = Job(request, generator.sampling, [], loop, pooled=True)
                else:
                    job = Job(protocol.ChatRequest([], [], {}, 1), generator.sampling, [], loop, pooled=True)
                    job.prompt = build_prompt(np.asarray(item, np.int64), generator.text.token_ids, 1, [], None)
                jobs.append(job)
                params.append(param)
    except BaseException:
        folder.close()
        raise
    return Items(jobs, params, folder, dimensions, encoding)


def check_items(generator, items: Items) -> None:
    """Each item's prompt against the context (from the text and the image headers; a video's
    tokens are counted when the engine decodes it), off the event loop."""
    for job, param in zip(items.jobs, items.params):
        try:
            if job.prompt is not None:
                generator.text.check_request(int(job.prompt.ids.size), 1)
            else:
                generator.check_prompt(job.request.messages, job.media, 1)
        except ValueError as e:
            error = as_api_error(e)
            raise items.folder.scrub(ApiError(f"{param}: {error.message}", param, error.status, error.code)) from None


async def run_items(request: Request, engine, items: Items) -> list[tuple[np.ndarray, int]] | None:
    """(pooled row, prompt tokens) of every item, in order; None if the client left (the jobs
    cancelled)."""
    try:
        return await answers(request, engine, items.jobs, max(WINDOW, engine.lanes), "hidden",
                             lambda i, error: items.folder.scrub(error))
    finally:
        items.folder.close()


def start_pooled(engine, first: Job) -> bool:
    """The engine's start of an embedding job (`Engine._start`, on its thread): `first` and the
    embedding jobs right behind it (up to the batched entry's lanes; those that join the line
    while these are prepared, e.g. their images encoded, as well) each prepared and placed
    in blocks, then pooled (together where `lane_plan`, else alone), each answered ("start",
    prompt tokens), ("hidden", row), their blocks given back. False (`first` kept, first in
    line) when its blocks are not free now; a job behind it that finds none waits first in
    line, with those after it."""
    from emitter.text_pool import pool_lane_counts

    text, gen = engine.text, engine.generator
    most = max([1] + pool_lane_counts(text.shape))
    jobs, placed = [first] + engine.take_pooled(most - 1), []
    for i in itertools.count():
        if i == len(jobs):  # and those that joined the line while these were prepared
            jobs += engine.take_pooled(most - len(jobs))
            if i == len(jobs):
                break
        job = jobs[i]
        if i and job.cancelled.is_set():
            engine.metrics.requests.labels("cancelled").inc()
            continue
        try:
            if job.prompt is None:
                job.prompt = gen.prepare(job.request.messages, job.media, 1, encode=engine.encode)
            got = text.admit(job.prompt)
        except Exception as e:  # noqa: BLE001 - one item's fault ends it alone
            _fail(engine, job, e)
            continue
        if got is None:  # no blocks now: this one and those after it wait, first in line
            engine.held.extendleft(reversed(jobs[max(i, 1):]))
            if i == 0:
                return False
            break
        placed.append((job, *got))
    try:
        together = [p for p in placed if lane_plan(text, p[0].prompt, p[2]) is not None]
        for job, blocks, start in placed:
            if not any(job is t[0] for t in together):
                try:
                    _answer(engine, job, text.prefill_blocks(blocks, job.prompt, start, pooled=True), start)
                except Exception as e:  # noqa: BLE001
                    _fail(engine, job, e)
        if together:
            try:
                rows = pooled_rows(text, [t[1] for t in together], [t[0].prompt for t in together],
                                   [t[2] for t in together])
            except Exception as e:  # noqa: BLE001 - the calls' fault ends their items
                for job, _, _ in together:
                    _fail(engine, job, e)
            else:
                for (job, _, start), row in zip(together, rows):
                    _answer(engine, job, row, start)
    finally:
        for _, blocks, _ in placed:
            text.release(blocks)
    return True


def _answer(engine, job: Job, row: np.ndarray, start: int) -> None:
    tokens = int(job.prompt.ids.size)
    engine.metrics.prefix_hit_tokens.inc(start)
    engine.metrics.prompt_tokens.inc(tokens)
    engine.metrics.requests.labels("finished").inc()
    job.send("start", tokens)
    job.send("hidden", row)


def _fail(engine, job: Job, e: Exception) -> None:
    error = e if isinstance(e, ApiError) else as_api_error(e)
    engine.metrics.requests.labels("refused" if error.status < 500 else "failed").inc()
    job.send("error", error)


def encoded(vector: np.ndarray, encoding: str):
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


def add_embedding_routes(app, generator, engine, model_id: str, limits) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        try:
            body = await read_json(request, limits.max_body_bytes)
            loop = asyncio.get_running_loop()
            items = await asyncio.to_thread(parse, body, generator, limits, model_id, loop)
            try:
                await asyncio.to_thread(check_items, generator, items)
            except BaseException:
                items.folder.close()
                raise
        except ApiError:
            engine.metrics.requests.labels("refused").inc()
            raise
        rows = await run_items(request, engine, items)
        if rows is None:
            return Response(status_code=499)  # the client left: no one reads it
        normalize = generator.pooling.normalize
        data = [{"object": "embedding", "index": i,
                 "embedding": encoded(finish(row, normalize, items.dimensions), items.encoding)}
                for i, (row, _) in enumerate(rows)]
        tokens = sum(n for _, n in rows)
        return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": model_id, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
