"""The language model at the Qwen3-VL-2B preset's widths (hidden 2048, 16 query / 8 KV
heads of 128, intermediate 6144, vocab 151936, tied embeddings, mrope_section [24, 20, 20])
with random weights: prefill logits against transformers' Qwen3VLTextModel + tied lm_head,
with image embeddings and DeepStack features at visual positions and 3-row M-RoPE ids.

`QWEN3VL_TEXT_2B_LAYERS` decoder layers (default 2; 28 is the whole preset: run it on a
quiet machine). The two sides run in turn, ours in a subprocess first, so only one copy
of the weights is in memory at a time (28 layers: 6.9 GB of f32 weights each side)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import rel_l2
from emitter.text_config import TEXT_PRESETS
from runtime.inputs.prefill import mrope_position_ids
from runtime.checkpoints.synthetic_text import write_text_model

LAYERS = int(os.environ.get("QWEN3VL_TEXT_2B_LAYERS", "2"))
IMAGE_ID = 151655
TOL = 1e-5


def prompt(rng, n=60, image=(20, 36), grid=(1, 8, 8)):
    ids = rng.integers(0, 151000, n)
    ids[ids == IMAGE_ID] = 1
    ids[image[0]:image[1]] = IMAGE_ID
    positions, _ = mrope_position_ids(ids, [grid], 2, image_token_id=IMAGE_ID, video_token_id=IMAGE_ID + 1)
    return ids, positions, np.arange(*image)


def ours_in_subprocess(folder: Path, inputs: Path, out: Path) -> dict:
    """Our prefill logits, with and without the DeepStack features, from a process of its
    own (so its memory is gone before transformers loads; torch is not imported there): {"logits": [2, vocab], "peak_rss_gb"}."""
    code = f"import test_text_2b as t; t.ours_main({str(folder)!r}, {str(inputs)!r}, {str(out)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent)
    return dict(np.load(out))


def ours_main(folder: str, inputs: str, out: str) -> None:
    import resource

    from runtime.text import TextSession

    x = np.load(inputs)
    session = TextSession(folder, buckets=(64,), context=64, deepstack_layers=LAYERS,
                          cache_dir=Path(folder).parent / "cache")
    args = (x["ids"], x["positions"], x["visual"], x["embeds"])
    logits = [session.prefill(*args, x["deepstack"]), session.prefill(*args, np.zeros_like(x["deepstack"]))]
    np.savez(out, logits=np.stack(logits), peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)


def transformers_model(folder: Path, cfg, attn_implementation: str = "eager"):
    """Qwen3VLTextModel holding the checkpoint's tensors themselves (built on the meta
    device, the tensors assigned, the rotary table made for real): one copy of the weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

    config = Qwen3VLTextConfig(**cfg.to_hf_text_config(), attn_implementation=attn_implementation)
    with torch.device("meta"):
        hf = Qwen3VLTextModel(config)
    prefix, state = "model.language_model.", {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update({k[len(prefix):]: v for k, v in load_file(shard).items() if k.startswith(prefix)})
    hf.load_state_dict(state, strict=True, assign=True)
    hf.rotary_emb = type(hf.rotary_emb)(config=config)
    return hf.eval()


@pytest.mark.parity
@pytest.mark.slow
def test_2b_widths_prefill_matches_transformers(tmp_path):
    import resource

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

    cfg = dataclasses.replace(TEXT_PRESETS["qwen3-vl-2b"], num_hidden_layers=LAYERS)
    folder = tmp_path / "m"
    write_text_model(folder, cfg, seed=5, config={"image_token_id": IMAGE_ID})
    rng = np.random.default_rng(0)
    ids, positions, visual = prompt(rng)
    embeds = rng.standard_normal((len(visual), cfg.hidden_size), dtype=np.float32)
    deepstack = rng.standard_normal((LAYERS, len(visual), cfg.hidden_size), dtype=np.float32)
    np.savez(tmp_path / "inputs.npz", ids=ids, positions=positions, visual=visual, embeds=embeds, deepstack=deepstack)
    ours = ours_in_subprocess(folder, tmp_path / "inputs.npz", tmp_path / "ours.npz")

    hf = transformers_model(folder, cfg)
    with torch.inference_mode():
        x = hf.embed_tokens(torch.from_numpy(ids)[None])
        mask = torch.zeros(1, ids.size, dtype=torch.bool)
        mask[0, torch.from_numpy(visual)] = True
        x[mask] = torch.from_numpy(embeds)
        hidden = hf(inputs_embeds=x, position_ids=torch.from_numpy(positions)[:, None], visual_pos_masks=mask,
                    deepstack_visual_embeds=list(torch.from_numpy(deepstack))).last_hidden_state
        expected = (hidden[0, -1] @ hf.embed_tokens.weight.T).numpy()
    error, control = rel_l2(ours["logits"][0], expected), rel_l2(ours["logits"][1], expected)
    print(json.dumps({"layers": LAYERS, "relL2": float(error), "no_deepstack_control": float(control),
                      "peak_rss_gb": {"ours": float(ours["peak_rss_gb"]),
                                      "transformers": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}}))
    assert error <= TOL, error
    assert control > 100 * TOL, control  # the control: the comparison can fail


# ----------------------------------------------------------------------------- decode steps

DECODE_LAYERS = 4
DECODE_STEPS = 6


def decode_config():
    """2B widths, 4 layers, lm_head untied from the embeddings (as the 8B and 32B configs
    have it), a 32768-token vocabulary (the widths are the 2B preset's; the vocabulary only
    sizes the two tables, and keeps the checkpoint at 0.8 GB instead of 3.3)."""
    return dataclasses.replace(TEXT_PRESETS["qwen3-vl-2b"], num_hidden_layers=DECODE_LAYERS, vocab_size=32768,
                               tie_word_embeddings=False)


def ours_decode_main(folder: str, inputs: str, out: str) -> None:
    """Our prefill then DECODE_STEPS greedy decode steps: every step's logits and token."""
    from runtime.text import TextSession

    x = np.load(inputs)
    session = TextSession(folder, buckets=(64,), context=128, cache_dir=Path(folder).parent / "cache")
    logits = [session.prefill(x["ids"], x["positions"])]
    tokens = []
    for step in range(DECODE_STEPS):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(session.decode(tokens[-1], x["ids"].size + step))
    np.savez(out, logits=np.stack(logits), tokens=np.array(tokens))


@pytest.mark.parity
@pytest.mark.slow
def test_2b_widths_decode_steps_match_transformers(tmp_path):
    """Prefill and each greedy decode step (the KV cache on the device, the untied lm_head)
    against transformers' model with its own KV cache: every step's logits within 1e-5, the
    same tokens."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

    cfg = decode_config()
    folder = tmp_path / "m"
    write_text_model(folder, cfg, seed=7)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 40)
    positions = np.broadcast_to(np.arange(ids.size), (3, ids.size)).copy()
    np.savez(tmp_path / "inputs.npz", ids=ids, positions=positions)
    code = (f"import test_text_2b as t; t.ours_decode_main({str(folder)!r}, {str(tmp_path / 'inputs.npz')!r}, "
            f"{str(tmp_path / 'ours.npz')!r})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent)
    ours = dict(np.load(tmp_path / "ours.npz"))

    from safetensors.torch import load_file
    hf = transformers_model(folder, cfg)
    head = next(load_file(s)["lm_head.weight"] for s in sorted(folder.glob("*.safetensors"))
                if "lm_head.weight" in load_file(s))
    expected, tokens = [], []
    with torch.inference_mode():
        out = hf(input_ids=torch.from_numpy(ids)[None], position_ids=torch.from_numpy(positions)[:, None],
                 use_cache=True)
        expected.append((out.last_hidden_state[0, -1] @ head.T).numpy())
        for step in range(DECODE_STEPS):
            tokens.append(int(np.argmax(expected[-1])))
            position = torch.full((3, 1, 1), ids.size + step)
            out = hf(input_ids=torch.tensor([[tokens[-1]]]), position_ids=position,
                     past_key_values=out.past_key_values, use_cache=True)
            expected.append((out.last_hidden_state[0, -1] @ head.T).numpy())
    errors = [rel_l2(a, e) for a, e in zip(ours["logits"], expected)]
    print(json.dumps({"layers": DECODE_LAYERS, "steps": DECODE_STEPS, "relL2": errors}))
    assert list(ours["tokens"]) == tokens
    assert max(errors) <= TOL, errors
    shifted = rel_l2(ours["logits"][2], expected[1])  # the control: a step off by one is far off
    assert shifted > 100 * TOL, shifted
