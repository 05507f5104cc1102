"""Choosing the next token from a row of logits: greedy or sampled, as transformers does.

`SamplingParams` holds the settings; `generation_defaults(model_dir)` reads them from the
checkpoint's `generation_config.json` with transformers' defaults for absent fields
(`do_sample` false, `temperature` 1.0, `top_k` 50, `top_p` 1.0, `repetition_penalty`
1.0; `min_p` none). `Sampler` applies, in transformers' order, to the model's f32 logits:

0. OpenAI's `logit_bias`, added to the logits of its token ids (before the penalties, as
   vLLM's sampler applies it);
1. the repetition penalty (`RepetitionPenaltyLogitsProcessor`: every id seen so far,
   prompt included, has its logit divided by the penalty if positive, else multiplied);
2. OpenAI's presence and frequency penalties (over the generated ids only, as vLLM:
   `logit -= frequency * count + presence * (count > 0)`);
3. when sampling: temperature, top-k, top-p, min-p (`TemperatureLogitsWarper`,
   `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`, each keeping at least one
   token), then a draw from the softmax with the sampler's own seeded generator;
   otherwise the argmax.

Log-probabilities (`Sampler.logprobs`) are of the model's distribution, `log_softmax` of
the raw logits, before any penalty or warper (vLLM's default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

# transformers' GenerationConfig defaults for the fields read here.
TRANSFORMERS_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                         "repetition_penalty": 1.0, "min_p": None}


class SamplingError(ValueError):
    """A sampling setting out of range; one line naming it."""


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50  # 0 or None: no top-k
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple = ()  # ((token id, bias in [-100, 100]), ...)

    def with_overrides(self, **fields) -> "SamplingParams":
        """These settings with the given (non-None) fields replaced; a `temperature` given
        decides greedy (0) or sampling (> 0), as OpenAI's API and vLLM read it."""
        fields = {k: v for k, v in fields.items() if v is not None}
        if "temperature" in fields and "do_sample" not in fields:
            fields["do_sample"] = fields["temperature"] > 0
            if fields["temperature"] == 0:
                fields["temperature"] = 1.0
        return replace(self, **fields).checked()

    def checked(self) -> "SamplingParams":
        """Itself, or SamplingError naming the first field out of range."""
        rules = [("temperature", self.temperature > 0 and math.isfinite(self.temperature), "a number > 0"),
                 ("top_p", 0 < self.top_p <= 1, "a number in (0, 1]"),
                 ("top_k", self.top_k is None or self.top_k >= 0, "0 (none) or a positive integer"),
                 ("min_p", self.min_p is None or 0 <= self.min_p <= 1, "a number in [0, 1]"),
                 ("repetition_penalty", self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
                  "a number > 0"),
                 ("presence_penalty", -2 <= self.presence_penalty <= 2, "a number in [-2, 2]"),
                 ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "a number in [-2, 2]"),
                 ("seed", self.seed is None or self.seed >= 0, "an integer >= 0"),
                 ("logit_bias", all(i >= 0 and -100 <= b <= 100 for i, b in self.logit_bias),
                  "token ids with biases in [-100, 100]")]
        for name, ok, expected in rules:
            if not ok:
                raise SamplingError(f"{name} {getattr(self, name)!r}: expected {expected}")
        return self


def _number(path: Path, config: dict, name: str, kind):
    value = config.get(name)
    if value is None:
        return TRANSFORMERS_DEFAULTS[name]
    numeric = (int,) if kind is int else (int, float)
    if isinstance(value, bool) != (kind is bool) or (kind is not bool and not isinstance(value, numeric)):
        raise SamplingError(f"{path}: field {name!r} = {value!r}: expected {kind.__name__}")
    return kind(value)


