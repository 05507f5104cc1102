"""Tool calls as the checkpoint's chat template teaches them: the format read from the
template, the model's text parsed into OpenAI `tool_calls` (whole or as it streams), and
the grammar that forces a call for `tool_choice` "required" or a named function.

Two formats, the two vLLM parsers of Qwen's templates:
- `hermes` (Qwen2.5, Qwen3, Qwen3-VL): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>`, each value converted by its parameter's schema type.
A template that writes `<function=` is the second; one that writes `<tool_call>`, the first;
any other renders no tools (`tools` is refused).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps'


def tool_format(template_text: str) -> str | None:
    """'qwen3_coder', 'hermes' or None: how the template writes a tool call."""
    if "<function=" in template_text:
        return "qwen3_coder"
    if OPEN in template_text:
        return "hermes"
    return None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else dict(out, index=index)


def _held(text: str, marker: str) -> int:
    """Characters at the end of `text` that begin `marker` (held back while streaming)."""
    return max((k for k in range(len(marker) - 1, 0, -1) if text.endswith(marker[:k])), default=0)


class ToolParser:
    """The model's text, fed as it streams, split into content and tool calls: `feed(text)`
    and `finish()` return events ("content", text) and ("call", ToolCall). A block that does
    not parse stays content, as vLLM's parsers leave it.

    `incremental` (hermes only, for streaming): a call's arguments go out as they come,
    ("call_start", ToolCall with no arguments) once its name is read, ("call_args", text)
    pieces (joined: the arguments' JSON as the model wrote it), ("call_end",) at its close.
    A started block that then does not parse ends with what was sent (vLLM does the same)."""

    def __init__(self, fmt: str, schemas: dict[str, dict], incremental: bool = False):
        self.parse_body = {"hermes": self._hermes, "qwen3_coder": self._xml}[fmt]
        self.schemas = schemas  # function name -> its parameters schema
        self.buffer, self.inside, self.calls = "", False, 0
        self.incremental = incremental and fmt == "hermes"
        self.args_at, self.sent = None, 0  # where the started call's arguments begin; characters sent

    def feed(self, text: str) -> list[tuple]:
        self.buffer += text
        events = []
        while True:
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = _held(self.buffer, OPEN)
                    self._content(events, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return events
                self._content(events, self.buffer[:at])
                self.buffer, self.inside = self.buffer[at + len(OPEN):], True
            else:
                at = self.buffer.find(CLOSE)
                if self.incremental:
                    self._stream_arguments(events, at)
                if at < 0:
                    return events
                body, self.buffer, self.inside = self.buffer[:at], self.buffer[at + len(CLOSE):], False
                call = self.parse_body(body)
                if self.args_at is not None:
                    self.args_at, self.sent, self.calls = None, 0, self.calls + 1
                    events.append(("call_end",))
                elif call is None:
                    self._content(events, OPEN + body + CLOSE)
                else:
                    self.calls += 1
                    events.append(("call", call))

    def finish(self) -> list[tuple]:
        """The rest: an unclosed block is content (a started call ends with what was sent)."""
        if self.args_at is not None:
            self.buffer, self.inside, self.args_at, self.sent, self.calls = "", False, None, 0, self.calls + 1
            return [("call_end",)]
        rest = (OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        events = []
        self._content(events, rest)
        return events

    def _stream_arguments(self, events: list, close: int) -> None:
        """The started call's arguments so far: while the block is open, all but what follows
        the last '}' seen (that one may be the outer object's); at its close, up to the outer
        '}'. Joined, the pieces are the arguments as the model wrote them."""
        if self.args_at is None:
            head = HERMES_HEAD.match(self.buffer)
            if head is None:
                return
            events.append(("call_start", ToolCall(json.loads(f'"{head.group(1)}"'), "")))
            self.args_at = head.end()
        region = self.buffer[self.args_at:close if close >= 0 else len(self.buffer)]
        end = region.rfind("}")
        if close < 0 and end < 0:
            end = len(region)
        if end > self.sent:
            events.append(("call_args", region[self.sent:end]))
            self.sent = end

    def _content(self, events: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):  # the newlines between calls are no content
            events.append(("content", text))

    def _hermes(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    def _xml(self, body: str) -> ToolCall | None:
        match = re.fullmatch(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", body, re.S)
        if not match:
            return None
        name = match.group(1).strip()
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments = {}
        for key, value in re.findall(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", match.group(2), re.S):
            arguments[key.strip()] = _typed(value, properties.get(key.strip()))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _stringy(schema) -> bool:
    """A parameter written as bare text: type string, an enum/const of strings, or no schema."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return all(isinstance(c, str) for c in choices)
    return kind in (None, "string") or (isinstance(kind, list) and "string" in kind)


def _typed(value: str, schema) -> object:
    """A qwen3_coder parameter's text as its schema says (vLLM's conversion): a string stays
    text; a number, boolean, object or array is read as JSON, left as text if not."""
    if _stringy(schema):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_tool_calls(fmt: str, schemas: dict, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer; content None when only calls were made."""
    parser = ToolParser(fmt, schemas)
    events = parser.feed(text) + parser.finish()
    calls = [e[1] for e in events if e[0] == "call"]
    content = "".join(e[1] for e in events if e[0] == "content")
    return (content.strip() or None) if calls else content, calls


# -- the grammar of a forced call (llguidance's Lark) -----------------------------------

def _literal(text: str) -> str:
    return json.dumps(text)


def _marker(text: str, single_tokens: set[str]) -> str:
    """A marker as the grammar writes it: its token when the vocabulary has it as one
    (llguidance treats added tokens as special: `<tool_call>` in Lark), else its text."""
    return text if text in single_tokens else _literal(text)


def _hermes_call(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _xml_function(rule: str, name: str, parameters: dict) -> list[str]:
    """Lark rules for one function in qwen3_coder's form: its properties in schema order,
    the required ones always, the others optional; a string value is text without '<'."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    parts, rules = [], []
    for i, (key, schema) in enumerate(properties.items()):
        value = f"{rule}_v{i}"
        schema = schema if isinstance(schema, dict) else {}
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None and _stringy(schema):
            rules.append(f"{value}: " + " | ".join(_literal(c) for c in choices))
        elif _stringy(schema) and "pattern" not in schema:
            most = schema.get("maxLength")
            rules.append(f"{value}: /[^<]{{{schema.get('minLength', 0)},{most}}}/" if isinstance(most, int)
                         else f"{value}: /[^<]*/")
        elif _stringy(schema):
            from llguidance import regex_to_lark
            pattern = schema["pattern"].removeprefix("^").removesuffix("$")  # the value is the whole match
            rules.append(f"{value}: /{regex_to_lark(pattern)}/")
        else:
            rules.append(f"{value}: %json {json.dumps(dict(schema, **{'x-guidance': JSON_STYLE}))}")
        part = f'{_literal(f"<parameter={key}>" + chr(10))} {value} {_literal(chr(10) + "</parameter>" + chr(10))}'
        parts.append(part if key in required else f"({part})?")
    rules.insert(0, f'{rule}: {_literal(f"<function={name}>" + chr(10))} {" ".join(parts)} "</function>"')
    return rules


def forced_call_grammar(fmt: str, functions: dict[str, dict], parallel: bool, single_tokens: set[str],
                        start: str = "start") -> str:
    """Lark for one tool call (or several when `parallel`) of one of `functions` (name ->
    parameters schema), in the template's format, and nothing else (its top rule `start`)."""
    open_, close = _marker(OPEN, single_tokens), _marker(CLOSE, single_tokens)
    if fmt == "hermes":
        calls = [_hermes_call(name, schema) for name, schema in functions.items()]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        rules = [f"call: %json {json.dumps(dict(schema, **{'x-guidance': JSON_STYLE}))}"]
    else:
        rules = []
        for i, (name, schema) in enumerate(functions.items()):
            rules += _xml_function(f"f{i}", name, schema)
        rules.append("call: " + " | ".join(f"f{i}" for i in range(len(functions))))
    block = f'{open_} "\\n" call "\\n" {close}'
    top = f'{start}: block ("\\n" block)*' if parallel else f"{start}: block"
    return "\n".join([top, f"block: {block}", *rules])
