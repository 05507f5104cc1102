"""Prompts longer than the largest prefill bucket: prefilled in chunks (emitter/text.py's
`prefill_chunks`), each attending over the cache the earlier chunks wrote, with image rows
and their DeepStack features injected in whichever chunk holds them. Against transformers
(f32, same checkpoint, same images): a multi-turn chat of about 4,000 tokens with three
images and chunk boundaries inside image rows gives the same greedy tokens, every step's
logits within relL2 1e-5, in `generate`'s one-sequence module and in a row of the
server's batched module."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_l2
from helpers import write_images
from test_text_parity import SMALL_POLICY, TOL, reference_chat
from emitter.config import PRESETS
from emitter.text import prefill_chunks
from emitter.text_config import TEXT_PRESETS
from runtime.inputs.chat import Media
from runtime.sampling import Sampler, SamplingParams
from runtime.text import Generator, run_tokens
from runtime.checkpoints.synthetic_text import write_generation_checkpoint

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BUCKETS = (64, 256)  # chunks of 256 tokens
CONTEXT = 4000  # not a whole number of chunks: the cache rounds up (cache_slots)
STEPS = 8
WORDS = "the a picture of red green blue cat dog house tree sky river road car window light".split()


def long_text(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, words))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    model_dir = root / "model"
    write_generation_checkpoint(model_dir, PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=3,
                                processor_policy_dict=SMALL_POLICY)
    images = write_images(root, ((320, 320), (256, 192), (200, 330)))
    chat = [
        {"role": "user", "content": [{"type": "image", "image": images[0]}, {"type": "image", "image": images[1]},
                                     {"type": "text", "text": long_text(1400, 1)}]},
        {"role": "assistant", "content": [{"type": "text", "text": long_text(300, 2)}]},
        {"role": "user", "content": [{"type": "text", "text": long_text(450, 3)},
                                     {"type": "image", "image": images[2]},
                                     {"type": "text", "text": "What is in the last picture?"}]},
    ]
    return model_dir, root, chat


def ours(gen, chat, steps):
    """Our answer to `chat` (the reference's messages: image parts carry their path)."""
    media = [Media("image", part["image"]) for m in chat for part in m["content"] if part["type"] == "image"]
    messages = [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else p
                                                for p in m["content"]]} for m in chat]
    prompt = gen.prepare(messages, media, steps)
    sampler = Sampler(SamplingParams(), prompt.ids, gen.text.cfg.vocab_size)
    tokens, logits, _ = run_tokens(gen.text, prompt, sampler, steps)
    return prompt, tokens, logits


@pytest.fixture(scope="module")
def expected(setup):
    model_dir, _, chat = setup
    return reference_chat(model_dir, chat, STEPS)


def test_long_chat_matches_transformers(setup, expected):
    model_dir, root, chat = setup
    ids, tokens, logits = expected
    assert 3000 <= ids.size <= CONTEXT - STEPS, ids.size
    gen = Generator(model_dir, buckets=BUCKETS, context=CONTEXT, cache_dir=root / "cache")
    prompt, got, got_logits = ours(gen, chat, STEPS)
    assert prompt.ids.tolist() == ids.tolist()
    # the chunking this test means to cover: boundaries inside an image's rows
    starts = [c.start for c in prefill_chunks(ids.size, BUCKETS, gen.text.slots)][1:]
    visual = set(prompt.visual.tolist())
    assert any(s - 1 in visual and s in visual for s in starts), "no chunk boundary inside an image"
    assert len(tokens) == STEPS and got == tokens
    errors = [rel_l2(a, b) for a, b in zip(got_logits, logits)]
    assert max(errors) <= TOL, errors

    # the same prompt into a row of the server's batched module, then batched decode steps
    from runtime.text_batch import BatchTextSession
    batch = BatchTextSession(model_dir, 2, buckets=BUCKETS, context=CONTEXT, deepstack_layers=2,
                             cache_dir=root / "cache")
    row_logits = [batch.prefill_row(1, prompt)]
    for step in range(3):
        length = ids.size + step
        row_logits.append(batch.decode_batch([1], [tokens[step]], [length + prompt.rope_delta], [length])[0])
    assert max(rel_l2(a, b) for a, b in zip(row_logits, got_logits)) <= 1e-6


def test_bf16_kv_cache_stays_near(setup, expected):
    """--kv-cache-dtype bf16 on the same chat: the logits measurably away from transformers'
    f32 ones but near them; a batched row of a bf16 cache gives what generate's module gives."""
    model_dir, root, chat = setup
    ids, tokens, logits = expected
    gen = Generator(model_dir, buckets=BUCKETS, context=CONTEXT, cache_dir=root / "cache", kv_cache_dtype="bf16")
    prompt, got, got_logits = ours(gen, chat, STEPS)
    errors = [rel_l2(a, b) for a, b in zip(got_logits, logits)]
    print(f"bf16 KV cache: relL2 per step {['%.2e' % e for e in errors]}, tokens equal {got == tokens}")
    assert 1e-5 < max(errors) <= 2e-2, errors
    assert got[0] == tokens[0]

    from runtime.text_batch import BatchTextSession
    batch = BatchTextSession(model_dir, 2, buckets=BUCKETS, context=CONTEXT, deepstack_layers=2,
                             cache_dir=root / "cache", kv_cache_dtype="bf16")
    row_logits = [batch.prefill_row(0, prompt)]
    for step in range(2):
        length = ids.size + step
        row_logits.append(batch.decode_batch([0], [got[step]], [length + prompt.rope_delta], [length])[0])
    assert max(rel_l2(a, b) for a, b in zip(row_logits, got_logits)) <= 1e-6
