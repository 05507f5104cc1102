"""MLX checkpoints against MLX itself: weights quantized by the real `mx.quantize` and
written by MLX's own safetensors writer (or by mlx-vlm's conversion code) load through
our checkpoint loader bit for bit equal to `mx.dequantize`, at every bit width, with
mixed per-module bits and with bf16 scales; and the compiled tower on an mlx-vlm
quantized checkpoint matches mlx-vlm's own Qwen3-VL vision model.

mlx (Linux CPU wheels: `mlx[cpu]`) and mlx-vlm are test-only dependencies; without
them these tests skip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from emitter.config import HF_PREFIX, PRESETS
from runtime.checkpoints.vision import CONV_NAME, MLX_PREFIX, load_vision_weights
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR, random_vision_weights

pytestmark = pytest.mark.parity  # every test here checks against the reference
mx = pytest.importorskip("mlx.core")

TINY = PRESETS["tiny"]
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
BITS = (2, 3, 4, 5, 6, 8)


def quantizable(hf_name: str, w: np.ndarray) -> bool:
    """The 2-D weights MLX quantizes: the linears and the position table (not the conv)."""
    return hf_name.endswith(".weight") and w.ndim == 2 and not hf_name.endswith(CONV_NAME)


def module_of(hf_name: str) -> str:
    return MLX_PREFIX + hf_name[len(HF_PREFIX):-len(".weight")]


def mlx_folder(folder: Path, settings, dtype=mx.float32, quantization: dict | None = None) -> dict:
    """Quantize tiny random weights with mx.quantize and save them with mx.save_safetensors
    in the MLX layout (`vision_tower.*`, conv channels-last), config.json beside them.
    `settings(module)` gives (bits, group_size) or None to leave a module unquantized.
    Returns {module: (packed, scales, biases, bits, group_size)} as MLX arrays."""
    folder.mkdir()
    arrays, quantized = {}, {}
    for hf_name, w in random_vision_weights(TINY, seed=5).items():
        name = MLX_PREFIX + hf_name[len(HF_PREFIX):]
        if hf_name.endswith(CONV_NAME):
            w = w.transpose(0, 2, 3, 4, 1)  # [h, C, T, P, P] -> [h, T, P, P, C]
        a = mx.array(w).astype(dtype)
        chosen = settings(module_of(hf_name)) if quantizable(hf_name, w) else None
        if chosen is None:
            arrays[name] = a
            continue
        bits, group_size = chosen
        packed, scales, biases = mx.quantize(a, group_size=group_size, bits=bits)
        module = module_of(hf_name)
        arrays.update({module + ".weight": packed, module + ".scales": scales, module + ".biases": biases})
        quantized[module] = (packed, scales, biases, bits, group_size)
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    config = {"model_type": "qwen3_vl", "vision_config": TINY.to_hf_vision_config()}
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))
    return quantized


def assert_bit_equal_to_mx_dequantize(weights: dict, quantized: dict) -> None:
    """Each dequantized weight equals mx.dequantize's, bit for bit. Scales and biases are
    widened to f32 first (exact), as the loader does: MLX would otherwise dequantize a
    bf16-scaled weight in bf16."""
    assert quantized
    for module, (packed, scales, biases, bits, group_size) in quantized.items():
        expected = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                                 group_size=group_size, bits=bits)
        ours = weights[HF_PREFIX + module[len(MLX_PREFIX):] + ".weight"]
        theirs = np.array(expected, dtype=np.float32)
        assert ours.shape == theirs.shape, module
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32), err_msg=module)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [32, 64])
def test_every_bit_width(tmp_path, bits, group_size):
    quantized = mlx_folder(tmp_path / "m", lambda module: (bits, group_size),
                           quantization={"group_size": group_size, "bits": bits, "mode": "affine"})
    assert_bit_equal_to_mx_dequantize(load_vision_weights(tmp_path / "m", TINY), quantized)


def test_mixed_bits_per_module(tmp_path):
    """Each module its own width and group size, recorded per module as mlx-lm / mlx-vlm do;
    one module left unquantized (false)."""
    modules = [module_of(n) for n, w in random_vision_weights(TINY).items() if quantizable(n, w)]
    per_module = {m: (BITS[i % len(BITS)], (32, 64)[i % 2]) for i, m in enumerate(modules)}
    per_module[MLX_PREFIX + "merger.linear_fc2"] = None
    quantization = {"group_size": 64, "bits": 4, "mode": "affine"}
    for module, chosen in per_module.items():
        quantization[module] = {"bits": chosen[0], "group_size": chosen[1]} if chosen else False
    quantized = mlx_folder(tmp_path / "m", per_module.get, quantization=quantization)
    assert {q[3] for q in quantized.values()} == set(BITS)
    weights = load_vision_weights(tmp_path / "m", TINY)
    assert_bit_equal_to_mx_dequantize(weights, quantized)
    name = HF_PREFIX + "merger.linear_fc2.weight"
    np.testing.assert_array_equal(weights[name], random_vision_weights(TINY, seed=5)[name])


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_bf16_scales(tmp_path, bits):
    """A bf16 model quantized by MLX has bf16 scales and biases; the unquantized tensors are bf16 too."""
    quantized = mlx_folder(tmp_path / "m", lambda module: (bits, 64), dtype=mx.bfloat16,
                           quantization={"group_size": 64, "bits": bits, "mode": "affine"})
    assert all(q[1].dtype == mx.bfloat16 for q in quantized.values())
    weights = load_vision_weights(tmp_path / "m", TINY)
    assert_bit_equal_to_mx_dequantize(weights, quantized)
    norm = HF_PREFIX + "blocks.1.norm2.weight"
    bf16 = np.array(mx.array(random_vision_weights(TINY, seed=5)[norm]).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(weights[norm], bf16)


# --------------------------------------------------------------------------- mlx-vlm's own tower

def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def mlx_vlm_checkpoint(tmp_path_factory):
    """Tiny random weights loaded into mlx-vlm's Qwen3-VL VisionModel, quantized with mixed
    bits by mlx-vlm's `quantize_model`, and written by its `save_weights` / `save_config`
    (the pieces of `mlx_vlm.convert`): (folder, the quantized mlx-vlm model)."""
    pytest.importorskip("mlx_vlm")
    import mlx.nn as nn
    from mlx_vlm.models.qwen3_vl.config import VisionConfig
    from mlx_vlm.models.qwen3_vl.vision import VisionModel
    from mlx_vlm.quant_utils import quantize_model
    from mlx_vlm.utils import save_config, save_weights

    class Wrapper(nn.Module):  # module paths as in mlx-vlm's full model: vision_tower.*
        def __init__(self, vision):
            super().__init__()
            self.vision_tower = vision

    vision_config = {"model_type": "qwen3_vl", **TINY.to_hf_vision_config()}
    model = Wrapper(VisionModel(VisionConfig.from_dict(vision_config)))
    weights = {name[len(HF_PREFIX):]: mx.array(w) for name, w in random_vision_weights(TINY, seed=7).items()}
    model.vision_tower.load_weights(list(model.vision_tower.sanitize(weights).items()), strict=True)

    mixed = {"vision_tower.blocks.0.attn.qkv": {"bits": 8, "group_size": 32},
             "vision_tower.blocks.1.mlp.linear_fc1": {"bits": 3, "group_size": 64},
             "vision_tower.pos_embed": {"bits": 6, "group_size": 64},
             "vision_tower.merger.linear_fc2": False}
    config = {"model_type": "qwen3_vl", "vision_config": vision_config}
    model, config = quantize_model(model, config, group_size=64, bits=4,
                                   quant_predicate=lambda path, module: mixed.get(path, True))
    folder = tmp_path_factory.mktemp("mlx-vlm") / "model"
    save_weights(folder, model)
    save_config(config, folder / "config.json")
    (folder / "preprocessor_config.json").write_text(json.dumps(SMALL_POLICY))
    return folder, model


def test_mlx_vlm_checkpoint_dequantizes_exactly(mlx_vlm_checkpoint):
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    folder, model = mlx_vlm_checkpoint
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["vision_tower.blocks.0.attn.qkv"]["bits"] == 8
    quantized = {}
    for path, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if hasattr(module, "scales"):
            quantized[path] = (module.weight, module.scales, module.biases, module.bits, module.group_size)
    assert {q[3] for q in quantized.values()} == {3, 4, 6, 8}
    assert "vision_tower.merger.linear_fc2" not in quantized
    assert_bit_equal_to_mx_dequantize(load_vision_weights(folder, TINY), quantized)


@pytest.mark.parametrize("precision", ["f32", "mlx"])
def test_tower_matches_mlx_vlm(mlx_vlm_checkpoint, tmp_path, precision):
    """The compiled graph on the mlx-vlm checkpoint against mlx-vlm's VisionModel (quantized
    matmuls, f32 activations) on the same pixels: main and DeepStack outputs; the linears
    expanded to f32 at load, or (mlx) the 4- and 8-bit ones in their bits (the 3- and 6-bit
    ones expanded)."""
    from runtime.inputs.processor import process_images
    from runtime.vision import VisionSession

    folder, model = mlx_vlm_checkpoint
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((64, 96), (96, 64))]
    session = VisionSession(folder, buckets=(64,), cache_dir=tmp_path / "cache", precision=precision)
    if precision == "mlx":
        assert {bits for _, bits, _ in session.cfg.native_weights} == {4, 8}
    ours = session.encode(images)
    pixel_values, grid_thw = process_images(images, session.policy)
    embeds, deepstack = model.vision_tower(mx.array(pixel_values), mx.array(grid_thw))
    assert len(deepstack) == len(TINY.deepstack_visual_indexes)
    errors = [rel_l2(ours.image_embeds, np.array(embeds))]
    errors += [rel_l2(ours.deepstack_features[k], np.array(d)) for k, d in enumerate(deepstack)]
    assert max(errors) <= 1e-5, errors


@pytest.mark.parametrize("bits", [4, 8])
def test_text_weights_equal_mx_dequantize(tmp_path, bits):
    """The language model's weights quantized by mx.quantize in mlx-vlm's layout
    (`language_model.model.*`, `language_model.lm_head`), written by MLX, load bit for bit
    equal to mx.dequantize (the text reader shares the vision side's dequantization)."""
    from emitter.text_config import LM_HEAD, TEXT_PREFIX, TEXT_PRESETS
    from runtime.checkpoints.synthetic_text import random_text_tensors
    from runtime.checkpoints.text import load_text_weights

    from dataclasses import replace
    cfg = replace(TEXT_PRESETS["tiny"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, mrope_section=(4, 2, 2))  # widths MLX's groups divide
    folder = tmp_path / "m"
    folder.mkdir()
    arrays, quantized = {}, {}
    for name, w in random_text_tensors(cfg, seed=3):
        stored = "language_model.lm_head.weight" if name == LM_HEAD else \
            "language_model.model." + name[len(TEXT_PREFIX):]
        if w.ndim != 2:
            arrays[stored] = mx.array(w)
            continue
        packed, scales, biases = mx.quantize(mx.array(w), group_size=32, bits=bits)
        module = stored[:-len(".weight")]
        arrays.update({stored: packed, module + ".scales": scales, module + ".biases": biases})
        quantized[name] = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_vl", "tie_word_embeddings": cfg.tie_word_embeddings,
        "text_config": cfg.to_hf_text_config(), "quantization": {"group_size": 32, "bits": bits}}))
    weights = load_text_weights(folder, cfg)
    assert quantized and set(quantized) <= set(weights)
    for name, expected in quantized.items():
        theirs = np.array(expected, dtype=np.float32)
        np.testing.assert_array_equal(weights[name].view(np.uint32), theirs.view(np.uint32), err_msg=name)
