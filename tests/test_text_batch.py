"""The batched language model (emitter/text_batch.py, runtime/text_batch.py): sequences
prefilled into rows and decoded together give, lane by lane, the one-sequence module's
logits bit for bit; and the `reset` it runs after loading is needed (control)."""

from __future__ import annotations

import numpy as np
import pytest

from emitter.config import PRESETS
from emitter.text_config import TEXT_PRESETS
from runtime.inputs.chat import Prompt
from runtime.text import TextSession, stream_tokens
from runtime.sampling import Sampler, SamplingParams
from runtime.checkpoints.synthetic_text import write_generation_checkpoint
from runtime.text_batch import BatchTextSession

SHAPE = dict(buckets=(16,), context=48, deepstack_layers=3)
STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    write_generation_checkpoint(root / "m", PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=4)
    rng = np.random.default_rng(0)
    prompts = []
    for n, delta in ((5, 0), (11, 3), (2, -1)):  # text-only ids, M-RoPE positions shifted like images do
        ids = rng.integers(0, TEXT_PRESETS["tiny"].vocab_size, n)
        positions = np.repeat(np.arange(n)[None], 3, 0)
        prompts.append(Prompt(ids, positions, delta))
    return root / "m", root / "cache", prompts


def solo_runs(model, cache, prompts):
    text = TextSession(model, cache_dir=cache, **SHAPE)
    runs = []
    for p in prompts:
        sampler = Sampler(SamplingParams(), p.ids, text.cfg.vocab_size)
        runs.append(list(stream_tokens(text, p, sampler, STEPS)))
    return runs


def batched_runs(session, prompts, starts, rows):
    """Prompt i prefilled into cache row `rows[i]` at step `starts[i]`, then greedy steps for
    all that run (the decode entry of 1, 2 or 4 lanes, as many as run)."""
    tokens = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    length = [p.ids.size for p in prompts]
    for step in range(max(starts) + STEPS):
        for i, p in enumerate(prompts):
            if starts[i] == step:
                row = session.prefill_row(rows[i], p)
                logits[i].append(row)
                tokens[i].append(int(np.argmax(row)))
        live = [i for i in range(len(prompts)) if starts[i] <= step and len(tokens[i]) < STEPS]
        if not live:
            continue
        out = session.decode_batch([rows[i] for i in live], [tokens[i][-1] for i in live],
                                   [length[i] + prompts[i].rope_delta for i in live], [length[i] for i in live])
        for i, row in zip(live, out):
            length[i] += 1
            logits[i].append(row)
            tokens[i].append(int(np.argmax(row)))
    return tokens, logits


def test_batched_decode_equals_the_one_sequence_module(setup):
    model, cache, prompts = setup
    solo = solo_runs(model, cache, prompts)
    session = BatchTextSession(model, 4, cache_dir=cache, **SHAPE)
    tokens, logits = batched_runs(session, prompts, starts=[0, 2, 5], rows=[2, 0, 3])  # admitted between steps
    for i, run in enumerate(solo):
        assert tokens[i] == [t for t, _ in run]
        for ours, (_, theirs) in zip(logits[i], run):
            assert np.array_equal(ours, theirs)


def test_without_reset_the_cache_updates_go_wrong(setup, monkeypatch):
    """Control: the same module, not reset after loading, gives other logits after the
    first step (IREE's shared zero buffer; see emitter/text_batch.reset_function)."""
    model, cache, prompts = setup
    solo = solo_runs(model, cache, prompts[:1])
    monkeypatch.setattr(TextSession, "_load", TextSession._load)
    monkeypatch.setattr(BatchTextSession, "_load", TextSession._load)
    session = BatchTextSession(model, 4, cache_dir=cache, **SHAPE)
    _, logits = batched_runs(session, prompts[:1], starts=[0], rows=[1])
    assert np.array_equal(logits[0][0], solo[0][0][1])  # the prefill itself is right
    assert not all(np.array_equal(ours, theirs) for ours, (_, theirs) in zip(logits[0][1:], solo[0][1:]))


def test_a_copied_prompt_decodes_as_its_prefill(setup):
    """`copy_prompt` gives a row what prefilling the same prompt there gives (decoded bit for
    bit as the one-sequence module), and steps with a spare lane leave idle rows as they were."""
    model, cache, prompts = setup
    solo = solo_runs(model, cache, prompts[1:2])[0]
    session = BatchTextSession(model, 4, cache_dir=cache, **SHAPE)
    prompt = prompts[1]
    first = session.prefill_row(3, prompt)  # idle in row 3 while three others decode:
    batched_runs(session, prompts, starts=[0, 0, 0], rows=[0, 1, 2])  # the 4-lane entry, one spare lane
    session.copy_prompt(3, 0, prompt.ids.size)  # over the other prompt row 0 held
    assert np.array_equal(first, solo[0][1])
    for row in (3, 0):
        token, length = int(np.argmax(first)), prompt.ids.size
        for step in range(1, STEPS):
            out = session.decode_batch([row], [token], [length + prompt.rope_delta], [length])[0]
            assert np.array_equal(out, solo[step][1]), (row, step)
            token, length = int(np.argmax(out)), length + 1


def test_lanes_of_different_spans_equal_their_solo_runs(setup):
    """A short sequence decoded beside a long one attends over the long one's span (1024
    slots) where alone it attends over 512: its logits are still the one-sequence
    module's bit for bit (the masked slots add exact zeros), and so are the long one's."""
    model, cache, _ = setup
    shape = dict(buckets=(16, 640), context=1024, deepstack_layers=3)
    rng = np.random.default_rng(1)
    prompts = [Prompt(ids, np.repeat(np.arange(ids.size)[None], 3, 0), 0)
               for ids in (rng.integers(0, TEXT_PRESETS["tiny"].vocab_size, n) for n in (600, 5))]
    text = TextSession(model, cache_dir=cache, **shape)
    solo = [list(stream_tokens(text, p, Sampler(SamplingParams(), p.ids, text.cfg.vocab_size), STEPS))
            for p in prompts]
    session = BatchTextSession(model, 2, cache_dir=cache, **shape)
    tokens, logits = batched_runs(session, prompts, starts=[0, 0], rows=[0, 1])
    for i, run in enumerate(solo):
        assert tokens[i] == [t for t, _ in run]
        for ours, (_, theirs) in zip(logits[i], run):
            assert np.array_equal(ours, theirs), i
