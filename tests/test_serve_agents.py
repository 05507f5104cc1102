"""Agent-ready serving: tool calls, structured output, reasoning, logit_bias, the other
fields. The parsers on strings in the templates' own formats (whole and streamed piece by
piece); then the real `qwen3vl serve` over tiny random checkpoints with Qwen3-VL's chat
template (and its Thinking variant), driven by the official `openai` client. Random
weights make free-running text noise, so the server tests check what a grammar forces:
the output always parses and validates against its schema (jsonschema)."""

from __future__ import annotations

import json

import pytest

from runtime.serve.reasoning import ReasoningSplitter, split_reasoning
from runtime.serve.tools import ToolParser, parse_tool_calls, tool_format

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time.", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}

# As Qwen3-VL's template writes a call (its system prompt's example and its history turns).
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
# As Qwen3.5's (qwen3_coder) template's example writes one.
XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n"
       "</parameter>\n</function>\n</tool_call>")


def streamed(fmt: str, text: str, step: int):
    parser, events = ToolParser(fmt, SCHEMAS), []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    content = "".join(e[1] for e in events if e[0] == "content")
    return content, [(e[1].name, json.loads(e[1].arguments)) for e in events if e[0] == "call"]


def test_format_read_from_the_template():
    import hashlib
    from runtime.checkpoints.synthetic_text import chat_template
    # Qwen3-VL-Instruct's shipped chat template, byte for byte (the 2B/8B chat_template.json's).
    assert hashlib.sha256(chat_template().encode()).hexdigest() == \
        "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"
    assert tool_format(chat_template()) == "hermes" and tool_format(chat_template(thinking=True)) == "hermes"
    assert tool_format("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}") == "qwen3_coder"
    assert tool_format("{{ messages }}") is None


def test_hermes_whole_and_streamed():
    content, calls = parse_tool_calls("hermes", SCHEMAS, HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                                 ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in calls}) == 2
    for step in (1, 3, 7, len(HERMES)):
        assert streamed("hermes", HERMES, step) == ("Let me check.\n", [(c.name, json.loads(c.arguments))
                                                                       for c in calls])


def test_qwen3_coder_whole_and_streamed_typed_by_schema():
    content, calls = parse_tool_calls("qwen3_coder", SCHEMAS, XML)
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Rome", "days": 2}  # days an integer: its schema's type
    for step in (1, 5, len(XML)):
        assert streamed("qwen3_coder", XML, step) == ("", [("get_weather", {"city": "Rome", "days": 2})])


