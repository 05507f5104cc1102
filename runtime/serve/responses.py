"""OpenAI's Responses API, `POST /v1/responses`, stateless, over the chat path.

The request is translated into a chat completions body (`to_chat`): `instructions` the
system message, `input` a string or items (messages with `input_text` / `input_image` /
`output_text` parts, `function_call` and `function_call_output` items of a tool loop;
`reasoning` items are dropped, as the chat path drops an earlier turn's reasoning), tools
flat (`{type, name, parameters}`), `tool_choice`, `max_output_tokens`, `text.format`. The
chat route's own checks then make the job (`checked`), the engine generates, and the chat
path's `Answer` (runtime/serve/answer.py) splits the text into reasoning, content and tool
calls: here they become output items (`reasoning`, `message`, `function_call`), whole or as
the typed Server-Sent Events of runtime/serve/response_events.py. A fault names the
Responses field (`input[2].content[0].image_url`, `max_output_tokens`), not the chat one.

Nothing is stored: `store` is accepted without effect, and `previous_response_id`,
`conversation` or an `item_reference` (which need stored state) are refused.
"""

from __future__ import annotations

from fastapi import Request

from runtime.serve.errors import ApiError, shown
from runtime.serve.protocol import SAMPLING_FIELDS
from runtime.serve.response_events import ResponseReply, collect, stream
from runtime.serve.respond import respond

PASSED = ("model", "stream", "temperature", "top_p", "parallel_tool_calls", *SAMPLING_FIELDS,
          "chat_template_kwargs", "mm_processor_kwargs", "thinking_token_budget", "ignore_eos")  # vLLM's too
