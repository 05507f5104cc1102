"""Deterministic random-weight Qwen3-VL checkpoint folders, written without torch.

`write_checkpoint` lays out what a real checkpoint folder holds (`config.json`,
`preprocessor_config.json`, `video_preprocessor_config.json`, `*.safetensors`, an index
when sharded) in the Hugging Face
layout or the MLX (mlx-vlm) layout, in f32, bf16 or f16, optionally MLX
affine-quantized, plus a few text-model tensors that a vision loader must ignore.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from emitter.atomic import folder_atomic, write_atomic
from emitter.config import ROPE_THETA, VisionConfig, weight_schema
from emitter.policy import VIDEO_PREPROCESSOR_CONFIG
from emitter.text_config import TokenIds
from emitter.video_policy import DEFAULT_VIDEO_POLICY

from runtime.checkpoints.tensor_files import INDEX_NAME
from runtime.checkpoints.vision import CONV_NAME, HF_PREFIX, MLX_PREFIX
from runtime.checkpoints.mlx_quant import dequantize_mlx, pack_mlx

__all__ = ["write_checkpoint", "quantize_mlx", "dequantize_mlx", "round_to_dtype",
           "write_safetensors", "random_vision_weights", "DEFAULT_PROCESSOR"]

DEFAULT_PROCESSOR = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "image_processor_type": "Qwen2VLImageProcessor",
}
ST_DTYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


# --------------------------------------------------------------------------- numerics

def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """The f32 values that `x` takes once stored as `dtype` ("f32", "f16" or "bf16")."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "f32":
        return x.copy()
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        return (_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"dtype {dtype!r}: expected 'f32', 'f16' or 'bf16'")


def to_bytes(x: np.ndarray, dtype: str) -> tuple[str, bytes]:
    if dtype == "f32":
        return "F32", np.ascontiguousarray(x, dtype="<f4").tobytes()
    if dtype == "f16":
        return "F16", np.ascontiguousarray(x, dtype="<f2").tobytes()
    if dtype == "bf16":
        return "BF16", _bf16_bits(x).astype("<u2").tobytes()
    if dtype == "u32":
        return "U32", np.ascontiguousarray(x, dtype="<u4").tobytes()
    raise ValueError(f"dtype {dtype!r}")


