"""`POST /v1/responses` (runtime/serve/responses.py) on the real `qwen3vl serve` over the tiny
checkpoint, driven by the official `openai` client's `responses.create` and
`responses.stream`: the answer equals the chat path's for the same conversation (one
generation path), text and image input, a forced tool call and the loop back, structured
output, the typed events in OpenAI's order, reasoning on a Thinking template, and error
objects naming the Responses field. Random weights make free text noise, so calls and
JSON are forced (tool_choice, text.format) where the test needs them to end."""

from __future__ import annotations

import json
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("httpx2")
jsonschema = pytest.importorskip("jsonschema")

from serve_helpers import KEY, Server, data_url, module_server, user  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
FLAT_TOOLS = [{"type": "function", "name": name, "description": "A lookup.", "parameters": schema}
              for name, schema in SCHEMAS.items()]  # Responses' shape: flat, not under "function"
TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in FLAT_TOOLS]
YES_NO = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve_cache):
    yield from module_server(tmp_path_factory.mktemp("responses"), serve_cache,
                             ["--image-min-tokens", "4", "--image-max-tokens", "64"])


def create(server, **kw):
    return server.client.responses.create(model="model", temperature=0, **kw)


def events_of(server, **kw) -> list:
    with server.client.responses.stream(model="model", temperature=0, **kw) as stream:
        return list(stream)


def chat(server, messages, **kw):
    return server.client.chat.completions.create(model="model", messages=messages, temperature=0, **kw)


def check_order(events, item_types: list[str]) -> None:
    """The events in OpenAI's order: created, in_progress, each item added ... done, the end;
    sequence numbers 0, 1, 2, ..."""
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    body, at = kinds[2:-1], 0
    for item_type in item_types:
        assert body[at] == "response.output_item.added"
        end = body.index("response.output_item.done", at)
        inner, at = body[at + 1:end], end + 1
        if item_type == "function_call":
            assert set(inner[:-1]) <= {"response.function_call_arguments.delta"}
            assert inner[-1] == "response.function_call_arguments.done"
        else:
            delta = "response.output_text" if item_type == "message" else "response.reasoning_text"
            assert inner[0] == "response.content_part.added" and inner[-1] == "response.content_part.done"
            assert set(inner[1:-2]) <= {f"{delta}.delta"} and inner[-2] == f"{delta}.done"
    assert at == len(body)


def test_text_equals_the_chat_path_whole_and_streamed(server):
    """`instructions` and a string `input` answer what chat answers for [system, user]:
    the same text and token counts; streamed, the deltas join to the same text, and the
    stream ends `response.incomplete` at max_output_tokens, as the whole response says."""
    r = create(server, instructions="Be brief.", input="Say something.", max_output_tokens=8)
    c = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}],
             max_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.output[0].type == "message"
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens)
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert r.instructions == "Be brief." and r.max_output_tokens == 8
    events = events_of(server, instructions="Be brief.", input="Say something.", max_output_tokens=8)
    check_order(events, ["message"])
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].type == f"response.{r.status}" and events[-1].response.output_text == r.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_image_input(server):
    """An `input_image` part (a data: URL) is the chat path's image_url part: the same
    prompt tokens and answer."""
    image = data_url(server.images[0])
    r = create(server, max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": image}, {"type": "input_text", "text": "Describe the image."}]}])
    c = chat(server, [user("Describe the image.", server.images[:1])], max_tokens=4)
    assert r.usage.input_tokens == c.usage.prompt_tokens > 20 and r.output_text == c.choices[0].message.content


def test_forced_tool_call_and_the_loop_back(server):
    """tool_choice required: one function_call item (call_id, name, arguments that validate);
    the call and its output sent back as input items make the prompt chat makes of the
    same turns; a named choice streams its arguments in pieces that join to the call."""
    question = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    r = create(server, input=question, tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=200)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name in SCHEMAS
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"forecast": "sunny"})}
    again = create(server, input=question + [call.model_dump(exclude_none=True), result], tools=FLAT_TOOLS,
                   max_output_tokens=4)
    turns = question + [{"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
                        {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}]
    c = chat(server, turns, tools=TOOLS, max_tokens=4)
    assert again.usage.input_tokens == c.usage.prompt_tokens > r.usage.total_tokens
    assert again.output_text == (c.choices[0].message.content or "")

    events = events_of(server, input="Time?", tools=FLAT_TOOLS, tool_choice={"type": "function", "name": "get_time"},
                       max_output_tokens=200)
    check_order(events, ["function_call"])
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[0].name == "get_time"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == final.output[0].arguments and len(pieces) > 1
    jsonschema.validate(json.loads(final.output[0].arguments), TIME)


def test_structured_output_text_format(server):
    """text.format json_schema is the chat path's response_format: the text validates, and
    the stream helper parses it into the client's own type."""
    from pydantic import BaseModel

    fmt = {"type": "json_schema", "name": "yes_no", "schema": YES_NO, "strict": True}
    r = create(server, input="Yes or no?", text={"format": fmt}, max_output_tokens=100)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), YES_NO)

    class YesNo(BaseModel):
        answer: Literal["yes", "no"]

    with server.client.responses.stream(model="model", input="Yes or no?", text_format=YesNo, temperature=0,
                                        max_output_tokens=100) as stream:
        final = stream.get_final_response()
    assert final.output_parsed.answer in ("yes", "no")


def post(server, body: dict):
    import httpx2 as httpx
    return httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60)


