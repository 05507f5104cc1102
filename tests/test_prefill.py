"""The DeepStack prefill payload: pad expansion, M-RoPE position ids, the fail-closed
checks, the scatter/DeepStack helpers and the file; parity with transformers' Qwen3-VL
(`get_rope_index`, and a whole tiny Qwen3VLModel forward) where torch is importable."""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from emitter.text_config import TokenIds
from runtime.inputs import prefill
from runtime.inputs.prefill import (PAYLOAD_KEYS, PrefillError, add_deepstack, load_payload, merged_count, save_payload,
                             scatter_image_embeds)

ROOT = Path(__file__).resolve().parents[1]
IDS = TokenIds()  # the prompts here use Qwen's released ids: what a config.json that names none means
VISION_START, VISION_END = IDS.vision_start_token_id, IDS.vision_end_token_id
IMAGE_PAD, VIDEO_PAD = IDS.image_token_id, IDS.video_token_id
VS, VE, PAD = VISION_START, VISION_END, IMAGE_PAD
expand_image_pads = partial(prefill.expand_image_pads, token_ids=IDS)
build_prefill_payload = partial(prefill.build_prefill_payload, token_ids=IDS)
mrope_position_ids = partial(prefill.mrope_position_ids, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD)


def image(*, n=1):
    """The chat template's form of one image before expansion."""
    return [VS] + [PAD] * n + [VE]


def prompt(*parts):
    """Concatenate parts: ints are text tokens, lists are spliced in."""
    out = []
    for p in parts:
        out += p if isinstance(p, list) else [p]
    return np.array(out, np.int64)


def expanded(grids, text=((11, 12), (13,), (14, 15, 16), (17,))):
    """text[0] <img0> text[1] <img1> ... text[n], pads already expanded."""
    parts = list(text[0])
    for i, g in enumerate(grids):
        parts += image(n=merged_count(g)) + list(text[i + 1])
    return np.array(parts, np.int64)


def features(m, d=8, seed=0, k=None):
    rng = np.random.default_rng(seed)
    shape = (m, d) if k is None else (k, m, d)
    return rng.standard_normal(shape).astype(np.float32)


# --------------------------------------------------------------------------- constants


@pytest.mark.parity
def test_token_ids_match_transformers_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3VLConfig()
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id) == (
        VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


def test_no_token_id_of_qwens_in_the_runtime():
    """The special-token ids come from the checkpoint (config.json, `TokenIds`): none of
    Qwen's released ids is written into the runtime's code."""
    import re
    released = "|".join(str(i) for i in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD))
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "runtime").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(rf"\b({released})\b", line)]
    assert found == []


def test_module_does_not_import_torch():
    code = "import sys, runtime.inputs.prefill; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --------------------------------------------------------------------------- expand_image_pads


def test_expand_image_pads_in_order():
    grids = [(1, 4, 6), (1, 8, 8), (1, 2, 2)]
    ids = prompt(1, 2, image(), 3, image(), image(), 4)
    out = expand_image_pads(ids, grids)
    assert out.dtype == np.int64
    assert out.tolist() == ([1, 2] + image(n=6) + [3] + image(n=16) + image(n=1) + [4])
    # the expanded prompt is what the payload takes
    assert (out == PAD).sum() == sum(merged_count(g) for g in grids) == 23


def test_expand_image_pads_counts_frames_and_keeps_other_tokens():
    ids = prompt(VIDEO_PAD, image(), 5)
    assert expand_image_pads(ids, [(2, 4, 4)]).tolist() == [VIDEO_PAD] + image(n=8) + [5]
    assert expand_image_pads(prompt(1, 2, 3), np.zeros((0, 3), np.int64)).tolist() == [1, 2, 3]
    assert expand_image_pads([image()], [[1, 2, 2]]).tolist() == image(n=1)  # [1, S] accepted


