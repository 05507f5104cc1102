"""The request fields of agent-ready serving, checked: `tools`, `tool_choice`,
`parallel_tool_calls`, structured output (OpenAI's `response_format`; vLLM's
`structured_outputs` {json, regex, choice, grammar} and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`) and `chat_template_kwargs`.

`agent_fields(body)` -> `AgentFields`, or ApiError (400) naming the field. At most one
constraint per request: a forced tool call (`tool_choice` "required" or a named function)
or one structured-output field. JSON schemas are checked by llguidance's compiler here;
the grammar is compiled against the checkpoint's tokenizer by the app (`resolve`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from runtime.serve.errors import ApiError

FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs", "guided_json",
          "guided_regex", "guided_choice", "guided_grammar", "chat_template_kwargs")
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class AgentFields:
    tools: list[dict] | None = None  # as the template takes them
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> parameters schema
    tool_choice: str = "none"  # none, auto, required, or "function:NAME"
    parallel: bool = True
    constraint: tuple | None = None  # (kind, value, param) for structured.Grammars.compile
    template_kwargs: dict = field(default_factory=dict)

    @property
    def forced(self) -> dict[str, dict] | None:
        """The functions a forced call may name (required: all; named: the one), else None."""
        if self.tool_choice == "required":
            return self.schemas
        if self.tool_choice.startswith("function:"):
            name = self.tool_choice.split(":", 1)[1]
            return {name: self.schemas[name]}
        return None


def _json_schema_error(schema, param: str) -> None:
    """ApiError unless llguidance compiles `schema` as a JSON schema."""
    from llguidance import LLMatcher

    if not isinstance(schema, dict):
        raise ApiError(f"{param}: not a JSON schema (expected an object)", param)
    try:
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
    except Exception as e:  # noqa: BLE001
        error = str(e)
    if error:
        line = "; ".join(x.strip() for x in error.splitlines() if x.strip())[:300]
        raise ApiError(f"{param}: not a JSON schema this server can enforce ({line})", param)


def _tools(body: dict) -> tuple[list | None, dict]:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None, {}
    if not isinstance(tools, list):
        raise ApiError("tools: expected a list of {type: function, function: {name, parameters}}", "tools")
    out, schemas = [], {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(f"{where}: expected {{type: 'function', function: {{name, parameters}}}}", where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ApiError(f"{where}.function.name: {name!r}: expected 1-64 letters, digits, _ . -",
                           f"{where}.function.name")
        if name in schemas:
            raise ApiError(f"{where}.function.name: {name!r} given twice", f"{where}.function.name")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ApiError(f"{where}.function.description: expected a string", f"{where}.function.description")
        parameters = function.get("parameters")
        parameters = EMPTY_PARAMETERS if parameters is None else parameters
        _json_schema_error(parameters, f"{where}.function.parameters")
        schemas[name] = parameters
        out.append({"type": "function", "function": {k: v for k, v in function.items()
                                                     if k in ("name", "description", "parameters")}})
    return out, schemas


def _tool_choice(body: dict, schemas: dict) -> str:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if schemas else "none"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ApiError("tool_choice: expected 'none', 'auto', 'required' or {type: 'function', function: "
                           "{name}}", "tool_choice")
        if name not in schemas:
            raise ApiError(f"tool_choice.function.name: {name!r}: not among the request's tools",
                           "tool_choice.function.name")
        return f"function:{name}"
    if choice not in ("none", "auto", "required"):
        raise ApiError(f"tool_choice: {choice!r}: expected 'none', 'auto', 'required' or a named function",
                       "tool_choice")
    if choice != "none" and not schemas:
        raise ApiError(f"tool_choice: {choice!r} without tools", "tool_choice")
    return choice


def _schema_of(value, param: str) -> dict:
    if isinstance(value, str):
        import json
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError(f"{param}: not valid JSON", param) from None
    _json_schema_error(value, param)
    return value


def _string(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise ApiError(f"{param}: expected a non-empty string", param)
    return value


def _choices(value, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ApiError(f"{param}: expected a non-empty list of non-empty strings", param)
    return value


def _response_format(value) -> tuple | None:
    if not isinstance(value, dict):
        raise ApiError("response_format: expected {type: text | json_object | json_schema}", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError("response_format.json_schema: expected {name, schema, strict}", "response_format.json_schema")
        param = "response_format.json_schema.schema"
        return ("json_schema", _schema_of(spec["schema"], param), param)
    raise ApiError(f"response_format.type: {kind!r}: expected 'text', 'json_object' or 'json_schema'",
                   "response_format.type")


def _constraints(body: dict) -> list[tuple]:
    """Every structured-output constraint the body asks for: (kind, value, param)."""
    out = []
    if body.get("response_format") is not None:
        rf = _response_format(body["response_format"])
        out += [rf] if rf else []
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError("structured_outputs: expected {json | regex | choice | grammar}", "structured_outputs")
        for key in so:
            if key not in ("json", "regex", "choice", "grammar", "json_object"):
                raise ApiError(f"structured_outputs.{key}: not supported by this server", f"structured_outputs.{key}")
        out += _guided({f"guided_{k}": v for k, v in so.items() if v is not None and k != "json_object"},
                       "structured_outputs.{}")
        if so.get("json_object"):
            out.append(("json_object", None, "structured_outputs.json_object"))
    return out + _guided(body, "guided_{}")


def _guided(fields: dict, spelling: str) -> list[tuple]:
    out = []
    for name in ("json", "regex", "choice", "grammar"):
        value = fields.get(f"guided_{name}")
        if value is None:
            continue
        param = spelling.format(name)
        if name == "json":
            out.append(("json_schema", _schema_of(value, param), param))
        elif name == "choice":
            out.append(("choice", _choices(value, param), param))
        else:
            out.append((name, _string(value, param), param))
    return out


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ApiError("chat_template_kwargs: expected an object", "chat_template_kwargs")
    for name in RESERVED_KWARGS:
        if name in kwargs:
            raise ApiError(f"chat_template_kwargs.{name}: set by the request itself, not here",
                           f"chat_template_kwargs.{name}")
    return dict(kwargs)


def agent_fields(body: dict) -> AgentFields:
    tools, schemas = _tools(body)
    choice = _tool_choice(body, schemas)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(f"parallel_tool_calls: {parallel!r}: expected true or false", "parallel_tool_calls")
    constraints = _constraints(body)
    if len(constraints) > 1:
        raise ApiError(f"{constraints[1][2]}: one constraint per request ({constraints[0][2]} given too)",
                       constraints[1][2])
    fields = AgentFields(tools, schemas, choice, parallel, constraints[0] if constraints else None,
                         _template_kwargs(body))
    if fields.forced is not None and fields.constraint:
        raise ApiError(f"{fields.constraint[2]}: not with tool_choice {choice.split(':')[0]!r} (which forces a "
                       "tool call)", fields.constraint[2])
    return fields
