"""runtime/sampling.py against transformers' logits processors on the same logits, the
checkpoint defaults against transformers' GenerationConfig, and the draw itself."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.sampling import Sampler, SamplingError, SamplingParams, generation_defaults

VOCAB = 400


def transformers_scores(params: SamplingParams, prompt, logits):
    """transformers' processors, in generate's order, on one row."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    processors = [lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty)]
    if params.do_sample:
        if params.temperature != 1.0:
            processors.append(lp.TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(lp.TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(lp.TopPLogitsWarper(params.top_p))
        if params.min_p is not None:
            processors.append(lp.MinPLogitsWarper(params.min_p))
    ids = torch.tensor(np.asarray(prompt, np.int64))[None]
    scores = torch.tensor(logits)[None]
    for p in processors:
        scores = p(ids, scores)
    return scores[0].numpy()


CASES = [
    SamplingParams(do_sample=False, repetition_penalty=1.3),
    SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
    SamplingParams(do_sample=True, temperature=1.5, top_k=0, top_p=0.5),
    SamplingParams(do_sample=True, temperature=1.0, top_k=5, top_p=1.0, min_p=0.1),
    SamplingParams(do_sample=True, temperature=0.3, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=0.9),
]


@pytest.mark.parity
@pytest.mark.parametrize("params", CASES, ids=range(len(CASES)))
def test_scores_equal_transformers(params):
    rng = np.random.default_rng(7)
    for _ in range(5):
        logits = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
        prompt = rng.integers(0, VOCAB, 30)
        ours = Sampler(params, prompt, VOCAB).warped(logits)
        theirs = transformers_scores(params, prompt, logits)
        assert np.array_equal(np.isfinite(ours), np.isfinite(theirs))
        kept = np.isfinite(theirs)
        np.testing.assert_allclose(ours[kept], theirs[kept], rtol=1e-6, atol=1e-6)
        assert kept.sum() < VOCAB or not params.do_sample or (params.top_k == 0 and params.top_p == 1)


@pytest.mark.parity
def test_generation_config_defaults_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    for config in ({}, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
                   {"repetition_penalty": 1.2, "min_p": 0.05}):
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
        theirs = transformers.GenerationConfig.from_pretrained(tmp_path)
        ours = generation_defaults(tmp_path)
        defaults = transformers.GenerationConfig._get_default_generation_params()
        for name in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "min_p"):
            value = getattr(theirs, name)
            assert getattr(ours, name) == (defaults.get(name) if value is None else value), name


def test_generation_config_bad_field_named(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(SamplingError, match=r"generation_config\.json: top_p 1\.5: expected a number in \(0, 1\]"):
        generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": "x"}))
    with pytest.raises(SamplingError, match="field 'top_k' = 'x': expected int"):
        generation_defaults(tmp_path)


def test_same_seed_same_tokens_and_the_draw_follows_the_distribution():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(8).astype(np.float32)
    params = SamplingParams(do_sample=True, temperature=1.0, top_k=0, seed=123)

    def draws(p, n):
        s = Sampler(p, [], 8)
        return [s.choose(logits) for _ in range(n)]

    assert draws(params, 50) == draws(params, 50)
    assert draws(params, 50) != draws(params.with_overrides(seed=124), 50)
    counts = np.bincount(draws(params, 20000), minlength=8) / 20000
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(counts, probs, atol=0.015)


def test_temperature_zero_is_greedy_and_penalties_apply():
    logits = np.array([1.0, 3.0, 2.0, 0.5], np.float32)
    greedy = SamplingParams(do_sample=True).with_overrides(temperature=0)
    assert not greedy.do_sample and Sampler(greedy, [], 4).choose(logits) == 1
    s = Sampler(SamplingParams().with_overrides(presence_penalty=2.0), [], 4)
    assert [s.choose(logits) for _ in range(3)] == [1, 2, 0]  # each chosen id loses 2 after it appears
    s = Sampler(SamplingParams().with_overrides(frequency_penalty=0.6), [], 4)
    assert [s.choose(logits) for _ in range(4)] == [1, 1, 2, 1]


def test_logprobs_of_the_model_distribution():
    logits = np.array([0.0, np.log(3.0)], np.float32)
    chosen, top = Sampler.logprobs(logits, 0, top=2)
    assert chosen == pytest.approx(np.log(0.25)) and top[0][0] == 1 and top[0][1] == pytest.approx(np.log(0.75))


@pytest.mark.parametrize("field,value,message", [("temperature", -1, "temperature -1: expected a number > 0"),
                                                 ("top_p", 0, r"top_p 0: expected a number in \(0, 1\]"),
                                                 ("presence_penalty", 3, "presence_penalty 3")])
def test_out_of_range_named(field, value, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams().with_overrides(**{field: value})


def test_logit_bias_is_added_before_the_penalties():
    logits = np.array([3.0, 1.0, 2.0, -1.0], np.float32)
    sampler = Sampler(SamplingParams(logit_bias=((1, 2.5), (0, -100.0))), [], 4)
    assert sampler.penalized(logits).tolist() == [-97.0, 3.5, 2.0, -1.0]
    penalized = Sampler(SamplingParams(logit_bias=((1, 3.0),), repetition_penalty=2.0), [1], 4)
    assert penalized.penalized(logits).tolist() == [3.0, 2.0, 2.0, -1.0]  # (1 + 3) / 2, as vLLM orders them
    assert sampler.choose(logits) == 1
    with pytest.raises(SamplingError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),)).checked()
