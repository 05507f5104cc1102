"""Random Qwen3-VL checkpoints in mlx-vlm's layout at any size, MLX-quantized or float, that
can answer (`qwen3vl random-checkpoint --with-text --layout mlx`): vision tower, language
model, tokenizer and chat template, written without mlx and without a float copy of any
quantized weight.

Where `synthetic.write_checkpoint` quantizes f32 weights with `quantize_mlx` (exact, for
small models), this draws each quantized weight in its bits: uniform random `bits`-bit
codes u packed in uint32 words (`mlx_quant`'s layout), and per group a scale s and bias b
such that w = s*u + b has mean 0 and about the spread of the f32 recipes
(`synthetic.random_vision_weights`, `synthetic_text.random_text_tensors`: std gain/sqrt(fan_in),
the embedding table 1). Norm weights, biases and the conv (channels-last) are float in
`dtype`. A mixture-of-experts language model (qwen3_vl_moe) is written as mlx-vlm's sanitize
and convert leave it: each layer's experts as switch_mlp stacks [E, out, in] per projection
(quantized as such), the router `mlp.gate` at 8 bits in groups of 64 (its quant_predicate,
a per-module entry of config.json's `quantization`). Each tensor is drawn from its own seeded generator as it is written, into shards
of about `shard_bytes` with model.safetensors.index.json, so memory stays near one tensor:
a 4-bit 8B (about 5 GB) is written holding a few hundred MB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from emitter import experts
from emitter.atomic import folder_atomic, write_atomic
from emitter.config import HF_PREFIX, VisionConfig, weight_schema
from emitter.policy import VIDEO_PREPROCESSOR_CONFIG
from emitter.text import weight_shapes
from emitter.text_config import DENSE_MODEL_TYPE, LM_HEAD, MOE_MODEL_TYPE, TEXT_PREFIX, TextConfig
from emitter.video_policy import DEFAULT_VIDEO_POLICY

from runtime.checkpoints.synthetic import (DEFAULT_PROCESSOR, ST_DTYPE, check_new_folder, checkpoint_config,
                                           quantization_block, safetensors_header, to_bytes)
from runtime.checkpoints.synthetic_text import add_language_files
from runtime.checkpoints.tensor_files import INDEX_NAME
from runtime.checkpoints.vision import CONV_NAME, MLX_PREFIX

STORED_PREFIX = "language_model.model."  # mlx-vlm's names of the decoder's tensors
STORED_HEAD = "language_model.lm_head"
ITEM_BYTES = {"U32": 4, "F32": 4, "F16": 2, "BF16": 2}
ROUTER_QUANTIZATION = {"group_size": 64, "bits": 8}  # mlx-vlm's qwen3_vl_moe quant_predicate for `mlp.gate`


def stored_name(name: str) -> str:
    """mlx-vlm's name of a decoder tensor (Hugging Face name in)."""
    return STORED_HEAD + ".weight" if name == LM_HEAD else STORED_PREFIX + name[len(TEXT_PREFIX):]


class Entry(NamedTuple):
    """One stored tensor: its name, safetensors dtype, shape and how to draw its bytes."""
    name: str
    tag: str
    shape: tuple[int, ...]
    draw: Callable[[], bytes]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * ITEM_BYTES[self.tag]


def _float(name: str, shape: tuple[int, ...], mean: float, std: float, dtype: str, rng) -> Entry:
    return Entry(name, ST_DTYPE[dtype], shape,
                 lambda: to_bytes(mean + std * rng().standard_normal(shape, np.float32), dtype)[1])


