"""Reranker models (Qwen3-VL-Reranker): vLLM's `POST /v1/rerank` (also `/rerank`; Jina's and
Cohere's shape) and `POST /score` (also `/v1/score`). `add_rerank_routes(app, ...)` mounts them.

A (query, document) pair is scored as the model card does: a system turn telling the model
to judge whether the Document meets the requirements, a user turn of content parts
`<Instruct>: {instruction}`, `<Query>:`, the query's parts, `\\n<Document>:`, the document's
parts, rendered by the checkpoint's own chat template with its generation prompt; the
prompt is prefilled by the engine like a chat's (a job of its own, batched with the others
between decode steps, the shared query prefix found in the prefix cache) and its last
position's logits give score = sigmoid(logit["yes"] - logit["no"]), i.e. the softmax over
[no, yes] (vLLM's `classifier_from_token`). The server holds a reranker when started with
vLLM's `--hf-overrides '{"classifier_from_token": ["no", "yes"], ...}'`, or when the
checkpoint's README says it is one (`reranker_checkpoint`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from runtime.checkpoints.model_card import card_names
from runtime.inputs.chat import Media
from runtime.serve import protocol
from runtime.serve.body import read_json
from runtime.serve.errors import ApiError, shown
from runtime.serve.media import MediaFolder
from runtime.serve.respond import answers
from runtime.serve.scheduler import Job, as_api_error

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
CLASSIFIER_TOKENS = ("no", "yes")  # vLLM's classifier_from_token for Qwen3(-VL)-Reranker: [negative, positive]
OVERRIDE_FIELDS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker", "method")
ARCHITECTURES = ("Qwen3VLForSequenceClassification", "Qwen3ForSequenceClassification")
COMMON = ("model", "instruction", "use_activation", "mm_processor_kwargs", *protocol.IGNORED)
RERANK_FIELDS = ("query", "documents", "top_n", "return_documents", *COMMON)
SCORE_FIELDS = ("text_1", "text_2", *COMMON)
PARTS = {"text": None, **protocol.MEDIA_PARTS}
WINDOW = 2  # a request's pairs queued at once: the engine prefills one while the next waits


def classifier_tokens(overrides: str | None) -> tuple[str, str] | None:
    """The (negative, positive) tokens that vLLM's `--hf-overrides` JSON names in
    `classifier_from_token` (None without the flag); ValueError naming the field at fault."""
    if overrides is None:
        return None
    try:
        value = json.loads(overrides)
    except ValueError as e:
        raise ValueError(f"--hf-overrides: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("--hf-overrides: expected a JSON object")
    for key in value:
        if key not in OVERRIDE_FIELDS:
            raise ValueError(f"--hf-overrides: field {key!r}: not taken by this server (it takes vLLM's reranker "
                             f"fields: {', '.join(OVERRIDE_FIELDS)})")
    names = value.get("architectures", [ARCHITECTURES[0]])
    if not isinstance(names, list) or not names or any(n not in ARCHITECTURES for n in names):
        raise ValueError(f"--hf-overrides: architectures {shown(names)}: expected [\"{ARCHITECTURES[0]}\"]")
    if not isinstance(value.get("is_original_qwen3_reranker", True), bool):
        raise ValueError("--hf-overrides: is_original_qwen3_reranker: expected true or false")
    if value.get("method", "from_2_way_softmax") != "from_2_way_softmax":
        raise ValueError(f"--hf-overrides: method {shown(value['method'])}: expected 'from_2_way_softmax'")
    tokens = value.get("classifier_from_token")
    if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) and t for t in tokens)):
        raise ValueError(f"--hf-overrides: classifier_from_token {shown(tokens)}: expected two tokens, "
                         "[negative, positive], as [\"no\", \"yes\"]")
    return tokens[0], tokens[1]


def reranker_checkpoint(model_dir) -> bool:
    """Whether the folder is a reranker by its own files: README.md's front matter (the Hugging
    Face model card) with `pipeline_tag: text-ranking` or a tag naming rerank, as
    Qwen3-VL-Reranker's has."""
    return card_names(model_dir, "text-ranking", "rerank")


