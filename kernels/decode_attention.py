"""One new token's attention over the paged KV cache in one hand-written dispatch (kernels/decode_attention.c),
and a chunk's (prefill) in another, each row the same math as its token's alone.

A decode step's attention in StableHLO is about seven dispatches a layer (the block-table
rows, the scores with the K read fused in, the running max, the own key's score, the
exponentials, the weighted V sum with the V read fused in, the sums and the division),
each with the IREE task executor's overhead. This kernel does one layer's attention for
one token in one dispatch, a workgroup per KV head: it walks the blocks the sequence's
table names, reads each block's K and V rows where they lie in the page pools (f32 or bf16),
and keeps an online softmax (the math and its order: the C file's header; `reference` is
the same in numpy, bit for bit). The table's length is a run-time value: the table is a
`memref<?xi32>` binding whose size the C function reads.

A chunk's attention (`chunk_attention`) is the same math for each of its rows, over the
pools that already hold the chunk's own K/V: row i at slot p attends as a token at slot p
whose own k and v are the pools' row p (`chunk_reference`: `reference` row by row, bit for
bit). A workgroup takes one KV head and one block's worth of rows, in vector lanes, and
walks only the blocks its rows see: the causal half of the scores is never computed, nor
any [heads, S, L] score tensor written (IREE's graph form wrote and re-read them in five
dispatches a layer, about a quarter of a 512-token prefill of the 2B).

They link like kernels/q8_matmul.py's (`build_object`, `object_name`, `object_executable`,
found through `search_flags`), so it is used where the graph links a kernel already: the q8_0
and q4_0 graph forms (emitter/text.py), whose target is an x86-64 CPU of a known ISA.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from emitter.builder import Builder, TensorType, Value
from emitter.kv_pages import BLOCK
from kernels.q8_matmul import KernelError, object_executable

SOURCE = Path(__file__).with_name("decode_attention.c")
ENTRIES = {"f32": "decode_attention_f32", "bf16": "decode_attention_bf16"}  # the pools' dtype -> C function
LANES = 16  # partial sums of a dot product (the C file's LANES): head_dim a multiple of it
MAX_GROUPS, MAX_HEAD_DIM = 8, 256  # the C file's bounds of its per-head state
CHUNK_ENTRIES = {"f32": "chunk_attention_f32", "bf16": "chunk_attention_bf16"}
MAX_CHUNK_HEAD_DIM = 128  # the C file's bound of a chunk tile's head_dim (its stack arrays)
# The exports' workgroup-count region: the workload `%n` workgroups along x.
WORKGROUPS = """%c1 = arith.constant 1 : index
      stream.return %n, %c1, %c1 : index, index, index"""


def scale_bits(head_dim: int) -> int:
    """f32(head_dim^-0.5)'s bits, the index constant the C functions take as their scale."""
    return struct.unpack("<I", struct.pack("<f", head_dim ** -0.5))[0]


def fits(groups: int, head_dim: int, kv_dtype: str) -> bool:
    """Whether the kernel takes this attention (else the graph's `token_attention` does)."""
    return kv_dtype in ENTRIES and groups <= MAX_GROUPS and head_dim <= MAX_HEAD_DIM and head_dim % LANES == 0


def chunk_fits(groups: int, head_dim: int, kv_dtype: str) -> bool:
    """Whether the chunk kernel takes this attention (else the graph's `grouped_attention` does)."""
    return fits(groups, head_dim, kv_dtype) and head_dim <= MAX_CHUNK_HEAD_DIM


def executable_name(kv_heads: int, blocks: int, groups: int, head_dim: int, kv_dtype: str) -> str:
    return f"decode_attention_{kv_heads}x{blocks}x{groups}x{head_dim}_{kv_dtype}"


