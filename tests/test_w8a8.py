"""--precision w8a8 (emitter/quant.py, emitter/layers.py `integer_project`): int8 weights with a
scale per output channel, activations quantized to int8 per row at run time, the contraction
in i32. The graph's integer projection against numpy's of the same integer math
(`quant.integer_matmul`): the same int8 activations, and f32 results within relL2 1e-5; the
w8a8 session against the f32 one over the dequantized weights (decode is not exact there: the
activations are quantized) and against the unquantized model, beside llama.cpp Q8_0's
distance (tests/test_gguf.py); the decode dispatches contract i8 x i8 -> i32."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import rel_l2
from emitter import quant
from emitter.builder import Builder
from emitter.layers import integer_project, quantized_activations
from emitter.quant import QuantizedWeight
from emitter.vision import render_module
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule
from runtime.bench.decode_profile import decode_module
from test_quant import CFG, answer, models  # noqa: F401 (the fixture)

TOL = 1e-5


def graph(m: int, k: int, n: int, group: int) -> LoadedModule:
    """x [M, K] f32, q [K, N] i8 and scales [N, K / group] in; the integer projection and x's
    int8 values out."""
    b = Builder(activations="i8")
    x = b.argument("x", (m, k))
    weight = QuantizedWeight(b.argument("q", (k, n), "i8"), b.argument("scales", (n, k // group)))
    y = integer_project(b, x, weight)
    xq, _ = quantized_activations(b, x, group, "check")
    return LoadedModule(compile_mlir(render_module(b, [("y", y), ("xq", xq)], title="w8a8 test")))


@pytest.mark.parametrize("m, group", [(1, 256), (4, 256), (1, 64), (3, 32)])
def test_integer_projection_equals_numpys_integer_math(m, group):
    """One group of all K inputs (w8a8's) and smaller groups: the graph's int8 activations
    are numpy's, its result numpy's `integer_matmul` (the i32 sums are exact, so only the f32
    scaling and the sum over groups may round differently). A row of zeros and a row with one
    large value are among the rows."""
    k, n = 256, 96
    rng = np.random.default_rng(m * 1000 + group)
    x = rng.standard_normal((m, k), dtype=np.float32)
    x[-1, 7] = 40.0
    if m > 2:
        x[0] = 0
    q, scales = quant.quantize(rng.standard_normal((n, k), dtype=np.float32), quant.Layout(8, group))
    y, xq = graph(m, k, n, group)(x, np.ascontiguousarray(q.T), scales)
    ref_xq, _ = quant.quantize_activations(x, group)
    assert np.array_equal(xq.transpose(1, 0, 2).reshape(m, k), ref_xq)
    ref = quant.integer_matmul(x, q, scales)
    assert rel_l2(y, ref) <= TOL, rel_l2(y, ref)
    if m > 2:
        assert not y[0].any()
    exact = x @ quant.dequantize(q, scales, group).T
    assert rel_l2(y, exact) > 10 * TOL  # the activations are quantized: this comparison can fail


def test_w8a8_weights_take_a_scale_per_output_channel():
    from emitter.text import text_weights
    specs = {s.name: s for s in text_weights(CFG, "w8a8")}
    down = "model.language_model.layers.0.mlp.down_proj.weight"
    assert specs[down].dtype == "i8" and specs[down].shape == (CFG.intermediate_size, CFG.hidden_size)
    assert specs[quant.scales_name(down)].shape == (CFG.hidden_size, 1)


def test_w8a8_is_part_of_the_identity():
    from emitter.identity import text_artifact_fields
    from emitter.text_shape import TextShape
    fields = {p: text_artifact_fields(CFG, TextShape((32,), 64), 0, p) for p in ("int8", "w8a8")}
    assert fields["w8a8"]["precision"] == "w8a8"
    assert fields["w8a8"]["weight_schema"] != fields["int8"]["weight_schema"]
    assert fields["w8a8"]["graph_sha256"] != fields["int8"]["graph_sha256"]


def test_decode_dispatches_multiply_in_integers(tmp_path):
    """Every projection of the decode step is an i8 x i8 -> i32 contraction; no f32 x i8 one
    and no dispatch that widens the weights to f32."""
    compile_mlir(decode_module(CFG, 64, "w8a8"), extra_flags=[f"--iree-hal-dump-executable-sources-to={tmp_path}"])
    names = [m for f in tmp_path.glob("*decode*.mlir") for m in re.findall(r"export public @(\w+)", f.read_text())]
    integer = [n for n in names if re.search(r"_(matmul|vecmat|matvec)\w*_i8xi8xi32$", n)]
    mixed = [n for n in names if n.endswith("f32xi8xf32") or n.endswith("i8xf32")]
    assert len(integer) >= 4 and not mixed, names


def test_w8a8_session_near_f32_over_its_dequantized_weights(models):  # noqa: F811 (the fixture)
    """The w8a8 session's logits against the f32 session over its dequantized weights (they
    differ by the activations' quantization alone) and against the unquantized model, beside
    int8's distance from the unquantized model."""
    w8a8 = answer(models / "model", models / "cache", "w8a8")
    dequantized = answer(models / "reference-w8a8", models / "cache", "f32")
    unquantized = answer(models / "model", models / "cache", "f32")
    int8 = answer(models / "model", models / "cache", "int8")
    activations = max(rel_l2(a, b) for a, b in zip(w8a8, dequantized))
    away = max(rel_l2(a, b) for a, b in zip(w8a8, unquantized))
    int8_away = max(rel_l2(a, b) for a, b in zip(int8, unquantized))
    print(f"w8a8 against f32 over its dequantized weights: relL2 {activations:.1e}; against the unquantized "
          f"model {away:.1e} (int8: {int8_away:.1e})")
    assert 100 * TOL < activations < away < 0.05, (activations, away)