@pytest.mark.parametrize("ids, grids, match", [
    (prompt(1, image(), 2, image()), [(1, 4, 4)], r"2 <\|image_pad\|> token\(s\) but 1 image grid"),
    (prompt(1, image()), [(1, 4, 4), (1, 2, 2)], r"1 <\|image_pad\|> token\(s\) but 2 image grid"),
    (prompt(1, 2), [(1, 2, 2)], r"0 <\|image_pad\|> token\(s\) but 1 image grid"),
    (prompt(image(n=4)), [(1, 4, 4)], "already expanded"),
    (prompt(1, PAD, VE), [(1, 2, 2)], "not wrapped"),
    (prompt(VS, PAD), [(1, 2, 2)], "not wrapped"),
    (prompt(image()), [(1, 3, 4)], "multiples of merge_size 2"),
    (prompt(image()), [(0, 2, 2)], "non-positive"),
    (prompt(image()), [(1, 2)], r"shape \[n, 3\]"),
    (np.array([[VS, PAD, VE], [VS, PAD, VE]]), [(1, 2, 2)], "one sequence"),
    (np.array([1.0, 2.0]), [], "integer token ids"),
])
def test_expand_image_pads_errors(ids, grids, match):
    with pytest.raises(PrefillError, match=match):
        expand_image_pads(ids, grids)


# --------------------------------------------------------------------------- position ids by hand


def test_mrope_positions_hand_derived():
    # Prompt: text a, text b, <vs>, image (grid 1x4x6 -> merged 2x3 = 6 pads), <ve>, text c.
    ids = prompt(21, 22, image(n=6), 23)
    # Rule: a text token takes the running position p on all three axes, then p += 1.
    text_before = [0, 1, 2]                                  # a, b, <vs>; p = 3 after them
    p = 3
    # An image's tokens (row-major over the merged 2x3 grid) get t = p, h = p + row, w = p + col.
    rows, cols = 4 // 2, 6 // 2
    img_t = [p for r in range(rows) for c in range(cols)]
    img_h = [p + r for r in range(rows) for c in range(cols)]
    img_w = [p + c for r in range(rows) for c in range(cols)]
    # After the image, p advances by max(rows, cols) (= max over the axes + 1 when t = 1).
    p += max(rows, cols)
    assert p == max(img_t + img_h + img_w) + 1
    text_after = [p, p + 1]                                  # <ve>, c
    expected = np.array([text_before + axis + text_after for axis in (img_t, img_h, img_w)])
    # rope_delta = max position + 1 - sequence length.
    expected_delta = (p + 1) + 1 - len(ids)

    position_ids, delta = mrope_position_ids(ids, [(1, 4, 6)])
    assert position_ids.dtype == np.int64 and position_ids.shape == (3, len(ids))
    np.testing.assert_array_equal(position_ids, expected)
    assert delta == expected_delta == -3


def test_mrope_positions_tall_image_and_no_image():
    # A tall image (merged 3 rows x 1 col) right at the start: p = 0 -> rows 0..2, cols 0.
    ids = prompt(PAD, PAD, PAD, 9)
    position_ids, delta = mrope_position_ids(ids, [(1, 6, 2)])
    np.testing.assert_array_equal(position_ids, [[0, 0, 0, 3], [0, 1, 2, 3], [0, 0, 0, 3]])
    assert delta == 4 - 4
    # Text only: positions 0..S-1 on every axis, delta 0.
    position_ids, delta = mrope_position_ids(prompt(5, 6, 7), None)
    np.testing.assert_array_equal(position_ids, np.tile(np.arange(3), (3, 1)))
    assert delta == 0


def test_mrope_positions_attention_mask_left_padding():
    ids = prompt(21, 22, image(n=6), 23)
    padded = np.concatenate([[0, 0], ids])
    mask = np.array([0, 0] + [1] * len(ids))
    unpadded, delta = mrope_position_ids(ids, [(1, 4, 6)])
    position_ids, delta_masked = mrope_position_ids(padded, [(1, 4, 6)], attention_mask=mask)
    # Masked slots hold 0; the kept tokens get the positions of the unpadded prompt.
    np.testing.assert_array_equal(position_ids[:, :2], 0)
    np.testing.assert_array_equal(position_ids[:, 2:], unpadded)
    assert delta_masked == delta


def test_mrope_positions_video_frames():
    # A video of 2 frames (grid 2x4x4): the processor writes "<ts> <vs> 4 pads <ve>" per frame;
    # each frame is a grid (1, 4, 4) -> merged 2x2, and every frame starts at the running p.
    frame = [VS] + [VIDEO_PAD] * 4 + [VE]
    ids = prompt(30, frame, 31, frame)
    position_ids, delta = mrope_position_ids(ids, None, video_grid_thw=[(2, 4, 4)])
    p0, p1 = 2, 2 + 2 + 2 + 1   # frame 0 after "30 <vs>"; frame 1 after "<ve> 31 <vs>" (p += 2 per frame)
    frame_h = lambda p: [p, p, p + 1, p + 1]
    frame_w = lambda p: [p, p + 1, p, p + 1]
    np.testing.assert_array_equal(position_ids[0], [0, 1, p0, p0, p0, p0, 4, 5, 6, p1, p1, p1, p1, 9])
    np.testing.assert_array_equal(position_ids[1, 2:6], frame_h(p0))
    np.testing.assert_array_equal(position_ids[2, 9:13], frame_w(p1))
    assert delta == 10 - len(ids)


