"""Constrained decoding with llguidance: a grammar compiled per request, a matcher per
sequence, the matcher's token mask applied to the sequence's logits before sampling.

- `Grammars(tokenizer, vocab_size)`: the checkpoint's `LLTokenizer` (from its
  tokenizer.json; EOS its EOS ids; the model's vocabulary size, rows past the tokenizer's
  always masked) and `compile(kind, value, param)` for `json_schema`, `json_object`,
  `regex`, `choice`, `grammar` (Lark, or GBNF converted) and `lark` (built here, e.g. a
  forced tool call): the grammar text, or ValueError naming `param`.
- `Constraint(grammars, grammar)`: one sequence's matcher. `mask(logits)` returns the
  logits with every token the grammar forbids at -inf (`llguidance.numpy` fills the
  bitmask); `accept(token)` advances it; `done` once the grammar is complete.
"""

from __future__ import annotations

import json
import re
import threading
import weakref

import numpy as np

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """The checkpoint's LLTokenizer and the grammars compiled against it."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self.ll = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size,
                                         eos_token=list(tokenizer.eos_ids) or None)
        self.vocab_size = vocab_size
        self.single_tokens = {t for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")
                              if tokenizer.tokenizer.token_to_id(t) is not None}

    @staticmethod
    def of(tokenizer, vocab_size: int) -> "Grammars":
        """One per tokenizer (building the LLTokenizer of a 151k vocabulary takes seconds: the
        engine starts it in the background, `warm`)."""
        with _LOCK:
            if tokenizer not in _CACHE:
                _CACHE[tokenizer] = Grammars(tokenizer, vocab_size)
            return _CACHE[tokenizer]

    @staticmethod
    def warm(tokenizer, vocab_size: int) -> None:
        """Build it on a daemon thread now, so the first constrained request does not wait."""
        threading.Thread(target=Grammars.of, args=(tokenizer, vocab_size), name="llguidance-tokenizer",
                         daemon=True).start()

    def compile(self, kind: str, value, param: str) -> str:
        """The grammar of one constraint, validated; ValueError '<param>: why' if it is not one."""
        from llguidance import LLMatcher, gbnf_to_lark

        try:
            if kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            elif kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(value)
            elif kind == "choice":
                grammar = LLMatcher.grammar_from_lark("start: " + choices(value, self.single_tokens))
            elif kind == "grammar":
                grammar = LLMatcher.grammar_from_lark(gbnf_to_lark(value) if "::=" in value else value)
            elif kind == "lark":
                grammar = LLMatcher.grammar_from_lark(value)
            else:
                raise ValueError(f"unknown constraint kind {kind!r}")
        except Exception as e:  # noqa: BLE001 - llguidance raises ValueError and its own kinds
            raise ValueError(f"{param}: {_one_line(e)}") from None
        error = LLMatcher.validate_grammar(grammar, self.ll)
        if error:
            raise ValueError(f"{param}: not a grammar llguidance can use: {_one_line(error)}")
        return grammar


def choices(values, single_tokens=frozenset()) -> str:
    """Lark's alternatives of `guided_choice` strings: each a string, where it holds one of
    the vocabulary's single tokens (`<tool_call>`, `<think>`: special to llguidance, whose
    lexer never matches them as text) that token as a token, as the model writes it."""
    if not single_tokens:
        return " | ".join(json.dumps(c) for c in values)
    split = re.compile("(" + "|".join(re.escape(t) for t in sorted(single_tokens, key=len, reverse=True)) + ")")
    return " | ".join(" ".join(part if part in single_tokens else json.dumps(part)
                               for part in split.split(c) if part) or '""' for c in values)


def think_first(kind: str, value, forced_lark: str | None = None, single_tokens=frozenset()) -> str:
    """Lark that lets a thinking model think first: free text up to the `</think>` token (its
    text never matches it: llguidance keeps special tokens out of the lexer), the newlines
    Qwen's templates write after it, then the constraint (`kind`, `value`; a forced call's
    Lark with its top rule named `answer`). Not for `grammar` (a grammar of the client's)."""
    from llguidance import regex_to_lark

    if kind == "lark":
        body = forced_lark
    elif kind in ("json_schema", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        body = f"answer: %json {json.dumps(dict(schema, **{'x-guidance': JSON_OPTIONS}))}"
    elif kind == "regex":
        body = f"answer: /{regex_to_lark(value)}/"
    elif kind == "choice":
        body = "answer: " + choices(value, single_tokens)
    else:
        raise ValueError(f"{kind}: not after a thinking model's reasoning")
    return "start: thinking </think> /\\n{0,2}/ answer\nthinking: /(?s:.*)/\n" + body


def _one_line(e) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return "; ".join(lines[:3])[:300] or type(e).__name__


class Constraint:
    """One sequence's matcher and its one-row bitmask."""

    def __init__(self, grammars: Grammars, grammar: str):
        import llguidance
        import llguidance.numpy as lln

        self.matcher = llguidance.LLMatcher(grammars.ll, grammar, log_level=0)
        self.bitmask = lln.allocate_token_bitmask(1, grammars.vocab_size)
        self._fill = lln.fill_next_token_bitmask

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The logits with the tokens the grammar forbids now at -inf (a copy)."""
        self._fill(self.matcher, self.bitmask, 0)
        allowed = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[:logits.shape[-1]].view(bool)
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"grammar: token {token} refused ({_one_line(self.matcher.get_error())})")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence ends)."""
        return self.matcher.is_stopped()
