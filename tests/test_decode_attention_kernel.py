"""The hand-written attention kernels (kernels/decode_attention.c, linked into IREE's executables
by emitter/kernel_calls.py): compiled by the real iree-compile, run by the IREE runtime, bit
for bit against numpy's f32 math of the same order (`decode_attention.reference`), with f32 and
bf16 pools, for the host's best ISA (AVX-512) and for x86-64-v3 code (AVX2); the table's length
a run-time dim (one module, tables of several lengths); a shuffled table, padded entries past
the slot, and a slot inside a block; and the same attention as the graph's `token_attention`
(emitter/attention.py) within f32 rounding. The chunk (prefill) kernel likewise: bit for bit
against `chunk_reference` (each row the one-token math of its slot), chunks at a table's start
and past a cached prefix, and within f32 rounding of the graph's `grouped_attention`."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from emitter.attention import token_attention
from emitter.builder import Builder
from emitter.kv_pages import BLOCK, SPAN_BLOCKS
from emitter.targets import target_flags
from emitter.vision import render_module
from emitter import kernel_calls as calls
from emitter.text import chunk_module
from kernels import decode_attention as da
from kernels.build import KernelError, build_object
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule

KV_HEADS, GROUPS, D, BLOCKS = 2, 2, 128, 12


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (nearest even), as uint16."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def vmfb(target: str, objects, kv_dtype: str, graph: bool = False) -> bytes:
    """The kernel (or, `graph`, the graph's `token_attention` over the same reads) on q, own k
    and v, the pools, a table of run-time length and the slot."""
    b = Builder()
    q = b.argument("q", (1, KV_HEADS * GROUPS, D))
    own_k, own_v = (b.argument(n, (KV_HEADS, 1, D), kv_dtype) for n in ("own_k", "own_v"))  # as the cache holds them
    pools = [b.argument(n, (KV_HEADS, BLOCKS, BLOCK, D), kv_dtype) for n in ("k_pool", "v_pool")]
    table, slot = b.argument("table", (SPAN_BLOCKS,), "i32"), b.argument("slot", (), "i32")
    b.bind(SPAN_BLOCKS.base, b.dimension_size(table, 0))
    if graph:
        from emitter.kv_pages import SPAN, read_blocks
        from emitter.text import position_mask
        f32 = lambda x: b.convert(x, "f32") if kv_dtype != "f32" else x  # noqa: E731
        cached = [f32(read_blocks(b, p, table)) for p in pools]
        out = token_attention(b, q, *cached, position_mask(b, slot, 1, SPAN, own=False), f32(own_k), f32(own_v))
    else:
        obj = build_object(calls.target_isa(tuple(target_flags(target))), objects, da.SOURCE)
        out = calls.token_attention(b, obj, q, *pools, table, slot, own_k, own_v)
    return compile_mlir(render_module(b, [("out", out)], title="decode attention test"), target)


def device_pools(*pools):
    """Pools (and own k, v) as the module takes them: bf16 ones (uint16 here) as ml_dtypes' bfloat16."""
    return [p.view(ml_dtypes.bfloat16) if p.dtype == np.uint16 else p for p in pools]


def inputs(seed: int, kv_dtype: str, span_blocks: int, slot: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, KV_HEADS * GROUPS, D), dtype=np.float32)
    own = [rng.standard_normal((KV_HEADS, 1, D), dtype=np.float32) for _ in range(2)]
    pools = [rng.standard_normal((KV_HEADS, BLOCKS, BLOCK, D), dtype=np.float32) * 2 for _ in range(2)]
    if kv_dtype == "bf16":
        own, pools = [bf16(x) for x in own], [bf16(p) for p in pools]
    table = rng.permutation(np.arange(1, BLOCKS))[:span_blocks].astype(np.int32)
    table[-(-slot // BLOCK):] = 0  # the entries past the slot name block 0, as the runtime's padding
    return q, *own, *pools, table, np.int32(slot)


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("target", ["llvm-cpu", "llvm-cpu-x86-64-v3"])
def test_kernel_is_numpys_math_bit_for_bit(tmp_path, target, kv_dtype):
    """One module, tables of 1, 4 and 8 blocks; slots at 0 (the own key alone), inside a
    block, at a block's end, and short of the table's end."""
    module = LoadedModule(vmfb(target, tmp_path, kv_dtype))
    for seed, (span, slot) in enumerate([(1, 0), (1, 7), (4, 48), (4, 37), (8, 100)]):
        q, k, v, kp, vp, table, s = inputs(seed, kv_dtype, span, slot)
        out = np.asarray(module(q, *device_pools(k, v, kp, vp), table, s))
        ref = da.reference(q[0], k[:, 0], v[:, 0], kp, vp, table, int(s))
        assert np.array_equal(out.reshape(ref.shape), ref), (span, slot, np.abs(out.reshape(ref.shape) - ref).max())


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
def test_kernel_is_the_graphs_attention(tmp_path, kv_dtype):
    """The same attention as the graph form it replaces, to f32 rounding (other sum orders)."""
    kernel = LoadedModule(vmfb("llvm-cpu", tmp_path, kv_dtype))
    graph = LoadedModule(vmfb("llvm-cpu", tmp_path, kv_dtype, graph=True))
    for seed, (span, slot) in enumerate([(2, 20), (8, 121)]):
        q, k, v, kp, vp, table, s = inputs(10 + seed, kv_dtype, span, slot)
        args = (q, *device_pools(k, v, kp, vp), table, s)
        a, b = np.asarray(kernel(*args)).reshape(1, -1), np.asarray(graph(*args))
        assert np.abs(a - b).max() <= 2e-6 * np.abs(b).max(), np.abs(a - b).max()


def test_bounds_are_one_line():
    assert not da.fits(GROUPS, 100, "f32") and not da.fits(16, D, "f32") and da.fits(4, D, "bf16")
    with pytest.raises(KernelError, match="head_dim 100"):
        calls.attention_executable("x.o", KV_HEADS, BLOCKS, GROUPS, 100, "f32")


# -- a chunk's attention (prefill) -------------------------------------------
ROWS = 32  # the chunk: two tiles of 16 rows


def chunk_vmfb(target: str, objects, kv_dtype: str, graph: bool = False) -> bytes:
    """The chunk kernel (or, `graph`, the graph's `grouped_attention` over the same reads, as
    emitter/text.py builds it) on q [ROWS, H, D], the pools holding the chunk's K/V, a table of
    run-time length and the chunk's start."""
    obj = None if graph else build_object(calls.target_isa(tuple(target_flags(target))), objects, da.SOURCE)
    return compile_mlir(chunk_module(obj, ROWS, KV_HEADS, GROUPS, D, BLOCKS, kv_dtype), target)


def chunk_inputs(seed: int, kv_dtype: str, span_blocks: int, start: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((ROWS, KV_HEADS * GROUPS, D), dtype=np.float32)
    pools = [rng.standard_normal((KV_HEADS, BLOCKS, BLOCK, D), dtype=np.float32) * 2 for _ in range(2)]
    if kv_dtype == "bf16":
        pools = [bf16(p) for p in pools]
    table = rng.permutation(np.arange(1, BLOCKS))[:span_blocks].astype(np.int32)
    return q, *pools, table, np.int32(start)


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("target", ["llvm-cpu", "llvm-cpu-x86-64-v3"])
def test_chunk_kernel_is_each_rows_token_math_bit_for_bit(tmp_path, target, kv_dtype):
    """One module: a chunk at the table's start, and chunks after 3 and 6 cached blocks (a
    shuffled table, longer than the chunk's end in the last)."""
    module = LoadedModule(chunk_vmfb(target, tmp_path, kv_dtype))
    for seed, (span, start) in enumerate([(2, 0), (5, 48), (10, 96)]):
        q, kp, vp, table, s = chunk_inputs(seed, kv_dtype, span, start)
        out = np.asarray(module(q, *device_pools(kp, vp), table, s)).reshape(q.shape)
        ref = da.chunk_reference(q, kp, vp, table, int(s))
        assert np.array_equal(out, ref), (span, start, np.abs(out - ref).max())


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
def test_chunk_kernel_is_the_graphs_attention(tmp_path, kv_dtype):
    """The same attention as the graph form it replaces (emitter/text.py's prefill), to f32 rounding."""
    kernel = LoadedModule(chunk_vmfb("llvm-cpu", tmp_path, kv_dtype))
    graph = LoadedModule(chunk_vmfb("llvm-cpu", tmp_path, kv_dtype, graph=True))
    for seed, (span, start) in enumerate([(2, 0), (7, 64)]):
        args = chunk_inputs(20 + seed, kv_dtype, span, start)
        a, b = np.asarray(kernel(*device_pools(*args[:3]), *args[3:])).reshape(ROWS, -1), np.asarray(
            graph(*device_pools(*args[:3]), *args[3:]))
        assert np.abs(a - b).max() <= 2e-6 * np.abs(b).max(), np.abs(a - b).max()


@pytest.mark.parametrize("kv_heads, groups", [(3, 1), (1, 3), (2, 4)])
def test_chunk_kernel_takes_any_group_count(tmp_path, kv_heads, groups):
    """Query heads a KV head other than the 2B's 2 (the kernel takes two a pass: one left over
    at 1 and 3), bit for bit."""
    obj = build_object(calls.target_isa(tuple(target_flags("llvm-cpu"))), tmp_path, da.SOURCE)
    module = LoadedModule(compile_mlir(chunk_module(obj, ROWS, kv_heads, groups, D, BLOCKS, "bf16"), "llvm-cpu"))
    rng = np.random.default_rng(7)
    q = rng.standard_normal((ROWS, kv_heads * groups, D), dtype=np.float32)
    kp, vp = (bf16(rng.standard_normal((kv_heads, BLOCKS, BLOCK, D), dtype=np.float32)) for _ in range(2))
    table = rng.permutation(np.arange(1, BLOCKS))[:5].astype(np.int32)
    out = np.asarray(module(q, *device_pools(kp, vp), table, np.int32(48))).reshape(q.shape)
    assert np.array_equal(out, da.chunk_reference(q, kp, vp, table, 48))


def test_chunk_bounds_are_one_line():
    assert da.chunk_fits(GROUPS, D, "bf16") and not da.chunk_fits(GROUPS, 256, "f32")
    with pytest.raises(KernelError, match="30 rows"):
        calls.chunk_executable("x.o", KV_HEADS, BLOCKS, GROUPS, D, 30, "f32")