def executable(obj: str | os.PathLike, kv_heads: int, blocks: int, groups: int, head_dim: int, kv_dtype: str) -> str:
    """A `stream.executable` whose export computes one token's attention output [kv_heads x
    groups x head_dim] f32 from (q [the same] f32, own k and v [kv_heads x head_dim], the
    K and V pools [kv_heads x blocks x 16 x head_dim] of `kv_dtype`, the table [?] i32 and the
    slot [1] i32), then the table's length (an index): one workgroup per KV head."""
    if not fits(groups, head_dim, kv_dtype):
        raise KernelError(f"decode_attention: {groups} query heads a KV head, head_dim {head_dim}, KV {kv_dtype}: "
                          f"expected at most {MAX_GROUPS}, a multiple of {LANES} up to {MAX_HEAD_DIM}, f32 or bf16")
    export, entry = executable_name(kv_heads, blocks, groups, head_dim, kv_dtype), ENTRIES[kv_dtype]
    pool = f"memref<{kv_heads * blocks * BLOCK * head_dim}x{kv_dtype}>"
    heads, own = f"memref<{kv_heads * groups * head_dim}xf32>", f"memref<{kv_heads * head_dim}x{kv_dtype}>"
    bindings = {"q": heads, "k": own, "v": own, "kp": pool, "vp": pool, "table": "memref<?xi32>{%span}",
                "slot": "memref<1xi32>", "out": heads}
    return object_executable(obj, export, entry, bindings,
                             {"blocks": blocks, "groups": groups, "d": head_dim, "scale": scale_bits(head_dim)},
                             WORKGROUPS, ("span",))


def token_attention(b: Builder, obj: str, q: Value, k_pool: Value, v_pool: Value, table: Value, slot: Value,
                    own_k: Value, own_v: Value) -> Value:
    """emitter/attention.py `token_attention`'s result [1, H*D] for q [1, H, D] over the
    slots 0..slot-1 of the blocks `table` [N] names in the pools [KVH, blocks, 16, D] and
    the token's own k, v [KVH, 1, D] (as the pools store them: their dtype), through the
    kernel object `obj`."""
    _, heads, d = q.shape
    kv_heads, blocks, _, _ = k_pool.shape
    groups = heads // kv_heads
    name = executable_name(kv_heads, blocks, groups, d, k_pool.dtype)
    flat = lambda x, hint: b.reshape(x, (int(np.prod(x.shape)),), hint=hint)  # noqa: E731
    operands = [flat(q, "attn_q"), flat(own_k, "attn_own_k"), flat(own_v, "attn_own_v"),
                flat(k_pool, "attn_k_pool"), flat(v_pool, "attn_v_pool"), table,
                b.reshape(slot, (1,), hint="attn_slot")]
    out = b.dispatch(name, executable(obj, kv_heads, blocks, groups, d, k_pool.dtype), name, operands,
                     TensorType((heads * d,), "f32"), workload=kv_heads, hint="decode_attention")
    return b.reshape(out, (1, heads * d), hint="context")


def chunk_executable_name(kv_heads: int, blocks: int, groups: int, head_dim: int, rows: int, kv_dtype: str) -> str:
    return f"chunk_attention_{rows}x{kv_heads}x{blocks}x{groups}x{head_dim}_{kv_dtype}"


def chunk_executable(obj: str | os.PathLike, kv_heads: int, blocks: int, groups: int, head_dim: int, rows: int,
                     kv_dtype: str) -> str:
    """A `stream.executable` whose export computes a chunk's attention output [rows x kv_heads x
    groups x head_dim] f32 from (q [the same] f32, the K and V pools [kv_heads x blocks x 16 x
    head_dim] of `kv_dtype` holding the chunk's own K/V, the table [?] i32 and the chunk's
    start [1] i32), then the table's length (an index): a workgroup per KV head and 16 rows."""
    if not chunk_fits(groups, head_dim, kv_dtype) or rows % BLOCK:
        raise KernelError(f"chunk_attention: {groups} query heads a KV head, head_dim {head_dim}, KV {kv_dtype}, "
                          f"{rows} rows: expected at most {MAX_GROUPS}, a multiple of {LANES} up to "
                          f"{MAX_CHUNK_HEAD_DIM}, f32 or bf16, a multiple of {BLOCK}")
    export = chunk_executable_name(kv_heads, blocks, groups, head_dim, rows, kv_dtype)
    pool = f"memref<{kv_heads * blocks * BLOCK * head_dim}x{kv_dtype}>"
    heads = f"memref<{rows * kv_heads * groups * head_dim}xf32>"
    bindings = {"q": heads, "kp": pool, "vp": pool, "table": "memref<?xi32>{%span}", "start": "memref<1xi32>",
                "out": heads}
    sizes = {"blocks": blocks, "groups": groups, "d": head_dim, "kv_heads": kv_heads, "tiles": rows // BLOCK,
             "scale": scale_bits(head_dim)}
    return object_executable(obj, export, CHUNK_ENTRIES[kv_dtype], bindings, sizes, WORKGROUPS, ("span",))


