"""Weight-only, group-wise, symmetric quantization of the language model's matmul weights
(`--precision int8`): the layout in the archive and in the graph, and the numbers, in one place.

A weight w [N, K] is cut along K into groups of GROUP (64) consecutive inputs. Each group
has one f32 scale, max|w| / 127 over its 64 weights, and its weights are stored as
q = clamp(round(w / scale), -127, 127) in i8 (`--precision int8`). So w ~ q * scale, exactly that product in f32
(`dequantize`): the quantized graph computes with these numbers and nothing else.

At 4 bits (`--precision int4`) the same with 7 in place of 127, q in -7..7, stored as i4
(two to a byte, `nibbles`).

In the archive the weight's checkpoint name holds q transposed, [K, N] (i8 or i4: `stored`), and
`scales_name` (the name with "weight" replaced by "scales") holds the scales [N, K / GROUP]
(f32). The graph reads them as they are (`QuantizedWeight`, emitter/layers.py's
`quantized_project`). Transposed because the one-row contraction runs over q as [G, g, N]
(N contiguous: a vector of outputs per input), which IREE 3.13 otherwise makes at load by
a transposed copy that stays resident beside the packed one (measured: 2.0x the i8 bytes
resident, against 1.1x when stored so).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ConfigError

GROUP = 64  # inputs per scale
QUANTIZED_BITS = {"int8": 8, "int4": 4}  # precision -> bits of a stored weight
STORAGE_DTYPE = {8: "i8", 4: "i4"}  # bits -> the graph's element type of q


def bits_of(precision: str) -> int | None:
    """The bits of a quantized precision's weights, or None for a float precision."""
    return QUANTIZED_BITS.get(precision)


def levels(bits: int) -> int:
    """The largest magnitude a stored value takes: 127 at 8 bits, 7 at 4 (symmetric: -127..127, -7..7)."""
    return (1 << (bits - 1)) - 1


def scales_name(weight_name: str) -> str:
    """`...proj.weight` -> `...proj.scales` (and `lm_head.weight` -> `lm_head.scales`)."""
    return weight_name[: -len("weight")] + "scales"


def weight_transform(bits: int, group: int = GROUP) -> str:
    """A quantized weight's `WeightSpec.host_transform` (part of the artifact identity)."""
    return f"quantize_int{bits}_g{group}"


def scales_transform(bits: int, group: int = GROUP) -> str:
    return f"group_scales_int{bits}_g{group}"


def groups(name: str, shape: tuple[int, ...], group: int = GROUP) -> int:
    """Groups per row of a [N, K] weight; ConfigError naming the tensor where K is not a
    multiple of the group."""
    if len(shape) != 2 or shape[1] % group:
        raise ConfigError(f"{name}: shape {list(shape)}: expected [N, K] with K a multiple of the quantization "
                          f"group {group}")
    return shape[1] // group


def quantize(w: np.ndarray, bits: int, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, K] int8, scales [N, K / group] f32) of an f32 weight [N, K]: per group
    scale = max|w| / levels, q = clamp(round-half-even(w / scale)). An all-zero group has
    scale 0 and q 0."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    scales = (np.abs(g).max(axis=2) / np.float32(levels(bits))).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.clip(np.rint(g / safe[:, :, None]), -levels(bits), levels(bits)).astype(np.int8)
    return q.reshape(n, k), scales


def stored(w: np.ndarray, bits: int, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """(q transposed [K, N], scales [N, K / group] f32): an f32 weight [N, K] as the
    archive holds it (`quantize`): q int8, or at 4 bits its K*N/2 bytes of nibbles (`nibbles`)."""
    q, scales = quantize(w, bits, group)
    q = np.ascontiguousarray(q.T)
    return (nibbles(q) if bits == 4 else q), scales


def nibbles(q: np.ndarray) -> np.ndarray:
    """Values in -8..7 packed two to a byte, as IREE reads a tensor of i4: element 2i in the
    low nibble of byte i, element 2i+1 in the high one (two's complement)."""
    flat = q.reshape(-1).astype(np.uint8) & 0xF
    return flat[0::2] | (flat[1::2] << 4)


def dequantize(q: np.ndarray, scales: np.ndarray, group: int = GROUP) -> np.ndarray:
    """The f32 weight [N, K] the quantized graph computes with: q * scale of its group."""
    n, k = q.shape
    g = q.reshape(n, k // group, group).astype(np.float32) * scales[:, :, None]
    return g.reshape(n, k)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [N, K] weight in a graph: q transposed [K, N] (i8 or i4) and its scales
    [N, K / group] (f32)."""
    q: object  # builder.Value
    scales: object  # builder.Value

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's [N, K]."""
        return self.q.shape[1], self.q.shape[0]

    @property
    def group(self) -> int:
        return self.q.shape[0] // self.scales.shape[1]
