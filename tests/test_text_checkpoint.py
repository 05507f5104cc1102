"""The language model's checkpoint reader shares the vision side's checks
(`checkpoint.scan_tensors`, `checkpoint.quant_settings`): shard names inside the folder,
tensors in two shards, tensors the config does not use, MLX quantization settings."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from emitter.text_config import TEXT_PRESETS
from runtime.checkpoints.tensor_files import INDEX_NAME, CheckpointError
from runtime.checkpoints.synthetic import quantize_mlx, write_safetensors
from runtime.checkpoints.synthetic_text import write_text_model
from runtime.checkpoints.text import load_text_weights, text_entries

CFG = replace(TEXT_PRESETS["tiny"], num_hidden_layers=1)


@pytest.fixture()
def model(tmp_path) -> Path:
    write_text_model(tmp_path / "m", CFG, seed=1)
    return tmp_path / "m"


def index(model: Path) -> dict:
    return json.loads((model / INDEX_NAME).read_text())


def add_shard(model: Path, name: str, tensors: dict[str, np.ndarray], listed: bool = True) -> None:
    write_safetensors(model / name, {k: ("F32", v.shape, v.tobytes()) for k, v in tensors.items()})
    if listed:
        data = index(model)
        data["weight_map"].update(dict.fromkeys(tensors, name))
        (model / INDEX_NAME).write_text(json.dumps(data))


def test_reads_what_it_wrote(model):
    weights = load_text_weights(model, CFG)
    assert set(weights) == {name for name, _ in text_entries(model, CFG)[0].items()}


def test_a_tensor_the_config_does_not_use_is_refused(model):
    add_shard(model, "extra.safetensors", {"model.language_model.extra.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(CheckpointError, match=r"model.language_model.extra.weight: a language-model tensor this "
                                              r"config does not use"):
        text_entries(model, CFG)


def test_lm_head_beside_tied_embeddings_is_ignored(model):
    assert "lm_head.weight" in text_entries(model, CFG)[1]  # stored, and used while untied
    tied = replace(CFG, tie_word_embeddings=True)
    assert "lm_head.weight" not in text_entries(model, tied)[0]


def test_shards_outside_the_folder_and_duplicates_are_refused(model):
    data = index(model)
    data["weight_map"]["model.language_model.norm.weight"] = "../elsewhere.safetensors"
    (model / INDEX_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="lies outside the model folder"):
        text_entries(model, CFG)


def test_a_tensor_in_two_shards_is_refused(model):
    norm = np.ones((CFG.hidden_size,), np.float32)
    add_shard(model, "twice.safetensors", {"model.language_model.norm.weight": norm,
                                           "model.language_model.extra.weight": norm}, listed=False)
    data = index(model)
    data["weight_map"]["model.language_model.extra.weight"] = "twice.safetensors"  # opens the shard
    (model / INDEX_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="present in two shards"):
        text_entries(model, CFG)


def test_mlx_quantization_mode_is_checked(model):
    name = "model.language_model.layers.0.mlp.up_proj"
    w = np.random.default_rng(0).standard_normal((CFG.intermediate_size, CFG.hidden_size), dtype=np.float32)
    packed, scales, biases = quantize_mlx(w, 4, 16)
    data = index(model)
    shard = model / data["weight_map"][name + ".weight"]
    from safetensors.numpy import load_file
    tensors = {k: v for k, v in load_file(shard).items() if k != name + ".weight"}
    write_safetensors(shard, {**{k: ("F32", v.shape, v.tobytes()) for k, v in tensors.items()},
                              name + ".weight": ("U32", packed.shape, packed.tobytes()),
                              name + ".scales": ("F32", scales.shape, scales.tobytes()),
                              name + ".biases": ("F32", biases.shape, biases.tobytes())})
    data["weight_map"].update({name + ".scales": shard.name, name + ".biases": shard.name})
    (model / INDEX_NAME).write_text(json.dumps(data))
    config = json.loads((model / "config.json").read_text())
    for quantization, expected in (({"bits": 4, "group_size": 16, "mode": "mxfp4"}, "mode 'mxfp4'"),
                                   ({"bits": 7, "group_size": 16}, "gives bits 7"),
                                   ({"bits": 4, "group_size": 20}, "gives group_size 20")):
        (model / "config.json").write_text(json.dumps({**config, "quantization": quantization}))
        with pytest.raises(CheckpointError, match=expected):
            load_text_weights(model, CFG)
    (model / "config.json").write_text(json.dumps({**config, "quantization": {"bits": 4, "group_size": 16}}))
    assert np.abs(load_text_weights(model, CFG)[name + ".weight"] - w).max() < 0.5