def test_streamed_hermes_arguments_come_in_pieces_that_join_to_the_call():
    """Streaming, a hermes call's name goes out first, then its arguments piece by piece
    (a '}' inside a string or a nested object is no end); joined by index, as the official
    client joins them, they are the calls of the whole answer."""
    from runtime.serve.answer import Answer, AnswerSpec
    text = HERMES.replace('"days": 3}', '"days": 3, "note": {"text": "a } b"}}')
    whole = [(c.name, json.loads(c.arguments)) for c in parse_tool_calls("hermes", SCHEMAS, text)[1]]
    for step in (1, 4, len(text)):
        answer, deltas = Answer(AnswerSpec("hermes", SCHEMAS)), []
        for i in range(0, len(text), step):
            deltas += answer.feed(text[i:i + step])
        deltas += answer.finish()
        calls = {}
        for delta in deltas:
            for piece in delta.get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
                call["name"] += piece["function"].get("name", "")
                call["arguments"] += piece["function"]["arguments"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == whole
        assert "".join(d.get("content", "") for d in deltas) == "Let me check.\n"
        assert answer.finish_reason("stop") == "tool_calls"
        if step == 1:
            assert sum(1 for d in deltas if "tool_calls" in d) > 20  # in pieces, not whole


def test_unparsable_or_unclosed_blocks_stay_content():
    for text in ("<tool_call>\n{not json}\n</tool_call>", "Hi <tool_call>\n{\"name\": \"get_time\""):
        assert parse_tool_calls("hermes", SCHEMAS, text) == (text, [])
        assert streamed("hermes", text, 2) == (text, [])
    assert parse_tool_calls("hermes", SCHEMAS, "No tools <tool here>") == ("No tools <tool here>", [])


def test_reasoning_split_whole_and_streamed():
    text = "The user asks.\nThink more.\n</think>\n\nThe answer."
    assert split_reasoning(text, True) == ("The user asks.\nThink more.", "The answer.")
    assert split_reasoning("<think>\nHm.\n</think>\n\nYes.", False) == ("Hm.", "Yes.")
    assert split_reasoning("Plain answer.", False) == (None, "Plain answer.")
    assert split_reasoning("Cut off mid-thought", True) == ("Cut off mid-thought", "")
    for step in (1, 2, 5):
        splitter, r, c = ReasoningSplitter(True), "", ""
        for i in range(0, len(text), step):
            a, b = splitter.feed(text[i:i + step])
            r, c = r + a, c + b
        a, b = splitter.finish()
        assert (r + a, c + b) == ("The user asks.\nThink more.\n", "The answer.")


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_forced_call_grammar_parses_and_validates_whatever_the_logits(fmt, tmp_path_factory):
    """The grammar of a forced call in each format, over the tiny checkpoint's tokenizer:
    random logits, masked, give text the format's parser reads into a call whose
    arguments validate (30 draws each)."""
    import numpy as np
    jsonschema = pytest.importorskip("jsonschema")
    from runtime.checkpoints.synthetic_text import train_tokenizer
    from runtime.inputs.tokenizer import ChatTokenizer
    from runtime.serve.structured import Constraint, Grammars
    from runtime.serve.tools import forced_call_grammar

    folder = tmp_path_factory.mktemp("tok")
    (folder / "tokenizer.json").write_text(train_tokenizer(384, 3).to_str())
    (folder / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    (folder / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    tok = ChatTokenizer(folder)
    grammars = Grammars(tok, 400)  # rows past the tokenizer's 384: always masked
    schemas = dict(SCHEMAS, lookup={"type": "object", "properties": {  # a pattern and a bounded free string
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "note": {"type": "string", "maxLength": 8}},
        "required": ["code", "note"], "additionalProperties": False})
    grammar = grammars.compile("lark", forced_call_grammar(fmt, schemas, False, grammars.single_tokens), "tool_choice")
    rng = np.random.default_rng(0)
    for _ in range(30):
        constraint, tokens = Constraint(grammars, grammar), []
        while not constraint.done and len(tokens) < 400:
            token = int(np.argmax(constraint.mask(rng.standard_normal(400).astype(np.float32) * 3)))
            assert token < 384
            constraint.accept(token)
            tokens.append(token)
        content, calls = parse_tool_calls(fmt, schemas, tok.decode(tokens))
        assert content is None and len(calls) == 1, tok.decode(tokens)
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])


# -- the real server ------------------------------------------------------------------

pytest.importorskip("openai")
pytest.importorskip("httpx2")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import KEY, Server, module_server, user  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_cache):
    yield from module_server(tmp_path_factory.mktemp("agents"), serve_cache,
                             ["--image-min-tokens", "4", "--image-max-tokens", "64"])


def create(server, **kw):
    return server.client.chat.completions.create(model="model", messages=kw.pop("messages", [user("Weather?")]),
                                                 temperature=0, max_tokens=kw.pop("max_tokens", 200), **kw)


