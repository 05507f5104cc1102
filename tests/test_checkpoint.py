"""Checkpoint loading (runtime.checkpoints.vision) on synthetic folders (runtime.checkpoints.synthetic):
Hugging Face and MLX layouts, f32/bf16/f16, sharded or not, MLX affine quantization,
text tensors never read, and every error a broken folder can raise."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from emitter.config import PRESETS, load_model_config, weight_schema
from runtime.checkpoints import tensor_files as st
from runtime.checkpoints import vision as ck
from runtime.checkpoints.tensor_files import CheckpointError, read_safetensors_header
from runtime.checkpoints.vision import load_vision_weights
from runtime.checkpoints.mlx_quant import dequantize_mlx, pack_mlx, unpack_mlx
from runtime.checkpoints.synthetic import (DEFAULT_PROCESSOR, quantize_mlx, round_to_dtype, write_checkpoint,
                               write_safetensors)

CFG = PRESETS["tiny"]
CONV = "model.visual.patch_embed.proj.weight"
QKV0 = "blocks.0.attn.qkv"


# --------------------------------------------------------------------------- helpers

def expected_from_source(source: dict, rounding=lambda x: x) -> dict:
    """What the loader must return for an unquantized checkpoint written from `source`."""
    return {name: rounding(source[name]).reshape(shape) for name, shape in weight_schema(CFG)}


def assert_exact(weights: dict, expected: dict) -> None:
    assert list(weights) == [name for name, _ in weight_schema(CFG)]
    for name, shape in weight_schema(CFG):
        w = weights[name]
        assert w.dtype == np.float32 and w.shape == shape and w.flags.c_contiguous, name
        np.testing.assert_array_equal(w, expected[name], err_msg=name)


def rewrite(path, edit) -> None:
    """Rewrite one safetensors file: edit({name: (dtype, shape, bytes)}) -> new dict."""
    entries = read_safetensors_header(path)
    tensors = {}
    for name, e in entries.items():
        with open(e.file, "rb") as f:
            f.seek(e.begin)
            tensors[name] = (e.dtype, e.shape, f.read(e.end - e.begin))
    write_safetensors(path, edit(tensors))


def f32_bytes(x) -> tuple[str, tuple, bytes]:
    x = np.asarray(x, dtype="<f4")
    return ("F32", x.shape, x.tobytes())


def raw_tensor(model_dir, name) -> np.ndarray:
    """A stored tensor read independently of the loader (f16/f32/u32 via numpy dtypes, bf16 by hand)."""
    for path in sorted(model_dir.glob("*.safetensors")):
        head = read_safetensors_header(path)
        if name in head:
            e = head[name]
            data = path.read_bytes()[e.begin:e.end]
            if e.dtype == "BF16":
                bits = np.frombuffer(data, "<u2").astype(np.uint32) << 16
                return bits.view(np.float32).reshape(e.shape)
            return np.frombuffer(data, {"F32": "<f4", "F16": "<f2", "U32": "<u4"}[e.dtype]).reshape(e.shape)
    raise KeyError(name)


def codes_by_bigint(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Unpack each row as one little-endian integer: code i = (row >> i*bits) & mask."""
    out = np.empty((packed.shape[0], n), dtype=np.int64)
    for r, row in enumerate(np.asarray(packed, dtype="<u4")):
        big = int.from_bytes(row.tobytes(), "little")
        out[r] = [(big >> (i * bits)) & ((1 << bits) - 1) for i in range(n)]
    return out