@pytest.mark.parametrize("ids, grids, kwargs, match", [
    (prompt(image(n=4), 1, image(n=4)), [(1, 4, 4)], {}, r"run #1 .* has no grid_thw entry"),
    (prompt(image(n=4)), [(1, 4, 4), (1, 4, 4)], {}, r"1 <\|image_pad\|> run\(s\) but 2 image grid"),
    (prompt(image(n=3)), [(1, 4, 4)], {}, r"image 0 \(grid_thw \(1, 4, 4\)\) needs 4 .* has 3"),
    (prompt(image(n=8)), [(1, 4, 4), (1, 4, 4)], {}, "needs 4 .* has 8 .*separator"),
    (prompt(VIDEO_PAD, 1), None, {}, r"<\|video_pad\|> run #0 .* no grid_thw"),
    (prompt(image(n=1)), [(1, 2, 2)], {"attention_mask": [1, 1]}, "attention_mask: shape"),
    (prompt(image(n=1)), [(1, 2, 2)], {"attention_mask": [1, 2, 1]}, "only 0 and 1"),
    (prompt(1, 2), None, {"attention_mask": [0, 0]}, "no .*tokens"),
    (prompt(image(n=1)), [(1, 2, 2)], {"merge_size": 0}, "merge_size"),
])
def test_mrope_errors(ids, grids, kwargs, match):
    with pytest.raises(PrefillError, match=match):
        mrope_position_ids(ids, grids, **kwargs)


# --------------------------------------------------------------------------- payload


GRIDS = [(1, 4, 6), (1, 8, 8), (1, 2, 2)]
M = sum(merged_count(g) for g in GRIDS)


def test_build_payload():
    ids = expanded(GRIDS)
    embeds, ds = features(M), features(M, seed=1, k=3)
    payload = build_prefill_payload(ids, embeds, ds, GRIDS, num_deepstack_layers=3)
    np.testing.assert_array_equal(payload.input_ids, ids)
    np.testing.assert_array_equal(payload.visual_positions, np.flatnonzero(ids == PAD))
    assert payload.visual_positions.dtype == np.int64 and len(payload.visual_positions) == M
    np.testing.assert_array_equal(payload.image_embeds, embeds)
    assert [k for k, _ in payload.deepstack] == [0, 1, 2]
    for k, f in payload.deepstack:
        np.testing.assert_array_equal(f, ds[k])
    np.testing.assert_array_equal(payload.deepstack_features, ds)
    position_ids, delta = mrope_position_ids(ids, GRIDS)
    np.testing.assert_array_equal(payload.position_ids, position_ids)
    assert payload.rope_delta == delta
    # A list of [M, D] is the same as [K, M, D]; K = 0 takes None (or an empty list).
    listed = build_prefill_payload(ids, embeds, list(ds), GRIDS, 3)
    np.testing.assert_array_equal(listed.deepstack_features, ds)
    none = build_prefill_payload(ids, embeds, None, GRIDS, 0)
    assert none.deepstack == [] and none.deepstack_features.shape == (0, M, 8)


