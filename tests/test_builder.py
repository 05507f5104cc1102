"""The StableHLO builder, op by op: each op is built into a tiny module, compiled with the real
iree-compile (llvm-cpu), run on the real IREE runtime and compared with numpy. Also the builder's
own checks (BuildError), float literals, SSA names, locations and determinism."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from emitter.builder import Builder, BuildError, TensorType, Value, float_literal
from emitter.dims import Dim
from emitter.vision import render_module
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule

RNG_SEED = 20240611


# -- helpers -------------------------------------------------------------------------------------
def render(b: Builder, results: dict[str, Value]) -> str:
    """Wrap the builder's arguments/lines and `results` into `module @qwen3vl_vision { func @main }`
    with the emitter's own template."""
    return render_module(b, list(results.items()), title="builder test")


def run(b: Builder, results: dict[str, Value], *inputs: np.ndarray) -> dict[str, np.ndarray]:
    """Compile with iree-compile, run on the IREE runtime; results by name."""
    module = LoadedModule(compile_mlir(render(b, results)))
    outputs = module(*[np.asarray(x, order="C") for x in inputs])  # keeps 0-d arrays 0-d
    assert len(outputs) == len(results)
    for (name, value), out in zip(results.items(), outputs):
        assert out.shape == value.shape, (name, out.shape, value.shape)
    return dict(zip(results, outputs))


def rng():
    return np.random.default_rng(RNG_SEED)


def assert_exact(actual, expected):
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    np.testing.assert_array_equal(actual, expected)


def assert_bits(actual, expected):
    """f32 equality bit for bit (so -0.0, NaN payloads and denormals count)."""
    expected = np.asarray(expected, np.float32)
    assert actual.dtype == np.float32
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


# -- constants and iota --------------------------------------------------------------------------
def test_constants_and_iota():
    b = Builder()
    values = np.array([0.0, -0.0, 1.0, -2.5, 0.1, 1 / 3, 3.4028235e38, -1.17549435e-38, 1e-45,
                       np.inf, -np.inf, 123456.789], np.float32)
    res = {
        "splat_f32": b.constant(1.5, (2, 3)),
        "splat_f32_scalar": b.constant(-0.1, ()),
        "splat_i32": b.constant(-7, (4,), "i32"),
        "splat_i32_scalar": b.constant(2**31 - 1, (), "i32"),
        "array": b.constant_array(values),
        "iota0": b.iota((2, 3), 0),
        "iota1": b.iota((2, 3), 1),
        "iota_f32": b.iota((4,), 0, "f32"),
    }
    out = run(b, res)
    assert_bits(out["splat_f32"], np.full((2, 3), 1.5, np.float32))
    assert_bits(out["splat_f32_scalar"], np.float32(-0.1))
    assert_exact(out["splat_i32"], np.full((4,), -7, np.int32))
    assert_exact(out["splat_i32_scalar"], np.int32(2**31 - 1))
    assert_bits(out["array"], values)
    assert_exact(out["iota0"], np.array([[0, 0, 0], [1, 1, 1]], np.int32))
    assert_exact(out["iota1"], np.array([[0, 1, 2], [0, 1, 2]], np.int32))
    assert_exact(out["iota_f32"], np.arange(4, dtype=np.float32))


