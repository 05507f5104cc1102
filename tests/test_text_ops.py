"""The builder ops the language model added, compiled with the real iree-compile and run on
the real IREE runtime against numpy: dynamic_slice, dynamic_update_slice (run-time starts,
clamped as StableHLO defines), mutable state that persists between calls, and the layers
rms_norm, silu, mrope_tables and block-wise grouped_attention."""

from __future__ import annotations

import numpy as np
import iree.runtime as rt
import pytest

from emitter.builder import Builder, BuildError
from emitter.attention import grouped_attention, power_of_two_split, token_attention
from emitter.kv_pages import BLOCK, SPAN, SPAN_BLOCKS, pool_shape, read_blocks
from emitter.layers import mrope_tables, rms_norm, silu
from emitter.module import function as module_function, render
from runtime.artifact.compiler import compile_mlir


def load(functions: list[dict], globals_=()) -> object:
    text = render("m", "", list(globals_), functions)
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, compile_mlir(text)))
    return context.modules.m


def function(b: Builder, name: str, results) -> dict:
    return module_function(b, name, list(results))


def test_dynamic_slice_and_update_clamp_like_stablehlo():
    b = Builder()
    x, u = b.argument("x", (5, 4)), b.argument("u", (2, 4))
    i, j = b.argument("i", (), "i32"), b.argument("j", (), "i32")
    zero = b.constant(0, (), "i32")
    m = load([function(b, "main", [("s", b.dynamic_slice(x, [i, j], (2, 3))),
                                   ("w", b.dynamic_update_slice(x, u, [i, zero]))])])
    rng = np.random.default_rng(0)
    xv, uv = rng.standard_normal((5, 4), dtype=np.float32), rng.standard_normal((2, 4), dtype=np.float32)
    for start in (0, 2, 4, 9, -3):  # out of range: clamped so the window fits
        s, w = (r.to_host() for r in m.main(xv, uv, np.array(start, np.int32), np.array(start, np.int32)))
        r, c = min(max(start, 0), 3), min(max(start, 0), 1)
        expected = xv.copy()
        expected[r:r + 2] = uv
        np.testing.assert_array_equal(s, xv[r:r + 2, c:c + 3])
        np.testing.assert_array_equal(w, expected)


def test_state_persists_between_calls_and_starts_at_zero():
    writer, reader = Builder(), Builder()
    states = [bb.state("cache", (3, 2)) for bb in (writer, reader)]
    row, slot = writer.argument("row", (1, 2)), writer.argument("slot", (), "i32")
    zero = writer.constant(0, (), "i32")
    updated = writer.dynamic_update_slice(writer.load_state(states[0]), row, [slot, zero])
    writer.store_state(updated, states[0])
    assert writer.globals == reader.globals
    m = load([function(writer, "write", [("r", writer.reshape(row, (2,)))]),
              function(reader, "read", [("c", reader.load_state(states[1]))])], writer.globals)
    np.testing.assert_array_equal(m.read().to_host(), np.zeros((3, 2), np.float32))
    m.write(np.array([[1, 2]], np.float32), np.array(2, np.int32))
    m.write(np.array([[3, 4]], np.float32), np.array(0, np.int32))
    np.testing.assert_array_equal(m.read().to_host(), [[3, 4], [0, 0], [1, 2]])
    with pytest.raises(BuildError, match="store_state"):
        writer.store_state(row, states[0])