def _bad_payload_cases():
    ids, embeds, ds = expanded(GRIDS), features(M), features(M, seed=1, k=3)
    two = [(1, 4, 8), (1, 4, 4)]           # 8 and 4 merged tokens
    swapped = expanded([(1, 4, 4), (1, 4, 8)])  # runs of 4 then 8: same total, wrong per image
    nan = embeds.copy()
    nan[5, 2] = np.nan
    return [
        (dict(deepstack_features=None), "has 3 DeepStack layer\\(s\\) but no deepstack features"),
        (dict(deepstack_features=[]), "has 3 DeepStack layer\\(s\\) but no deepstack features"),
        (dict(deepstack_features=ds[:2]), "has 3 DeepStack layer\\(s\\) but 2 deepstack feature"),
        (dict(deepstack_features=[ds[0], ds[1], None]), r"deepstack_features\[2\]: missing; the config has 3"),
        (dict(deepstack_features=[ds[0], None, ds[2]]), r"deepstack_features\[1\]: missing"),
        (dict(deepstack_features=np.concatenate([ds, ds[:1]])), "3 DeepStack layer\\(s\\) but 4"),
        (dict(num_deepstack_layers=0), "has 0 DeepStack layer\\(s\\) but 3"),
        (dict(num_deepstack_layers=-1), "num_deepstack_layers"),
        (dict(deepstack_features=ds[:, :-1]), r"deepstack_features\[0\]: shape \[22, 8\] differs .*\[23, 8\]"),
        (dict(deepstack_features=[ds[0], ds[1], ds[2][:, :4]]), r"deepstack_features\[2\]: shape"),
        (dict(deepstack_features=ds[0]), r"\[K, M, D\]"),
        (dict(deepstack_features=np.where(ds > 3, np.inf, ds)), r"deepstack_features\[\d\]: non-finite"),
        (dict(image_embeds=embeds[:-1], deepstack_features=ds[:, :-1]),
         "23 <\\|image_pad\\|> tokens but image_embeds has 22 rows"),
        (dict(input_ids=expanded(GRIDS[:2] + [(1, 4, 4)])), "26 <\\|image_pad\\|> tokens but image_embeds has 23"),
        (dict(input_ids=expanded(GRIDS), grid_thw=[(1, 4, 6), (1, 8, 8)]),
         "grid_thw gives 22 merged tokens for 2 image\\(s\\) but image_embeds has 23"),
        (dict(input_ids=swapped, grid_thw=two, image_embeds=embeds[:12], deepstack_features=ds[:, :12]),
         r"image 0 \(grid_thw \(1, 4, 8\)\) needs 8 .* has 4"),
        (dict(input_ids=np.concatenate([ids, [VIDEO_PAD]])), "video_pad.*no video_embeds were given"),
        (dict(image_embeds=nan), r"image_embeds: non-finite values \(first in row 5\)"),
        (dict(image_embeds=embeds.astype(np.int32)), "floating-point"),
        (dict(image_embeds=embeds[None]), r"image_embeds: expected shape \[M, D\]"),
        (dict(grid_thw=[(1, 4, 6), (1, 8, 8), (1, 2, 3)]), "multiples of merge_size"),
    ]


@pytest.mark.parametrize("change, match", _bad_payload_cases())
def test_build_payload_fails_closed(change, match):
    args = dict(input_ids=expanded(GRIDS), image_embeds=features(M), deepstack_features=features(M, seed=1, k=3),
                grid_thw=GRIDS, num_deepstack_layers=3)
    args.update(change)
    with pytest.raises(PrefillError, match=match):
        build_prefill_payload(**args)


def test_unexpanded_prompt_is_refused_with_a_hint():
    ids = prompt(1, image(), 2, image(), 3, image())
    with pytest.raises(PrefillError, match="3 <\\|image_pad\\|> tokens but image_embeds has 23"):
        build_prefill_payload(ids, features(M), features(M, k=3), GRIDS, 3)
    ids = prompt(1, image(), 2, image(n=16), image(n=6))  # right count, first image not expanded
    with pytest.raises(PrefillError, match="needs 6 .* has 1 \\(expand_image_pads first"):
        build_prefill_payload(ids, features(M), features(M, k=3), GRIDS, 3)


# --------------------------------------------------------------------------- scatter / add_deepstack


@pytest.fixture
def payload():
    return build_prefill_payload(expanded(GRIDS), features(M), features(M, seed=1, k=2), GRIDS, 2)


def test_scatter_image_embeds(payload):
    s = len(payload.input_ids)
    inputs = features(s, seed=5)
    out = scatter_image_embeds(inputs, payload)
    assert out is not inputs and out.dtype == inputs.dtype
    # Rule: the j-th image-pad token (in sequence order) takes row j of image_embeds; other rows kept.
    j = 0
    for i in range(s):
        if payload.input_ids[i] == PAD:
            np.testing.assert_array_equal(out[i], payload.image_embeds[j])
            j += 1
        else:
            np.testing.assert_array_equal(out[i], inputs[i])
    assert j == M
    assert not np.shares_memory(out, inputs) and np.array_equal(inputs, features(s, seed=5))  # input untouched


def test_add_deepstack(payload):
    s = len(payload.input_ids)
    hidden = features(s, seed=6)
    for layer in (0, 1):
        out = add_deepstack(hidden, payload, layer)
        # Rule: after decoder layer k < K, the j-th visual position gets += deepstack feature k row j.
        expected = hidden.copy()
        feature = payload.deepstack_features[layer]
        for j, i in enumerate(payload.visual_positions):
            expected[i] = hidden[i] + feature[j]
        np.testing.assert_array_equal(out, expected)
        assert np.array_equal(hidden, features(s, seed=6))  # input untouched
    # Layers with no feature: hidden comes back unchanged.
    assert add_deepstack(hidden, payload, 2) is hidden
    assert add_deepstack(hidden, payload, -1) is hidden


