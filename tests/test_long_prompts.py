"""Prompts longer than the largest prefill bucket: prefilled in chunks (emitter/text_shape.py's
`prefill_chunks`), each attending over the cache the earlier chunks wrote, with image and
video rows and their DeepStack features injected in whichever chunk holds them. Against
transformers (f32, same checkpoint, same images and video file): a multi-turn chat of about
4,000 tokens with three images, and one of about 3,100 tokens with a 12-frame video, each
with a chunk boundary inside a medium's rows, give the same greedy tokens, every step's
logits within relL2 1e-5, in `generate`'s one-sequence module and in a row of the server's
batched module."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_l2
from helpers import gradient_frames, write_images, write_video
from test_text_parity import SMALL_POLICY, TOL, reference_chat
from emitter.config import PRESETS
from emitter.text_shape import prefill_chunks
from emitter.text_config import TEXT_PRESETS
from runtime.inputs.chat import Media
from runtime.sampling import Sampler, SamplingParams
from runtime.generator import Generator
from runtime.text import TextSession, run_tokens
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
    """Our answer to `chat` (the reference's messages: image and video parts carry their path)."""
    media = [Media(part["type"], part[part["type"]]) for m in chat for part in m["content"] if part["type"] != "text"]
    messages = [{"role": m["role"], "content": [p if p["type"] == "text" else {"type": p["type"]}
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
    check_parity(model_dir, root, chat, expected, "image_token_id")


@pytest.fixture(scope="module")
def video_chat(setup):
    """A chat of about 3,100 tokens with a video of 12 sampled 256x256 frames (6 groups of
    64 rows) whose rows hold the chunk boundary at 768."""
    _, root, _ = setup
    video = write_video(root / "clip.mp4", gradient_frames(24, 256, 256, seed=9), rate=4)
    return [
        {"role": "user", "content": [{"type": "text", "text": long_text(350, 4)}, {"type": "video", "video": video},
                                     {"type": "text", "text": long_text(600, 5)}]},
        {"role": "assistant", "content": [{"type": "text", "text": long_text(200, 6)}]},
        {"role": "user", "content": [{"type": "text", "text": long_text(300, 7) + " What happens in the video?"}]},
    ]


def test_long_chat_with_a_video_matches_transformers(setup, video_chat):
    model_dir, root, _ = setup
    check_parity(model_dir, root, video_chat, reference_chat(model_dir, video_chat, STEPS), "video_token_id")


def check_parity(model_dir, root, chat, expected, pad: str):
    """`chat` through `generate`'s module against transformers' (prompt ids, tokens, logits),
    with a chunk boundary inside the rows of a medium whose pad is `pad`
    (image_token_id or video_token_id); then the same prompt as one of two lanes of the
    server's module, bit-equal to `generate`'s."""
    ids, tokens, logits = expected
    assert 3000 <= ids.size <= CONTEXT - STEPS, ids.size
    gen = Generator(model_dir, buckets=BUCKETS, context=CONTEXT, cache_dir=root / "cache")
    prompt, got, got_logits = ours(gen, chat, STEPS)
    assert prompt.ids.tolist() == ids.tolist()
    # the chunking this test means to cover: a boundary inside a medium's rows (between two of
    # its DeepStack rows too: they sit at the same positions)
    starts = [c.start for c in prefill_chunks(ids.size, gen.text.shape)][1:]
    rows = set(np.flatnonzero(ids == getattr(gen.text.token_ids, pad)).tolist())
    assert any(s - 1 in rows and s in rows for s in starts), f"no chunk boundary inside the rows of {pad}"
    assert len(tokens) == STEPS and got == tokens
    errors = [rel_l2(a, b) for a, b in zip(got_logits, logits)]
    assert max(errors) <= TOL, errors

    # the same prompt as one of two lanes (the server's module), then decode steps
    batch = TextSession(model_dir, BUCKETS, CONTEXT, 2, cache_dir=root / "cache", lanes=2)
    assert lane_logits(batch, prompt, tokens[:3]) == [x.tobytes() for x in got_logits[:4]]


def lane_logits(session, prompt, tokens, expect_hit=None) -> list[bytes]:
    """A sequence of `prompt` in `session` (blocks from its prefix cache or prefilled), then
    decode steps feeding `tokens`: the logits of each call, as bytes; its blocks given back."""
    seq, start = session.admit(prompt)
    if expect_hit is not None:
        assert (start > 0) == expect_hit, start
    out = [session.prefill_blocks(seq, prompt, start)]
    for step, token in enumerate(tokens):
        length = prompt.ids.size + step
        assert session.grow(seq, length + 1)
        out.append(session.decode_batch([seq], [token], [length + prompt.rope_delta], [length])[0])
    session.release(seq)
    return [x.tobytes() for x in out]


def test_prefix_cache_hit_is_bit_equal_to_a_miss(setup):
    """A chat's second turn (the first turn, its answer and a new question) finds the first
    turn's prompt blocks in the prefix cache and prefills only the rest, with chunks that
    start elsewhere than a miss's: its logits equal, bit for bit, those of a session without
    the prefix cache. The same prompt again is a hit too; and many sequences share one prefix."""
    model_dir, root, chat = setup
    gen = Generator(model_dir, buckets=BUCKETS, context=CONTEXT, cache_dir=root / "cache", lanes=4)
    first, answer, _ = ours(gen, chat, STEPS)
    turn2 = chat + [{"role": "assistant", "content": [{"type": "text", "text": gen.tokenizer.decode(answer)}]},
                    {"role": "user", "content": [{"type": "text", "text": "And the first picture?"}]}]
    media = [Media("image", part["image"]) for m in turn2 for part in m["content"] if part["type"] == "image"]
    messages = [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else p
                                                for p in m["content"]]} for m in turn2]
    second = gen.prepare(messages, media, STEPS)
    assert second.ids[:first.ids.size - 1].tolist() == first.ids[:-1].tolist()  # the template may end a turn otherwise

    text = gen.text
    text.release(text.sequence)  # generate's sequence gives its blocks back (the first turn's stay cached)
    hits = text.pool.hit_tokens
    hit = lane_logits(text, second, answer[:3], expect_hit=True)
    assert text.pool.hit_tokens - hits >= first.ids.size // 16 * 16 - 16  # the first turn's blocks
    miss = TextSession(model_dir, BUCKETS, CONTEXT, 2, cache_dir=root / "cache", lanes=4, prefix_cache=False)
    assert lane_logits(miss, second, answer[:3], expect_hit=False) == hit
    assert lane_logits(text, second, answer[:3], expect_hit=True) == hit  # the whole prompt again

    # four sequences sharing the first turn's blocks, decoded together
    seqs = [text.admit(second) for _ in range(4)]
    assert all(start == seqs[0][1] > 0 for _, start in seqs)
    shared = seqs[0][0].ids[:seqs[0][1] // 16]
    assert all(seq.ids[:len(shared)] == shared for seq, _ in seqs)
    assert all(text.pool.refs[b] == 4 for b in shared)
    logits = [text.prefill_blocks(seq, second, start) for seq, start in seqs]
    assert all(x.tobytes() == hit[0] for x in logits)
    n = second.ids.size
    for seq, _ in seqs:
        assert text.grow(seq, n + 1)
    step = text.decode_batch([seq for seq, _ in seqs], [answer[0]] * 4, [n + second.rope_delta] * 4, [n] * 4)
    assert all(x.tobytes() == hit[1] for x in step)
    for seq, _ in seqs:
        text.release(seq)
    assert all(text.pool.refs[b] == 0 for b in shared)


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

    batch = TextSession(model_dir, BUCKETS, CONTEXT, 2, cache_dir=root / "cache", lanes=2, kv_cache_dtype="bf16")
    assert lane_logits(batch, prompt, got[:2]) == [x.tobytes() for x in got_logits[:3]]
