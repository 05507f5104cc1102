"""--precision int8 and int4 (emitter/quant.py): the language model's matmul weights and
embedding table in i8 with an f32 scale per 64 inputs, or in i4 with a searched f32 scale per
64. The quantized session against the f32 session
over the dequantized weights (the same numbers, so relL2 <= 1e-5), and against the
unquantized model (a distance quantization must show); the decode dispatches read i8; the
resident weights are the i8 ones."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import rel_l2
from helpers import chunked_logits, q4_0_blocks
from emitter import quant
from emitter.config import ConfigError
from emitter.precision import PRECISIONS, precision as precision_of
from emitter.text import text_weights, weight_layouts
from emitter.text_config import TEXT_PRESETS
from runtime.artifact.compiler import compile_mlir
from runtime.bench.decode_profile import decode_module
from runtime.checkpoints.synthetic import write_safetensors
from runtime.checkpoints.synthetic_text import write_text_model
from runtime.checkpoints.text import load_text_weights

# The tiny preset at widths the group of 64 divides, embeddings tied (one quantized table
# for the input rows and lm_head).
CFG = dataclasses.replace(TEXT_PRESETS["tiny"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          tie_word_embeddings=True)
TOL = 1e-5


def test_quantize_is_symmetric_groupwise():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 256), dtype=np.float32)
    w[2, 64:128] = 0  # an all-zero group
    q, scales = quant.quantize(w, precision_of("int8").layout)
    assert q.dtype == np.int8 and scales.shape == (6, 4) and scales.dtype == np.float32
    groups = w.reshape(6, 4, 64)
    assert np.array_equal(scales, np.abs(groups).max(axis=2) / np.float32(127))
    assert np.abs(q).max() == 127 and scales[2, 1] == 0 and not q[2, 64:128].any()
    error = np.abs(quant.dequantize(q, scales) - w).reshape(6, 4, 64)
    assert (error <= scales[:, :, None] / 2 * (1 + 1e-6)).all()  # round to nearest
    q4, scales4 = quant.quantize(w, quant.Layout(4))
    assert np.array_equal(scales4, np.abs(groups).max(axis=2) / np.float32(7)) and np.abs(q4).max() == 7
    packed, _ = quant.stored(w, quant.Layout(4))  # transposed [K, N], element 2i in byte i's low nibble
    low, high = (packed & 15).astype(np.int8), (packed >> 4).astype(np.int8)
    unpacked = np.stack([low, high], 1).reshape(-1)
    assert np.array_equal(np.where(unpacked > 7, unpacked - 16, unpacked), q4.T.reshape(-1))


def searched_group(w: np.ndarray) -> float:
    """One group's int4 step, as `quant.searched` describes it, one candidate at a time in
    float64 arithmetic rounded where the layout rounds (a reference of the same math)."""
    import ml_dtypes
    top = w[np.argmax(np.abs(w))]
    best = None
    for c in quant.CANDIDATES:
        q = np.clip(np.rint(w / (top * np.float32(c / -8))), -8, 7) if top else np.zeros_like(w)
        norm = np.float32(q @ q)
        step = np.float32((np.float32(q @ w) / (norm if norm else np.float32(1))).astype(ml_dtypes.bfloat16))
        values = np.clip(np.rint(w / step), -8, 7) if step else np.zeros_like(w)
        error = float(np.sum((values.astype(np.float64) * step - w) ** 2))
        if best is None or error < best[0]:
            best = (error, step)
    return best[1]


def test_searched_bf16_scales_per_32_use_16_levels():
    """A searched 4-bit layout at Q4_0's bits (groups of 32, bf16 scales): all of -8..7, each
    group's bf16 scale the one `searched_group` finds;
    on N(0, 1) weights closer than Q4_0's rule (llama.cpp's quantize_row_q4_0_ref: d = the
    signed max / -8 in f16, q = round(w / d) + 8 clamped to 0..15)."""
    import ml_dtypes
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256), dtype=np.float32)
    w[3, 32:64] = 0  # an all-zero group
    layout = quant.Layout(4, 32, scales="bf16", searched=True)
    q, scales = quant.quantize(w, layout)
    assert layout.group == 32 and scales.dtype == ml_dtypes.bfloat16 and scales.shape == (64, 8)
    assert q.min() == -8 and q.max() == 7 and scales[3, 1] == 0 and not q[3, 32:64].any()
    groups = w.reshape(64, 8, 32)
    expected = [[searched_group(g) for g in row] for row in groups[:8]]
    assert np.allclose(scales[:8].astype(np.float32), expected, rtol=0, atol=0), (scales[:8], expected)
    wide = scales.astype(np.float32)[:, :, None]
    assert np.array_equal(q.reshape(64, 8, 32), np.clip(np.rint(groups / np.where(wide == 0, 1, wide)), -8, 7))
    q4_0 = quant.dequantize(*q4_0_blocks(w), 32)
    ours = quant.dequantize(q, scales, layout.group)
    print(f"relative error: ours {rel_l2(ours, w):.4f}, Q4_0's rule {rel_l2(q4_0.reshape(w.shape), w):.4f}")
    assert rel_l2(ours, w) < 0.97 * rel_l2(q4_0.reshape(w.shape), w)


def test_a_width_the_group_does_not_divide_is_one_line():
    with pytest.raises(ConfigError, match=r"embed_tokens.weight: shape \[384, 48\]: expected \[N, K\] with K a "
                                          r"multiple of the quantization group 64"):
        text_weights(TEXT_PRESETS["tiny"], "int8")


@pytest.mark.parametrize("tied", [True, False])
def test_int4_keeps_the_table_lm_head_reads_in_int8(tied):
    """Under int4 the projections are i4 with f32 scales per 64, and the table lm_head reads
    (the embedding table when tied, else lm_head; an untied embedding table stays i4) is
    int8's layout, as llama.cpp's Q4_0 keeps it in Q6_K."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    dtypes = {s.name: s.dtype for s in text_weights(cfg, "int4")}
    head = "lm_head.weight" if not tied else next(n for n in dtypes if n.endswith("embed_tokens.weight"))
    assert dtypes[head] == "i8" and dtypes[quant.scales_name(head)] == "f32"
    quantized = [n for n, d in dtypes.items() if d in ("i8", "i4")]
    assert all(dtypes[n] == "i4" and dtypes[quant.scales_name(n)] == "f32" for n in quantized if n != head)
    assert len(quantized) == 7 * cfg.num_hidden_layers + 1 + (not tied)


