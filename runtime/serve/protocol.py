"""A `/v1/chat/completions` body checked and turned into what the engine runs.

Every field is checked for its type and range; anything wrong is an `ApiError` (400)
naming the field (`messages[1].content[0].image_url.url`, `temperature`, ...). A field
this server does not know is refused by name, never dropped; `n` other than 1 is refused.
Only IGNORED (`user`, `metadata`, `store`, `service_tier`: bookkeeping, nothing about the
answer) are accepted without effect. Tools, `tool_choice`, structured output and the
chat template's kwargs are checked in runtime/serve/agents.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.serve.errors import ApiError, shown

ROLES = ("system", "user", "assistant", "tool", "developer")  # developer: taken as system
MEDIA_PARTS = {"image_url": "image", "video_url": "video"}
SAMPLING_FIELDS = {"temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0), "top_k": (int, -1, None),
                   "min_p": (float, 0.0, 1.0), "seed": (int, 0, None), "presence_penalty": (float, -2.0, 2.0),
                   "frequency_penalty": (float, -2.0, 2.0), "repetition_penalty": (float, 0.0, None)}
MAX_STOPS = 4
IGNORED = ("user", "metadata", "store", "service_tier")
KNOWN = ("messages", "model", "n", "stream", "stream_options", "max_tokens", "max_completion_tokens", "stop",
         "logprobs", "top_logprobs", "ignore_eos", "logit_bias", "mm_processor_kwargs", "thinking_token_budget",
         *SAMPLING_FIELDS, *IGNORED)


@dataclass
class ChatRequest:
    messages: list[dict]  # as the chat template takes them
    media: list[tuple[str, str, str]]  # (kind, url, param) in prompt order
    sampling: dict  # SamplingParams overrides; absent fields keep the checkpoint's
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False  # vLLM's extension: decode to max_tokens past EOS ids
    agents: object = None  # agents.AgentFields: tools, tool_choice, constraint, template kwargs
    answer: object = None  # answer.AnswerSpec, set by the app: how the text becomes the message
    fingerprint: str | None = None  # system_fingerprint
    echo: str = ""  # /v1/completions' echo: the prompt's text, returned before the answer
    thinking_token_budget: int | None = None  # vLLM's: reasoning tokens before `</think>` is forced (None: no limit)


def _number(body: dict, name: str, kind, low, high):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        span = f" in [{low}, {high}]" if high is not None else f" >= {low}"
        raise ApiError(f"{name}: {shown(value)}: expected {'an integer' if kind is int else 'a number'}{span}", name)
    return kind(value)


def _text(part: dict, param: str) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise ApiError(f"{param}.text: expected a string", f"{param}.text")
    return text


def _content(content, role: str, param: str, media: list) -> str | list[dict]:
    """A message's content as the template takes it; media URLs appended to `media`."""
    if content is None and role == "assistant":
        return ""  # an assistant turn of tool calls only
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ApiError(f"{param}: expected a string or a non-empty list of content parts", param)
    parts = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text(part, where)})
        elif kind in MEDIA_PARTS:
            if role != "user":
                raise ApiError(f"{where}: {kind} parts are only accepted in user messages", where)
            url = part.get(kind)
            url = url.get("url") if isinstance(url, dict) else url
            media.append((MEDIA_PARTS[kind], url, f"{where}.{kind}.url"))
            parts.append({"type": MEDIA_PARTS[kind]})
        else:
            raise ApiError(f"{where}.type: {shown(kind)}: expected 'text', 'image_url' or 'video_url'",
                           f"{where}.type")
    return parts


