"""The paged KV cache (emitter/kv_pages.py, runtime/kv_cache.py, emitter/text.py's module):
sequences admitted between steps and decoded together give, lane by lane, what each gives
alone, bit for bit, whatever blocks they were given; the block pool gives blocks back,
shares keyed ones and evicts the least recently freed."""

from __future__ import annotations

import numpy as np
import pytest

from emitter.config import PRESETS
from emitter.kv_pages import BLOCK
from emitter.text_shape import Chunk, TextShape, TextShapeError, chunk_plan, prefill_chunks
from emitter.text_config import TEXT_PRESETS
from runtime.inputs.chat import Prompt
from runtime.kv_cache import BlockPool, Blocks, block_keys
from runtime.text import TextSession, stream_tokens
from runtime.sampling import Sampler, SamplingParams
from runtime.checkpoints.synthetic_text import write_generation_checkpoint

SHAPE = dict(buckets=(16,), context=48, deepstack_layers=3)
STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    write_generation_checkpoint(root / "m", PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=4)
    rng = np.random.default_rng(0)
    prompts = []
    for n, delta in ((5, 0), (11, 3), (2, -1)):  # text-only ids, M-RoPE positions shifted like images do
        ids = rng.integers(0, TEXT_PRESETS["tiny"].vocab_size, n)
        positions = np.repeat(np.arange(n)[None], 3, 0)
        prompts.append(Prompt(ids, positions, delta))
    return root / "m", root / "cache", prompts


def solo_runs(model, cache, prompts, shape=SHAPE):
    text = TextSession(model, cache_dir=cache, **shape)
    runs = []
    for p in prompts:
        sampler = Sampler(SamplingParams(), p.ids, text.cfg.vocab_size)
        runs.append(list(stream_tokens(text, p, sampler, STEPS)))
    return runs


def batched_runs(session, prompts, starts):
    """Prompt i admitted (blocks, prefill) at step `starts[i]`, then greedy steps for all that
    run (the decode entry of 1, 2 or 4 lanes, as many as run)."""
    tokens = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    seqs = [None] * len(prompts)
    length = [p.ids.size for p in prompts]
    for step in range(max(starts) + STEPS):
        for i, p in enumerate(prompts):
            if starts[i] == step:
                seqs[i], start = session.admit(p)
                row = session.prefill_blocks(seqs[i], p, start)
                logits[i].append(row)
                tokens[i].append(int(np.argmax(row)))
        live = [i for i in range(len(prompts)) if starts[i] <= step and len(tokens[i]) < STEPS]
        if not live:
            continue
        for i in live:
            assert session.grow(seqs[i], length[i] + 1)
        out = session.decode_batch([seqs[i] for i in live], [tokens[i][-1] for i in live],
                                   [length[i] + prompts[i].rope_delta for i in live], [length[i] for i in live])
        for i, row in zip(live, out):
            length[i] += 1
            logits[i].append(row)
            tokens[i].append(int(np.argmax(row)))
    for seq in seqs:
        session.release(seq)
    return tokens, logits


def test_batched_decode_equals_each_alone(setup):
    model, cache, prompts = setup
    solo = solo_runs(model, cache, prompts)
    session = TextSession(model, cache_dir=cache, lanes=4, **SHAPE)
    session.pool.take(5)  # other blocks than the one-sequence session's
    tokens, logits = batched_runs(session, prompts, starts=[0, 2, 5])  # admitted between steps
    for i, run in enumerate(solo):
        assert tokens[i] == [t for t, _ in run]
        for ours, (_, theirs) in zip(logits[i], run):
            assert np.array_equal(ours, theirs)


