"""A numpy encoder of llama.cpp's K-quant block types (Q4_K, Q5_K, Q6_K), for tests: any
valid encoding of an f32 weight [N, K] (K a multiple of 256), its bytes laid out as gguf's
own `gguf.quants.dequantize` reads them (the reference the tests compare against). Not
llama.cpp's search for the best scales: per sub-block the range's min and max, then the
6-bit (Q4_K, Q5_K) or int8 (Q6_K) scales of the super-block's f16 d and dmin."""

from __future__ import annotations

import numpy as np

SUPER = 256


def _round(x, lo, hi) -> np.ndarray:
    return np.clip(np.rint(x), lo, hi).astype(np.int32)


def _f16(x) -> np.ndarray:
    """f32 [..] as f16 [.., 2] bytes."""
    return np.asarray(x, np.float16)[..., None].view(np.uint8)


def _safe(x):
    return np.where(x == 0, np.float32(1), x)


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit sc and eight 6-bit m [..., 8] as Q4_K's 12 bytes (the inverse of gguf's
    `Q4_K.get_scale_min`)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    low = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mins = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    mixed = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    return np.concatenate([low, mins, mixed], axis=-1).astype(np.uint8)


def _k_affine(w: np.ndarray, levels: int):
    """(d, dmin f16-rounded f32 [rows, nb], sc, m int [rows, nb, 8], u int [rows, nb, 8, 32])."""
    rows = w.shape[0]
    g = w.reshape(rows, -1, 8, 32)
    lo = np.minimum(g.min(axis=-1), 0)
    span = (g.max(axis=-1) - lo) / levels
    d = np.float16(span.max(axis=-1) / 63).astype(np.float32)
    dmin = np.float16((-lo).max(axis=-1) / 63).astype(np.float32)
    sc = _round(span / _safe(d)[..., None], 0, 63)
    m = _round(-lo / _safe(dmin)[..., None], 0, 63)
    scale = d[..., None] * sc.astype(np.float32)
    u = _round((g + (dmin[..., None] * m)[..., None]) / _safe(scale)[..., None], 0, levels)
    return d, dmin, sc, m, u


def _nibble_body(u: np.ndarray) -> np.ndarray:
    """Codes [rows, nb, 8, 32] (low 4 bits) as 128 bytes per block: runs 2j and 2j+1 in the
    low and high nibbles of 32 bytes."""
    low = (u & 0xF).astype(np.uint8).reshape(*u.shape[:2], 4, 2, 32)
    return (low[..., 0, :] | (low[..., 1, :] << 4)).reshape(*u.shape[:2], 128)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, u = _k_affine(w, 15)
    return np.concatenate([_f16(d), _f16(dmin), pack_k_scales(sc, m), _nibble_body(u)], axis=-1).reshape(w.shape[0], -1)


def encode_q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, u = _k_affine(w, 31)
    fifth = ((u >> 4) & 1).astype(np.uint8)  # [rows, nb, 8, 32]: bit i of byte j is run i's element j
    qh = (fifth << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), pack_k_scales(sc, m), qh, _nibble_body(u)],
                          axis=-1).reshape(w.shape[0], -1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    g = w.reshape(rows, -1, 16, 16)
    s = np.abs(g).max(axis=-1) / 31
    d = np.float16(s.max(axis=-1) / 127).astype(np.float32)
    sc = _round(s / _safe(d)[..., None], -128, 127)
    scale = d[..., None] * sc.astype(np.float32)
    u = (_round(g / _safe(scale)[..., None], -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)
    low, high = u & 0xF, u >> 4
    ql = (low[:, :, :, :2] | (low[:, :, :, 2:] << 4)).reshape(rows, -1, 128)  # [h, s, j]: run h*4 + s*2 + j//32
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8).reshape(rows, -1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=-1).reshape(rows, -1)


ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """The bytes uint8 [N, K / 256 * block bytes] of an f32 [N, K] weight in `kind`."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % SUPER:
        raise ValueError(f"shape {list(w.shape)}: expected [N, K] with K a multiple of {SUPER}")
    return ENCODERS[kind](w)