def generation_defaults(model_dir) -> SamplingParams:
    """The sampling settings of `model_dir/generation_config.json`, transformers' defaults
    for the fields it does not set (or all of them without the file)."""
    path = Path(model_dir) / "generation_config.json"
    config = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise SamplingError(f"{path}: cannot read as JSON ({e})") from None
        if not isinstance(config, dict):
            raise SamplingError(f"{path}: expected a JSON object")
    fields = {"do_sample": bool, "temperature": float, "top_k": int, "top_p": float, "repetition_penalty": float,
              "min_p": float}
    params = SamplingParams(**{k: _number(path, config, k, kind) for k, kind in fields.items()})
    try:
        return params.checked()
    except SamplingError as e:
        raise SamplingError(f"{path}: {e}") from None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def top_k_filter(scores: np.ndarray, k: int) -> np.ndarray:
    """TopKLogitsWarper: -inf below the k-th largest score (ties with it kept)."""
    if not k or k >= scores.size:
        return scores
    kth = np.partition(scores, -k)[-k]
    return np.where(scores < kth, -np.inf, scores).astype(scores.dtype)


def top_p_filter(scores: np.ndarray, p: float) -> np.ndarray:
    """TopPLogitsWarper: ascending sort, drop the tokens whose cumulative probability is
    <= 1 - p (the most likely token always kept)."""
    if p >= 1.0:
        return scores
    order = np.argsort(scores, kind="stable")
    probs = np.exp(log_softmax(scores[order]))
    remove = np.cumsum(probs) <= 1 - p
    remove[-1] = False
    out = scores.copy()
    out[order[remove]] = -np.inf
    return out


def min_p_filter(scores: np.ndarray, min_p: float | None) -> np.ndarray:
    """MinPLogitsWarper: drop tokens less likely than min_p times the top probability."""
    if min_p is None:
        return scores
    probs = np.exp(log_softmax(scores))
    remove = probs < min_p * probs.max()
    remove[int(np.argmax(probs))] = False
    return np.where(remove, -np.inf, scores).astype(scores.dtype)


class Sampler:
    """The choice of each new token of one sequence (its prompt ids, its own generator)."""

    def __init__(self, params: SamplingParams, prompt_ids, vocab_size: int):
        self.params = params.checked()
        self.vocab_size = vocab_size
        self.seen = np.zeros(vocab_size, bool)
        self.seen[np.asarray(prompt_ids, np.int64).reshape(-1)] = True
        self.counts = np.zeros(vocab_size, np.int64)
        self.rng = np.random.default_rng(params.seed)

    def penalized(self, logits: np.ndarray) -> np.ndarray:
        """Steps 0 to 2 of the module docstring, on a copy (f32, as transformers computes)."""
        p = self.params
        out = np.asarray(logits, np.float32).copy()
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias)
            out[list(ids)] += np.asarray(biases, np.float32)
        if p.repetition_penalty != 1.0:
            seen = out[self.seen]
            penalty = np.float32(p.repetition_penalty)
            out[self.seen] = np.where(seen < 0, seen * penalty, seen / penalty)
        if p.presence_penalty or p.frequency_penalty:
            out -= (np.float32(p.frequency_penalty) * self.counts + np.float32(p.presence_penalty) *
                    (self.counts > 0)).astype(np.float32)
        return out

    def warped(self, logits: np.ndarray) -> np.ndarray:
        """The scores the draw is made from (step 3 before the draw); the penalized logits
        when greedy."""
        p, scores = self.params, self.penalized(logits)
        if not p.do_sample:
            return scores
        if p.temperature != 1.0:
            scores = scores / np.float32(p.temperature)
        scores = top_k_filter(scores, p.top_k or 0)
        scores = top_p_filter(scores, p.top_p)
        return min_p_filter(scores, p.min_p)

    def choose(self, logits: np.ndarray) -> int:
        """The next token (and it is counted as seen)."""
        scores = self.warped(logits)
        if self.params.do_sample:
            probs = np.exp(log_softmax(scores))
            token = int(min(np.searchsorted(np.cumsum(probs), self.rng.random() * probs.sum(), side="right"),
                            probs.size - 1))
        else:
            token = int(np.argmax(scores))
        self.seen[token] = True
        self.counts[token] += 1
        return token

    @staticmethod
    def logprobs(logits: np.ndarray, token: int, top: int = 0) -> tuple[float, list[tuple[int, float]]]:
        """The model's log-probability of `token` and its `top` most likely tokens."""
        lp = log_softmax(logits)
        best = np.argsort(-lp, kind="stable")[:top] if top else []
        return float(lp[token]), [(int(i), float(lp[i])) for i in best]
