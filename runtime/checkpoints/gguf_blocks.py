"""GGUF's quantized block types in their bits: a tensor's blocks unpacked into
emitter/quant.py's layout (signed q, f32 scales per group and, affine, f32 biases), so
that w = scale*q (+ bias) per group are the numbers of `gguf.quants.dequantize`:

- Q8_0, blocks of 32: f16 d, 32 i8 q; w = d*q. As 8-bit symmetric, group 32.
- Q4_0, blocks of 32: f16 d, 16 bytes (element j in the low nibble of byte j, j+16 in its
  high one); w = d*(u-8). As 4-bit symmetric, group 32: q = u-8.
- Q4_1, Q5_0, Q5_1 (what llama.cpp writes for rows that 256 does not divide in a K-quant
  file), blocks of 32: f16 d, Q4_1's and Q5_1's f16 m, Q5_0's and Q5_1's 4 bytes holding
  each value's fifth bit (element j in bit j), then Q4_0's 16 bytes; w = d*(u-16) (Q5_0),
  d*u + m (Q4_1, Q5_1). As 8-bit symmetric (Q5_0: q = u-16) or affine (Q4_1 4-bit, q = u-8,
  bias 8*d + m; Q5_1 8-bit, q = u-16, bias 16*d + m), group 32.
- Q4_K, super-blocks of 256: f16 d, f16 dmin, 12 bytes of eight 6-bit sc and m (one each
  per 32), 128 bytes of nibbles; w = d*sc*u - dmin*m, u 0..15. As 4-bit affine, group 32:
  q = u-8, scale d*sc, bias 8*d*sc - dmin*m.
- Q5_K: Q4_K's, plus 32 bytes holding each value's fifth bit; u 0..31. As 8-bit affine,
  group 32: q = u-16, bias 16*d*sc - dmin*m.
- Q6_K, super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 i8 sc,
  f16 d; w = d*sc*(u-32) per 16, u 0..63. As 8-bit symmetric, group 16: q = u-32.

The scales are exact in f32 (an f16 times a small integer), and so are the products with
q; an affine bias is one f32 rounding from gguf's (8*d*sc and dmin*m exact, their
difference rounded). Each tensor is unpacked `quant.BLOCK_ROWS` rows at a time into the
archive's arrangement (`in_bits`): nothing of weight size in f32.
"""

from __future__ import annotations

import numpy as np

from emitter import quant

SUPER = 256  # values per K-quant super-block
LAYOUTS = {"Q8_0": quant.Layout(8, 32), "Q4_0": quant.Layout(4, 32), "Q4_1": quant.Layout(4, 32, affine=True),
           "Q5_0": quant.Layout(8, 32), "Q5_1": quant.Layout(8, 32, affine=True),
           "Q4_K": quant.Layout(4, 32, affine=True), "Q5_K": quant.Layout(8, 32, affine=True),
           "Q6_K": quant.Layout(8, 16)}
CENTRE = {"Q4_0": 8, "Q4_1": 8, "Q5_0": 16, "Q5_1": 16, "Q4_K": 8, "Q5_K": 16, "Q6_K": 32}  # taken from the codes
LEGACY = {"Q4_0": (False, False), "Q4_1": (True, False), "Q5_0": (False, True), "Q5_1": (True, True)}  # m, fifth bit


def halves(raw: np.ndarray) -> np.ndarray:
    """f16 bytes [..., 2] as f32 [...] (exact)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def nibbles(raw: np.ndarray) -> np.ndarray:
    """Bytes [..., c, 32] as codes [..., 2c, 32]: of each 32 bytes, the low nibbles are one
    run of 32 codes and the high nibbles the next (Q4_K's and Q5_K's order)."""
    both = np.stack([raw & np.uint8(0xF), raw >> np.uint8(4)], axis=-2)  # [..., c, 2, 32]
    return both.reshape(*raw.shape[:-2], 2 * raw.shape[-2], 32)


def k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale d*sc, dm = dmin*m), f32 [rows, blocks, 8], of Q4_K / Q5_K blocks: f16 d and dmin,
    then 12 bytes packing eight 6-bit sc and eight 6-bit m (gguf's `Q4_K.get_scale_min`)."""
    d, dmin = halves(blocks[..., 0:2]), halves(blocks[..., 2:4])
    packed = blocks[..., 4:16].reshape(*blocks.shape[:-1], 3, 4)
    low, mins, mixed = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1).astype(np.float32)
    m = np.concatenate([mins & 0x3F, (mixed >> 4) | ((mins >> 2) & 0x30)], axis=-1).astype(np.float32)
    return d[..., None] * sc, dmin[..., None] * m