def chunk_attention(b: Builder, obj: str, q: Value, k_pool: Value, v_pool: Value, table: Value,
                    start: Value) -> Value:
    """The attention [S, H*D] of a chunk's queries q [S, H, D] at slots start.. over the
    sequence's slots up to each row's own, the blocks `table` [N] names in the pools [KVH,
    blocks, 16, D] (which hold the chunk's own K/V already), through the kernel object `obj`."""
    rows, heads, d = q.shape
    kv_heads, blocks, _, _ = k_pool.shape
    groups = heads // kv_heads
    name = chunk_executable_name(kv_heads, blocks, groups, d, rows, k_pool.dtype)
    flat = lambda x, hint: b.reshape(x, (int(np.prod(x.shape)),), hint=hint)  # noqa: E731
    operands = [flat(q, "attn_q"), flat(k_pool, "attn_k_pool"), flat(v_pool, "attn_v_pool"), table,
                b.reshape(start, (1,), hint="attn_start")]
    text = chunk_executable(obj, kv_heads, blocks, groups, d, rows, k_pool.dtype)
    out = b.dispatch(name, text, name, operands, TensorType((rows * heads * d,), "f32"),
                     workload=kv_heads * rows // BLOCK, hint="chunk_attention")
    return b.reshape(out, (rows, heads * d), hint="context")


def chunk_module(obj: str | None, rows: int, kv_heads: int, groups: int, head_dim: int, blocks: int,
                 kv_dtype: str) -> str:
    """A chunk's attention alone as a module's MLIR (`main`: q [rows, H, D], the K and V pools,
    the table of run-time length and the start -> the context): through the kernel object
    `obj`, or with `obj` None the graph form it replaces in the q8_0 and q4_0 graphs
    (`grouped_attention` over the slots the table names, masked past each row's own), for the
    tests and benchmarks that hold one against the other."""
    from emitter.attention import grouped_attention
    from emitter.kv_pages import SPAN, SPAN_BLOCKS, read_span
    from emitter.text import position_mask
    from emitter.vision import render_module

    b = Builder()
    q = b.argument("q", (rows, kv_heads * groups, head_dim))
    pools = [b.argument(n, (kv_heads, blocks, BLOCK, head_dim), kv_dtype) for n in ("k_pool", "v_pool")]
    table, start = b.argument("table", (SPAN_BLOCKS,), "i32"), b.argument("start", (), "i32")
    b.bind(SPAN_BLOCKS.base, b.dimension_size(table, 0))
    if obj is None:
        f32 = lambda x: b.convert(x, "f32") if kv_dtype != "f32" else x  # noqa: E731
        keys, values = (f32(read_span(b, p, table)) for p in pools)
        out = grouped_attention(b, q, [keys], [values], position_mask(b, start, rows, SPAN))
    else:
        out = chunk_attention(b, obj, q, *pools, table, start)
    return render_module(b, [("out", out)], title="chunk attention, " + ("kernel" if obj else "graph form"))


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
    seen = min(max(slot, 0), len(table) * BLOCK)
    out = np.zeros_like(q, dtype=f)
    for h in range(kv_heads):
        for g in range(groups):
            qg = q[h * groups + g].astype(f)
            peak, total, acc = _dot(qg, own_k[h]) * scale, f(1), own_v[h].astype(f).copy()
            for j in range(-(-seen // BLOCK)):
                rows = min(BLOCK, seen - j * BLOCK)
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
        block = min(int(np.uint32(table[slot // BLOCK])), blocks - 1)
        own_k, own_v = k_pool[:, block, slot % BLOCK], v_pool[:, block, slot % BLOCK]
        out[i] = reference(q[i], own_k, own_v, k_pool, v_pool, table, slot)
    return out
