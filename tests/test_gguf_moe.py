"""llama.cpp GGUF files of a mixture-of-experts Qwen3-VL (architecture `qwen3vlmoe`), written by
llama.cpp's own convert_hf_to_gguf.py from a random qwen3_vl_moe checkpoint (every layer sparse:
llama.cpp has no dense layer among sparse ones), Q4_0 by `gguf.quants.quantize` over its f32
file: the config from the `qwen3vlmoe.*` keys, gate's and up's stacks (`ffn_gate_exps`,
`ffn_up_exps`) read as one, the f32 file's logits the checkpoint's; Q8_0 and Q4_0 expert stacks
held in the block kernel's tiles as they are (the file's own codes and f16 scales, nothing
requantized) and run through its expert entry; an expert stack of another type one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import rel_l2
from gguf_helpers import converted_checkpoint, dequantized_folder, model_folder, requantize
from helpers import chunked_logits, generate_logits
from emitter import quant
from emitter.experts import GATE_UP, is_expert
from emitter.text_config import TEXT_PREFIX, TEXT_PRESETS
from runtime.checkpoints import gguf_text
from runtime.checkpoints.text import model_text_config
from runtime.checkpoints.tensor_files import CheckpointError
from runtime.text import TextSession

gguf = pytest.importorskip("gguf")

# every layer sparse; widths that Q8_0's and Q4_0's blocks of 32 divide
CFG = dataclasses.replace(TEXT_PRESETS["tiny-moe"], hidden_size=64, intermediate_size=128, moe_intermediate_size=96,
                          mlp_only_layers=())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    work = tmp_path_factory.mktemp("gguf_moe")
    ckpt, convert = converted_checkpoint(work, CFG, seed=5)
    out = {t: convert(f"text-{t}.gguf", "--outtype", t) for t in ("f32", "q8_0")}
    out["q4_0"] = requantize(out["f32"], work / "text-q4_0.gguf", lambda name, data: (
        gguf.GGMLQuantizationType.Q4_0 if data.ndim >= 2 and "token_embd" not in name and "gate_inp" not in name
        else None), arch=gguf_text.MOE_ARCH)
    out["mmproj-f32"] = convert("mmproj-f32.gguf", "--mmproj", "--outtype", "f32")
    out["hf"] = ckpt
    return out


def logits(model, cache, precision: str) -> np.ndarray:
    return chunked_logits(model, cache, precision, CFG.vocab_size, 2)


def test_config_and_the_f32_file_are_the_checkpoints(files, tmp_path):
    cfg, _ = model_text_config(files["q8_0"])
    hf, _ = model_text_config(files["hf"])
    assert cfg == hf and cfg.num_experts == 8 and cfg.moe
    cache = tmp_path / "cache"
    assert rel_l2(logits(files["f32"], cache, "f32"), logits(files["hf"], cache, "f32")) <= 1e-6


def unpacked(q: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """An expert's weight [N, K] f32 out of the kernel's tiles (q [N, K * bits / 8] i8 in
    `pack_weight`'s order, scales [N, K / 32] f16 in `pack_scales`')."""
    n = q.shape[0]
    k = q.shape[1] * 8 // bits
    raw = q.reshape(-1).view(np.uint8)
    if bits == 8:
        codes = raw.view(np.int8).reshape(n // 16, k // 4, 16, 4).transpose(0, 2, 1, 3).reshape(n, k)
    else:
        steps = raw.reshape(n // 16, k // 32, 4, 16, 4)
        halves = np.stack([steps & 15, steps >> 4], axis=2).astype(np.int8) - 8
        codes = halves.transpose(0, 4, 1, 2, 3, 5).reshape(n, k)
    d = scales.reshape(-1).reshape(n // 16, k // 32, 16).transpose(0, 2, 1).reshape(n, k // 32)
    return (codes.reshape(n, k // 32, 32).astype(np.float32) * d.astype(np.float32)[:, :, None]).reshape(n, k)


@pytest.mark.parametrize("kind,bits", [("q8_0", 8), ("q4_0", 4)])
def test_expert_stacks_are_the_files_own_bits(files, tmp_path, kind, bits):
    """The expert stacks, like every Q8_0 or Q4_0 matrix of the file, run in the kernel's
    tiles, the file's numbers exactly (unpacked, equal to gguf's dequantization); the session
    in those bits near the f32 session over the same dequantized weights (the kernel's Q8_0
    activations the only difference)."""
    path = files[kind]
    cfg, _ = model_text_config(path)
    entries = gguf_text.native_weights(path, cfg)
    packed = [e[0] for e in entries if e[3:] == (quant.PACKED,)]
    assert {e[1] for e in entries} == {bits} and len(packed) == len(entries)
    assert sum(is_expert(name) for name in packed) == 2 * cfg.num_hidden_layers
    tensors = gguf_text.text_tensors(path, cfg)
    name = f"{TEXT_PREFIX}layers.1.{GATE_UP}"
    q, scales = gguf_text.packed_blocks(name, tensors[name])
    expected = gguf_text.dequantized(tensors[name])
    for e in range(cfg.num_experts):
        assert np.array_equal(unpacked(q[e], scales[e], bits), expected[e]), e
    cache = tmp_path / "cache"
    ours = logits(path, cache, "native")
    ref = logits(dequantized_folder(path, tmp_path / "deq"), cache, "f32")
    assert 0 < rel_l2(ours, ref) <= (0.02 if bits == 8 else 0.05)


def test_an_image_answer_from_the_folder_with_its_mmproj(files, tmp_path):
    folder = model_folder(files, tmp_path, text="q4_0")
    out = generate_logits(folder, "assets/demo.png", None, tmp_path / "cache", tmp_path)
    assert out.shape == (2, CFG.vocab_size) and np.isfinite(out).all()


def test_an_expert_stack_of_another_type_is_one_line(files, tmp_path):
    bad = requantize(files["f32"], tmp_path / "q5.gguf", lambda name, data: (
        gguf.GGMLQuantizationType.Q5_0 if "ffn_down_exps" in name else None), arch=gguf_text.MOE_ARCH)
    with pytest.raises(CheckpointError, match=r"^blk\.0\.ffn_down_exps\.weight: GGUF type Q5_0 for an expert stack is "
                                              r"not supported .*expected one of Q8_0, Q4_0, F32, F16, BF16 \(the "
                                              r"K-quants .* --precision q4_0\)$"):
        TextSession(bad, buckets=(32,), context=64, cache_dir=tmp_path / "c", precision="native")