def _messages(body: dict) -> tuple[list[dict], list]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: expected a non-empty list of {role, content} objects", "messages")
    out, media = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where}: expected an object with role and content", where)
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role: {shown(role)}: expected one of {', '.join(ROLES)}", f"{where}.role")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content(message.get("content"), role, f"{where}.content", media)})
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ApiError(f"{where}.tool_calls: only in assistant messages", f"{where}.tool_calls")
            out[-1]["tool_calls"] = history_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            out[-1]["tool_call_id"] = message["tool_call_id"]
    return out, media


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(f"stop: expected a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return stops


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value, param = body.get(name, False), param or name
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{param}: {shown(value)}: expected true or false", param)
    return value


def _include_usage(body: dict) -> bool:
    """stream_options.include_usage: only with stream true (as OpenAI), a boolean."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(f"stream_options: {shown(options)}: expected an object", "stream_options")
    if not _flag(body, "stream"):
        raise ApiError("stream_options: only with stream: true", "stream_options")
    return _flag(options, "include_usage", "stream_options.include_usage")


def _refused(body: dict, known=None) -> None:
    """400 for `n` > 1 and for any field not `known` (default: chat's)."""
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(f"n: {shown(n)}: this server returns one choice per request; expected 1", "n")
    if known is None:
        from runtime.serve.agents import FIELDS
        known = KNOWN + FIELDS
    for name in body:
        if name not in known:
            raise ApiError(f"{name}: not supported by this server (refused rather than ignored)", name,
                           code="unsupported_field")


def logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: {token id (a string of digits): bias in [-100, 100]}."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError("logit_bias: expected an object of token id -> bias", "logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ApiError(f"logit_bias: key {key!r}: expected a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(f"logit_bias: {key}: {bias!r}: expected a number in [-100, 100]", "logit_bias")
        out[int(key)] = float(bias)
    return out


def sampling_overrides(body: dict) -> dict:
    """The sampling fields given (SamplingParams overrides, `logit_bias` as sorted (id, bias)
    pairs), checked; absent ones left out (chat completions and completions alike)."""
    sampling = {name: _number(body, name, *rule) for name, rule in SAMPLING_FIELDS.items()}
    if sampling["top_k"] in (-1, 0):
        sampling["top_k"] = 0 if sampling["top_k"] is not None else None
    if sampling["temperature"] == 0 and sampling["top_p"] is not None:
        sampling["top_p"] = None  # greedy: nucleus mass has no effect
    if sampling["top_p"] == 0:
        raise ApiError("top_p: 0: expected a number in (0, 1]", "top_p")
    sampling["logit_bias"] = tuple(sorted(logit_bias(body).items())) or None
    return {k: v for k, v in sampling.items() if v is not None}


def parse_chat_request(body, max_media: int) -> ChatRequest:
    """The checked request; ApiError (400) at the first field that is wrong."""
    from runtime.serve.agents import agent_fields

    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _refused(body)
    messages, media = _messages(body)
    agents = agent_fields(body)
    if len(media) > max_media:
        raise ApiError(f"messages: {len(media)} images and videos: more than the {max_media} this server accepts "
                       "per request (--max-media)", "messages", code="too_many_media")
    sampling = sampling_overrides(body)
    max_tokens = _number(body, "max_completion_tokens", int, 1, None) or _number(body, "max_tokens", int, 1, None)
    logprobs = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", int, 0, 20) or 0
    if top and not logprobs:
        raise ApiError("top_logprobs: only with logprobs: true", "top_logprobs")
    return ChatRequest(messages, media, sampling, max_tokens,
                       _stop(body), _flag(body, "stream"), _include_usage(body), logprobs, top,
                       _flag(body, "ignore_eos"), agents,
                       thinking_token_budget=_number(body, "thinking_token_budget", int, 0, None))


def check_logit_bias(sampling: dict, vocab: int) -> None:
    """400 for a logit_bias key past the model's vocabulary."""
    bad = [t for t, _ in sampling.get("logit_bias") or () if t >= vocab]
    if bad:
        raise ApiError(f"logit_bias: key '{bad[0]}': expected a token id below the vocabulary's {vocab}", "logit_bias")


def history_tool_calls(calls, param: str) -> list[dict]:
    """An assistant turn's tool_calls as the template takes them: arguments parsed into an
    object (Qwen's newer templates iterate them)."""
    import json

    if not isinstance(calls, list):
        raise ApiError(f"{param}: expected a list of tool calls", param)
    out = []
    for i, call in enumerate(calls):
        where = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(f"{where}.function: expected {{name, arguments}}", f"{where}.function")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ApiError(f"{where}.function.arguments: not a JSON object", f"{where}.function.arguments")
        out.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"],
                                                                             "arguments": arguments}})
    return out