@pytest.mark.parametrize("body, status, param, code", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "previous_response_not_found"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input[0].type", "invalid_value"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0]", "unsupported_value"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]}, 400, "tools[0].parameters",
     "invalid_value"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://example.com/a.png"}]}]},
     400, "input[0].content[0].image_url", "url_not_allowed"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0].type", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}}, 400, "text.format.schema",
     "invalid_value"),
    ({"frobnicate": 1}, 400, "frobnicate", "unsupported_field"),
    ({"model": "other"}, 404, "model", "model_not_found"),
])
def test_bad_input_is_an_error_object_naming_the_field(server, body, status, param, code):
    r = post(server, dict({"input": "Hi"}, **body))
    error = r.json()["error"]
    assert r.status_code == status and error["param"] == param and error["code"] == code, error
    assert param in error["message"] and "messages" not in error["message"]


def test_the_official_client_raises_the_error(server):
    with pytest.raises(openai.BadRequestError) as caught:
        create(server, input="Hi", previous_response_id="resp_123")
    assert caught.value.code == "previous_response_not_found" and "stateless" in caught.value.message


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, server):
    from emitter.config import PRESETS
    from emitter.text_config import TEXT_PRESETS
    from runtime.checkpoints.synthetic_text import write_generation_checkpoint
    from serve_helpers import SMALL_POLICY

    root = tmp_path_factory.mktemp("thinking")
    write_generation_checkpoint(root / "model", PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=3,
                                processor_policy_dict=SMALL_POLICY, thinking=True)
    s = Server(root, model=root / "model", cache=server.cache)
    yield s
    s.process.kill()
    s.process.wait()


def test_reasoning_item_on_a_thinking_template(thinking):
    """The Thinking template opens <think>: the reasoning is a `reasoning` item (the chat
    path's `reasoning`), counted in usage; streamed, its reasoning_text deltas join to it."""
    kw = dict(input="Hi", max_output_tokens=8)
    r = create(thinking, **kw)
    c = chat(thinking, [{"role": "user", "content": "Hi"}], max_tokens=8)
    reasoning = c.choices[0].message.model_dump()["reasoning"]
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.status == "incomplete"
    assert r.output[0].content[0].text == reasoning and r.output_text == ""
    assert r.usage.output_tokens_details.reasoning_tokens == 8
    events = events_of(thinking, **kw)
    check_order(events, ["reasoning", "message"])
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 8
    budget = {"thinking_token_budget": 2}  # the chat path's reasoning budget: </think> forced after 2
    r = create(thinking, extra_body=budget, **kw)
    c = chat(thinking, [{"role": "user", "content": "Hi"}], max_tokens=8, extra_body=budget).choices[0].message
    assert r.output[0].content[0].text == c.model_dump()["reasoning"] and r.output_text == c.content != ""
    assert r.usage.output_tokens_details.reasoning_tokens == 2


def test_agents_sdk_default_model_call(server):
    """The OpenAI Agents SDK's default model (OpenAIResponsesModel) runs a tool loop against
    this server, run whole and streamed: a forced call (the SDK sends its output type's
    text.format with it; a forced call writes no text, so the format waits for the next
    turn), the tool's result back, then the answer in the output type (`openai-agents`, a
    pinned test dependency)."""
    import asyncio

    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    agents.set_tracing_disabled(True)  # no traces sent anywhere
    calls = []

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        calls.append(zone)
        return "12:00"

    class Answer(BaseModel):
        answer: Literal["yes", "no"]

    async def run(streamed: bool):
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        agent = agents.Agent(name="a", instructions="Answer briefly.", tools=[get_time], output_type=Answer,
                             model=agents.OpenAIResponsesModel(model="model", openai_client=client),
                             model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200,
                                                                 temperature=0))
        if not streamed:
            return await agents.Runner.run(agent, "Is it noon in UTC?", max_turns=3)
        result = agents.Runner.run_streamed(agent, "Is it noon in UTC?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    for streamed in (False, True):
        result = asyncio.run(run(streamed))
        assert isinstance(result.final_output, Answer)
    assert len(calls) == 2 and set(calls) <= {"UTC", "CET"}


def test_a_client_that_leaves_cancels_its_response(server):
    """A stream whose client closes, and a plain request whose client closes its socket,
    are cancelled (not run on to max_output_tokens): the lane is free again."""
    import httpx2 as httpx
    from serve_helpers import wait_for

    cancelled = lambda: server.metric("qwen3vl_requests_total", '{outcome="cancelled"}')  # noqa: E731
    before = cancelled()
    long = {"input": "Go on.", "max_output_tokens": 100000, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/responses", json=dict(long, stream=True),
                           headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert next(line for line in r.iter_lines() if "output_text.delta" in line)
    assert wait_for(lambda: cancelled() == before + 1, 5)
    sock = raw(server, long)
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 1)
    sock.close()
    assert wait_for(lambda: cancelled() == before + 2, 5)
    assert wait_for(lambda: server.metric("qwen3vl_requests_running") == 0, 5)


def raw(server, body: dict):
    import socket
    data = json.dumps(body).encode()
    head = (f"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head.encode() + data)
    return sock


def test_routing_key_of_a_response_is_its_chats():
    """Over Ray replicas a Responses request is routed as the chat it becomes: the same
    conversation keys the same, so its later turns find their prefix on one replica."""
    from runtime.serve.affinity import routing_key

    image = "data:image/png;base64,AAAA"
    chat_body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]}]}
    response_body = {"instructions": "Be brief.", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": image}, {"type": "input_text", "text": "What is it?"}]}]}
    key = routing_key("/v1/chat/completions", json.dumps(chat_body).encode())
    assert key is not None and routing_key("/v1/responses", json.dumps(response_body).encode()) == key
    assert routing_key("/v1/responses", b'{"input": [{"type": "bogus"}]}') is None