def _quantized(module: str, shape: tuple[int, ...], std: float, bits: int, group: int, dtype: str,
               rng) -> list[Entry]:
    """`module`.weight (uint32 codes), .scales and .biases of a random [out, in] weight (or a
    stack of experts [E, out, in], each stored so)."""
    *stack, out, n_in = shape
    levels = (1 << bits) - 1
    scale = std * np.sqrt(12.0 / ((levels + 1) ** 2 - 1))  # the std of s*u, u uniform over the codes
    cut = (*stack, out, n_in // group)

    def scales() -> np.ndarray:  # drawn again for the biases, from the same seed
        return np.float32(scale) * (1 + 0.1 * rng().standard_normal(cut, np.float32))

    tag = ST_DTYPE[dtype]
    rows = int(np.prod(shape[:-1]))
    return [Entry(module + ".weight", "U32", (*stack, out, n_in * bits // 32), lambda: rng().bytes(rows * n_in * bits // 8)),
            Entry(module + ".scales", tag, cut, lambda: to_bytes(scales(), dtype)[1]),
            Entry(module + ".biases", tag, cut, lambda: to_bytes(-scales() * np.float32(levels / 2), dtype)[1])]


def _vision_entries(cfg: VisionConfig, bits: int | None, group: int, dtype: str, seeded) -> list[Entry]:
    """The tower's tensors under mlx-vlm's names (`vision_tower.*`, the conv channels-last),
    the recipe of `synthetic.random_vision_weights`; quantized: every 2-D weight (the
    linears and the position table), as `synthetic.write_checkpoint` does."""
    entries = []
    for name, shape in weight_schema(cfg):
        suffix = name[len(HF_PREFIX):]
        parts, stored = suffix.split("."), MLX_PREFIX + suffix
        if suffix == CONV_NAME:
            h, c, t, p, _ = cfg.conv_shape
            entries.append(_float(stored, (h, t, p, p, c), 0.0, 1 / np.sqrt(shape[1]), dtype, seeded(stored)))
        elif parts[-1] == "bias":
            entries.append(_float(stored, shape, 0.0, 0.1, dtype, seeded(stored)))
        elif any(p in ("norm", "norm1", "norm2") for p in parts):
            entries.append(_float(stored, shape, 1.0, 0.1, dtype, seeded(stored)))
        else:
            gain = 0.5 if suffix.endswith(("attn.proj.weight", "mlp.linear_fc2.weight")) else 1.0
            std = 0.5 if suffix == "pos_embed.weight" else gain / np.sqrt(shape[1])
            entries += _matrix(stored, shape, std, bits, group, dtype, seeded)
    return entries


def _text_entries(cfg: TextConfig, bits: int | None, group: int, dtype: str, seeded) -> list[Entry]:
    """The language model's tensors under mlx-vlm's names, the recipe of
    `synthetic_text.random_text_tensors`; quantized: every 2-D weight (the embedding
    table, the projections, an untied lm_head) and expert stack (switch_mlp's, per
    projection: `experts.switch_parts`), the routers in ROUTER_QUANTIZATION."""
    entries = []
    for name, shape in weight_shapes(cfg):
        stored = stored_name(name)
        if name.endswith("norm.weight"):
            entries.append(_float(stored, shape, 1.0, 0.1, dtype, seeded(stored)))
        elif experts.is_expert(name):
            std = (0.5 if name.endswith(experts.DOWN) else 1.0) / np.sqrt(shape[-1])
            for part, part_shape in experts.switch_parts(stored, shape):
                entries += _matrix(part, part_shape, std, bits, group, dtype, seeded)
        elif name.endswith(experts.ROUTER):
            entries += _matrix(stored, shape, 1 / np.sqrt(shape[1]), router_bits(shape, bits, group),
                               ROUTER_QUANTIZATION["group_size"], dtype, seeded)
        else:
            gain = 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            std = 1.0 if name.endswith("embed_tokens.weight") else gain / np.sqrt(shape[1])
            entries += _matrix(stored, shape, std, bits, group, dtype, seeded)
    return entries


def router_bits(shape: tuple[int, int], bits: int | None, group: int) -> int | None:
    """The bits of a router [E, hidden] in a checkpoint quantized at `bits` / `group`:
    ROUTER_QUANTIZATION's, where mlx-vlm quantizes it (both groups divide its inputs); else None."""
    inputs = shape[1]
    return None if bits is None or inputs % group or inputs % ROUTER_QUANTIZATION["group_size"] \
        else ROUTER_QUANTIZATION["bits"]


def _matrix(stored: str, shape, std: float, bits: int | None, group: int, dtype: str, seeded) -> list[Entry]:
    if bits is None or shape[-1] % group:  # as mlx-vlm leaves a module its group size does not divide
        return [_float(stored, shape, 0.0, std, dtype, seeded(stored))]
    module = stored[: -len(".weight")]
    return _quantized(module, shape, std, bits, group, dtype, seeded(module))


def write_shards(folder: Path, entries: list[Entry], shard_bytes: int, metadata: dict) -> None:
    """Safetensors shards of about `shard_bytes` (`model-0000k-of-0000n.safetensors`) and their
    index, each tensor drawn as it is written."""
    shards, size = [[]], 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(folder / file, "wb") as f:
            f.write(safetensors_header(((e.name, e.tag, e.shape, e.nbytes) for e in shard), metadata))
            for e in shard:
                data = e.draw()
                assert len(data) == e.nbytes, e.name
                f.write(data)
        weight_map.update(dict.fromkeys((e.name for e in shard), file))
    total = sum(e.nbytes for e in entries)
    write_atomic(folder / INDEX_NAME, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")


def write_mlx_generation_checkpoint(model_dir, vision: VisionConfig, text: TextConfig, bits: int | None = 4,
                                    group_size: int = 64, dtype: str = "bf16", seed: int = 0,
                                    shard_bytes: int = 2 << 30) -> None:
    """Write the folder (new or empty; whole or not at all: built in a temp folder beside it,
    then renamed): config.json (with mlx-vlm's `quantization` when `bits`), the processor
    configs, the weights in shards, the tokenizer, chat template and generation config."""
    if text.hidden_size != vision.out_hidden_size:
        raise ValueError(f"text hidden_size {text.hidden_size} != vision out_hidden_size {vision.out_hidden_size}")
    if bits is not None and bits not in (4, 8):
        raise ValueError(f"bits {bits}: expected 4 or 8")
    model_dir = Path(model_dir)
    check_new_folder(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)

    def seeded(name: str):  # each tensor its own generator: its draws do not depend on the others'
        key = [seed, *name.encode()]
        return lambda: np.random.default_rng(key)

    entries = (_vision_entries(vision, bits, group_size, dtype, seeded)
               + _text_entries(text, bits, group_size, dtype, seeded))
    with folder_atomic(model_dir) as tmp:
        write_shards(tmp, entries, shard_bytes, {"format": "mlx"})
        config = checkpoint_config(vision, dtype, MOE_MODEL_TYPE if text.num_experts else DENSE_MODEL_TYPE)
        if bits is not None:
            config.update(quantization_block(bits, group_size))
            quantization = config["quantization"]  # also `quantization_config`: one dict
            for name, shape in weight_shapes(text):
                if name.endswith(experts.ROUTER) and router_bits(shape, bits, group_size):
                    quantization[stored_name(name)[: -len(".weight")]] = dict(ROUTER_QUANTIZATION)
        write_atomic(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        write_atomic(tmp / "preprocessor_config.json", json.dumps(DEFAULT_PROCESSOR, indent=2) + "\n")
        write_atomic(tmp / VIDEO_PREPROCESSOR_CONFIG, json.dumps(DEFAULT_VIDEO_POLICY.to_config(), indent=2) + "\n")
        add_language_files(tmp, text, seed)
        released_rope(tmp / "config.json")


def released_rope(path: Path) -> None:
    """config.json's text_config given the rotary settings also as the released config.json
    spells them (`rope_theta`, `rope_scaling`), which mlx-vlm's TextConfig requires; beside
    transformers 5's `rope_parameters`, the same numbers."""
    config = json.loads(path.read_text())
    text = config["text_config"]
    rope = dict(text["rope_parameters"])
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    write_atomic(path, json.dumps(config, indent=2) + "\n")