def test_int8_is_part_of_the_identity():
    from emitter.identity import text_artifact_fields
    from emitter.text_shape import TextShape
    shape = TextShape((32,), 64)
    fields = {p: text_artifact_fields(CFG, shape, 0, p) for p in ("f32", "int8")}
    assert fields["int8"]["precision"] == "int8"
    assert fields["int8"]["weight_schema"] != fields["f32"]["weight_schema"]
    assert fields["int8"]["graph_sha256"] != fields["f32"]["graph_sha256"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The checkpoint, and its reference: the same folder with every quantized weight
    replaced by its dequantization (`quant.dequantize`), in f32."""
    root = tmp_path_factory.mktemp("quant")
    write_text_model(root / "model", CFG, seed=5)
    for precision in [p for p, row in PRECISIONS.items() if row.layout]:
        weights = load_text_weights(root / "model", CFG)
        layouts = weight_layouts(CFG, precision, list(weights))
        for name, layout in layouts.items():
            weights[name] = quant.dequantize(*quant.quantize(weights[name], layout), layout.group)
        folder = root / f"reference-{precision}"
        folder.mkdir()
        shutil.copy(root / "model" / "config.json", folder)
        write_safetensors(folder / "model.safetensors",
                          {k: ("F32", w.shape, np.ascontiguousarray(w).tobytes()) for k, w in weights.items()})
    return root


def answer(model, cache, precision: str, steps: int = 4) -> np.ndarray:
    """`helpers.chunked_logits` over this file's vocabulary."""
    return chunked_logits(model, cache, precision, CFG.vocab_size, steps)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_equals_f32_over_the_dequantized_weights(models, precision):
    quantized = answer(models / "model", models / "cache", precision)
    reference = answer(models / f"reference-{precision}", models / "cache", "f32")
    unquantized = answer(models / "model", models / "cache", "f32")
    errors = [rel_l2(a, b) for a, b in zip(quantized, reference)]
    away = [rel_l2(a, b) for a, b in zip(quantized, unquantized)]
    print(f"{precision} against f32 over its dequantized weights: relL2 {max(errors):.1e}; against the "
          f"unquantized model: {min(away):.1e}-{max(away):.1e}")
    assert max(errors) <= TOL, errors
    assert min(away) > 100 * TOL, away  # it is quantized: the comparison above can fail


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_decode_dispatches_read_the_bits(tmp_path, precision):
    """The decode dispatches contract the quantized weights in their bits (f32 x i8 -> f32,
    f32 x i4 -> f32); none widens one to an f32 copy (an i8 -> f32 dispatch that is no
    contraction; the embedding row's gather is i32 x i8)."""
    bits = quant.STORAGE_DTYPE[precision_of(precision).bits]
    compile_mlir(decode_module(CFG, 64, precision),
                 extra_flags=[f"--iree-hal-dump-executable-sources-to={tmp_path}"])
    names = [m for f in tmp_path.glob("*decode*.mlir") for m in re.findall(r"export public @(\w+)", f.read_text())]
    contractions = [n for n in names if re.search(rf"_(matmul|vecmat|matvec)\w*_f32x{bits}xf32$", n)]
    widening = [n for n in names if n.endswith(f"{bits}xf32") and n not in contractions]
    assert contractions and not widening, names


# Widths at which projections have many groups of inputs (1024 and 4096 wide).
WIDE = dataclasses.replace(CFG, vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=128, mrope_section=(24, 20, 20))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_batched_decode_vectorizes_along_the_outputs(tmp_path, precision):
    """At 4 lanes (the server's batched step) every split-K dot keeps its vectors along N,
    the outputs: IREE's configured dispatches give each f32 x i8 (i4) batch_matmul a vector
    tile wider than one along N. (Scaled as partial * scale, data tiling took the scaling
    for a contraction and turned the dots to [1, 16, 1, 0], 16 along the rows and scalar
    along N: 25x slower; docs/history/performance-notebook.md, "Quantized decode at several lanes".)"""
    bits = quant.STORAGE_DTYPE[precision_of(precision).bits]
    compile_mlir(decode_module(WIDE, 64, precision, lanes=4),
                 extra_flags=[f"--iree-hal-dump-executable-files-to={tmp_path}"])
    text = "\n".join(f.read_text() for f in tmp_path.glob("configured_*decode*.mlir"))
    tiles = re.findall(rf"linalg.batch_matmul {{lowering_config = #iree_cpu.lowering_config<[^>]*"
                       rf"vector_common_parallel = \[(\d+), (\d+), (\d+), 0\][^>]*>}} ins\([^)]*xf32>, "
                       rf"tensor<[^)]*x{bits}>\)", text)
    assert tiles and all(int(n) > 1 for _, _, n in tiles), tiles


RESIDENT_INT8 = """
import sys, numpy as np
from runtime.text import TextSession
def anon():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) * 1024
start = anon()
session = TextSession(sys.argv[1], buckets=(64,), context=80, cache_dir=sys.argv[2], precision=sys.argv[3])
session.module
loaded = anon() - start
logits = session.prefill(np.arange(40) + 5, np.broadcast_to(np.arange(40), (3, 40)))
session.decode(int(np.argmax(logits)), 40)
print(loaded, anon() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("precision", ["int8", "w8a8"])
def test_int8_weights_resident_in_their_bits(tmp_path, precision):
    """Once loaded, the int8 (w8a8) session holds its weights in i8: w8a8's anonymous memory
    under 2.5x the bytes of the i8 weights and scales (1.95x: IREE's copy of them tiled for
    VNNI; measured 1.13x, 1.95x before the load's freed heap was given back), where one f32
    copy of them would be 4x and more. int8 holds no copy of them: under 0.6x, the module
    and the scales' reciprocals (measured 0.17x; the archive's pages serve prefill and
    decode, `Precision.compile_flags`; 1.89x while decode's split-K q had a load-time copy, and
    before the freed heap went back). A prefill then adds IREE's pool of per-call
    transients (the dequantized weights of a chunk), printed."""
    cfg = WIDE
    write_text_model(tmp_path / "m", cfg, seed=1)
    stored = sum(int(np.prod(s.shape)) * (1 if s.dtype == "i8" else 4) for s in text_weights(cfg, precision))
    for _ in range(2):  # the first fills the cache; the second, a fresh process, is measured
        out = subprocess.run([sys.executable, "-c", RESIDENT_INT8, tmp_path / "m", tmp_path / "cache", precision],
                             capture_output=True, text=True, check=True)
    loaded, answered = map(int, out.stdout.split()[-2:])
    print(f"resident: {loaded / stored:.2f}x the {stored / 1e6:.0f} MB of i8 weights and scales once loaded, "
          f"{answered / stored:.2f}x after a prefill and a decode step")
    assert loaded < {"int8": 0.6, "w8a8": 2.5}[precision] * stored, (loaded, stored)


@pytest.mark.parametrize("precision", ["int8", "w8a8"])
def test_generate_quantized_from_the_command_line(tmp_path, precision):
    """`qwen3vl generate --precision int8` (and w8a8) with an image (the vision tower in bf16
    beside the quantized language model): it answers, its first logits near the f32 command's."""
    from helpers import generate_logits, write_images
    from emitter.config import PRESETS
    from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR
    from runtime.checkpoints.synthetic_text import write_generation_checkpoint

    policy = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})
    write_generation_checkpoint(tmp_path / "m", dataclasses.replace(PRESETS["tiny"], out_hidden_size=64),
                                dataclasses.replace(CFG, tie_word_embeddings=False), seed=3,
                                processor_policy_dict=policy)
    (image,) = write_images(tmp_path, ((64, 64),))
    logits = {p: generate_logits(tmp_path / "m", image, p, tmp_path / "cache", tmp_path) for p in (precision, "f32")}
    assert 1e-4 < rel_l2(logits[precision][0], logits["f32"][0]) < 5e-2