def codes(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(unsigned codes uint8 [rows, blocks, groups, group] (Q8_0: its signed q), scales f32
    [rows, blocks, groups], gguf's dm = dmin*m of an affine type or None) of a tensor's
    blocks uint8 [rows, blocks, bytes] (module docstring)."""
    if kind == "Q8_0":
        return blocks[..., 2:].view(np.int8)[..., None, :], halves(blocks[..., :2])[..., None], None
    if kind in LEGACY:
        return legacy(kind, blocks)
    if kind in ("Q4_K", "Q5_K"):
        scale, dm = k_scales(blocks)
        body = blocks[..., -SUPER // 2:].reshape(*blocks.shape[:-1], 4, 32)
        u = nibbles(body)
        if kind == "Q5_K":
            high = blocks[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]
            u = u | ((high & np.uint8(1)) << np.uint8(4))
        return u, scale, dm
    if kind == "Q6_K":
        rows, count = blocks.shape[:2]
        low = blocks[..., :128].reshape(rows, count, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        low = (low & np.uint8(0xF)).reshape(rows, count, 8, 32)
        high = blocks[..., 128:192].reshape(rows, count, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        high = (high & np.uint8(3)).reshape(rows, count, 8, 32)
        u = (low | (high << np.uint8(4))).reshape(rows, count, 16, 16)
        scale = halves(blocks[..., 208:210])[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
        return u, scale, None
    raise ValueError(f"GGUF type {kind}: expected one of {', '.join(LAYOUTS)}")


def q6_k_parts(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks uint8 [rows, K/256, 210] as they are: (codes q int8 [rows, K] in -32..31,
    sub-scales sc int8 [rows, K/16], d f16 [rows, K/256]); w = d * sc * q per 16 (the block
    kernel's q6k entry reads these, kernels/q8_matmul.py `pack_q6_k`)."""
    rows, count = blocks.shape[:2]
    u, _, _ = codes("Q6_K", blocks)
    q = (u - np.uint8(CENTRE["Q6_K"])).view(np.int8).reshape(rows, -1)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, count * 16)
    d = np.ascontiguousarray(blocks[..., 208:210]).view("<f2").reshape(rows, count)
    return q, sc, d.astype(np.float16)


def legacy(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`codes` of Q4_0, Q4_1, Q5_0 and Q5_1 blocks of 32 (module docstring): gguf's
    w = d*u + m written as d*u - dm, dm = -m."""
    has_min, fifth = LEGACY[kind]
    d = halves(blocks[..., :2])[..., None]
    dm = -halves(blocks[..., 2:4])[..., None] if has_min else None
    body = blocks[..., -16:]
    u = np.concatenate([body & np.uint8(0xF), body >> np.uint8(4)], axis=-1)  # element j, then j+16
    if fifth:
        at = 4 if has_min else 2
        u = u | (np.unpackbits(blocks[..., at:at + 4], axis=-1, bitorder="little") << np.uint8(4))
    return u[..., None, :], d, dm


def signed(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q int8 [rows, K], scales f32 [rows, K / group], biases f32 like the scales or None) of
    a tensor's blocks uint8 [rows, blocks, bytes]: the codes re-centred (module docstring)."""
    u, scale, dm = codes(kind, blocks)
    rows = blocks.shape[0]
    centre = CENTRE.get(kind, 0)
    q = (u - np.uint8(centre)).view(np.int8) if centre else u  # modulo 256: u - centre in -centre..
    scales = scale.reshape(rows, -1)
    biases = None if dm is None else (np.float32(centre) * scale - dm).reshape(rows, -1).astype(np.float32)
    return q.reshape(rows, -1), scales.astype(np.float32), biases


def shape_of(t) -> tuple[int, int]:
    """A 2-D GGUF tensor's [N, K] (GGUF lists its dimensions innermost first)."""
    n, k = (int(x) for x in reversed(t.shape))
    return n, k


def in_bits(t) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q as the archive holds it (`quant.arranged`: [K, N] i8, or i4 nibbles),
    scales f32 [N, K / group], biases f32 or None) of a GGUF tensor of a `LAYOUTS` type in
    its layout, unpacked `quant.BLOCK_ROWS` rows at a time."""
    kind = t.tensor_type.name
    layout, (n, k) = LAYOUTS[kind], shape_of(t)
    raw = np.asarray(t.data, np.uint8).reshape(n, -1)
    per_block = SUPER if kind.endswith("_K") else 32
    scales, biases = [], []

    def rows():
        for block in quant.row_blocks(raw):
            q, s, b = signed(kind, block.reshape(block.shape[0], k // per_block, -1))
            scales.append(s)
            biases.append(b)
            yield q

    q = quant.arranged(rows(), (n, k), layout.bits)
    return q, np.concatenate(scales), (np.concatenate(biases) if layout.affine else None)