def quantize_mlx(w: np.ndarray, bits: int, group_size: int,
                 scale_dtype: str = "f32") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX affine quantization (mx.quantize's algorithm) of a 2-D weight, computed in f32.

    Returns (packed uint32 [out, in*bits/32], scales [out, in/g], biases [out, in/g]), the
    scales and biases as f32 arrays holding values exactly representable in `scale_dtype`
    (the dtype they will be stored in; the codes are chosen against those rounded values,
    as MLX does when quantizing a bf16/f16 weight). `dequantize_mlx` is the inverse, up to
    the rounding of the codes."""
    w = np.asarray(w, dtype=np.float32)
    out, n_in = w.shape
    if n_in % group_size or (n_in * bits) % 32:
        raise ValueError(f"a [{out}, {n_in}] weight cannot be quantized with group_size {group_size}, "
                         f"bits {bits}")
    n_bins = np.float32((1 << bits) - 1)
    g = w.reshape(out, n_in // group_size, group_size)
    w_max = g.max(axis=2, keepdims=True)
    w_min = g.min(axis=2, keepdims=True)
    mask = np.abs(w_min) > np.abs(w_max)
    scales = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scales = np.where(mask, scales, -scales)
    edge = np.where(mask, w_min, w_max)
    q0 = np.round(edge / scales)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(q0 != 0, edge / np.where(q0 != 0, q0, 1), scales).astype(np.float32)
    biases = np.where(q0 == 0, np.float32(0), edge).astype(np.float32)
    scales, biases = round_to_dtype(scales, scale_dtype), round_to_dtype(biases, scale_dtype)
    q = np.clip(np.round((g - biases) / scales), 0, n_bins).astype(np.uint32)
    return pack_mlx(q.reshape(out, n_in), bits), scales[..., 0], biases[..., 0]


# --------------------------------------------------------------------------- safetensors

def safetensors_header(entries, metadata: dict[str, str] | None = None) -> bytes:
    """The start of a safetensors file whose tensors follow in order: its 8-byte length and
    JSON header (padded to 8 bytes), from (name, dtype tag, shape, byte count) entries."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(path: str | Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file from {name: (dtype tag, shape, raw little-endian bytes)},
    atomically (whole or not at all)."""
    head = safetensors_header(((name, dtype, shape, len(data)) for name, (dtype, shape, data) in tensors.items()),
                              metadata)
    write_atomic(path, b"".join([head, *(d for _, _, d in tensors.values())]))


# --------------------------------------------------------------------------- weights

def _hf_shape(cfg: VisionConfig, suffix: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return cfg.conv_shape if suffix == CONV_NAME else shape


def random_vision_weights(cfg: VisionConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """f32 random weights keyed by Hugging Face name, in Hugging Face shapes (the conv
    [h, C, T, P, P]), drawn in `weight_schema` order from `np.random.default_rng(seed)`.

    Linear and conv weights are normal * gain / sqrt(fan_in) (gain 0.5 for attn.proj and
    the blocks' fc2, else 1), biases 0.1 * normal, the position table 0.5 * normal, LayerNorm
    weights 1 + 0.1 * normal, so activations stay O(1) through the tower. The same recipe
    as tests/torch_reference.random_vision_state_dict, so seed 0 on `tiny` gives the
    weights of the parity fixture."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in weight_schema(cfg):
        suffix = name[len(HF_PREFIX):]
        shape = _hf_shape(cfg, suffix, shape)
        parts = suffix.split(".")
        z = rng.standard_normal(shape, dtype=np.float32)
        if parts[-1] == "weight" and any(p in ("norm", "norm1", "norm2") for p in parts):
            w = 1.0 + 0.1 * z
        elif parts[-1] == "bias":
            w = 0.1 * z
        elif suffix == "pos_embed.weight":
            w = 0.5 * z
        else:  # a linear or the conv
            gain = 0.5 if suffix.endswith(("attn.proj.weight", "mlp.linear_fc2.weight")) else 1.0
            w = z * np.float32(gain / np.sqrt(int(np.prod(shape[1:]))))
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def _text_config(cfg: VisionConfig) -> dict:
    hidden = cfg.out_hidden_size  # the merger output replaces text embeddings
    heads = 4
    head_dim = 16
    return {
        "model_type": "qwen3_vl_text",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": max(3, len(cfg.deepstack_visual_indexes)),
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": 5000000.0,
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        "tie_word_embeddings": False,
    }


def _text_tensors(cfg: VisionConfig, rng: np.random.Generator, layout: str) -> dict[str, np.ndarray]:
    hidden = cfg.out_hidden_size
    prefix = "model.language_model." if layout == "hf" else "language_model.model."
    norm = 1.0 + 0.1 * rng.standard_normal((2, hidden))
    down = 0.05 * rng.standard_normal((hidden, 2 * hidden))
    return {
        prefix + "norm.weight": norm[0].astype(np.float32),
        prefix + "layers.0.input_layernorm.weight": norm[1].astype(np.float32),
        prefix + "layers.0.mlp.down_proj.weight": down.astype(np.float32),
    }


def check_new_folder(model_dir: Path) -> None:
    """A checkpoint is written as a whole folder: refuse one that exists with files in it
    (a stale index or shard beside the new files would be read in their place)."""
    if model_dir.is_symlink() or (model_dir.exists() and not model_dir.is_dir()):
        raise ValueError(f"{model_dir}: exists and is not a plain folder (a file or a symlink); expected a new "
                         f"or empty folder")
    if model_dir.is_dir():
        held = sorted(os.listdir(model_dir))
        if held:
            raise ValueError(f"{model_dir}: not empty (holds {held[0]}"
                             f"{f' and {len(held) - 1} more' if len(held) > 1 else ''}); "
                             f"expected a new or empty folder")


def write_checkpoint(model_dir: str | Path, cfg: VisionConfig, seed: int = 0, layout: str = "hf",
                     dtype: str = "f32", bits: int | None = None, group_size: int = 64, shards: int = 1,
                     processor_policy_dict: dict | None = None, model_type: str = "qwen3_vl",
                     quant_overrides: dict[str, dict | bool] | None = None,
                     video_policy_dict: dict | None = None) -> dict[str, np.ndarray]:
    """Write a random-weight checkpoint folder; returns the f32 source weights (keyed by
    Hugging Face name, Hugging Face shapes, before any rounding or quantization).

    layout "hf" names tensors `model.visual.*`; "mlx" names them `vision_tower.*`, stores
    the conv channels-last and, with `bits`, affine-quantizes every 2-D weight whose input
    size the group size divides (the linears and the position table), scales and biases in
    `dtype`. `quant_overrides` maps a module suffix (e.g. "blocks.0.attn.qkv") to
    {"bits", "group_size"} (recorded in config.json's `quantization` under the module's
    path) or False (left unquantized). `video_policy_dict`: the video_preprocessor_config.json
    (default: the released Qwen3-VL one).

    `model_dir` must be new or empty. The files are written into a temp folder beside it,
    which is renamed into place once complete: on any error nothing is left behind (and a
    temp folder of a killed writer is removed by the next write)."""
    if layout not in ("hf", "mlx"):
        raise ValueError(f"layout {layout!r}: expected 'hf' or 'mlx'")
    if dtype not in ST_DTYPE:
        raise ValueError(f"dtype {dtype!r}: expected one of {list(ST_DTYPE)}")
    if bits is not None and layout != "mlx":
        raise ValueError("quantized checkpoints use the MLX layout")
    if shards < 1:
        raise ValueError("shards must be at least 1")
    model_dir = Path(model_dir)
    check_new_folder(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        with folder_atomic(model_dir) as tmp:  # onto a missing or empty folder
            source = _write_files(tmp, cfg, seed, layout, dtype, bits, group_size, shards, processor_policy_dict,
                                  model_type, quant_overrides)
            video = DEFAULT_VIDEO_POLICY.to_config() if video_policy_dict is None else video_policy_dict
            write_atomic(tmp / VIDEO_PREPROCESSOR_CONFIG, json.dumps(video, indent=2) + "\n")
    except OSError as e:  # named by the folder asked for, never the temp one
        reason = e.strerror or str(e)
        reason = reason.replace(str(tmp), str(model_dir)) if tmp else reason
        raise OSError(f"{model_dir}: cannot write the checkpoint ({reason})") from None
    return source


def checkpoint_config(cfg: VisionConfig, dtype: str, model_type: str = "qwen3_vl") -> dict:
    """config.json of a vision checkpoint as released ones write it (`_text_config`'s small
    stand-in language model; `synthetic_text` replaces it with a whole one)."""
    vision = {"model_type": model_type, **cfg.to_hf_vision_config()}
    if cfg.rope_theta != ROPE_THETA:
        vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": float(cfg.rope_theta)}
    return {
        "architectures": ["Qwen3VLForConditionalGeneration" if model_type == "qwen3_vl"
                          else "Qwen3VLMoeForConditionalGeneration"],
        "model_type": model_type,
        **asdict(TokenIds()),  # as released: the ids a config.json naming none means
        "tie_word_embeddings": False,
        "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype],
        "text_config": _text_config(cfg),
        "vision_config": vision,
    }


def quantization_block(bits: int, group_size: int, overrides: dict | None = None) -> dict:
    """config.json's MLX `quantization` (and `quantization_config`) as mlx-vlm writes them:
    the global settings, then each overridden module under its stored path."""
    quant: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for module, settings in sorted((overrides or {}).items()):
        quant[MLX_PREFIX + module] = settings
    return {"quantization": quant, "quantization_config": quant}


def _write_files(model_dir: Path, cfg: VisionConfig, seed: int, layout: str, dtype: str, bits: int | None,
                 group_size: int, shards: int, processor_policy_dict: dict | None, model_type: str,
                 quant_overrides: dict[str, dict | bool] | None) -> dict[str, np.ndarray]:
    """The files of `write_checkpoint`, written into `model_dir` (a fresh folder)."""
    source = random_vision_weights(cfg, seed)
    rng = np.random.Generator(np.random.PCG64(seed + 1_000_003))
    overrides = dict(quant_overrides or {})

    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}

    def put(name: str, arr: np.ndarray, kind: str) -> None:
        tag, data = to_bytes(arr, kind)
        tensors[name] = (tag, tuple(arr.shape), data)

    prefix = HF_PREFIX if layout == "hf" else MLX_PREFIX
    for hf_name, w in source.items():
        suffix = hf_name[len(HF_PREFIX):]
        name = prefix + suffix
        if layout == "mlx" and suffix == CONV_NAME:
            w = w.transpose(0, 2, 3, 4, 1)  # [h, C, T, P, P] -> [h, T, P, P, C]
        module = suffix[: -len(".weight")] if suffix.endswith(".weight") else None
        settings = overrides.get(module, {}) if module else {}
        q_bits = settings.get("bits", bits) if isinstance(settings, dict) else None
        q_group = settings.get("group_size", group_size) if isinstance(settings, dict) else None
        if (q_bits is not None and module is not None and suffix != CONV_NAME and w.ndim == 2
                and w.shape[1] % q_group == 0 and (w.shape[1] * q_bits) % 32 == 0):
            packed, scales, biases = quantize_mlx(w, q_bits, q_group, scale_dtype=dtype)
            put(name, packed, "u32")
            put(prefix + module + ".scales", scales, dtype)
            put(prefix + module + ".biases", biases, dtype)
        else:
            put(name, w, dtype)
    text = _text_tensors(cfg, rng, layout)
    for name, w in text.items():
        put(name, w, dtype)

    # Files: vision tensors split in `shards` contiguous runs; text tensors in the last shard.
    fmt = {"format": "pt"} if layout == "hf" else {"format": "mlx"}
    if shards == 1:
        write_safetensors(model_dir / "model.safetensors", tensors, fmt)
    else:
        vision_names = [n for n in tensors if n not in text]
        chunks = np.array_split(np.arange(len(vision_names)), shards)
        weight_map: dict[str, str] = {}
        total = 0
        for k, chunk in enumerate(chunks):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            names = [vision_names[i] for i in chunk] + (list(text) if k == shards - 1 else [])
            part = {n: tensors[n] for n in names}
            write_safetensors(model_dir / file, part, fmt)
            for n in names:
                weight_map[n] = file
                total += len(tensors[n][2])
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_atomic(model_dir / INDEX_NAME, json.dumps(index, indent=2) + "\n")

    config = checkpoint_config(cfg, dtype, model_type)
    if layout == "mlx" and bits is not None:
        config.update(quantization_block(bits, group_size, overrides))
    write_atomic(model_dir / "config.json", json.dumps(config, indent=2) + "\n")
    processor = DEFAULT_PROCESSOR if processor_policy_dict is None else processor_policy_dict
    write_atomic(model_dir / "preprocessor_config.json", json.dumps(processor, indent=2) + "\n")
    return source
