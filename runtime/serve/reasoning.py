"""The reasoning of a thinking checkpoint split from its answer.

A template that writes `<think>` thinks: the answer's text up to `</think>` is reasoning,
the rest content. The reasoning starts open when the rendered prompt ends inside `<think>`
(Qwen3-VL-Thinking's generation prompt opens it), else only if the answer begins with
`<think>` (Qwen3's, where the model opens it itself). vLLM's `qwen3` reasoning parser reads
it so; the split streams (a piece that could begin `</think>` is held back).
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template_text: str) -> bool:
    return OPEN in template_text


def opened_by_prompt(prompt_text: str) -> bool:
    """True when the prompt leaves a `<think>` open for the answer."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ReasoningSplitter:
    """`feed(text)` -> (reasoning, content) released now; `finish()` the rest."""

    def __init__(self, open_at_start: bool):
        self.state = "reasoning" if open_at_start else "start"
        self.buffer, self.reasoned = "", open_at_start

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(OPEN):
                self.buffer, self.state, self.reasoned = stripped[len(OPEN):].lstrip("\n"), "reasoning", True
            elif OPEN.startswith(stripped):
                return "", ""  # could still be the opening
            else:
                self.state = "content"
        if self.state == "reasoning":
            at = self.buffer.find(CLOSE)
            if at < 0:
                keep = max((k for k in range(len(CLOSE) - 1, 0, -1) if self.buffer.endswith(CLOSE[:k])), default=0)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:at], self.buffer[at + len(CLOSE):].lstrip("\n"), "content"
            if not self.buffer:
                self.state = "after"  # newlines right after </think> are dropped as they come
        if self.state == "after":
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return reasoning, ""
            self.state = "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest if self.state != "after" else rest.lstrip("\n")


def split_reasoning(text: str, open_at_start: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    splitter = ReasoningSplitter(open_at_start)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return ((r1 + r2).strip("\n") if splitter.reasoned else None), c1 + c2


class ThinkingBudget:
    """vLLM's `thinking_token_budget`, token by token: once a sequence has written `budget`
    tokens of reasoning (inside `<think>`, opened by the prompt or by its first token) without
    closing it, its next token is `</think>` (`forced()`), and the answer follows as usual."""

    def __init__(self, budget: int, open_at_start: bool, open_id: int | None, close_id: int):
        self.budget, self.open_id, self.close_id = budget, open_id, close_id
        self.state = "reasoning" if open_at_start else "start"
        self.spent = 0

    def forced(self) -> int | None:
        """The token the next step must write: `</think>` when the budget is spent, else None."""
        return self.close_id if self.state == "reasoning" and self.spent >= self.budget else None

    def accept(self, token: int) -> None:
        if self.state == "start":
            self.state = "reasoning" if token == self.open_id else "answer"
        elif self.state == "reasoning":
            if token == self.close_id:
                self.state = "answer"
            else:
                self.spent += 1