def test_scatter_and_add_check_shapes(payload):
    s = len(payload.input_ids)
    with pytest.raises(PrefillError, match=rf"inputs_embeds: expected shape \[{s}, 8\] .* got \[{s - 1}, 8\]"):
        scatter_image_embeds(features(s - 1), payload)
    with pytest.raises(PrefillError, match=rf"hidden: expected shape \[{s}, 8\] .* got \[{s}, 4\]"):
        add_deepstack(features(s, d=4), payload, 0)


# --------------------------------------------------------------------------- file


def test_save_and_load_payload(tmp_path, payload):
    from safetensors import safe_open

    path = tmp_path / "prefill.safetensors"
    path.write_bytes(b"stale")
    save_payload(path, payload)
    assert [p.name for p in tmp_path.iterdir()] == ["prefill.safetensors"]  # no temp left, old file replaced
    with safe_open(str(path), "np") as f:
        assert sorted(f.keys()) == sorted(PAYLOAD_KEYS)
        assert f.metadata()["format"] == "qwen3vl-prefill-payload"
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert got["deepstack_features"].shape == (2, M, 8)
    np.testing.assert_array_equal(got["deepstack_layers"], [0, 1])
    assert got["position_ids"].dtype == np.int64 and got["position_ids"].shape == (3, len(payload.input_ids))
    assert got["rope_delta"].shape == () and int(got["rope_delta"]) == payload.rope_delta
    back = load_payload(path)
    for name in ("input_ids", "visual_positions", "image_embeds", "position_ids", "deepstack_features"):
        np.testing.assert_array_equal(getattr(back, name), getattr(payload, name))
    assert back.rope_delta == payload.rope_delta and [k for k, _ in back.deepstack] == [0, 1]


def test_save_payload_without_deepstack_and_failed_write(tmp_path):
    p = build_prefill_payload(expanded([(1, 2, 2)]), features(1), None, [(1, 2, 2)], 0)
    save_payload(tmp_path / "p.safetensors", p)
    assert load_payload(tmp_path / "p.safetensors").deepstack_features.shape == (0, 1, 8)
    with pytest.raises(OSError, match="cannot write .*missing/p.safetensors: No such file"):
        save_payload(tmp_path / "missing" / "p.safetensors", p)
    bad = build_prefill_payload(expanded([(1, 2, 2)]), features(1), None, [(1, 2, 2)], 0)
    bad.position_ids = object()  # fails while serializing: nothing may be left behind
    with pytest.raises(Exception):
        save_payload(tmp_path / "q.safetensors", bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


# --------------------------------------------------------------------------- transformers parity


@pytest.fixture(scope="module")
def hf_model():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import torch
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    torch.manual_seed(0)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=151700,
                rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[4, 2, 2],
                                     mrope_interleaved=True))
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                  deepstack_visual_indexes=[0, 1])
    model = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision)).eval()
    return model


def _hf_rope_index(model, ids, grids=None, video_grids=None, mask=None):
    import torch
    types = np.zeros_like(ids)
    types[ids == IMAGE_PAD] = 1
    types[ids == VIDEO_PAD] = 2  # mm_token_type_ids as the processor makes them
    t = lambda a: None if a is None else torch.tensor(np.asarray(a), dtype=torch.long)
    position_ids, deltas = model.get_rope_index(t(ids[None]), mm_token_type_ids=t(types[None]),
                                                image_grid_thw=t(grids), video_grid_thw=t(video_grids),
                                                attention_mask=None if mask is None else t(np.asarray(mask)[None]))
    return position_ids[:, 0].numpy(), int(deltas[0, 0])


PARITY_PROMPTS = [
    # several images of different grids, text before/between/after
    (GRIDS, ((11, 12), (13,), (14, 15, 16), (17,))),
    # images back to back (only </vs><vs> between), tall and wide, nothing after the last
    ([(1, 8, 4), (1, 4, 8), (1, 2, 2), (1, 6, 6)], ((1,), (), (2, 3), (), ())),
    ([(1, 12, 2)], ((), (5, 6, 7, 8))),
]