def one_line_naming(err: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


# --------------------------------------------------------------------------- identity, folder

def test_synthetic_is_deterministic(tmp_path):
    for d, seed in (("a", 3), ("b", 3), ("c", 4)):
        write_checkpoint(tmp_path / d, CFG, seed=seed, dtype="bf16", shards=2)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    shard = "model-00001-of-00002.safetensors"
    assert (tmp_path / "a" / shard).read_bytes() != (tmp_path / "c" / shard).read_bytes()


def test_synthetic_files_read_by_safetensors(tmp_path):
    safe_open = pytest.importorskip("safetensors").safe_open
    source = write_checkpoint(tmp_path, CFG, dtype="f16")
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        w = f.get_tensor("model.visual.blocks.1.mlp.linear_fc1.weight")
    assert w.dtype == np.float16
    np.testing.assert_array_equal(w, source["model.visual.blocks.1.mlp.linear_fc1.weight"].astype(np.float16))


# --------------------------------------------------------------------------- HF layout

def test_hf_f32_exact(tmp_path):
    source = write_checkpoint(tmp_path, CFG)
    weights = load_vision_weights(tmp_path, CFG)
    assert_exact(weights, expected_from_source(source))
    # The conv is flattened in the HF (C, T, P, P) order.
    np.testing.assert_array_equal(weights[CONV][:, :512], source[CONV][:, 0].reshape(CFG.hidden_size, 512))
    assert ck.weights_in_order(weights, CFG)[0] is weights[CONV]


def _bf16_reference(x):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_widening_exact(tmp_path, dtype, shards):
    source = write_checkpoint(tmp_path, CFG, dtype=dtype, shards=shards, seed=shards)
    assert (tmp_path / st.INDEX_NAME).is_file() == (shards > 1)
    rounding = _bf16_reference if dtype == "bf16" else (lambda x: x.astype(np.float16).astype(np.float32))
    expected = expected_from_source(source, rounding)
    assert_exact(load_vision_weights(tmp_path, CFG), expected)
    # The synthetic writer's own rounding agrees with the independent one.
    for name in expected:
        np.testing.assert_array_equal(round_to_dtype(source[name], dtype).reshape(expected[name].shape),
                                      expected[name])


def test_hf_sharded_without_index(tmp_path):
    source = write_checkpoint(tmp_path, CFG, shards=3)
    (tmp_path / st.INDEX_NAME).unlink()
    assert_exact(load_vision_weights(tmp_path, CFG), expected_from_source(source))


def test_hf_visual_prefix(tmp_path):
    source = write_checkpoint(tmp_path, CFG)
    rewrite(tmp_path / "model.safetensors",
            lambda t: {n.replace("model.visual.", "visual.", 1): v for n, v in t.items()})
    assert_exact(load_vision_weights(tmp_path, CFG), expected_from_source(source))


def test_text_shards_are_never_opened(tmp_path, monkeypatch):
    source = write_checkpoint(tmp_path, CFG, shards=2)
    index_path = tmp_path / st.INDEX_NAME
    index = json.loads(index_path.read_text())
    (tmp_path / "model-text.safetensors").write_bytes(b"\xff" * 64)  # not a safetensors file
    index["weight_map"]["model.language_model.layers.9.mlp.up_proj.weight"] = "model-text.safetensors"
    index["weight_map"]["lm_head.weight"] = "model-gone.safetensors"  # missing, holds no vision tensor
    index_path.write_text(json.dumps(index))
    opened, read = [], []
    real_header, real_raw = st.read_safetensors_header, st._read_raw
    monkeypatch.setattr(st, "read_safetensors_header", lambda p: opened.append(p.name) or real_header(p))
    monkeypatch.setattr(st, "_read_raw", lambda e: read.append(e.name) or real_raw(e))
    assert_exact(load_vision_weights(tmp_path, CFG), expected_from_source(source))
    assert sorted(opened) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # The text tensors share the second shard, but their bytes are never read.
    assert read and all(name.startswith("model.visual.") for name in read)
    assert len(read) == len(set(read)) == len(weight_schema(CFG))


# --------------------------------------------------------------------------- MLX layout

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mlx_unquantized(tmp_path, dtype):
    source = write_checkpoint(tmp_path, CFG, layout="mlx", dtype=dtype, shards=2)
    head = read_safetensors_header(next(tmp_path.glob("model-00001*")))
    conv = head["vision_tower.patch_embed.proj.weight"]
    assert conv.shape == (CFG.hidden_size, 2, 16, 16, 3)  # channels-last on disk
    rounding = (lambda x: x) if dtype == "f32" else _bf16_reference
    assert_exact(load_vision_weights(tmp_path, CFG), expected_from_source(source, rounding))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mlx_quantized(tmp_path, bits, group_size, dtype):
    source = write_checkpoint(tmp_path, CFG, layout="mlx", dtype=dtype, bits=bits, group_size=group_size)
    weights = load_vision_weights(tmp_path, CFG)
    for module in (QKV0, "blocks.3.mlp.linear_fc2", "merger.linear_fc1",
                   "deepstack_merger_list.1.linear_fc2", "pos_embed"):
        hf = f"model.visual.{module}.weight"
        out, n_in = source[hf].shape
        packed = raw_tensor(tmp_path, f"vision_tower.{module}.weight")
        assert packed.dtype == np.uint32 and packed.shape == (out, n_in * bits // 32)
        scales = raw_tensor(tmp_path, f"vision_tower.{module}.scales").astype(np.float32)
        biases = raw_tensor(tmp_path, f"vision_tower.{module}.biases").astype(np.float32)
        assert scales.shape == biases.shape == (out, n_in // group_size)
        q = codes_by_bigint(packed, bits, n_in).astype(np.float32)
        group = np.arange(n_in) // group_size
        expected = q * scales[:, group] + biases[:, group]
        np.testing.assert_array_equal(weights[hf], expected, err_msg=hf)
        # And it is a faithful quantization of the source weight: almost everywhere within
        # half a step; a few values at a group's far end are clipped (MLX snaps the bias to a
        # multiple of the scale so that zero is exact, and the stored scale is rounded to
        # f16/bf16 while up to 255 codes multiply it).
        err = np.abs(weights[hf] - source[hf]) / np.abs(scales[:, group])
        assert err.max() <= 3 and np.mean(err <= 0.5 + 1e-3) >= 0.98, hf
    # Unquantized tensors (norms, biases, the conv) come through exactly rounded.
    rounding = _bf16_reference if dtype == "bf16" else (lambda x: x.astype(np.float16).astype(np.float32))
    for name in (CONV, "model.visual.blocks.2.norm1.weight", "model.visual.merger.linear_fc2.bias"):
        np.testing.assert_array_equal(weights[name], rounding(source[name]).reshape(weights[name].shape))


def test_mlx_quantized_overrides_and_mixed_bits(tmp_path):
    overrides = {QKV0: {"bits": 8, "group_size": 32}, "merger.linear_fc2": False,
                 "blocks.1.mlp.linear_fc1": {"bits": 3, "group_size": 32}}
    source = write_checkpoint(tmp_path, CFG, layout="mlx", bits=4, group_size=64, dtype="f32",
                              quant_overrides=overrides, shards=2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization"]["vision_tower.merger.linear_fc2"] is False
    weights = load_vision_weights(tmp_path, CFG)
    qkv = raw_tensor(tmp_path, f"vision_tower.{QKV0}.weight")
    assert qkv.shape == (3 * CFG.hidden_size, CFG.hidden_size // 4)
    assert raw_tensor(tmp_path, "vision_tower.blocks.1.mlp.linear_fc1.weight").shape == (
        CFG.intermediate_size, CFG.hidden_size * 3 // 32)
    name = "model.visual.merger.linear_fc2.weight"
    np.testing.assert_array_equal(weights[name], source[name])  # left unquantized
    for module, bits, gs in ((QKV0, 8, 32), ("blocks.1.mlp.linear_fc1", 3, 32),
                             ("blocks.1.attn.proj", 4, 64)):
        hf = f"model.visual.{module}.weight"
        packed, scales, biases = quantize_mlx(source[hf], bits, gs)
        np.testing.assert_array_equal(weights[hf], dequantize_mlx(packed, scales, biases, bits, gs))
    # The per-module entry may also be keyed by the Hugging Face module path.
    config["quantization"]["model.visual." + QKV0] = config["quantization"].pop("vision_tower." + QKV0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    again = load_vision_weights(tmp_path, CFG)
    for name in weights:
        np.testing.assert_array_equal(again[name], weights[name])
    # Bits are never guessed from shapes: quantized tensors need the config's block.
    del config["quantization"], config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, "vision_tower.", "no 'quantization' block", "config.json")


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_unpack_round_trip(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(5, 64), dtype=np.uint32)
    packed = pack_mlx(codes, bits)
    assert packed.dtype == np.uint32 and packed.shape == (5, 64 * bits // 32)
    np.testing.assert_array_equal(unpack_mlx(packed, bits), codes)
    np.testing.assert_array_equal(codes_by_bigint(packed, bits, 64), codes)


def test_pack_is_least_significant_first():
    assert pack_mlx(np.arange(1, 9, dtype=np.uint32)[None], 4)[0, 0] == 0x87654321
    assert pack_mlx(np.array([[0x11, 0x22, 0x33, 0x44]], np.uint32), 8)[0, 0] == 0x44332211
    # 3 bits: code i sits at bits [3i, 3i + 3) of the row's little-endian stream.
    codes = np.zeros((1, 32), np.uint32)
    codes[0, 10] = 0b101  # bits 30..32: straddles the first two words
    assert list(pack_mlx(codes, 3)[0]) == [1 << 30, 1, 0]


@pytest.mark.parametrize("bits,group_size", [(2, 32), (3, 64), (4, 32), (6, 64), (8, 64)])
def test_quantize_round_trip(bits, group_size):
    w = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
    packed, scales, biases = quantize_mlx(w, bits, group_size)
    back = dequantize_mlx(packed, scales, biases, bits, group_size)
    step = np.repeat(np.abs(scales), group_size, axis=1)
    assert np.all(np.abs(back - w) <= step * (1 + 1e-5) + 1e-6)  # see test_mlx_quantized
    assert np.mean(np.abs(back - w) <= 0.5 * step * (1 + 1e-5) + 1e-6) > 0.95
    # The group's extreme of larger magnitude is represented exactly (MLX's edge rule).
    g = w.reshape(16, -1, group_size)
    edge = np.where(np.abs(g.min(2)) > np.abs(g.max(2)), g.min(2), g.max(2))
    bg = back.reshape(16, -1, group_size)
    np.testing.assert_allclose(np.take_along_axis(bg, np.abs(g).argmax(2)[..., None], 2)[..., 0], edge,
                               rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- errors

def test_error_missing_tensor(tmp_path):
    write_checkpoint(tmp_path, CFG)
    name = "model.visual.blocks.2.attn.proj.bias"
    rewrite(tmp_path / "model.safetensors", lambda t: {n: v for n, v in t.items() if n != name})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "missing", "model.safetensors")


def test_error_unexpected_shape(tmp_path):
    write_checkpoint(tmp_path, CFG, shards=2)
    name = "model.visual.merger.linear_fc1.bias"
    shard = json.loads((tmp_path / st.INDEX_NAME).read_text())["weight_map"][name]
    rewrite(tmp_path / shard, lambda t: {**t, name: f32_bytes(np.zeros(7))})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "unexpected shape [7]", shard)


def test_error_conv_shape(tmp_path):
    write_checkpoint(tmp_path, CFG)
    name = "model.visual.patch_embed.proj.weight"
    rewrite(tmp_path / "model.safetensors", lambda t: {**t, name: f32_bytes(np.zeros((64, 3, 2, 14, 14)))})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "unexpected shape", "model.safetensors")


@pytest.mark.parametrize("dtype", ["F64", "I8", "F8_E4M3"])
def test_error_unknown_dtype(tmp_path, dtype):
    write_checkpoint(tmp_path, CFG)
    name = "model.visual.blocks.0.norm1.weight"

    def edit(t):
        size = {"F64": 8, "I8": 1, "F8_E4M3": 1}[dtype] * CFG.hidden_size
        return {**t, name: (dtype, (CFG.hidden_size,), b"\0" * size)}

    rewrite(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, dtype, "model.safetensors")


@pytest.mark.parametrize("part", ["scales", "biases"])
def test_error_quantized_without_scales_or_biases(tmp_path, part):
    write_checkpoint(tmp_path, CFG, layout="mlx", bits=4, group_size=32)
    drop = f"vision_tower.{QKV0}.{part}"
    rewrite(tmp_path / "model.safetensors", lambda t: {n: v for n, v in t.items() if n != drop})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, f"vision_tower.{QKV0}.weight", part, "model.safetensors")


def test_error_packed_shape(tmp_path):
    write_checkpoint(tmp_path, CFG, layout="mlx", bits=4, group_size=32)
    name = f"vision_tower.{QKV0}.weight"
    rewrite(tmp_path / "model.safetensors",
            lambda t: {**t, name: ("U32", (192, 7), np.zeros((192, 7), "<u4").tobytes())})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "stored shape [192, 7]", "[192, 8]", "model.safetensors")


def test_error_duplicate_without_index(tmp_path):
    write_checkpoint(tmp_path, CFG, shards=2)
    (tmp_path / st.INDEX_NAME).unlink()
    name = "model.visual.blocks.0.norm1.bias"  # lives in shard 1; copy it into shard 2
    rewrite(tmp_path / "model-00002-of-00002.safetensors",
            lambda t: {**t, name: f32_bytes(np.zeros(CFG.hidden_size))})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "two shards", "model-00001-of-00002.safetensors",
                    "model-00002-of-00002.safetensors")


def test_error_duplicate_with_index(tmp_path):
    write_checkpoint(tmp_path, CFG, shards=2)
    name = "model.visual.blocks.0.norm1.bias"
    rewrite(tmp_path / "model-00002-of-00002.safetensors",
            lambda t: {**t, name: f32_bytes(np.zeros(CFG.hidden_size))})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "two shards", "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("dtype,bad", [("f32", np.nan), ("bf16", np.inf)])
def test_error_non_finite(tmp_path, dtype, bad):
    source = write_checkpoint(tmp_path, CFG, dtype=dtype)
    name = "model.visual.pos_embed.weight"
    w = source[name].copy()
    w[5, 3] = bad
    bf16 = ("BF16", w.shape, (w.view(np.uint32) >> 16).astype("<u2").tobytes())
    store = f32_bytes(w) if dtype == "f32" else bf16
    rewrite(tmp_path / "model.safetensors", lambda t: {**t, name: store})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "non-finite", "model.safetensors")


def test_error_non_finite_scales(tmp_path):
    write_checkpoint(tmp_path, CFG, layout="mlx", bits=8, group_size=64, dtype="f32")
    name = f"vision_tower.{QKV0}.scales"
    rewrite(tmp_path / "model.safetensors",
            lambda t: {**t, name: f32_bytes(np.full((3 * CFG.hidden_size, 1), np.inf))})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "non-finite", "model.safetensors")