def test_constant_array_round_trips_random_bits():
    """Random finite f32 bit patterns (all magnitudes, denormals included) survive the text."""
    bits = rng().integers(0, 2**32, size=256, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    values = np.where(np.isfinite(values), values, np.float32(0.5))
    b = Builder()
    out = run(b, {"array": b.constant_array(values)})
    assert_bits(out["array"], values)


# -- elementwise ---------------------------------------------------------------------------------
def test_binary_f32():
    r = rng()
    x = r.standard_normal((3, 4)).astype(np.float32)
    y = (r.standard_normal((3, 4)) + 3).astype(np.float32)
    b = Builder()
    a, c = b.argument("x", x.shape), b.argument("y", y.shape)
    res = {"add": b.add(a, c), "subtract": b.subtract(a, c), "multiply": b.multiply(a, c),
           "divide": b.divide(a, c), "maximum": b.maximum(a, c)}
    out = run(b, res, x, y)
    assert_bits(out["add"], x + y)
    assert_bits(out["subtract"], x - y)
    assert_bits(out["multiply"], x * y)
    np.testing.assert_allclose(out["divide"], x / y, rtol=1e-6)  # may use reciprocal-multiply
    assert_bits(out["maximum"], np.maximum(x, y))


def test_binary_i32():
    x = np.array([[7, -7, 0, 100], [-3, 5, 2**30, -(2**30)]], np.int32)
    y = np.array([[2, 2, 5, -3], [-3, -2, 3, 7]], np.int32)
    b = Builder()
    a, c = b.argument("x", x.shape, "i32"), b.argument("y", y.shape, "i32")
    res = {"add": b.add(a, c), "subtract": b.subtract(a, c), "multiply": b.multiply(a, c),
           "divide": b.divide(a, c), "maximum": b.maximum(a, c)}
    out = run(b, res, x, y)
    assert_exact(out["add"], x + y)
    assert_exact(out["subtract"], x - y)
    assert_exact(out["multiply"], x * y)  # wraps like int32
    assert_exact(out["divide"], (np.sign(x) * np.sign(y) * (np.abs(x) // np.abs(y))).astype(np.int32))
    assert_exact(out["maximum"], np.maximum(x, y))


def test_unary_f32():
    r = rng()
    x = r.uniform(-4, 4, (5, 7)).astype(np.float32)
    pos = r.uniform(0.01, 100, (5, 7)).astype(np.float32)
    b = Builder()
    a, p = b.argument("x", x.shape), b.argument("pos", pos.shape)
    res = {"negate": b.negate(a), "exponential": b.exponential(a), "tanh": b.tanh(a),
           "rsqrt": b.rsqrt(p), "cosine": b.cosine(a), "sine": b.sine(a), "erf": b.erf(a)}
    out = run(b, res, x, pos)
    x64, pos64 = x.astype(np.float64), pos.astype(np.float64)
    assert_bits(out["negate"], -x)
    np.testing.assert_allclose(out["exponential"], np.exp(x64), rtol=2e-6)
    np.testing.assert_allclose(out["tanh"], np.tanh(x64), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(out["rsqrt"], 1 / np.sqrt(pos64), rtol=2e-6)
    np.testing.assert_allclose(out["cosine"], np.cos(x64), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(out["sine"], np.sin(x64), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(out["erf"], np.vectorize(math.erf)(x64), rtol=2e-6, atol=1e-6)


def test_convert():
    f = np.array([-2.7, -0.5, 0.0, 0.4, 3.9, 1e6 + 0.5, -123456.0], np.float32)
    i = np.array([-5, 0, 3, 2**24, 2**24 + 1, -(2**31), 2**31 - 1], np.int32)
    b = Builder()
    fa, ia = b.argument("f", f.shape), b.argument("i", i.shape, "i32")
    res = {"f_to_i": b.convert(fa, "i32"), "i_to_f": b.convert(ia, "f32"),
           "round_trip": b.convert(b.convert(ia, "f32"), "i32")}
    assert res["f_to_i"].type == TensorType(f.shape, "i32")
    assert res["i_to_f"].type == TensorType(i.shape, "f32")
    out = run(b, res, f, i)
    assert_exact(out["f_to_i"], np.trunc(f).astype(np.int32))  # toward zero
    assert_exact(out["i_to_f"], i.astype(np.float32))  # round to nearest even
    ok = np.abs(i.astype(np.int64)) < 2**24  # exactly representable in f32
    assert_exact(out["round_trip"][ok], i[ok])


# -- compare and select --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_compare_and_select(dtype):
    np_dtype = np.float32 if dtype == "f32" else np.int32
    x = np.array([[-3, 0, 2, 5], [1, -1, 7, -8]], np_dtype)
    y = np.array([[-3, 1, -2, 5], [0, -1, 9, -9]], np_dtype)
    b = Builder()
    a, c = b.argument("x", x.shape, dtype), b.argument("y", y.shape, dtype)
    preds = {d: b.compare(d, a, c) for d in ("EQ", "NE", "GT", "GE", "LT", "LE")}
    for p in preds.values():
        assert p.type == TensorType(x.shape, "i1")
    res = {f"cmp_{d}": b.convert(p, "i32") for d, p in preds.items()}
    res["select_max"] = b.select(preds["GT"], a, c)
    res["select_min"] = b.select(preds["LT"], a, c)
    out = run(b, res, x, y)
    expected = {"EQ": x == y, "NE": x != y, "GT": x > y, "GE": x >= y, "LT": x < y, "LE": x <= y}
    for d, e in expected.items():
        assert_exact(out[f"cmp_{d}"], e.astype(np.int32))
    assert_exact(out["select_max"], np.where(x > y, x, y))
    assert_exact(out["select_min"], np.where(x < y, x, y))


def test_compare_float_nan_and_signed_negative():
    """FLOAT compares are ordered (NaN is unequal to all); SIGNED treats -1 < 0."""
    xf = np.array([np.nan, 1.0, -np.inf], np.float32)
    yf = np.array([np.nan, np.nan, -1.0], np.float32)
    xi = np.array([-1, -(2**31), 5], np.int32)
    yi = np.array([0, 2**31 - 1, 5], np.int32)
    b = Builder()
    af, bf = b.argument("xf", xf.shape), b.argument("yf", yf.shape)
    ai, bi = b.argument("xi", xi.shape, "i32"), b.argument("yi", yi.shape, "i32")
    res = {"f_eq": b.convert(b.compare("EQ", af, bf), "i32"),
           "f_lt": b.convert(b.compare("LT", af, bf), "i32"),
           "i_lt": b.convert(b.compare("LT", ai, bi), "i32")}
    out = run(b, res, xf, yf, xi, yi)
    with np.errstate(invalid="ignore"):
        assert_exact(out["f_eq"], (xf == yf).astype(np.int32))
        assert_exact(out["f_lt"], (xf < yf).astype(np.int32))
    assert_exact(out["i_lt"], (xi < yi).astype(np.int32))


def test_compare_i1():
    b = Builder()
    t, f = b.constant(1, (2,), "i1"), b.constant(0, (2,), "i1")
    out = run(b, {"gt": b.convert(b.compare("GT", t, f), "i32"), "t": b.convert(t, "i32")})
    assert_exact(out["t"], np.ones(2, np.int32))
    assert_exact(out["gt"], np.ones(2, np.int32))  # true > false


# -- shape ops -----------------------------------------------------------------------------------
def test_broadcast_in_dim():
    s = np.array(2.5, np.float32)
    row = np.arange(3, dtype=np.float32)
    col = np.array([[10], [20]], np.float32)
    one = np.array([[1, 2, 3]], np.int32)
    b = Builder()
    sa, ra = b.argument("s", ()), b.argument("row", row.shape)
    ca, oa = b.argument("col", col.shape), b.argument("one", one.shape, "i32")
    res = {
        "scalar": b.broadcast_in_dim(sa, (2, 3), []),
        "row": b.broadcast_in_dim(ra, (2, 3), [1]),
        "row_as_col": b.broadcast_in_dim(ra, (3, 2), [0]),
        "col_expand": b.broadcast_in_dim(ca, (2, 3), [0, 1]),  # size-1 dim expands
        "expand_rank3": b.broadcast_in_dim(oa, (2, 4, 3), [1, 2]),  # new dim + size-1 expansion
        "transposing": b.broadcast_in_dim(ca, (3, 2), [1, 0]),  # dims need not be sorted
    }
    out = run(b, res, s, row, col, one)
    assert_exact(out["scalar"], np.full((2, 3), 2.5, np.float32))
    assert_exact(out["row"], np.broadcast_to(row, (2, 3)))
    assert_exact(out["row_as_col"], np.broadcast_to(row[:, None], (3, 2)))
    assert_exact(out["col_expand"], np.broadcast_to(col, (2, 3)))
    assert_exact(out["expand_rank3"], np.broadcast_to(one[None], (2, 4, 3)))
    assert_exact(out["transposing"], np.broadcast_to(col.T, (3, 2)))


def test_reshape_transpose_slice_concatenate():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    y = np.arange(100, 112, dtype=np.int32).reshape(3, 4)
    b = Builder()
    xa, ya = b.argument("x", x.shape), b.argument("y", y.shape, "i32")
    res = {
        "reshape": b.reshape(xa, (6, 4)),
        "reshape_flat": b.reshape(ya, (12,)),
        "reshape_scalar_like": b.reshape(b.slice(ya, (1, 2), (2, 3)), ()),
        "transpose": b.transpose(xa, (2, 0, 1)),
        "transpose2": b.transpose(ya, (1, 0)),
        "slice": b.slice(xa, (0, 1, 1), (2, 3, 4)),
        "slice_i32": b.slice(ya, (1, 0), (3, 2)),
        "concat0": b.concatenate([xa, xa], 0),
        "concat2": b.concatenate([xa, b.slice(xa, (0, 0, 0), (2, 3, 1)), xa], 2),
        "concat_i32": b.concatenate([ya, ya, ya], 1),
    }
    out = run(b, res, x, y)
    assert_exact(out["reshape"], x.reshape(6, 4))
    assert_exact(out["reshape_flat"], y.reshape(12))
    assert_exact(out["reshape_scalar_like"], y[1, 2])
    assert_exact(out["transpose"], x.transpose(2, 0, 1))
    assert_exact(out["transpose2"], y.T)
    assert_exact(out["slice"], x[0:2, 1:3, 1:4])
    assert_exact(out["slice_i32"], y[1:3, 0:2])
    assert_exact(out["concat0"], np.concatenate([x, x], 0))
    assert_exact(out["concat2"], np.concatenate([x, x[:, :, :1], x], 2))
    assert_exact(out["concat_i32"], np.concatenate([y, y, y], 1))


# -- contractions, reductions, gather ------------------------------------------------------------
def test_dot_general():
    r = rng()
    a = r.standard_normal((3, 4)).astype(np.float32)
    w = r.standard_normal((5, 4)).astype(np.float32)  # [out, in], like a torch Linear weight
    k = r.standard_normal((4, 6)).astype(np.float32)
    qa = r.standard_normal((2, 3, 4)).astype(np.float32)
    qb = r.standard_normal((2, 5, 4)).astype(np.float32)
    va = r.standard_normal((2, 4, 6)).astype(np.float32)
    b = Builder()
    A, W, K = b.argument("a", a.shape), b.argument("w", w.shape), b.argument("k", k.shape)
    QA, QB, VA = b.argument("qa", qa.shape), b.argument("qb", qb.shape), b.argument("va", va.shape)
    res = {
        "linear": b.dot_general(A, W, ([1], [1])),  # a @ w.T
        "matmul": b.dot_general(A, K, ([1], [0])),  # a @ k
        "batched_scores": b.dot_general(QA, QB, ([2], [2]), ([0], [0])),  # q @ k^T per batch
        "batched_matmul": b.dot_general(QA, VA, ([2], [1]), ([0], [0])),
        "batch_not_leading": b.dot_general(QA, QB, ([0], [0]), ([2], [2])),  # batch over last dim
    }
    assert res["linear"].shape == (3, 5)
    assert res["batched_scores"].shape == (2, 3, 5)
    assert res["batch_not_leading"].shape == (4, 3, 5)
    out = run(b, res, a, w, k, qa, qb, va)
    a64 = {n: v.astype(np.float64) for n, v in dict(a=a, w=w, k=k, qa=qa, qb=qb, va=va).items()}
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["linear"], a64["a"] @ a64["w"].T, **tol)
    np.testing.assert_allclose(out["matmul"], a64["a"] @ a64["k"], **tol)
    np.testing.assert_allclose(out["batched_scores"], np.einsum("bik,bjk->bij", a64["qa"], a64["qb"]), **tol)
    np.testing.assert_allclose(out["batched_matmul"], np.einsum("bik,bkj->bij", a64["qa"], a64["va"]), **tol)
    np.testing.assert_allclose(out["batch_not_leading"], np.einsum("bik,bjk->kij", a64["qa"], a64["qb"]), **tol)


def test_reduce():
    r = rng()
    x = r.standard_normal((3, 4, 5)).astype(np.float32)
    xi = r.integers(-1000, 1000, (3, 4)).astype(np.int32)
    b = Builder()
    X, XI = b.argument("x", x.shape), b.argument("xi", xi.shape, "i32")
    res = {
        "sum_last": b.reduce(X, [2]),
        "sum_01": b.reduce(X, [0, 1], "add"),
        "sum_all": b.reduce(X, [0, 1, 2]),
        "max_last": b.reduce(X, [2], "maximum"),
        "max_02": b.reduce(X, [0, 2], "maximum"),
        "sum_i32": b.reduce(XI, [1]),
    }
    assert res["sum_all"].shape == ()
    out = run(b, res, x, xi)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(out["sum_last"], x64.sum(2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["sum_01"], x64.sum((0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["sum_all"], x64.sum(), rtol=1e-5, atol=1e-5)
    assert_exact(out["max_last"], x.max(2))
    assert_exact(out["max_02"], x.max((0, 2)))
    assert_exact(out["sum_i32"], xi.sum(1, dtype=np.int32))


def test_reduce_maximum_all_neg_inf():
    """The max init is -inf, so a row of -inf reduces to -inf (not to some finite sentinel)."""
    x = np.array([[-np.inf, -np.inf], [-np.inf, 3.0]], np.float32)
    b = Builder()
    X = b.argument("x", x.shape)
    out = run(b, {"m": b.reduce(X, [1], "maximum")}, x)
    assert_bits(out["m"], np.array([-np.inf, 3.0], np.float32))


def test_reduce_maximum_i32():
    xi = np.array([[-5, -9, -2], [7, 3, 8]], np.int32)
    b = Builder()
    XI = b.argument("xi", xi.shape, "i32")
    out = run(b, {"m": b.reduce(XI, [1], "maximum")}, xi)
    assert_exact(out["m"], xi.max(1))


def test_gather_rows():
    table = np.arange(15, dtype=np.float32).reshape(5, 3) * 1.5
    idx = np.array([4, 0, 0, 2, 3, 1, 4], np.int32)
    itable = np.arange(8, dtype=np.int32).reshape(4, 2) - 3
    iidx = np.array([3, 3], np.int32)
    b = Builder()
    T, I = b.argument("table", table.shape), b.argument("idx", idx.shape, "i32")
    IT, II = b.argument("itable", itable.shape, "i32"), b.argument("iidx", iidx.shape, "i32")
    res = {"rows": b.gather_rows(T, I), "irows": b.gather_rows(IT, II, hint="emb")}
    assert res["rows"].type == TensorType((7, 3), "f32")
    out = run(b, res, table, idx, itable, iidx)
    assert_exact(out["rows"], table[idx])
    assert_exact(out["irows"], itable[iidx])


def test_take_rows():
    """IREE's gather of whole rows, for indices of any shape (the KV cache's block reads)."""
    table = np.arange(40, dtype=np.float32).reshape(8, 5) * -0.5
    idx = np.array([[7, 0, 3], [3, 3, 1]], np.int32)
    b = Builder()
    T, I = b.argument("table", table.shape), b.argument("idx", idx.shape, "i32")
    res = {"rows": b.take_rows(T, I)}
    assert res["rows"].type == TensorType((2, 3, 5), "f32")
    assert_exact(run(b, res, table, idx)["rows"], table[idx])


def test_broadcast_to_and_scalar():
    x = np.array([[1.0, -2.0, 3.0]], np.float32)
    b = Builder()
    X = b.argument("x", x.shape)
    n = len(b.lines)
    assert b.broadcast_to(X, (1, 3), [0, 1]) is X  # same shape: no op
    assert len(b.lines) == n
    big = b.broadcast_to(X, (4, 3), [0, 1])
    half = b.scalar(0.5, big)
    assert half.type == big.type
    ione = b.scalar(3, b.iota((2, 2), 1))
    assert ione.type == TensorType((2, 2), "i32")
    res = {"scaled": b.multiply(big, half), "ione": ione}
    out = run(b, res, x)
    assert_bits(out["scaled"], np.broadcast_to(x * np.float32(0.5), (4, 3)))
    assert_exact(out["ione"], np.full((2, 2), 3, np.int32))


def test_run_time_dims():
    """A shape with a run-time dim (emitter/dims.py) takes the ops' dynamic forms: one
    compiled function, called at two sizes, against numpy."""
    n = Dim("n")
    b = Builder()
    x = b.argument("x", (n, 3))
    b.bind("n", b.dimension_size(x, 0))
    flat = b.reshape(x, (n * 3,))  # dynamic_reshape
    column = b.slice(x, (0, 1), (n, 2))  # real_dynamic_slice
    res = {"rows": b.iota((n, 3), 0),  # dynamic_iota
           "flat": flat,
           "back": b.add(b.reshape(flat, (n, 3)), b.scalar(2.0, x)),  # a constant of run-time shape
           "wide": b.broadcast_in_dim(column, (2, n, 1), [1, 2]),  # dynamic_broadcast_in_dim
           "size": b.size(n * 2)}
    assert res["flat"].type == TensorType((n * 3,), "f32") and str(res["wide"].type) == "tensor<2x?x1xf32>"
    module = LoadedModule(compile_mlir(render(b, res)))
    for size in (1, 5):
        xv = rng().standard_normal((size, 3), dtype=np.float32)
        rows, flat, back, wide, twice = module(xv)
        assert_exact(rows, np.repeat(np.arange(size, dtype=np.int32)[:, None], 3, 1))
        assert_bits(flat, xv.reshape(-1))
        assert_bits(back, xv + np.float32(2.0))
        assert_bits(wide, np.broadcast_to(xv[None, :, 1:2], (2, size, 1)))
        assert int(twice) == 2 * size


@pytest.mark.parametrize("case", ["slice_part", "reshape_count", "concat_along", "unbound", "dslice_size"])
def test_run_time_dim_errors(case):
    n = Dim("n")
    b = Builder()
    x = b.argument("x", (n, 3))
    ops = {"slice_part": lambda: b.slice(x, (1, 0), (n, 3)),
           "reshape_count": lambda: b.reshape(x, (n * 2,)),
           "concat_along": lambda: b.concatenate([x, x], 0),
           "unbound": lambda: b.iota((n, 3), 0),
           "dslice_size": lambda: b.dynamic_slice(x, [b.constant(0, (), "i32")] * 2, (n, 3))}
    with pytest.raises(BuildError):
        ops[case]()


# -- type inference errors -----------------------------------------------------------------------
def _error_cases():
    def args(b):
        return (b.argument("x", (2, 3)), b.argument("y", (3, 2)), b.argument("i", (2, 3), "i32"),
                b.argument("m", (2, 3, 4)))

    return {
        "add_shapes": lambda b, x, y, i, m: b.add(x, y),
        "add_dtypes": lambda b, x, y, i, m: b.add(x, i),
        "multiply_shapes": lambda b, x, y, i, m: b.multiply(x, m),
        "compare_dtypes": lambda b, x, y, i, m: b.compare("EQ", x, i),
        "bad_reshape": lambda b, x, y, i, m: b.reshape(x, (4, 2)),
        "bad_perm_dup": lambda b, x, y, i, m: b.transpose(m, (0, 0, 1)),
        "bad_perm_rank": lambda b, x, y, i, m: b.transpose(m, (1, 0)),
        "bad_perm_range": lambda b, x, y, i, m: b.transpose(x, (1, 2)),
        "slice_past_end": lambda b, x, y, i, m: b.slice(x, (0, 0), (2, 4)),
        "slice_negative": lambda b, x, y, i, m: b.slice(x, (-1, 0), (2, 3)),
        "slice_rank": lambda b, x, y, i, m: b.slice(x, (0,), (2,)),
        "slice_empty": lambda b, x, y, i, m: b.slice(x, (1, 0), (1, 3)),
        "dot_contract": lambda b, x, y, i, m: b.dot_general(x, y, ([1], [1])),
        "dot_batch": lambda b, x, y, i, m: b.dot_general(m, y, ([2], [0]), ([0], [0])),
        "dot_dtypes": lambda b, x, y, i, m: b.dot_general(x, i, ([1], [1])),
        "select_f32_pred": lambda b, x, y, i, m: b.select(x, x, x),
        "select_i32_pred": lambda b, x, y, i, m: b.select(i, x, x),
        "select_pred_shape": lambda b, x, y, i, m: b.select(b.compare("LT", y, y), x, x),
        "select_branches": lambda b, x, y, i, m: b.select(b.compare("LT", x, x), x, i),
        "bcast_dims_rank": lambda b, x, y, i, m: b.broadcast_in_dim(x, (2, 3, 4), [0]),
        "bcast_size": lambda b, x, y, i, m: b.broadcast_in_dim(x, (4, 3), [0, 1]),
        "concat_shape": lambda b, x, y, i, m: b.concatenate([x, y], 0),
        "concat_dtype": lambda b, x, y, i, m: b.concatenate([x, i], 0),
        "gather_f32_idx": lambda b, x, y, i, m: b.gather_rows(x, b.argument("fi", (4,))),
        "gather_rank": lambda b, x, y, i, m: b.gather_rows(m, b.argument("ii", (4,), "i32")),
        "unknown_dtype": lambda b, x, y, i, m: b.argument("z", (2,), "f8"),
        "convert_unknown_dtype": lambda b, x, y, i, m: b.convert(x, "f8"),
        "concat_rank": lambda b, x, y, i, m: b.concatenate([x, m], 0),
        "concat_dim_range": lambda b, x, y, i, m: b.concatenate([x, x], 2),
        "reduce_dims_range": lambda b, x, y, i, m: b.reduce(x, [7]),
        "reduce_dims_repeat": lambda b, x, y, i, m: b.reduce(x, [1, 1]),
        "iota_dim": lambda b, x, y, i, m: b.iota((2, 3), 2),
        "bcast_dims_repeat": lambda b, x, y, i, m: b.broadcast_in_dim(x, (2, 3, 3), [1, 1]),
        "bcast_dims_range": lambda b, x, y, i, m: b.broadcast_in_dim(x, (2, 3), [0, 5]),
        "dot_dims_range": lambda b, x, y, i, m: b.dot_general(x, y, ([4], [0])),
        "dot_batch_is_contract": lambda b, x, y, i, m: b.dot_general(m, m, ([0], [0]), ([0], [0])),
        "compare_direction": lambda b, x, y, i, m: b.compare("BIGGER", x, x),
        "stage_quote": lambda b, x, y, i, m: b.stage('a"b').__enter__(),
    }, args


_CASES, _ARGS = _error_cases()


@pytest.mark.parametrize("case", sorted(_CASES))
def test_build_errors(case):
    b = Builder()
    operands = _ARGS(b)
    n = len(b.lines)
    with pytest.raises(BuildError):
        _CASES[case](b, *operands)
    # A rejected op appends nothing after its own checks (helpers like compare may precede it).
    assert all("loc(" in line for line in b.lines[n:])


def test_build_error_is_value_error():
    assert issubclass(BuildError, ValueError)


# -- float literals ------------------------------------------------------------------------------
_SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.1, 1 / 3, 2.5, 1e-45, -1e-45, 1.17549435e-38, 1.1754942e-38,
            3.4028235e38, -3.4028235e38, 1e38, 16777217.0, 0.30000001, 123456789.0, 6.02e23,
            float("inf"), float("-inf"), float("nan"), -1e-300]


def _parse_literal(text: str) -> np.float32:
    if text.startswith("0x"):
        return np.array([int(text, 16)], np.uint32).view(np.float32)[0]
    return np.float32(float(text))


def _check_literal(x):
    text = float_literal(x)
    with np.errstate(over="ignore"):
        x32 = np.float32(x)
    assert "." in text or text.startswith("0x"), text
    assert re.fullmatch(r"-?\d\.\d+e[+-]\d+|0x[0-9A-F]{8}", text), text
    back = _parse_literal(text)
    if np.isnan(x32):
        assert np.isnan(back) and text.startswith("0x"), text
    else:
        assert back.view(np.uint32) == x32.view(np.uint32), (x, text)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("x", _SPECIAL, ids=repr)
def test_float_literal_round_trips(x):
    _check_literal(x)


def test_float_literal_round_trips_random_bits():
    bits = np.random.default_rng(7).integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    for x in bits.view(np.float32):
        _check_literal(x)
    for x in np.random.default_rng(8).standard_normal(2000):  # python floats: rounded to f32 first
        _check_literal(float(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float_literal_infinities_are_hex():
    assert float_literal(float("-inf")) == "0xFF800000"
    assert float_literal(float("inf")) == "0x7F800000"
    with pytest.raises(BuildError, match="does not fit in f32"):
        float_literal(1e300)
    assert float_literal(1.0) == "1.0e+00"


def test_bf16_constants_are_bf16_literals_that_keep_their_value():
    """A bf16 splat prints as a float (an integer literal does not parse for bf16) and its
    non-finite values as 16-bit hex; a value bf16 cannot hold exactly is refused."""
    assert float_literal(float("-inf"), "bf16") == "0xFF80" and float_literal(0.0, "bf16") == "0.0e+00"
    with pytest.raises(BuildError, match="not exact in bf16"):
        float_literal(0.1, "bf16")
    b = Builder()
    x = b.argument("x", (3,))
    values = [b.convert(b.constant(v, (3,), "bf16"), "f32") for v in (0.0, -2.5, float("-inf"))]
    out = run(b, {"zero": b.add(x, values[0]), "neg": b.add(x, values[1]), "inf": b.add(x, values[2])},
              np.ones(3, np.float32))
    assert list(out["zero"]) == [1.0] * 3 and list(out["neg"]) == [-1.5] * 3 and list(out["inf"]) == [-np.inf] * 3


# -- names, locations, determinism ---------------------------------------------------------------
_SSA = re.compile(r"[A-Za-z_][A-Za-z0-9_.$-]*")


def _small_graph(b: Builder) -> dict[str, Value]:
    x = b.argument("pixel values", (4, 3))  # a space: sanitized
    x2 = b.argument("pixel values", (4, 3))  # same hint: a fresh name
    d = b.argument("3d", (4,), "i32")  # leading digit: prefixed
    with b.stage("patch_embed"):
        h = b.add(x, x2, hint="sum/odd name")
        h = b.multiply(h, b.scalar(2.0, h))
        h = b.multiply(h, b.scalar(2.0, h))  # same hints again
    with b.stage("blocks.0.attn"):
        s = b.dot_general(h, h, ([1], [1]))
        with b.stage("blocks.0.attn.softmax"):
            m = b.reduce(s, [1], "maximum")
            e = b.exponential(b.subtract(s, b.broadcast_in_dim(m, (4, 4), [0])))
        g = b.gather_rows(e, d)
    with b.stage("merger"):
        out = b.erf(b.concatenate([g, h], 1))
    return {"out": out, "scores": s}


def test_ssa_names_unique_and_sanitized():
    b = Builder()
    _small_graph(b)
    names = [v.name for v, _ in b.arguments]
    for line in b.lines:
        m = re.match(r"%(\S+) = ", line)
        assert m, line
        names.append(m.group(1))
    assert len(names) == len(set(names))
    for name in names:
        assert _SSA.fullmatch(name), name
    # every %use in the body refers to a defined name
    defined = set(names)
    for line in b.lines:
        for used in re.findall(r"%([A-Za-z0-9_.$-]+)", line):
            assert used in defined, (used, line)
    assert [v.name for v, _ in b.arguments] == ["pixel_values", "pixel_values.1", "v3d"]
    assert [abi for _, abi in b.arguments] == ["pixel values", "pixel values", "3d"]


def test_names_are_prefixed_by_stage():
    b = Builder()
    x = b.argument("x", (2,))
    with b.stage("blocks.3.attn"):
        y = b.negate(x, hint="scores")
    assert y.name == "blocks.3.attn.scores"
    z = b.negate(x)
    assert z.name == "input.negate"  # default stage


def test_every_line_has_its_stage_loc():
    b = Builder()
    _small_graph(b)
    expected = {"patch_embed": 0, "blocks.0.attn": 0, "blocks.0.attn.softmax": 0, "merger": 0}
    for line in b.lines:
        m = re.fullmatch(r'%(\S+) = .* loc\("([^"]*)"\)', line)
        assert m, line
        name, stage = m.groups()
        assert stage in expected, line
        assert name.startswith(stage + "."), line  # SSA name carries the same stage
        assert line.count("loc(") == 1, line
        expected[stage] += 1
    assert all(expected.values()), expected
    # nested stages restore the outer one
    assert any(line.endswith('loc("blocks.0.attn")') and "gather" in line for line in b.lines)


def test_stage_restored_after_exception():
    b = Builder()
    x = b.argument("x", (2,))
    with pytest.raises(BuildError):
        with b.stage("broken"):
            b.reshape(x, (3,))
    assert b.negate(x).name.startswith("input.")


def test_emitting_twice_is_identical_and_compiles():
    texts = []
    for _ in range(2):
        b = Builder()
        texts.append(render(b, _small_graph(b)))
    assert texts[0] == texts[1]
    assert texts[0].count("module @qwen3vl_vision") == 1
    # the mixed graph is valid StableHLO that IREE compiles and runs
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    d = np.array([3, 0, 1, 1], np.int32)
    module = LoadedModule(compile_mlir(texts[0]))
    out, scores = module(x, x, d)
    h = (x + x) * 4
    s = h.astype(np.float64) @ h.T
    e = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(scores, s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, np.vectorize(math.erf)(np.concatenate([e[d], h], 1)), rtol=1e-5, atol=1e-5)


def test_gather_points_takes_points_of_the_named_axes():
    """x[t, :, i, :] for each (t, i) row of the indices, against numpy's fancy indexing
    (the Q8_0 table's rows out of its tiles); indices of the wrong width are one line."""
    b = Builder()
    x = b.argument("x", (3, 4, 5, 2))
    points = b.argument("points", (2, 2), "i32")
    module = LoadedModule(compile_mlir(render_module(b, [("y", b.gather_points(x, [0, 2], points))], title="t")))
    xs = np.arange(3 * 4 * 5 * 2, dtype=np.float32).reshape(3, 4, 5, 2)
    at = np.array([[2, 4], [0, 1]], np.int32)
    assert np.array_equal(module(xs, at)[0], xs[at[:, 0], :, at[:, 1], :])
    with pytest.raises(BuildError, match=r"gather_points: needs \[N, 2\] i32 indices"):
        b.gather_points(x, [0, 2], b.argument("bad", (2, 3), "i32"))
