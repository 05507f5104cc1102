"""An answer's text as its tokens arrive: each new piece once its characters are whole,
and stop strings cut out (the text that could still begin one held back)."""

from __future__ import annotations


class TextStream:
    """`add(token)` returns the new text it releases; `stopped` turns true at the first
    stop string (neither it nor anything after it is released); `flush()` releases the
    rest at the end. `emit(piece)`, when given, hears every released piece."""

    def __init__(self, tokenizer, stops=(), emit=None):
        self.tokenizer, self.stops, self.emit = tokenizer, [s for s in stops if s], emit
        self.tokens: list[int] = []
        self.sent, self.text, self.stopped = 0, "", False

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):  # a partial UTF-8 character: wait for the rest
            return ""
        self.text = text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        return self._release(len(text) - self._held(text))

    def __call__(self, token: int) -> None:
        self.add(token)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self.text = self.tokenizer.decode(self.tokens)
        return self._release(len(self.text))

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that begin some stop string."""
        return max((k for s in self.stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)

    def _release(self, end: int) -> str:
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        if piece and self.emit:
            self.emit(piece)
        return piece

    @property
    def released(self) -> str:
        return self.text[:self.sent]
