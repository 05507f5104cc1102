"""The language model at the Qwen3-VL-2B preset's widths (hidden 2048, 16 query / 8 KV
heads of 128, intermediate 6144, vocab 151936, tied embeddings, mrope_section [24, 20, 20])
with random weights: prefill logits against transformers' Qwen3VLTextModel + tied lm_head,
with image embeddings and DeepStack features at visual positions and 3-row M-RoPE ids.

Two of the preset's 28 decoder layers: depth repeats the same layer graph, and the whole
preset (6.9 GB of f32 weights, packed once more at load, plus transformers' copy) does not
fit beside the other work of a 24 GiB machine. The full-depth check is the benchmark's."""

from __future__ import annotations

import dataclasses
import gc
import json

import numpy as np
import pytest

from conftest import rel_l2
from emitter.text_config import TEXT_PRESETS
from runtime.generate import TextSession
from runtime.prefill import mrope_position_ids
from runtime.synthetic import write_safetensors
from runtime.synthetic_text import random_text_weights

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LAYERS = 2
IMAGE_ID = 151655
TOL = 1e-5


def write_text_checkpoint(folder, cfg, weights) -> None:
    folder.mkdir()
    tensors = {name: ("F32", w.shape, w.tobytes()) for name, w in weights.items()}
    write_safetensors(folder / "model.safetensors", tensors)
    config = {"model_type": "qwen3_vl", "tie_word_embeddings": cfg.tie_word_embeddings, "image_token_id": IMAGE_ID,
              "text_config": cfg.to_hf_text_config()}
    (folder / "config.json").write_text(json.dumps(config))


def prompt(rng, n=60, image=(20, 36), grid=(1, 8, 8)):
    ids = rng.integers(0, 151000, n)
    ids[ids == IMAGE_ID] = 1
    ids[image[0]:image[1]] = IMAGE_ID
    positions, _ = mrope_position_ids(ids, [grid], 2, image_token_id=IMAGE_ID)
    return ids, positions, np.arange(*image)


@pytest.mark.slow
def test_2b_widths_prefill_matches_transformers(tmp_path):
    from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

    cfg = dataclasses.replace(TEXT_PRESETS["qwen3-vl-2b"], num_hidden_layers=LAYERS)
    weights = random_text_weights(cfg, seed=5)
    write_text_checkpoint(tmp_path / "m", cfg, weights)
    rng = np.random.default_rng(0)
    ids, positions, visual = prompt(rng)
    embeds = rng.standard_normal((len(visual), cfg.hidden_size), dtype=np.float32)
    deepstack = rng.standard_normal((LAYERS, len(visual), cfg.hidden_size), dtype=np.float32)

    session = TextSession(tmp_path / "m", buckets=(64,), context=64, deepstack_layers=LAYERS,
                          cache_dir=tmp_path / "cache")
    ours = session.prefill(ids, positions, visual, embeds, deepstack)
    no_deepstack = session.prefill(ids, positions, visual, embeds, np.zeros_like(deepstack))
    del session
    gc.collect()

    hf = Qwen3VLTextModel(Qwen3VLTextConfig(**cfg.to_hf_text_config(), attn_implementation="eager")).eval()
    prefix = "model.language_model."
    hf.load_state_dict({k[len(prefix):]: torch.from_numpy(w) for k, w in weights.items()}, strict=True)
    del weights
    with torch.inference_mode():
        x = hf.embed_tokens(torch.from_numpy(ids)[None])
        mask = torch.zeros(1, ids.size, dtype=torch.bool)
        mask[0, torch.from_numpy(visual)] = True
        x[mask] = torch.from_numpy(embeds)
        hidden = hf(inputs_embeds=x, position_ids=torch.from_numpy(positions)[:, None], visual_pos_masks=mask,
                    deepstack_visual_embeds=list(torch.from_numpy(deepstack))).last_hidden_state
        expected = (hidden[0, -1] @ hf.embed_tokens.weight.T).numpy()
    error, control = rel_l2(ours, expected), rel_l2(no_deepstack, expected)
    print(f"2B widths: relL2 {error:.2e}, no-DeepStack control {control:.2e}")
    assert error <= TOL, error
    assert control > 100 * TOL, control  # the control: the comparison can fail
