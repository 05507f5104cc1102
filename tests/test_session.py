"""The vision session end to end on a random tiny checkpoint: processor, packing,
cached artifacts, resident weights, trimming; against the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from conftest import rel_l2
from emitter.config import PRESETS
from emitter.text_config import load_token_ids
from runtime.inputs.processor import process_images
from runtime.oracle.reference import Reference
from runtime.vision import VisionSession
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, write_checkpoint

TINY = PRESETS["tiny"]
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})


def images(seed=0, sizes=((64, 96), (100, 60), (40, 200), (130, 130))):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    write_checkpoint(folder, TINY, seed=2, processor_policy_dict=SMALL_POLICY)
    return VisionSession(folder, buckets=(64, 128), cache_dir=tmp_path_factory.mktemp("cache"))


def reference_output(session, pictures):
    from runtime.checkpoints.vision import load_vision_weights
    pixels, grids = process_images(pictures, session.policy)
    stages = Reference(TINY, load_vision_weights(session.model_dir, TINY)).run(pixels, grids)
    k = len(TINY.deepstack_visual_indexes)
    return stages["merger"], np.stack([stages[f"deepstack_merger_list.{i}"] for i in range(k)]), grids


def test_encode_matches_reference_across_calls(session):
    pictures = images()
    out = session.encode(pictures)
    expected_main, expected_deepstack, grids = reference_output(session, pictures)
    np.testing.assert_array_equal(out.grid_thw, grids)
    assert len(out.calls) >= 2, "these images need more than one call of the largest bucket"
    assert out.image_embeds.shape == (sum(out.merged_counts(4)), TINY.out_hidden_size)
    assert out.deepstack_features.shape == (2, *out.image_embeds.shape)
    assert rel_l2(out.image_embeds, expected_main) <= 1e-5
    assert rel_l2(out.deepstack_features, expected_deepstack) <= 1e-5


def test_smallest_bucket_is_used(session):
    out = session.encode(images(sizes=((64, 64),)))
    assert [c.bucket for c in out.calls] == [64]


def test_a_second_call_does_not_touch_an_earlier_result(session):
    first = session.encode(images(1, sizes=((64, 96),)))
    kept = first.image_embeds.copy()
    session.encode(images(2, sizes=((64, 96),)))
    np.testing.assert_array_equal(first.image_embeds, kept)


def test_image_too_large_for_every_bucket_is_refused(tmp_path):
    write_checkpoint(tmp_path, TINY, seed=2, processor_policy_dict=SMALL_POLICY)
    small = VisionSession(tmp_path, buckets=(16,), cache_dir=tmp_path / "cache")
    # 96x128 px -> a 6x8 patch grid -> 48 patches
    with pytest.raises(ValueError, match=r"big\.png: 48 patches .* largest bucket is 16"):
        small.encode(images(sizes=((96, 128),)), names=["big.png"])


def prompt_with_images(ids, count: int) -> list[int]:
    """Text tokens around `count` images in the chat template's form, with the checkpoint's ids."""
    image = [ids.vision_start_token_id, ids.image_token_id, ids.vision_end_token_id]
    return [1, 2] + [t for _ in range(count) for t in image + [3]] + [4]


def check_payload(session, payload, pictures) -> None:
    out = session.encode(pictures)
    np.testing.assert_array_equal(payload.image_embeds, out.image_embeds)
    assert [layer for layer, _ in payload.deepstack] == [0, 1]
    assert len(payload.visual_positions) == len(out.image_embeds)
    assert payload.position_ids.shape == (3, len(payload.input_ids))


def test_prefill_payload_from_a_prompt(session):
    pictures = images(sizes=((64, 96), (100, 60)))
    payload = session.prefill(prompt_with_images(load_token_ids(session.model_dir), 2), pictures)
    check_payload(session, payload, pictures)


def test_prefill_takes_the_checkpoints_own_token_ids(tmp_path):
    """A random checkpoint with a language model has its tokenizer's ids, not Qwen's: the
    prefill payload finds its pads by them (config.json's image_token_id and the rest)."""
    from emitter.text_config import TEXT_PRESETS, TokenIds
    from runtime.checkpoints.synthetic_text import write_generation_checkpoint
    write_generation_checkpoint(tmp_path / "m", TINY, TEXT_PRESETS["tiny"], seed=4, processor_policy_dict=SMALL_POLICY)
    ids = load_token_ids(tmp_path / "m")
    assert ids.image_token_id != TokenIds().image_token_id
    session = VisionSession(tmp_path / "m", buckets=(64, 128), cache_dir=tmp_path / "cache")
    pictures = images(sizes=((64, 96),))
    payload = session.prefill(prompt_with_images(ids, 1), pictures)
    check_payload(session, payload, pictures)
    assert (payload.input_ids[payload.visual_positions] == ids.image_token_id).all()


def test_argument_bound_weights_give_the_same_result(session, tmp_path):
    """The runtime's default binding (parameters) and weights as arguments agree."""
    other = VisionSession(session.model_dir, buckets=(64, 128), cache_dir=tmp_path, weights="arguments")
    assert session.plan.weights == "parameters" and other.plan.weights == "arguments"
    pictures = images(3, sizes=((64, 96), (100, 60)))
    np.testing.assert_allclose(other.encode(pictures).image_embeds, session.encode(pictures).image_embeds,
                               rtol=1e-5, atol=1e-6)


def test_one_module_serves_every_bucket(tmp_path):
    """All buckets are entries of one loaded module over one memory-mapped archive."""
    write_checkpoint(tmp_path / "m", TINY, seed=2, processor_policy_dict=SMALL_POLICY)
    session = VisionSession(tmp_path / "m", buckets=(128, 32, 64), cache_dir=tmp_path / "c")
    assert session.buckets == (32, 64, 128)
    small, large = images(sizes=((64, 64),)), images(sizes=((150, 200),))  # 16 and 120 patches
    first = session.encode(small)
    artifact = session.artifact()
    assert session.encode(large).calls[0].bucket == 128 and session.artifact() is artifact
    again = session.encode(small)
    assert again.calls[0].bucket == 32
    np.testing.assert_array_equal(again.image_embeds, first.image_embeds)
    assert sorted(p.suffix for p in (tmp_path / "c").iterdir() if p.suffix != ".lock") == [
        ".irpa", ".json", ".json", ".vmfb"]
