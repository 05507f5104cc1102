"""MLX affine quantization: the packed format of mlx's `mx.quantize` and the
`quantization` block mlx-lm / mlx-vlm write into config.json.

A quantized weight [out, in] is stored as `weight` uint32 [out, in*bits/32], each row a
little-endian bit stream of `bits`-bit codes (least-significant bits first), with
`scales` and `biases` [out, in/group_size]; `w = q*scale + bias`, computed here in f32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QUANT_BITS = (2, 3, 4, 5, 6, 8)


def unpack_mlx(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [rows, words] -> uint32 codes [rows, words*32/bits].

    Each row is a little-endian bit stream (code i occupies bits [i*bits, (i+1)*bits),
    least-significant first across the little-endian words): MLX's packing for every
    width, 2/4/8 within one word and 3/5/6 across byte triples/quintuples."""
    packed = np.ascontiguousarray(packed, dtype="<u4")
    rows, words = packed.shape
    if 32 % bits == 0:
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        codes = (packed[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
        return codes.reshape(rows, words * (32 // bits))
    n = words * 32 // bits
    stream = np.unpackbits(packed.view(np.uint8).reshape(rows, words * 4), axis=1, bitorder="little")
    stream = stream[:, : n * bits].reshape(rows, n, bits).astype(np.uint32)
    return (stream << np.arange(bits, dtype=np.uint32)).sum(axis=2, dtype=np.uint32)


def unpack_bytes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [rows, words] -> uint8 codes [rows, words*32/bits] at 8 or 4 bits, one byte a
    code (`unpack_mlx`'s codes without its 4-byte ones): at 8 bits the words' bytes as they
    are, at 4 each byte's low nibble then its high one."""
    raw = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8)
    if bits == 8:
        return raw
    if bits != 4:
        raise ValueError(f"{bits}-bit codes: expected 8 or 4")
    codes = np.empty((raw.shape[0], raw.shape[1] * 2), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = raw & np.uint8(0xF), raw >> np.uint8(4)
    return codes


def pack_mlx(codes: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `unpack_mlx`: codes [rows, n] (each < 2**bits) -> uint32 [rows, n*bits/32]."""
    codes = np.asarray(codes, dtype=np.uint32)
    rows, n = codes.shape
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole 32-bit words")
    stream = ((codes[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    packed = np.packbits(stream.reshape(rows, n * bits), axis=1, bitorder="little")
    return packed.view("<u4").astype(np.uint32).reshape(rows, n * bits // 32)


def dequantize_mlx(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                   bits: int, group_size: int) -> np.ndarray:
    """MLX affine dequantization in f32: w[r, c] = q[r, c]*scales[r, c//g] + biases[r, c//g]."""
    q = unpack_mlx(packed, bits).astype(np.float32)
    s = np.repeat(np.asarray(scales, dtype=np.float32), group_size, axis=1)
    b = np.repeat(np.asarray(biases, dtype=np.float32), group_size, axis=1)
    return q * s + b


@dataclass(frozen=True)
class QuantConfig:
    """config.json's `quantization` block as mlx-lm / mlx-vlm write it: global `bits`,
    `group_size` and `mode`, plus per-module entries keyed by module path (a dict of
    overrides, or false for a module left unquantized)."""
    block: dict
    source: str  # where it was read, for messages: "<dir>/config.json 'quantization'"

    def module(self, paths: tuple[str, ...]) -> tuple[dict | None, str]:
        """The settings that apply to a module known by `paths` (its stored and Hugging Face
        spellings) and the config entry they come from; None for a module marked false."""
        for path in paths:
            override = self.block.get(path)
            if isinstance(override, dict):
                return {**self.block, **override}, f"{self.source}[{path!r}]"
            if override is False:
                return None, f"{self.source}[{path!r}]"
        return self.block, self.source

    def names_module(self, paths: tuple[str, ...]) -> bool:
        return any(isinstance(self.block.get(path), dict) for path in paths)


def quantization_config(model_dir: Path) -> QuantConfig | None:
    """The MLX quantization block of the folder's config.json (`quantization`, else an
    MLX-style `quantization_config`), or None when it has none."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict) and "quant_method" not in q and ("bits" in q or "group_size" in q or "mode" in q):
            return QuantConfig(q, f"{path} '{key}'")
    return None
