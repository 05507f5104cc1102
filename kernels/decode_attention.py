"""The attention kernels (kernels/decode_attention.c): one new token's attention over the paged KV
cache in one dispatch, and a chunk's (prefill) in another, each row the same math as its token's
alone; their bounds, and their arithmetic in numpy, bit for bit.

A decode step's attention in StableHLO is about seven dispatches a layer (the block-table
rows, the scores with the K read fused in, the running max, the own key's score, the
exponentials, the weighted V sum with the V read fused in, the sums and the division),
each with the IREE task executor's overhead. This kernel does one layer's attention for
one token in one dispatch, a workgroup per KV head: it walks the blocks the sequence's
table names, reads each block's K and V rows where they lie in the page pools (f32 or bf16),
and keeps an online softmax (the math and its order: the C file's header; `reference` is
the same in numpy, bit for bit). The table's length is a run-time value.

A chunk's attention is the same math for each of its rows, over the pools that already hold
the chunk's own K/V: row i at slot p attends as a token at slot p whose own k and v are the
pools' row p (`chunk_reference`: `reference` row by row, bit for bit). A workgroup takes one
KV head and one block's worth of rows, in vector lanes, and walks only the blocks its rows
see: the causal half of the scores is never computed, nor any [heads, S, L] score tensor
written (IREE's graph form wrote and re-read them in five dispatches a layer, about a
quarter of a 512-token prefill of the 2B).

Built like kernels/q8_matmul.c (kernels/build.py); emitter/kernel_calls.py emits the calls,
in the q8_0 and q4_0 graphs (emitter/text.py), whose target is an x86-64 CPU of a known ISA.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("decode_attention.c")
ROWS = 16  # slots a KV cache block holds (the C file's ROWS; emitter/kv_pages.py's BLOCK)
ENTRIES = {"f32": "decode_attention_f32", "bf16": "decode_attention_bf16"}  # the pools' dtype -> C function
LANES = 16  # partial sums of a dot product (the C file's LANES): head_dim a multiple of it
MAX_GROUPS, MAX_HEAD_DIM = 8, 256  # the C file's bounds of its per-head state
CHUNK_ENTRIES = {"f32": "chunk_attention_f32", "bf16": "chunk_attention_bf16"}
MAX_CHUNK_HEAD_DIM = 128  # the C file's bound of a chunk tile's head_dim (its stack arrays)


def scale_bits(head_dim: int) -> int:
    """f32(head_dim^-0.5)'s bits, the index constant the C functions take as their scale."""
    return struct.unpack("<I", struct.pack("<f", head_dim ** -0.5))[0]


def fits(groups: int, head_dim: int, kv_dtype: str) -> bool:
    """Whether the kernel takes this attention (else the graph's `token_attention` does)."""
    return kv_dtype in ENTRIES and groups <= MAX_GROUPS and head_dim <= MAX_HEAD_DIM and head_dim % LANES == 0


def chunk_fits(groups: int, head_dim: int, kv_dtype: str) -> bool:
    """Whether the chunk kernel takes this attention (else the graph's `grouped_attention` does)."""
    return fits(groups, head_dim, kv_dtype) and head_dim <= MAX_CHUNK_HEAD_DIM


# -- the math, in numpy ------------------------------------------------------
def _exp(x: np.ndarray) -> np.ndarray:
    """The C file's exp_f32, elementwise in f32, the same operations in the same order."""
    f = np.float32
    x = np.asarray(x, f)
    n = np.trunc(x * f(1.44269504088896341) + np.where(x < 0, f(-0.5), f(0.5))).astype(f)
    r = x - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    p = np.full_like(r, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    p = p * (r * r) + r + f(1)
    two_n = ((np.clip(n, -127, 128).astype(np.int32) + 127).astype(np.uint32) << np.uint32(23)).view(f)
    return np.where(x < f(-87.33654), f(0), p * two_n).astype(f)


def _dot(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """q [D] . k [..., D] as the C file's dot: LANES partial sums in order, then a tree."""
    part = np.zeros((*k.shape[:-1], LANES), np.float32)
    for i in range(0, q.shape[-1], LANES):
        part = part + q[i:i + LANES] * k[..., i:i + LANES]
    w = LANES // 2
    while w:
        part = part[..., :w] + part[..., w:2 * w]
        w //= 2
    return part[..., 0]


def reference(q: np.ndarray, own_k: np.ndarray, own_v: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray,
              table: np.ndarray, slot: int) -> np.ndarray:
    """The kernel's output [H, D] f32, bit for bit: q [H, D], own k and v [KVH, D] and pools
    [KVH, blocks, 16, D] (f32, or bf16 as uint16), the table [N] i32 and the slot."""
    f = np.float32
    widen = (lambda p: (p.astype(np.uint32) << np.uint32(16)).view(f)) if k_pool.dtype == np.uint16 else np.asarray
    k_pool, v_pool, own_k, own_v = widen(k_pool), widen(v_pool), widen(own_k), widen(own_v)
    kv_heads, blocks, _, d = k_pool.shape
    groups = q.shape[0] // kv_heads
    scale = f(d ** -0.5)
    seen = min(max(slot, 0), len(table) * ROWS)
    out = np.zeros_like(q, dtype=f)
    for h in range(kv_heads):
        for g in range(groups):
            qg = q[h * groups + g].astype(f)
            peak, total, acc = _dot(qg, own_k[h]) * scale, f(1), own_v[h].astype(f).copy()
            for j in range(-(-seen // ROWS)):
                rows = min(ROWS, seen - j * ROWS)
                block = min(int(np.uint32(table[j])), blocks - 1)
                s = _dot(qg, k_pool[h, block, :rows]) * scale
                top = max(peak, s.max())
                if top > peak:
                    c = _exp(peak - top)
                    total, acc, peak = total * c, acc * c, top
                for r in range(rows):
                    p = _exp(s[r] - peak)
                    total = total + p
                    acc = acc + p * v_pool[h, block, r]
            out[h * groups + g] = acc / total
    return out


def chunk_reference(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, table: np.ndarray,
                    start: int) -> np.ndarray:
    """The chunk kernel's output [S, H, D] f32, bit for bit: q [S, H, D] at slots start..,
    the pools [KVH, blocks, 16, D] (f32, or bf16 as uint16) holding its own K/V: row i is
    `reference` of the token at slot start + i whose own k and v are the pools' row there."""
    blocks = k_pool.shape[1]
    out = np.zeros(q.shape, np.float32)
    for i in range(q.shape[0]):
        slot = start + i
        block = min(int(np.uint32(table[slot // ROWS])), blocks - 1)
        own_k, own_v = k_pool[:, block, slot % ROWS], v_pool[:, block, slot % ROWS]
        out[i] = reference(q[i], own_k, own_v, k_pool, v_pool, table, slot)
    return out