def test_lanes_of_different_spans_equal_each_alone(setup):
    """A short sequence decoded beside a long one reads as many blocks as the long one (38
    and up) where alone it reads one: its logits are still its own bit for bit (the masked
    slots add exact zeros), and so are the long one's."""
    model, cache, _ = setup
    shape = dict(buckets=(16, 640), context=1024, deepstack_layers=3)
    rng = np.random.default_rng(1)
    prompts = [Prompt(ids, np.repeat(np.arange(ids.size)[None], 3, 0), 0)
               for ids in (rng.integers(0, TEXT_PRESETS["tiny"].vocab_size, n) for n in (600, 5))]
    solo = solo_runs(model, cache, prompts, shape)
    session = TextSession(model, cache_dir=cache, lanes=2, **shape)
    tokens, logits = batched_runs(session, prompts, starts=[0, 0])
    for i, run in enumerate(solo):
        assert tokens[i] == [t for t, _ in run]
        for ours, (_, theirs) in zip(logits[i], run):
            assert np.array_equal(ours, theirs), i


def test_block_pool_shares_keys_and_evicts_least_recently_freed():
    prompt = Prompt(np.arange(40), np.repeat(np.arange(40)[None], 3, 0), 0)
    keys = block_keys(prompt, 2)
    assert keys == block_keys(prompt, 2) and len(set(keys)) == 2
    other = Prompt(np.arange(40), np.repeat(np.arange(40)[None], 3, 0) + 1, 0)  # same ids, other positions
    assert block_keys(other, 1) != keys[:1]
    pool = BlockPool(6)
    a = Blocks(pool.take(3))
    pool.remember(a.ids[:2], keys)
    assert pool.used == 3 and len(pool.free) == 2
    shared = pool.share(keys)
    assert shared == a.ids[:2] and [pool.refs[b] for b in shared] == [2, 2]
    pool.release(a.ids)
    assert pool.used == 2  # the shared two still held
    pool.release(shared)
    assert pool.used == 0
    assert pool.share(keys) == a.ids[:2]  # free, still findable
    pool.release(a.ids[:2])
    taken = pool.take(4)  # the never-keyed blocks first, then the least recently freed keyed one
    assert a.ids[1] in taken and a.ids[0] not in taken  # a block is freed after those behind it
    assert pool.share(keys) == a.ids[:1]  # the first block still keyed; the second taken for another
    with pytest.raises(MemoryError):
        pool.take(2)


def test_shapes_are_checked():
    with pytest.raises(TextShapeError, match="multiple of 16"):
        TextShape((100,), 200)
    with pytest.raises(TextShapeError, match="at least"):
        TextShape((16,), 64, blocks=3)
    shape = TextShape((32, 128), 1000, lanes=2)
    assert shape.slots == 1024 and shape.blocks == 2 * 64 + 1
    chunks = prefill_chunks(300, shape, 0)
    # 44 rows after two whole chunks: 32 + 32 (64 rows and two calls, counted 96) rather than 128 (144)
    assert [(c.start, c.size, c.blocks) for c in chunks] == [(0, 128, 8), (128, 128, 16), (256, 32, 18), (288, 32, 20)]
    assert [(c.start, c.size) for c in prefill_chunks(300, shape, 288)] == [(288, 32)]
    assert prefill_chunks(1020, shape, 1008) is None or prefill_chunks(1020, shape, 1008)[-1].start + 32 <= 1024
    assert BLOCK == 16


def test_chunk_plans_pad_the_fewest_rows():
    """A prompt's rest runs in the buckets that cover it at the least rows, each call counted
    one block more (it reads every weight): a tail bucket takes the remainder, and a few
    smaller calls beat one mostly padded large one."""
    assert chunk_plan(5, (16, 64, 128)) == (64, 16)  # 78 rows: 80, not 128
    assert chunk_plan(6, (16, 64, 128, 512)) == (128,)  # 96: 128 + 16 ties 64 + 16 + 16: the larger first
    assert chunk_plan(19, (128, 512)) == (128, 128, 128)  # 300: 384 rows in three calls, not 512 in one
    assert chunk_plan(63, (128, 512)) == (512, 512)  # 1000
    assert chunk_plan(1, (64, 128)) == (64,)
    assert chunk_plan(0, (64,)) == ()
    assert prefill_chunks(300, TextShape((128, 512), 4096), 256) == [Chunk(256, 128)]  # from a cached prefix