def test_error_no_vision_weights(tmp_path):
    write_checkpoint(tmp_path / "text", CFG)
    rewrite(tmp_path / "text" / "model.safetensors",
            lambda t: {n: v for n, v in t.items() if not n.startswith("model.visual.")})
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path / "text", CFG)
    one_line_naming(err, "no vision weights", "model.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path / "empty", CFG)
    one_line_naming(err, "no vision weights", "empty")
    write_checkpoint(tmp_path / "idx", CFG, shards=2)
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "idx" / st.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path / "idx", CFG)
    one_line_naming(err, "no vision weights", st.INDEX_NAME)
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path / "nowhere", CFG)
    one_line_naming(err, "nowhere", "not a readable folder")


def test_error_index_references_missing_shard(tmp_path):
    write_checkpoint(tmp_path, CFG, shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    msg = one_line_naming(err, "model-00002-of-00003.safetensors", "missing", st.INDEX_NAME)
    assert "model.visual." in msg


def test_error_index_places_tensor_in_wrong_shard(tmp_path):
    write_checkpoint(tmp_path, CFG, shards=2)
    index = json.loads((tmp_path / st.INDEX_NAME).read_text())
    name = "model.visual.blocks.0.norm1.weight"
    index["weight_map"][name] = "model-00002-of-00002.safetensors"
    (tmp_path / st.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, name, "model-00002-of-00002.safetensors")


def test_error_not_a_safetensors_file(tmp_path):
    write_checkpoint(tmp_path, CFG)
    shutil.copy(tmp_path / "config.json", tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, "broken.safetensors", "not a safetensors file")


def test_error_truncated_file(tmp_path):
    write_checkpoint(tmp_path, CFG)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as err:
        load_vision_weights(tmp_path, CFG)
    one_line_naming(err, "model.safetensors")


def test_checkpoint_error_is_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_synthetic_weights_match_parity_fixture(tmp_path):
    """Seed 0 on `tiny` writes the weights of tests/fixtures/tiny_parity.safetensors."""
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "tiny_parity.safetensors"  # in the repository: never skipped
    write_checkpoint(tmp_path, CFG, seed=0)
    weights = load_vision_weights(tmp_path, CFG)
    head, data = read_safetensors_header(fixture), fixture.read_bytes()
    for name, shape in weight_schema(CFG):
        e = head["weight." + name]
        assert e.dtype == "F32"
        ref = np.frombuffer(data[e.begin:e.end], "<f4").reshape(shape)
        np.testing.assert_array_equal(weights[name], ref, err_msg=name)


def test_synthetic_folder_contents(tmp_path):
    write_checkpoint(tmp_path / "a", CFG)
    write_checkpoint(tmp_path / "b", CFG, processor_policy_dict={"patch_size": 16, "custom": 1})
    write_checkpoint(tmp_path / "c", CFG, layout="mlx", bits=4, group_size=32)
    assert load_model_config(tmp_path / "a") == CFG
    assert load_model_config(tmp_path / "c") == CFG
    other = dataclasses.replace(CFG, rope_theta=5000.0, num_position_embeddings=64)
    write_checkpoint(tmp_path / "d", other, model_type="qwen3_vl_moe")
    assert load_model_config(tmp_path / "d") == other
    assert json.loads((tmp_path / "a" / "preprocessor_config.json").read_text()) == DEFAULT_PROCESSOR
    custom = json.loads((tmp_path / "b" / "preprocessor_config.json").read_text())
    assert custom == {"patch_size": 16, "custom": 1}
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    assert config["text_config"]["hidden_size"] == CFG.out_hidden_size
    names = read_safetensors_header(tmp_path / "a" / "model.safetensors")
    assert any(n.startswith("model.language_model.") for n in names)