@dataclass(frozen=True)
class Classifier:
    """The two tokens a reranker's score is read from: score = softmax over their logits, the
    positive one's probability (sigmoid of positive - negative)."""
    negative: int
    positive: int
    names: tuple[str, str]

    @classmethod
    def of(cls, tokenizer, names: tuple[str, str]) -> "Classifier":
        """The tokens' ids in the checkpoint's vocabulary (each must be one token)."""
        ids = []
        for name in names:
            token = tokenizer.tokenizer.token_to_id(name)
            if token is None:
                raise ValueError(f"classifier token {name!r}: not a token of {tokenizer.model_dir / 'tokenizer.json'} "
                                 "(a reranker's vocabulary holds it; --hf-overrides classifier_from_token names them)")
            ids.append(token)
        return cls(ids[0], ids[1], tuple(names))

    @property
    def ids(self) -> tuple[int, int]:
        return self.negative, self.positive


def score_of(logits, activation: bool = True) -> float:
    """sigmoid(positive - negative) of the two logits (in float64), or the difference itself."""
    d = float(logits[1]) - float(logits[0])
    if not activation:
        return d
    return 1.0 / (1.0 + math.exp(-d)) if d >= 0 else math.exp(d) / (1.0 + math.exp(d))


@dataclass
class Item:
    """A query or a document: its content parts as the template takes them, its media
    (kind, url, param) in order, and what the response echoes."""
    parts: list
    media: list
    echo: dict
    param: str  # where it is in the request: documents[2], text_2[0]


def item(value, param: str) -> Item:
    """A string, {"text": ...}, or vLLM's {"content": [text, image_url or video_url parts]}."""
    if isinstance(value, str):
        return Item([{"type": "text", "text": value}], [], {"text": value}, param)
    if isinstance(value, dict) and set(value) == {"text"} and isinstance(value["text"], str):
        return item(value["text"], param)
    content = value.get("content") if isinstance(value, dict) else None
    if not isinstance(value, dict) or set(value) != {"content"} or not isinstance(content, list):
        raise ApiError(f"{param}: {shown(value)}: expected a string or an object {{content: [text, image_url or "
                       "video_url parts]}", param)
    if not content:
        raise ApiError(f"{param}.content: expected at least one part", f"{param}.content")
    parts, media = [], []
    for i, part in enumerate(content):
        where = f"{param}.content[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PARTS:
            raise ApiError(f"{where}.type: {shown(kind)}: expected 'text', 'image_url' or 'video_url'",
                           f"{where}.type")
        if kind == "text":
            parts.append({"type": "text", "text": protocol._text(part, where)})
            continue
        url = part.get(kind)
        url = url.get("url") if isinstance(url, dict) else url
        media.append((PARTS[kind], url, f"{where}.{kind}.url"))
        parts.append({"type": PARTS[kind]})
    return Item(parts, media, {"multi_modal": content}, param)


def items(value, param: str, many: bool = True) -> list[Item]:
    """vLLM's ScoreInputs: one item, a list of them, or one {"content": [...]} whose every part
    is an item of its own (`many`: a list or a content object; else one item)."""
    if not many:
        if isinstance(value, list):
            raise ApiError(f"{param}: expected one string or {{content: [...]}}, not a list", param)
        return [item(value, param)]
    if isinstance(value, dict) and set(value) == {"content"} and isinstance(value["content"], list):
        return [item({"content": [part]}, f"{param}.content[{i}]") for i, part in enumerate(value["content"])] or \
            [item(value, param)]
    if isinstance(value, str):
        return [item(value, param)]
    if not isinstance(value, list):
        raise ApiError(f"{param}: {shown(value)}: expected a list of strings or {{content: [...]}} objects", param)
    if not value:
        raise ApiError(f"{param}: expected at least one item", param)
    return [item(v, f"{param}[{i}]") for i, v in enumerate(value)]


