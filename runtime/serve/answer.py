"""The answer's text into OpenAI's message: reasoning split off (runtime/serve/reasoning.py),
then tool calls parsed out of the content (runtime/serve/tools.py), whole or as it streams.

`resolve(request, tokenizer, vocab_size)` (the app, per request) decides from the checkpoint's
template what the answer holds and compiles the request's grammar; `Answer(spec)` turns
the text into message fields or stream deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.serve import reasoning, tools
from runtime.serve.errors import ApiError


@dataclass
class AnswerSpec:
    tool_format: str | None = None  # parse tool calls in this format (None: the text is content)
    schemas: dict = field(default_factory=dict)
    thinks: bool = False  # split <think>...</think> off as reasoning
    think_open: bool = False  # the prompt left <think> open
    grammar: object = None  # (structured.Grammars, grammar text) for the engine
    budget: tuple | None = None  # (thinking_token_budget, <think> id, </think> id): reasoning.ThinkingBudget's


def resolve(request, tokenizer, vocab_size: int) -> AnswerSpec:
    """The answer's spec and the request's template kwargs (tools, chat_template_kwargs) set;
    ApiError naming the field the checkpoint cannot honour."""
    from runtime.serve.structured import Grammars, think_first

    agents = request.agents
    fmt = tools.tool_format(tokenizer.template_text)
    if agents.tools:  # rendered under "none" too (OpenAI's and vLLM's prompt): the model sees them, calls none
        if fmt is None and agents.tool_choice != "none":
            raise ApiError("tools: this checkpoint's chat template renders no tools", "tools")
        agents.template_kwargs["tools"] = agents.tools
    spec = AnswerSpec(fmt if agents.tools and agents.tool_choice != "none" else None, agents.schemas,
                      reasoning.thinks(tokenizer.template_text))
    try:
        text = tokenizer.render(request.messages, **agents.template_kwargs) if spec.thinks else ""
    except ValueError as e:
        raise ApiError(" ".join(str(e).split()), "messages") from None
    spec.think_open = spec.thinks and reasoning.opened_by_prompt(text)
    if spec.thinks and request.thinking_token_budget is not None:
        ids = [tokenizer.tokenizer.token_to_id(t) for t in (reasoning.OPEN, reasoning.CLOSE)]
        if ids[1] is None:
            raise ApiError(f"thinking_token_budget: this checkpoint's vocabulary has no {reasoning.CLOSE} token to "
                           "end the reasoning with", "thinking_token_budget")
        spec.budget = (request.thinking_token_budget, *ids)
    forced = agents.forced
    if forced is None and agents.constraint is None:
        return spec
    grammars = Grammars.of(tokenizer, vocab_size)
    start = "answer" if spec.think_open else "start"
    if forced is not None:
        kind, value, param = "lark", tools.forced_call_grammar(fmt, forced, agents.parallel, grammars.single_tokens,
                                                               start), "tool_choice"
    else:
        kind, value, param = agents.constraint
    if spec.think_open:  # the reasoning first, free, then the constraint
        if kind == "grammar" or "</think>" not in grammars.single_tokens:
            raise ApiError(f"{param}: the chat template opens <think> for the answer, and this constraint cannot "
                           "follow the reasoning; pass chat_template_kwargs {\"enable_thinking\": false}", param)
        kind, value = "lark", think_first(kind, value, value if kind == "lark" else None, grammars.single_tokens)
    try:
        spec.grammar = (grammars, grammars.compile(kind, value, param))
    except ValueError as e:
        raise ApiError(str(e), param) from None
    return spec


class Answer:
    """`feed(text)` -> stream deltas; `finish()` the rest; `message(text)` the whole message."""

    def __init__(self, spec: AnswerSpec):
        self.spec = spec
        self.split = reasoning.ReasoningSplitter(spec.think_open) if spec.thinks else None
        self.parser = tools.ToolParser(spec.tool_format, spec.schemas, incremental=True) if spec.tool_format else None
        self.calls = 0

    def feed(self, text: str) -> list[dict]:
        r, c = self.split.feed(text) if self.split else ("", text)
        return self._deltas(r, self.parser.feed(c) if self.parser else [("content", c)])

    def finish(self) -> list[dict]:
        r, c = self.split.finish() if self.split else ("", "")
        events = (self.parser.feed(c) + self.parser.finish()) if self.parser else [("content", c)]
        return self._deltas(r, events)

    def _deltas(self, reasoning_text: str, events: list) -> list[dict]:
        out = [{"reasoning_content": reasoning_text, "reasoning": reasoning_text}] if reasoning_text else []
        for event in events:
            if event[0] == "content" and event[1]:
                out.append({"content": event[1]})
            elif event[0] in ("call", "call_start"):  # a whole call, or one whose arguments follow
                out.append({"tool_calls": [event[1].openai(self.calls)]})
                self.calls += event[0] == "call"
            elif event[0] == "call_args":
                out.append({"tool_calls": [{"index": self.calls, "function": {"arguments": event[1]}}]})
            elif event[0] == "call_end":
                self.calls += 1
        return out

    def message(self, text: str) -> dict:
        """The whole assistant message of `text`."""
        message = {"role": "assistant"}
        if self.spec.thinks:
            reasoning_text, text = reasoning.split_reasoning(text, self.spec.think_open)
            message.update(reasoning_content=reasoning_text, reasoning=reasoning_text)
        content, calls = (tools.parse_tool_calls(self.spec.tool_format, self.spec.schemas, text)
                          if self.spec.tool_format else (text, []))
        self.calls = len(calls)
        message["content"] = content
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message

    def finish_reason(self, finish: str) -> str:
        return "tool_calls" if self.calls and finish == "stop" else finish