def test_text_layers_against_numpy():
    rng = np.random.default_rng(1)
    s, heads, kv_heads, d, t1 = 3, 4, 2, 16, 5
    b = Builder()
    x, w = b.argument("x", (s, 8)), b.argument("w", (8,))
    pos = b.argument("pos", (3, s), "i32")
    q = b.argument("q", (s, heads, d))
    k1, v1 = b.argument("k1", (kv_heads, t1, d)), b.argument("v1", (kv_heads, t1, d))
    k2, v2 = b.argument("k2", (kv_heads, 1, d)), b.argument("v2", (kv_heads, 1, d))
    mask = b.argument("mask", (s, t1 + 1))
    inv_freq = (1.0 / 1000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
    cos, sin = mrope_tables(b, pos, inv_freq, (4, 2, 2))
    results = [("rms", rms_norm(b, x, w, 1e-6)), ("silu", silu(b, x)), ("cos", cos), ("sin", sin),
               ("one", grouped_attention(b, q, [b.concatenate([k1, k2], 1)], [b.concatenate([v1, v2], 1)], mask)),
               ("two", grouped_attention(b, q, [k1, k2], [v1, v2], mask))]
    m = load([function(b, "main", results)])
    args = dict(x=rng.standard_normal((s, 8), dtype=np.float32), w=rng.standard_normal(8, dtype=np.float32),
                pos=np.array([[0, 5, 9], [0, 6, 7], [0, 2, 8]], np.int32),
                q=rng.standard_normal((s, heads, d), dtype=np.float32),
                k1=rng.standard_normal((kv_heads, t1, d), dtype=np.float32),
                v1=rng.standard_normal((kv_heads, t1, d), dtype=np.float32),
                k2=rng.standard_normal((kv_heads, 1, d), dtype=np.float32),
                v2=rng.standard_normal((kv_heads, 1, d), dtype=np.float32),
                mask=np.where(rng.random((s, t1 + 1)) < 0.3, -np.inf, 0).astype(np.float32))
    args["mask"][:, -1] = 0  # every row sees at least one key
    out = dict(zip([n for n, _ in results], (r.to_host() for r in m.main(*args.values()))))
    xv = args["x"].astype(np.float64)
    np.testing.assert_allclose(out["rms"], args["w"] * xv / np.sqrt((xv**2).mean(-1, keepdims=True) + 1e-6),
                               rtol=1e-5)
    np.testing.assert_allclose(out["silu"], xv / (1 + np.exp(-xv)), rtol=1e-5)
    rows = [0 if j % 3 == 0 or (j % 3 == 1 and j >= 6) or (j % 3 == 2 and j >= 6) else j % 3 for j in range(d // 2)]
    angles = np.stack([args["pos"][rows[j]] * inv_freq[j] for j in range(d // 2)], 1)
    np.testing.assert_allclose(out["cos"], np.cos(np.concatenate([angles, angles], 1)), atol=1e-6)
    keys, values = np.concatenate([args["k1"], args["k2"]], 1), np.concatenate([args["v1"], args["v2"]], 1)
    expected = np.zeros((s, heads, d))
    for h in range(heads):
        scores = args["q"][:, h] @ keys[h // 2].T / np.sqrt(d) + args["mask"]
        p = np.exp(scores - scores.max(1, keepdims=True))
        expected[:, h] = (p / p.sum(1, keepdims=True)) @ values[h // 2]
    for name in ("one", "two"):
        np.testing.assert_allclose(out[name], expected.reshape(s, heads * d), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_power_of_two_split_scales_exactly(head_dim):
    """x * 2^e rounds nothing, so scaling by 2^e inside a sum and by the rest after it gives
    the scale's own product, bit for bit (numpy f32 over random values)."""
    inside, after = power_of_two_split(head_dim ** -0.5)
    assert inside == 2.0 ** np.floor(np.log2(inside)) and inside * after == np.float32(head_dim ** -0.5)
    x = np.random.default_rng(head_dim).standard_normal(100_000).astype(np.float32) * np.float32(50)
    scaled = (x * np.float32(inside)) * np.float32(after)
    np.testing.assert_array_equal(scaled, x * np.float32(head_dim ** -0.5))


def test_token_attention_over_blocks_against_numpy():
    """One token's attention over keys and values read through a shuffled block table (the
    decode step's form), its own K/V beside them, against numpy in f64; the table's length
    is a run-time dim (`SPAN_BLOCKS`): one compiled function, called with 4 blocks and 2."""
    kv_heads, heads, d, blocks = 2, 4, 128, 9
    b = Builder()
    q = b.argument("q", (1, heads, d))
    pools = [b.argument(n, pool_shape(kv_heads, blocks, d)) for n in ("k", "v")]
    own = [b.argument(n, (kv_heads, 1, d)) for n in ("own_k", "own_v")]
    table, mask = b.argument("table", (SPAN_BLOCKS,), "i32"), b.argument("mask", (1, SPAN))
    b.bind(SPAN_BLOCKS.base, b.dimension_size(table, 0))
    read = [read_blocks(b, pool, table) for pool in pools]
    m = load([function(b, "main", [("context", token_attention(b, q, *read, mask, *own))])])
    rng = np.random.default_rng(3)
    qv, kp, vp = (rng.standard_normal(s, dtype=np.float32) for s in
                  ((1, heads, d), pool_shape(kv_heads, blocks, d), pool_shape(kv_heads, blocks, d)))
    ok, ov = (rng.standard_normal((kv_heads, 1, d), dtype=np.float32) for _ in range(2))
    for tv, seen in ((np.array([7, 2, 5, 1], np.int32), 50), (np.array([3, 8], np.int32), 17)):
        span = tv.size * BLOCK  # slots 0..seen-1 cached, the rest masked
        mv = np.where(np.arange(span) < seen, 0.0, -np.inf).astype(np.float32)[None]
        got = m.main(qv, kp, vp, ok, ov, tv, mv).to_host()
        keys = np.concatenate([kp[:, tv].reshape(kv_heads, span, d)[:, :seen], ok], 1).astype(np.float64)
        values = np.concatenate([vp[:, tv].reshape(kv_heads, span, d)[:, :seen], ov], 1).astype(np.float64)
        qg = qv.reshape(kv_heads, heads // kv_heads, d).astype(np.float64)
        scores = np.einsum("hgd,htd->hgt", qg, keys) * d ** -0.5
        p = np.exp(scores - scores.max(-1, keepdims=True))
        expected = np.einsum("hgt,htd->hgd", p / p.sum(-1, keepdims=True), values).reshape(1, heads * d)
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
