"""The cost of constrained decoding per decode step: llguidance's token mask filled and
applied for every lane of a batch, at the 2B vocabulary (151,936 logits per lane).

What the engine does per constrained lane and step (runtime/serve/structured.py):
`fill_next_token_bitmask` (the matcher's mask into an int32 bitmask row), the bitmask
applied to the lane's f32 logits (`Constraint.mask`), the chosen token consumed. Measured
here alone, without the model: the figure to set beside a decode step (a 2B f32 decode
step is ~140 ms on this machine, docs/serve.md). Also llguidance.numpy's own
`apply_token_bitmask_inplace` and the parallel fill (`LLExecutor`) for comparison.

The vocabulary: no 151k tokenizer is on this machine, so a synthetic one of 151,936 token
strings (the 256 bytes, then word-like pieces with and without a leading space, digits,
punctuation runs and CJK characters; Qwen's special tokens at its ids) stands in. The
mask's cost follows the vocabulary's size and how many tokens a state allows (inside a
JSON string nearly all); a real Qwen vocabulary differs in its token shapes.

    .venv/bin/python benchmarks/bench_structured.py [--lanes 4] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

VOCAB = 151936
SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>", 151657: "<tool_call>",
            151658: "</tool_call>", 151667: "<think>", 151668: "</think>"}
SCHEMA = {"type": "object", "properties": {
    "name": {"const": "search"},
    "arguments": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 200}, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}},
        "required": ["query", "limit", "tags"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}


def synthetic_tokens(seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = np.linspace(2.0, 0.2, len(letters))
    weights /= weights.sum()
    tokens, seen = [bytes([b]) for b in range(256)], {bytes([b]) for b in range(256)}
    while len(tokens) < 151643:
        r = rng.random()
        if r < 0.75:
            word = "".join(rng.choice(letters, int(rng.integers(2, 11)), p=weights))
            word = (" " if rng.random() < 0.6 else "") + (word.capitalize() if rng.random() < 0.2 else word)
        elif r < 0.85:
            word = str(int(rng.integers(0, 1000)))
        elif r < 0.93:
            word = "".join(rng.choice(list("{}[]()<>:;,.\"'=+-*/_\\|!?#&%$@\n\t "), int(rng.integers(2, 5))))
        else:
            word = "".join(chr(int(c)) for c in rng.integers(0x4E00, 0x9FFF, int(rng.integers(1, 4))))
        data = word.encode()
        if data not in seen:
            seen.add(data)
            tokens.append(data)
    tokens += [b""] * (VOCAB - len(tokens))
    for i, text in SPECIALS.items():
        tokens[i] = text.encode()
    return tokens


class Vocabulary:
    """What llguidance.TokenizerWrapper asks of a tokenizer (greedy longest match)."""

    def __init__(self, tokens: list[bytes]):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, 151645, None
        self.special_token_ids = list(SPECIALS)
        self.ids = {t: i for i, t in enumerate(tokens) if t and i not in SPECIALS}
        self.longest = max(len(t) for t in self.ids)

    def __call__(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                if data[i:i + n] in self.ids:
                    out.append(self.ids[data[i:i + n]])
                    i += n
                    break
        return out


def mask_where(bitmask_row: np.ndarray, logits: np.ndarray) -> np.ndarray:
    allowed = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:logits.shape[-1]].view(bool)
    return np.where(allowed, logits, np.float32(-np.inf))


def main() -> None:
    import llguidance
    import llguidance.numpy as lln

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary(synthetic_tokens())), n_vocab=VOCAB)
    print(f"LLTokenizer of {VOCAB} tokens built in {time.perf_counter() - start:.1f} s")
    lark = ('start: <tool_call> "\\n" call "\\n" </tool_call>\ncall: %json ' +
            json.dumps(dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": False}})))
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert not llguidance.LLMatcher.validate_grammar(grammar, tok)
    rng = np.random.default_rng(1)
    matchers = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(args.lanes)]
    bitmask = lln.allocate_token_bitmask(args.lanes, VOCAB)
    logits = rng.standard_normal((args.lanes, VOCAB)).astype(np.float32)
    executor = llguidance.LLExecutor()
    fill, apply, theirs, par, allowed_counts, wide = [], [], [], [], [], []
    for _ in range(args.steps):
        live = [i for i, m in enumerate(matchers) if not m.is_stopped()]
        if not live:
            matchers = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(args.lanes)]
            live = list(range(args.lanes))
        serial_first = len(fill) % 2 == 0  # alternate, so neither fill finds the other's work warm
        if serial_first:
            t1 = time.perf_counter()
            for i in live:
                lln.fill_next_token_bitmask(matchers[i], bitmask, i)
            t2 = t0 = time.perf_counter()
            lln.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in live], bitmask)
            t1, t2, t0 = t1, t2, t0
            t_par = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            lln.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in live], bitmask)
            t_par = time.perf_counter() - t0
            t1 = time.perf_counter()
            for i in live:
                lln.fill_next_token_bitmask(matchers[i], bitmask, i)
        t2 = time.perf_counter() if not serial_first else t2
        masked = [mask_where(bitmask[i], logits[i]) for i in live]
        t3 = time.perf_counter()
        copy = logits[live].copy()
        lln.apply_token_bitmask_inplace(copy, bitmask[live])
        t4 = time.perf_counter()
        step_allowed = 0
        for row, i in zip(masked, live):
            allowed = np.flatnonzero(np.isfinite(row))
            allowed_counts.append(allowed.size)
            step_allowed = max(step_allowed, allowed.size)
            token = int(rng.choice(allowed)) if rng.random() < 0.7 else int(allowed[np.argmax(row[allowed])])
            matchers[i].consume_token(token)
        par.append(t_par), fill.append(t2 - t1), apply.append(t3 - t2), theirs.append(t4 - t3)
        wide.append(step_allowed > 1000)

    def ms(values):
        values = sorted(values)
        return f"median {statistics.median(values) * 1e3:7.2f} ms, p90 {values[int(0.9 * len(values))] * 1e3:7.2f} ms"

    total = [f + a for f, a in zip(fill, apply)]
    in_strings = [t for t, w in zip(total, wide) if w]
    print(f"{args.lanes} lanes, {args.steps} steps, {VOCAB} logits per lane; tokens allowed per lane-step: median "
          f"{int(statistics.median(allowed_counts))}")
    print(f"  fill (one lane after another):   {ms(fill)}")
    print(f"  fill (LLExecutor, in parallel):  {ms(par)}")
    print(f"  apply (Constraint.mask's where): {ms(apply)}")
    print(f"  apply (llguidance.numpy's):      {ms(theirs)}")
    print(f"  fill + apply, the engine's path: {ms(total)} = "
          f"{statistics.median(total) * 1e3 / 140 * 100:.1f}% of a 140 ms 2B decode step")
    if in_strings:
        print(f"  the same, steps where a lane is inside a string (> 1000 tokens allowed; {len(in_strings)} steps): "
              f"{ms(in_strings)} = {statistics.median(in_strings) * 1e3 / 140 * 100:.1f}%")


if __name__ == "__main__":
    main()