def pair_messages(query: Item, document: Item, instruction: str) -> list[dict]:
    """The model card's chat of one (query, document) pair (Qwen3VLReranker.format_mm_instruction)."""
    content = [{"type": "text", "text": "<Instruct>: " + instruction}, {"type": "text", "text": "<Query>:"},
               *query.parts, {"type": "text", "text": "\n<Document>:"}, *document.parts]
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
            {"role": "user", "content": content}]


@dataclass
class Pairs:
    """A checked request: its (query, document) pairs' jobs, and how the answer is written."""
    jobs: list
    folder: MediaFolder
    activation: bool
    params: list  # each pair's document's place, named by a fault of its prompt (too long, say)

    def fault(self, i: int, error: ApiError) -> ApiError:
        """`error` of pair `i`, named by its document when it names the chat's messages."""
        error = self.folder.scrub(error)
        if error.param != "messages":
            return error
        return ApiError(f"{self.params[i]}: {error.message}", self.params[i], error.status, error.code)


def common(body, known, model_id: str) -> tuple[str, bool]:
    """The fields /rerank and /score share: (instruction, use_activation)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for name in body:
        if name not in known:
            raise ApiError(f"{name}: not supported by this server (refused rather than ignored)", name,
                           code="unsupported_field")
    if body.get("model") is not None and body["model"] != model_id:
        raise ApiError(f"model: {shown(body['model'])}: this server serves {model_id!r}", "model", 404,
                       "model_not_found")
    instruction = body.get("instruction")
    if instruction is not None and (not isinstance(instruction, str) or not instruction.strip()):
        raise ApiError("instruction: expected a non-empty string", "instruction")
    activation = body.get("use_activation")
    if activation is not None and not isinstance(activation, bool):
        raise ApiError(f"use_activation: {shown(activation)}: expected true or false", "use_activation")
    return instruction or DEFAULT_INSTRUCTION, activation is not False


def make_pairs(body, pairs: list[tuple[Item, Item]], instruction: str, activation: bool, generator, limits,
               classifier: Classifier, loop) -> Pairs:
    """Each pair as a score job answering on `loop`, its media written to the request's folder
    (ApiError at the first fault; the folder closed then)."""
    policy = limits.image_budget.for_request(body, generator.policy)
    folder = MediaFolder(limits.allowed_local_media, limits.max_image_pixels)
    try:
        written: dict[str, Media] = {}  # a query's media are written once for all its pairs
        jobs = []
        for query, document in pairs:
            found = query.media + document.media
            if len(found) > limits.max_media:
                raise ApiError(f"{found[-1][2]}: {len(found)} images and videos in one (query, document) pair: more "
                               f"than the {limits.max_media} this server accepts (--max-media)",
                               found[-1][2].split(".content")[0], code="too_many_media")
            media = []
            for kind, url, param in found:
                if param not in written:
                    written[param] = Media(kind, folder.path(url, kind, param), name=param,
                                           policy=policy if kind == "image" else None)
                media.append(written[param])
            request = protocol.ChatRequest(pair_messages(query, document, instruction), found, {}, 1)
            jobs.append(Job(request, generator.sampling, media, loop, classify=classifier.ids))
    except BaseException:
        folder.close()
        raise
    return Pairs(jobs, folder, activation, [d.param for _, d in pairs])


def rerank_pairs(body, generator, limits, model_id: str, classifier: Classifier, loop) -> tuple[Pairs, list, int]:
    """A /rerank body checked: (its pairs, the documents, top_n: 0 for all)."""
    instruction, activation = common(body, RERANK_FIELDS, model_id)
    if "query" not in body:
        raise ApiError("query: required (a string or {content: [...]})", "query")
    if "documents" not in body:
        raise ApiError("documents: required (a list of strings or {content: [...]} objects)", "documents")
    query = items(body["query"], "query", many=False)[0]
    documents = items(body["documents"], "documents")
    top_n = protocol._number(body, "top_n", int, 0, None) or 0
    protocol._flag(body, "return_documents")
    return make_pairs(body, [(query, d) for d in documents], instruction, activation, generator, limits,
                      classifier, loop), documents, top_n


def score_pairs(body, generator, limits, model_id: str, classifier: Classifier, loop) -> Pairs:
    """A /score body checked: text_1 against text_2, one to one, one to many or n to n."""
    instruction, activation = common(body, SCORE_FIELDS, model_id)
    for name in ("text_1", "text_2"):
        if name not in body:
            raise ApiError(f"{name}: required (a string, {{content: [...]}}, or a list of them)", name)
    first, second = items(body["text_1"], "text_1"), items(body["text_2"], "text_2")
    if len(first) > 1 and len(first) != len(second):
        raise ApiError(f"text_1: {len(first)} items against text_2's {len(second)}: expected 1 to 1, 1 to N or "
                       "N to N", "text_1")
    pairs = list(zip(first * len(second) if len(first) == 1 else first, second))
    return make_pairs(body, pairs, instruction, activation, generator, limits, classifier, loop)


async def run_pairs(request: Request, engine, generator, pairs: Pairs) -> list[tuple[float, int]] | None:
    """(score, prompt tokens) of every pair, in order; None if the client left (the jobs
    cancelled). Each prompt is checked against the context first (off the event loop), and
    at most WINDOW of the request's jobs wait in the engine's queue at once."""
    try:
        for i, job in enumerate(pairs.jobs):
            try:
                await asyncio.to_thread(generator.check_prompt, job.request.messages, job.media, 1)
            except ValueError as e:
                raise pairs.fault(i, as_api_error(e)) from None
        found = await answers(request, engine, pairs.jobs, WINDOW, "logits", pairs.fault)
        return None if found is None else [(score_of(logits, pairs.activation), tokens) for logits, tokens in found]
    finally:
        pairs.folder.close()


def add_rerank_routes(app, generator, engine, model_id: str, limits) -> None:
    """/v1/rerank, /rerank, /score and /v1/score; each a 400 naming `model` on a server
    that does not hold a reranker (`limits.reranker` None)."""

    def classifier(path: str) -> Classifier:
        if limits.reranker is None:
            raise ApiError(f"{path}: {model_id!r} is not served as a reranker (start the server with --hf-overrides "
                           "'{\"classifier_from_token\": [\"no\", \"yes\"]}', or give it a Qwen3-VL-Reranker "
                           "checkpoint)", "model", code="model_not_reranker")
        return limits.reranker

    async def rerank(request: Request):
        found = classifier(request.url.path)
        body = await read_json(request, limits.max_body_bytes)
        pairs, documents, top_n = await asyncio.to_thread(rerank_pairs, body, generator, limits, model_id, found,
                                                          asyncio.get_running_loop())  # media decoded off the loop
        scored = await run_pairs(request, engine, generator, pairs)
        if scored is None:
            return Response(status_code=499)
        order = sorted(range(len(scored)), key=lambda i: -scored[i][0])[:top_n or None]
        echo = body.get("return_documents") is not False
        results = [dict({"index": i, "relevance_score": scored[i][0]}, **({"document": documents[i].echo}
                                                                            if echo else {})) for i in order]
        tokens = sum(t for _, t in scored)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model_id, "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def score(request: Request):
        found = classifier(request.url.path)
        body = await read_json(request, limits.max_body_bytes)
        pairs = await asyncio.to_thread(score_pairs, body, generator, limits, model_id, found,
                                        asyncio.get_running_loop())
        scored = await run_pairs(request, engine, generator, pairs)
        if scored is None:
            return Response(status_code=499)
        tokens = sum(t for _, t in scored)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model_id,
                "data": [{"index": i, "object": "score", "score": s} for i, (s, _) in enumerate(scored)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    for path in ("/v1/rerank", "/rerank"):
        app.post(path)(rerank)
    for path in ("/score", "/v1/score"):
        app.post(path)(score)
