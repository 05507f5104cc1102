"""The Q8_0 x Q8_0 and Q4_0 x Q8_0 block kernel (kernels/q8_matmul.c): its weights' tile layout,
the packing of weights into it, and its arithmetic in numpy.

llama.cpp's Q8_0 math: weights and activations in blocks of 32 inputs, a scale per block on both
sides (the weights' f16), each block's int8 x int8 dot product summed exactly in int32 and scaled
into an f32 accumulator (`reference`); Q4_0 x Q8_0 the same with the weights in 4 bits (-8..7,
Q4_0's 18 bytes a block of 32 with its f16 scale), and 6 bits (-32..31, 26 bytes a block: q4_0's
lm_head table, where llama.cpp keeps Q6_K), one C function per weight width (`ENTRIES`) over the
same loops and activations: AVX-512 VNNI (vpdpbusd) or AVX2 (vpmaddubsw), built by
kernels/build.py. GGUF's Q6_K runs in its bits through its own entry (`Q6_K_ENTRY`, `pack_q6_k`,
`reference_q6_k`): the 6-bit codes with Q6_K's int8 scale per 16 inputs and f16 d per 256, each
block's two halves' exact dots combined in int32 by their scales, then scaled by d and x's scale. IREE 3.13's own code for the grouped integer forms runs 3-10x slower than one
group (docs/history/performance-notebook.md), so the graph calls this kernel instead: emitter/kernel_calls.py
emits the call (one workgroup per `OUTPUTS_PER_WORKGROUP` outputs), emitter/quant.py chooses the
weights' numbers, and the archive writer packs them here.

Weights are stored packed in 16-output tiles (`pack_weight`, `pack_scales`): the kernel reads
64 bytes of 16 outputs x 4 inputs per step, one vpdpbusd against 4 broadcast bytes of x; at 4
bits one 64-byte load holds two steps (low nibbles, high nibbles), unpacked by an and and a shift.
The graph reads the same layout when it gathers rows out of the tiles (emitter/kernel_calls.py
`block_rows`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kernels.build import KernelError

SOURCE = Path(__file__).with_name("q8_matmul.c")
BLOCK = 32  # inputs per scale, both sides (Q8_0)
TILE = 16  # outputs per packed weight tile; N a multiple of two tiles
OUTPUTS_PER_WORKGROUP = 128  # a multiple of 2 * TILE (the AVX-512 loop takes two tiles at once)
# weight bits -> the C function: Q8_0, Q4_0, and the 6-bit table of q4_0's lm_head (`pack_weight`)
ENTRIES = {8: "q8_matmul_workgroup", 6: "q6_matmul_workgroup", 4: "q4_matmul_workgroup"}
# weight bits -> the mixture-of-experts entry: stacks of experts, rows sorted by expert
EXPERT_ENTRIES = {8: "q8_experts_workgroup", 4: "q4_experts_workgroup"}
# GGUF's Q6_K in its bits (`pack_q6_k`, `reference_q6_k`): 6-bit codes, an int8 scale per SUB inputs
# and an f16 d per SUPER, against the same Q8_0 activations (the halves' sums of x rather than the blocks')
Q6_K_ENTRY = "q6k_matmul_workgroup"
SUPER, SUB = 256, 16
Q6_K_ROW_BYTES = SUPER * 6 // 8 + SUPER // SUB  # bytes a row of 256 inputs in the tiles: codes, sub-scales (208)


def check_shape(m: int, n: int, k: int) -> None:
    if m < 1:
        raise KernelError(f"q8_matmul: rows {m}: expected at least 1")
    if n % (2 * TILE) or n == 0:
        raise KernelError(f"q8_matmul: outputs {n}: expected a positive multiple of {2 * TILE}")
    if k % BLOCK or k == 0:
        raise KernelError(f"q8_matmul: inputs {k}: expected a positive multiple of {BLOCK}")


def check_bits(bits: int) -> int:
    if bits not in ENTRIES:
        raise KernelError(f"q8_matmul: weight bits {bits}: expected one of {', '.join(map(str, ENTRIES))}")
    return bits


def pack_weight(q: np.ndarray, bits: int = 8) -> np.ndarray:
    """q [N, K] int8 as the kernel reads it, flat: 8 bits [N/16, K/4, 16, 4]; 4 bits the codes
    q + 8 in bytes [N/16, K/32, 4, 16, 4], inputs 4s..4s+3 of a block in the low nibbles and
    16+4s..16+4s+3 in the high ones; 6 bits the codes q + 32, each tile's block 384 bytes: their
    low 4 bits as the 4-bit layout's 256, then their top 2 bits in [2, 16, 4] bytes, step s's
    (inputs 4s..4s+3) in byte row s % 2 at bits 2 (s // 2) (kernels/q8_matmul.c)."""
    n, k = q.shape
    check_shape(1, n, k)
    low = -(1 << (check_bits(bits) - 1)) + (bits == 8)  # -127 at 8 bits (the AVX2 sign trick), -8 at 4
    if q.dtype != np.int8 or (q < low).any() or (q > (1 << (bits - 1)) - 1).any():
        raise KernelError(f"q8_matmul: weight: expected int8 values in [{low}, {(1 << (bits - 1)) - 1}]")
    if bits == 8:
        return np.ascontiguousarray(q.reshape(n // TILE, TILE, k // 4, 4).transpose(0, 2, 1, 3)).reshape(-1)
    codes = (q + np.int8(1 << (bits - 1))).view(np.uint8).reshape(n // TILE, TILE, k // BLOCK, 8, 4)
    steps = codes.transpose(0, 2, 3, 1, 4)  # tile, block, step, output, input
    nibbles = steps & np.uint8(0xF)
    parts = [nibbles[:, :, :4] | (nibbles[:, :, 4:] << np.uint8(4))]  # [tiles, blocks, 4, 16, 4]
    if bits == 6:
        top = (steps >> np.uint8(4)).reshape(n // TILE, k // BLOCK, 4, 2, TILE, 4)  # step 2r + h at [r, h]
        parts.append(np.bitwise_or.reduce([top[:, :, r] << np.uint8(2 * r) for r in range(4)]))
    return np.concatenate(parts, axis=2).reshape(-1).view(np.int8)


def pack_scales(scales: np.ndarray) -> np.ndarray:
    """Weight scales [N, K/32] f16 as the kernel reads them: [N/16, K/32, 16], flat."""
    n, blocks = scales.shape
    if scales.dtype != np.float16:
        raise KernelError(f"q8_matmul: weight scales of {scales.dtype}: expected float16 (Q8_0's)")
    return np.ascontiguousarray(scales.reshape(n // TILE, TILE, blocks).transpose(0, 2, 1)).reshape(-1)


# -- the math, in numpy ------------------------------------------------------
def reference(xq: np.ndarray, dx: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """y [M, N] f32 as the kernel computes it at either width (q [N, K] int8, unpacked), bit for
    bit: per block b in order,
    acc += (f32(scales[:, b]) * dx[:, b]) * f32(i32 dot of the block), each op rounded to f32."""
    m, k = xq.shape
    blocks = k // BLOCK
    sums = np.einsum("mbj,nbj->mnb", xq.reshape(m, blocks, BLOCK).astype(np.int32),
                     q.reshape(-1, blocks, BLOCK).astype(np.int32), dtype=np.int32)
    acc, scales = np.zeros((m, q.shape[0]), np.float32), scales.astype(np.float32)
    for b in range(blocks):
        acc = acc + (scales[None, :, b] * dx[:, b:b + 1]) * sums[:, :, b].astype(np.float32)
    return acc


# -- Q6_K ----------------------------------------------------------------------
def pack_q6_k(q: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """Q6_K's codes q [N, K] int8 (-32..31) and sub-scales sc [N, K/16] int8 as the q6k entry
    reads them, flat: each tile's super-block of 256 inputs its 8 blocks' codes in the 6-bit
    layout (`pack_weight(q, 6)`: 384 bytes a block), then their sub-scales [8 blocks, 2 halves,
    16 outputs] (256 bytes): 3328 bytes, Q6_K's 210 a row of 256 less d (kernels/q8_matmul.c)."""
    n, k = q.shape
    check_shape(1, n, k)
    if k % SUPER or sc.shape != (n, k // SUB) or sc.dtype != np.int8:
        raise KernelError(f"q8_matmul q6_k: codes {list(q.shape)} and sub-scales {list(sc.shape)} {sc.dtype}: "
                          f"expected K a multiple of {SUPER} and int8 [N, K/{SUB}]")
    supers = k // SUPER
    codes = pack_weight(q, 6).view(np.uint8).reshape(n // TILE, supers, 8 * 384)
    scales = sc.view(np.uint8).reshape(n // TILE, TILE, supers, 16).transpose(0, 2, 3, 1)  # tile, super, half, output
    return np.concatenate([codes, scales.reshape(n // TILE, supers, 256)], axis=2).reshape(-1).view(np.int8)


def half_sums(xq: np.ndarray) -> np.ndarray:
    """The sums [M, K/16] int32 of each half block of x's codes (the q6k entry's xh)."""
    m, k = xq.shape
    return xq.reshape(m, k // SUB, SUB).astype(np.int32).sum(axis=2, dtype=np.int32)


def reference_q6_k(xq: np.ndarray, dx: np.ndarray, q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """y [M, N] f32 as the q6k entry computes it, bit for bit (q [N, K] int8 codes, sc [N, K/16]
    int8, d [N, K/256] f16): per block b of 32 in order, s = sc[:, 2b] dot0 + sc[:, 2b+1] dot1 in
    int32 (exact), acc += (f32(d[:, b // 8]) * dx[:, b]) * f32(s), each op rounded to f32."""
    m, k = xq.shape
    halves = np.einsum("mhj,nhj->mnh", xq.reshape(m, k // SUB, SUB).astype(np.int32),
                       q.reshape(-1, k // SUB, SUB).astype(np.int32), dtype=np.int32)
    s = (halves * sc.astype(np.int32)[None]).reshape(m, q.shape[0], k // BLOCK, 2).sum(axis=3, dtype=np.int32)
    acc, d = np.zeros((m, q.shape[0]), np.float32), d.astype(np.float32)
    for b in range(k // BLOCK):
        acc = acc + (d[None, :, b // (SUPER // BLOCK)] * dx[:, b:b + 1]) * s[:, :, b].astype(np.float32)
    return acc