def streamed_calls(server, **kw):
    """The official client's stream, tool-call deltas reassembled by index: (calls, finish)."""
    calls, finish = {}, None
    for chunk in create(server, stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def check_call(name: str, arguments: str, allowed=SCHEMAS) -> dict:
    assert name in allowed
    value = json.loads(arguments)
    jsonschema.validate(value, allowed[name])
    return value


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse_and_validate(server, choice, stream):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    allowed = SCHEMAS if choice == "required" else {"get_time": TIME}
    kw = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    if stream:
        calls, finish = streamed_calls(server, **kw)
        assert len(calls) == 1 and calls[0]["id"].startswith("call_")
        check_call(calls[0]["name"], calls[0]["arguments"], allowed)
    else:
        r = create(server, **kw)
        message = r.choices[0].message
        finish = r.choices[0].finish_reason
        assert len(message.tool_calls) == 1 and message.content is None
        check_call(message.tool_calls[0].function.name, message.tool_calls[0].function.arguments, allowed)
    assert finish == "tool_calls"


def test_two_step_tool_loop(server):
    """Call, result, answer: the assistant's call and the tool's result go back through the
    template (the prompt grows by them), the answer is content."""
    messages = [user("What is the weather in Paris for 3 days?")]
    first = create(server, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    check_call(call.function.name, call.function.arguments)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    second = create(server, messages=messages, tools=TOOLS, max_tokens=8)  # auto: free text, no call in 8 tokens
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


@pytest.mark.parity
def test_tool_choice_none_keeps_the_tools_in_the_prompt(server):
    """`tool_choice: "none"` renders the tools as OpenAI and vLLM do: the prompt's ids are
    transformers' `apply_chat_template(messages, tools=...)` (the same count, and
    /v1/completions over those ids answers what the chat answers), and a call in the
    answer's text is not parsed (the same forced text is a call under "auto")."""
    transformers = pytest.importorskip("transformers")
    arguments = {"city": "Paris", "days": 3}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    messages = [user("What is the weather in Paris for 3 days?"), {"role": "assistant", "content": None,
                                                                   "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"forecast": "sunny"})}]
    theirs = json.loads(json.dumps(messages))  # as transformers documents a call: its arguments a dict
    theirs[1]["tool_calls"][0]["function"]["arguments"] = arguments
    ids = transformers.AutoTokenizer.from_pretrained(server.model).apply_chat_template(
        theirs, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    kw = dict(messages=messages, max_tokens=8, extra_body={"ignore_eos": True})
    chat = create(server, tools=TOOLS, tool_choice="none", **kw)
    assert chat.usage.prompt_tokens == len(ids) > create(server, **kw).usage.prompt_tokens
    done = server.client.completions.create(model="model", prompt=ids, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert done.choices[0].text == chat.choices[0].message.content and done.usage == chat.usage
    assert chat.choices[0].message.tool_calls is None
    call = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    text = f"<tool_call>\n{call}\n</tool_call>"  # forced: the markers as their tokens (llguidance's Lark)
    grammar = f"start: <tool_call> {json.dumps(chr(10) + call + chr(10))} </tool_call>"
    forced = dict(messages=[user("Time?")], tools=TOOLS, extra_body={"guided_grammar": grammar})
    none = create(server, tool_choice="none", **forced).choices[0]
    assert none.message.content == text and none.message.tool_calls is None and none.finish_reason == "stop"
    auto = create(server, tool_choice="auto", **forced).choices[0]
    assert [c.function.name for c in auto.message.tool_calls] == ["get_time"] and auto.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(server, stream):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in create(server, stream=True, **kw) if c.choices)
    else:
        text = create(server, **kw).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_json_object(server):
    r = create(server, extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    assert __import__("re").fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].message.content)
    r = create(server, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy") and r.choices[0].finish_reason == "stop"
    # a choice holding the vocabulary's single tokens: those tokens, as the model writes them
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert create(server, extra_body={"guided_choice": [call]}).choices[0].message.content == call
    # Random weights never end a key; a bias on '}' (allowed by the grammar only after '{')
    # closes it: the mask and logit_bias together.
    brace = tokenizer(server).tokenizer.token_to_id("}")
    r = create(server, response_format={"type": "json_object"}, logit_bias={str(brace): 100})
    assert json.loads(r.choices[0].message.content) == {} and r.choices[0].finish_reason == "stop"


def test_logit_bias_and_fingerprint(server):
    plain = create(server, max_tokens=1)
    token = 100 if plain.choices[0].message.content != "e" else 101
    r = create(server, max_tokens=1, logprobs=True, logit_bias={str(token): 100})
    assert r.choices[0].logprobs.content[0].bytes == list(server_token_bytes(server, token))
    assert plain.system_fingerprint and plain.system_fingerprint.startswith("fp_")


def tokenizer(server):
    from runtime.inputs.tokenizer import ChatTokenizer
    return ChatTokenizer(server.model)


def server_token_bytes(server, token: int) -> bytes:
    return tokenizer(server).token_bytes(token)


def bad(server, body) -> tuple[int, dict]:
    r = server.post(dict({"messages": [user("Hi")]}, **body))
    return r.status_code, r.json()["error"]


@pytest.mark.parametrize("body, param, pattern", [
    ({"frobnicate": 1}, "frobnicate", "not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters", "not a JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not among"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema", "not a JSON schema"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "regex"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "key 'x': expected a token id"),
    ({"logit_bias": {"5": 101}}, "logit_bias", r"\[-100, 100\]"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "below the vocabulary"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one constraint"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the request"),
    ({"messages": [user("Hi"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}, user("And?")]},
     "messages[1].tool_calls[0].function.arguments", "not a JSON object"),
])
def test_bad_fields_are_400s_naming_them(server, body, param, pattern):
    status, error = bad(server, body)
    assert status == 400 and error["param"] == param and __import__("re").search(pattern, error["message"]), error
    assert "\n" not in error["message"]


def test_developer_role_is_system(server):
    a = create(server, messages=[{"role": "developer", "content": "Be brief."}, user("Hi")], max_tokens=4)
    b = create(server, messages=[{"role": "system", "content": "Be brief."}, user("Hi")], max_tokens=4)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, server):
    from emitter.config import PRESETS
    from emitter.text_config import TEXT_PRESETS
    from runtime.checkpoints.synthetic_text import write_generation_checkpoint
    from serve_helpers import SMALL_POLICY

    root = tmp_path_factory.mktemp("thinking")
    write_generation_checkpoint(root / "model", PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=3,
                                processor_policy_dict=SMALL_POLICY, thinking=True)
    s = Server(root, model=root / "model", cache=server.cache, extra=("--thinking-token-budget", "100"))
    yield s
    s.process.kill()
    s.process.wait()


def test_reasoning_split_on_a_thinking_template(thinking):
    """The Thinking template opens <think>: the answer (no </think> from random weights) is
    all reasoning, under both names, streamed as reasoning deltas; with enable_thinking
    false (chat_template_kwargs reaches the template) it is all content."""
    r = create(thinking, max_tokens=8, extra_body={"ignore_eos": True})
    message = r.choices[0].message.model_dump()
    assert message["reasoning_content"] == message["reasoning"] and message["reasoning"]
    assert not message["content"]
    pieces = [c.choices[0].delta.model_dump() for c in create(thinking, max_tokens=8, stream=True,
                                                               extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(p.get("reasoning_content") or "" for p in pieces) == message["reasoning"]
    assert not "".join(p.get("content") or "" for p in pieces)
    off = create(thinking, max_tokens=8, extra_body={"ignore_eos": True,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and not off.choices[0].message.model_dump().get("reasoning")
    assert off.usage.prompt_tokens > r.usage.prompt_tokens  # the closed, empty think block


def test_a_reasoning_budget_forces_the_close(thinking):
    """vLLM's thinking_token_budget: after that many reasoning tokens `</think>` is forced and
    the answer follows (random weights never close it themselves); the reasoning is what the
    unbounded run thinks first. The server's --thinking-token-budget (100 here) is the default."""
    def reasoning(r):
        return r.choices[0].message.model_dump()["reasoning"]

    free = create(thinking, max_tokens=4, extra_body={"ignore_eos": True})
    r = create(thinking, max_tokens=12, extra_body={"ignore_eos": True, "thinking_token_budget": 4})
    assert reasoning(r) == reasoning(free) and r.choices[0].message.content and r.usage.completion_tokens == 12
    assert create(thinking, max_tokens=110, extra_body={"ignore_eos": True}).choices[0].message.content
    over = create(thinking, max_tokens=110, extra_body={"ignore_eos": True, "thinking_token_budget": 200})
    assert not over.choices[0].message.content and len(reasoning(over)) > len(reasoning(free))
    bad = thinking.post({"messages": [user("Hi")], "thinking_token_budget": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_token_budget"


def test_constraints_follow_the_reasoning(thinking):
    """With <think> open, a constraint holds after `</think>`: the reasoning is free (here
    closed at once by a logit_bias on `</think>`, which random weights would not write), the
    content forced; a tool call is parsed from the content. A client's own grammar cannot
    follow the reasoning (400) unless thinking is off."""
    close = {str(tokenizer(thinking).tokenizer.token_to_id("</think>")): 100}
    r = create(thinking, logit_bias=close, extra_body={"guided_choice": ["a", "b"]})
    assert r.choices[0].message.content in ("a", "b") and r.choices[0].message.model_dump()["reasoning"] == ""
    calls, finish = streamed_calls(thinking, logit_bias=close, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False)
    assert len(calls) == 1 and finish == "tool_calls"
    check_call(calls[0]["name"], calls[0]["arguments"])
    r = thinking.post({"messages": [user("Hi")], "guided_grammar": 'start: "a"'})
    assert r.status_code == 400 and "enable_thinking" in r.json()["error"]["message"]
    r = create(thinking, extra_body={"guided_grammar": 'start: "a" | "b"',
                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content in ("a", "b")


def test_models_by_id_completions_tokenize_detokenize(server):
    """/v1/completions over the chat's own prompt ids (from /tokenize) answers what the chat
    answers, greedy, streamed or not; /detokenize gives the prompt's text back."""
    import httpx2 as httpx
    headers = {"Authorization": f"Bearer {KEY}"}
    assert server.client.models.retrieve("model").id == "model"
    missing = httpx.get(server.url + "/v1/models/other", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    messages = [{"role": "user", "content": "Say something."}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=headers).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=headers).json()["prompt"]
    assert text == tokenizer(server).render(messages)
    chat = create(server, messages=messages, max_tokens=8, extra_body={"ignore_eos": True})
    done = server.client.completions.create(model="model", prompt=ids, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert done.choices[0].text == chat.choices[0].message.content and done.usage == chat.usage
    assert done.system_fingerprint == chat.system_fingerprint
    pieces = server.client.completions.create(model="model", prompt=text, max_tokens=8, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in pieces if c.choices) == chat.choices[0].message.content
    r = server.client.completions.create(model="model", prompt="the", extra_body={"guided_choice": ["red", "blue"]})
    assert r.choices[0].text in ("red", "blue")
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "tools": TOOLS}, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_image_budget_per_request_within_the_server_bounds(server):
    """mm_processor_kwargs' max_pixels shrinks the image's tokens; a second budget for the
    same image is encoded anew (the encoder cache tells them apart); outside the server's
    --image-min-tokens 4 / --image-max-tokens 64 (x 32 x 32 pixels) it is a 400."""
    messages = [user("Describe the image.", server.images[:1])]
    misses = server.metric("qwen3vl_encoder_cache_misses_total")
    full = create(server, messages=messages, max_tokens=1)
    small = create(server, messages=messages, max_tokens=1, extra_body={"mm_processor_kwargs": {"max_pixels": 4096}})
    assert small.usage.prompt_tokens < full.usage.prompt_tokens
    assert server.metric("qwen3vl_encoder_cache_misses_total") - misses == 2
    for kwargs, param in (({"max_pixels": 65537}, "mm_processor_kwargs.max_pixels"),
                          ({"min_pixels": 1024}, "mm_processor_kwargs.min_pixels"),
                          ({"size": 3}, "mm_processor_kwargs.size")):
        status, error = bad(server, {"messages": messages, "mm_processor_kwargs": kwargs})
        assert status == 400 and error["param"] == param, error