IGNORED = ("store", "metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "stream_options")
STATEFUL = {"previous_response_id": "previous_response_not_found", "conversation": "conversation_not_found"}
HANDLED = ("input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning", "truncation",
           "include", "background", "max_tool_calls", "top_logprobs")
STATIC_NAMES = [("max_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
                ("response_format.json_schema", "text.format"), ("response_format.type", "text.format.type"),
                ("response_format", "text.format"), ("tool_choice.function.name", "tool_choice.name"),
                ("messages", "input")]


def add_routes(app, engine, model_id: str, checked) -> None:
    """Mounts POST /v1/responses; `checked(request, translate)` is the chat route's own
    request check (runtime/serve/app.py), run on the translated body."""
    @app.post("/v1/responses")
    async def responses(request: Request):
        translation = Translation()
        try:
            job, folder = await checked(request, translation)
            reply = ResponseReply(model_id, translation.body, job.request, translation.rename)
            return await respond(request, engine, job, lambda tokens, gone: collect(job, reply, gone, folder),
                                 lambda tokens: stream(job, reply, folder), folder)
        except ApiError as e:
            raise translation.rename(e) from None


class Translation:
    """Called with the Responses body, gives the chat body; remembers the body, and where
    each chat field came from (`rename` puts a chat field's error back in Responses terms)."""

    def __init__(self):
        self.body, self.names = {}, list(STATIC_NAMES)

    def __call__(self, body):
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        self.body = body
        return to_chat(body, self.names)

    def rename(self, e: ApiError) -> ApiError:
        if not e.param:
            return e
        for old, new in sorted(self.names, key=lambda pair: -len(pair[0])):
            if e.param == old or e.param.startswith(old) and e.param[len(old)] in ".[":
                param = new + e.param[len(old):]
                return ApiError(e.message.replace(e.param, param, 1), param, e.status, e.code, e.headers)
        return e


def to_chat(body: dict, names: list) -> dict:
    """The chat completions body of a Responses body (ApiError naming the Responses field)."""
    for name, code in STATEFUL.items():
        if body.get(name) is not None:
            raise ApiError(f"{name}: this server stores no responses or conversations (stateless); send the whole "
                           "conversation in `input`", name, code=code)
    for name in body:
        if name not in PASSED + IGNORED + HANDLED:
            raise ApiError(f"{name}: not supported by this server (refused rather than ignored)", name,
                           code="unsupported_field")
    _refuse_unless(body, "background", (None, False))
    _refuse_unless(body, "truncation", (None, "disabled"))
    _refuse_unless(body, "max_tool_calls", (None,))
    _refuse_unless(body, "top_logprobs", (None, 0))
    include = body.get("include")
    if include:
        raise ApiError(f"include: {shown(include)}: this server adds nothing on request", "include",
                       code="unsupported_value")
    chat = {name: body[name] for name in PASSED if name in body}
    messages = chat["messages"] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError("instructions: expected a string", "instructions")
        names.extend([("messages[0]", "instructions"), ("messages[0].content", "instructions")])
        messages.append({"role": "system", "content": instructions})
    _input(body.get("input"), messages, names)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"], names)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise ApiError("text: expected {format}", "text")
        _refuse_unless(text, "verbosity", (None, "medium"), "text.verbosity")
        forced = chat.get("tool_choice") not in (None, "none", "auto")
        if text.get("format") is not None and not forced:  # a forced call writes no text to format
            chat["response_format"] = _format(text["format"])
    _reasoning(body.get("reasoning"))
    return chat


def _refuse_unless(body: dict, name: str, allowed: tuple, param: str | None = None) -> None:
    if body.get(name) not in allowed:
        raise ApiError(f"{param or name}: {shown(body[name])}: not supported by this server (expected "
                       f"{' or '.join(repr(a) for a in allowed if a is not None) or 'null'})", param or name,
                       code="unsupported_value")


def _reasoning(value) -> None:
    """`reasoning`: only its defaults (the checkpoint's template decides whether it thinks;
    `chat_template_kwargs` {"enable_thinking": false} turns a Thinking template's off)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ApiError("reasoning: expected {effort, summary}", "reasoning")
    for key, item in value.items():
        if item is not None:
            raise ApiError(f"reasoning.{key}: {shown(item)}: not supported by this server (reasoning follows the "
                           "chat template; chat_template_kwargs {\"enable_thinking\": false} turns it off)",
                           f"reasoning.{key}", code="unsupported_value")


def _input(value, messages: list, names: list) -> None:
    if isinstance(value, str):
        names.append((f"messages[{len(messages)}].content", "input"))
        messages.append({"role": "user", "content": value})
        return
    if not isinstance(value, list) or not value:
        raise ApiError("input: expected a string or a non-empty list of items", "input")
    for j, item in enumerate(value):
        where = f"input[{j}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        k = len(messages)
        if kind == "message":
            names.append((f"messages[{k}]", where))
            messages.append({"role": item.get("role"), "content": _parts(item.get("content"), where, k, names)})
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if not (last and last["role"] == "assistant" and "tool_call_id" not in last):
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            calls = last.setdefault("tool_calls", [])
            at = f"messages[{len(messages) - 1}].tool_calls[{len(calls)}]"
            names.extend([(at, where), (f"{at}.function", where)])
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError(f"{where}.call_id: expected a string", f"{where}.call_id")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": item.get("name"), "arguments": item.get("arguments")}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(f"{where}.call_id: expected a string", f"{where}.call_id")
            names.extend([(f"messages[{k}].content", f"{where}.output"), (f"messages[{k}]", where)])
            output = item.get("output")
            content = _parts(output, f"{where}.output", k, names) if isinstance(output, list) else output
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind == "reasoning":
            continue  # the chat path keeps no earlier turn's reasoning either
        elif kind == "item_reference":
            raise ApiError(f"{where}: an item_reference needs stored items; this server stores none (send the item "
                           "itself)", where, code="unsupported_value")
        else:
            raise ApiError(f"{where}.type: {shown(kind)}: expected 'message', 'function_call', "
                           "'function_call_output' or 'reasoning'", f"{where}.type")


PART_TEXT = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


def _parts(content, where: str, k: int, names: list):
    """A message's content as chat content: a string as is, parts one for one."""
    if not isinstance(content, list):
        return content  # a string, or a fault the chat check names
    parts = []
    for p, part in enumerate(content):
        at = f"{where}.content[{p}]" if not where.endswith(".output") else f"{where}[{p}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in PART_TEXT:
            names.append((f"messages[{k}].content[{p}].text", f"{at}.{PART_TEXT[kind]}"))
            parts.append({"type": "text", "text": part.get(PART_TEXT[kind])})
        elif kind == "input_image":
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise ApiError(f"{at}.file_id: this server stores no files; give image_url (a data: URL or an "
                               "allowed URL)", f"{at}.file_id", code="unsupported_value")
            names.append((f"messages[{k}].content[{p}].image_url.url", f"{at}.image_url"))
            names.append((f"messages[{k}].content[{p}]", at))
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            raise ApiError(f"{at}.type: {shown(kind)}: expected 'input_text', 'input_image' or 'output_text'",
                           f"{at}.type")
    return parts


def _tools(tools, names: list) -> list:
    if not isinstance(tools, list):
        raise ApiError("tools: expected a list of {type: 'function', name, parameters}", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(f"tools[{i}].type: {shown(kind)}: this server runs no hosted tools; expected 'function'",
                           f"tools[{i}].type")
        names.append((f"tools[{i}].function", f"tools[{i}]"))
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k not in ("type", "strict")}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise ApiError(f"tool_choice.type: {shown(choice.get('type'))}: expected 'function'", "tool_choice.type")
    return choice


def _format(fmt) -> dict:
    """text.format as chat's response_format: json_schema's name, schema and strict are
    flat here, nested under json_schema there."""
    if not isinstance(fmt, dict):
        raise ApiError("text.format: expected {type: text | json_object | json_schema}", "text.format")
    if fmt.get("type") != "json_schema":
        return fmt
    if "schema" not in fmt:
        raise ApiError("text.format.schema: required for type json_schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}