@pytest.mark.parity
@pytest.mark.parametrize("grids, text", PARITY_PROMPTS)
def test_mrope_matches_get_rope_index(hf_model, grids, text):
    ids = expanded(grids, text)
    expected, expected_delta = _hf_rope_index(hf_model, ids, grids)
    position_ids, delta = mrope_position_ids(ids, grids)
    np.testing.assert_array_equal(position_ids, expected)
    assert delta == expected_delta
    # Left padding with an attention mask.
    padded, mask = np.concatenate([[0, 0, 0], ids]), np.r_[[0, 0, 0], np.ones(len(ids), np.int64)]
    expected, expected_delta = _hf_rope_index(hf_model, padded, grids, mask=mask)
    position_ids, delta = mrope_position_ids(padded, grids, attention_mask=mask)
    np.testing.assert_array_equal(position_ids, expected)
    assert delta == expected_delta


@pytest.mark.parity
def test_mrope_matches_get_rope_index_with_video(hf_model):
    def video(t, h, w, first_ts=40):
        out = []
        for f in range(t):
            out += [first_ts + f] + [VS] + [VIDEO_PAD] * (h * w // 4) + [VE]
        return out

    ids = prompt(1, image(n=6), 2, video(3, 4, 6), 3, image(n=1), video(2, 8, 4), 4)
    grids, video_grids = [(1, 4, 6), (1, 2, 2)], [(3, 4, 6), (2, 8, 4)]
    expected, expected_delta = _hf_rope_index(hf_model, ids, grids, video_grids)
    position_ids, delta = mrope_position_ids(ids, grids, video_grid_thw=video_grids)
    np.testing.assert_array_equal(position_ids, expected)
    assert delta == expected_delta


@pytest.mark.parity
def test_payload_drives_a_prefill_like_transformers(hf_model):
    """A whole tiny Qwen3VLModel forward fed precomputed vision outputs, against the same
    language model fed our scattered embeds, our position ids and our add_deepstack (hooked
    after each decoder layer)."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    model = hf_model
    d, k = model.config.text_config.hidden_size, len(model.config.vision_config.deepstack_visual_indexes)
    ids = expand_image_pads(prompt(11, image(), 12, 13, image(), image(), 14), GRIDS)
    embeds, ds = features(M, d=d, seed=2), features(M, d=d, seed=3, k=k)
    payload = build_prefill_payload(ids, embeds, ds, GRIDS, num_deepstack_layers=k)

    split = [merged_count(g) for g in GRIDS]
    vision_out = BaseModelOutputWithDeepstackFeatures(
        pooler_output=torch.split(torch.from_numpy(embeds), split),
        deepstack_features=[torch.split(torch.from_numpy(f), split) for f in ds])
    types = torch.from_numpy((ids == IMAGE_PAD).astype(np.int64))[None]
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids)[None], image_grid_thw=torch.tensor(GRIDS),
                         mm_token_type_ids=types, mm_encoder_outputs={"image": vision_out},
                         use_cache=False).last_hidden_state[0].numpy()

    lm = model.language_model

    def hook(layer):
        def apply(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            out = torch.from_numpy(add_deepstack(hidden[0].numpy(), payload, layer))[None]
            return (out,) + tuple(output[1:]) if isinstance(output, tuple) else out
        return apply

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(lm.layers)]
    try:
        with torch.no_grad():
            text_embeds = lm.embed_tokens(torch.from_numpy(payload.input_ids))[None][0].numpy()
            inputs = torch.from_numpy(scatter_image_embeds(text_embeds, payload))[None]
            got = lm(inputs_embeds=inputs, position_ids=torch.from_numpy(payload.position_ids)[:, None],
                     use_cache=False).last_hidden_state[0].numpy()
    finally:
        for h in handles:
            h.remove()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # The DeepStack features matter here: without them the output differs.
    with torch.no_grad():
        plain = lm(inputs_embeds=inputs, position_ids=torch.from_numpy(payload.position_ids)[:, None],
                   use_cache=False).last_hidden_state[0].numpy()
    assert not np.allclose(plain, expected, atol=1e-3)
    # And transformers' own _deepstack_process agrees with add_deepstack on one layer.
    hidden = features(len(ids), d=d, seed=7)
    ref = lm._deepstack_process(torch.from_numpy(hidden)[None], torch.from_numpy(ids == IMAGE_PAD)[None],
                                torch.from_numpy(ds[1]))[0].numpy()
    np.testing.assert_array_equal(add_deepstack(hidden, payload, 1), ref)
