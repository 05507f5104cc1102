"""--precision q4_0 (emitter/quant.py, kernels/q8_matmul.py): llama.cpp's Q4_0 weights (4-bit,
-8..7, an f16 scale per 32 inputs searched for the least squared error, packed two codes to a
byte in the kernel's tiles when the archive is written) against activations quantized per row
and block of 32 at run time (Q8_0's), every decoder projection and an untied lm_head through the
hand-written kernel linked into the module; lm_head in 6 bits (-32..31, searched f16 scales per
32, as llama.cpp's Q4_0 files keep it in Q6_K; in Q8_0 at widths 256 does not divide, as
llama.cpp falls back) through the same kernel's 6-bit entry. The
session's logits against transformers' text model whose projections run numpy's
`q8_matmul.reference` of the same integer math over the same weights (a tied embedding table in
the head's 6-bit blocks, its rows gathered out of the tiles; an untied one in Q8_0's); greedy
tokens equal. The graph form names the kernel's ISA (the artifact identity)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from emitter import quant
from emitter.precision import precision
from emitter.text import text_weights
from emitter.kernel_calls import block_rows
from kernels import q8_matmul
from runtime.checkpoints.synthetic_text import write_text_model
from test_q8_0 import CFG, UNTIED, check_integer_math, folders  # noqa: F401 (the fixture)

Q4_0 = functools.partial(quant.block_weight, bits=4)  # our Q4_0 blocks (searched f16 scales)
Q6 = functools.partial(quant.block_weight, bits=6)  # lm_head's 6-bit blocks (the same search)
Q8_0 = quant.block_weight


# Rows of 256 inputs: lm_head in 6 bits (at 64, CFG's, it is Q8_0, as llama.cpp falls back from Q6_K)
WIDE = dataclasses.replace(CFG, hidden_size=256, intermediate_size=256)
WIDE_ODD = dataclasses.replace(WIDE, vocab_size=CFG.vocab_size - 7)  # the tied 6-bit table padded to the tiles


@pytest.fixture(scope="module")
def wide(folders):
    write_text_model(folders / "wide", WIDE, seed=5)
    write_text_model(folders / "wide-odd", WIDE_ODD, seed=5)
    return folders


@pytest.mark.parity
@pytest.mark.parametrize("name, cfg, head", [("untied", UNTIED, Q8_0), ("tied", CFG, Q8_0), ("wide", WIDE, Q6),
                                            ("wide-odd", WIDE_ODD, Q6)])
def test_q4_0_equals_numpys_integer_math(wide, name, cfg, head):
    """Prefill (two chunks: 32 rows, then 5) and greedy decode steps through the kernel
    against numpy's integer math of the same weights (lm_head's in `head`'s blocks: 6-bit at
    rows of 256, the tied table's rows gathered out of its 6-bit tiles); against f32 it is
    quantized (the control: the comparison can fail)."""
    check_integer_math(wide, name, cfg, "q4_0", Q4_0, head)


def test_q4_0_weights_are_q4_0_blocks_in_the_kernels_tiles():
    """Projections: 16 bytes of codes and an f16 scale a block of 32 (Q4_0's 4.5 bits a
    weight); lm_head at rows of 256 inputs in 6-bit blocks (24 bytes and a scale: as llama.cpp
    keeps `output` wider, in Q6_K), a tied table with it, at other widths in Q8_0 (as llama.cpp
    falls back there); an untied embedding table in Q8_0 blocks."""
    specs = {s.name: s for s in text_weights(UNTIED, "q4_0")}
    down, table = "model.language_model.layers.0.mlp.down_proj.weight", "model.language_model.embed_tokens.weight"
    assert (specs[down].dtype, specs[down].shape) == ("i8", (UNTIED.hidden_size, UNTIED.intermediate_size // 2))
    assert specs[quant.scales_name(down)].dtype == "f16"
    assert specs["lm_head.weight"].shape == (UNTIED.vocab_size, UNTIED.hidden_size)  # Q8_0 at 64 inputs
    assert specs[quant.scales_name("lm_head.weight")].dtype == "f16"
    assert (specs[table].dtype, specs[table].shape) == ("i8", (UNTIED.vocab_size, UNTIED.hidden_size))  # packed
    assert specs[quant.scales_name(table)].dtype == "f16"
    for cfg in (WIDE, dataclasses.replace(WIDE, tie_word_embeddings=False)):
        specs = {s.name: s for s in text_weights(cfg, "q4_0")}
        head = "lm_head.weight" if "lm_head.weight" in specs else table
        assert specs[head].shape == (cfg.vocab_size, cfg.hidden_size * 6 // 8)  # 6 bits
        assert specs[table].shape[1] == cfg.hidden_size * (6 if head == table else 8) // 8
    w = np.random.default_rng(0).standard_normal((64, 96), dtype=np.float32)
    q, scales = precision("q4_0").layout.store(w)
    ref_q, ref_scales = Q4_0(w)
    assert q.shape == (64, 48) and np.array_equal(q.reshape(-1), q8_matmul.pack_weight(ref_q, 4))
    assert np.array_equal(scales.reshape(-1), q8_matmul.pack_scales(ref_scales))


def test_the_kernels_isa_is_part_of_the_identity():
    """q4_0 builds a graph form named by the target's ISA; its archive differs from q8_0's."""
    from emitter.identity import text_artifact_fields
    from emitter.text_shape import TextShape
    assert precision("q4_0").for_target("llvm-cpu-x86-64-v3").name == "q4_0-avx2"
    assert precision("q4_0").for_target("llvm-cpu").family == "q4_0"
    fields = {p: text_artifact_fields(CFG, TextShape((32,), 64), 0, p)
              for p in ("q4_0-avx512vnni", "q4_0-avx2", "q8_0-avx2")}
    assert fields["q4_0-avx2"]["graph_sha256"] != fields["q4_0-avx512vnni"]["graph_sha256"]
    assert fields["q4_0-avx2"]["weight_schema"] == fields["q4_0-avx512vnni"]["weight_schema"]  # one archive
    assert fields["q4_0-avx2"]["weight_schema"] != fields["q8_0-avx2"]["weight_schema"]


def test_a_target_without_the_kernel_is_one_line():
    from emitter.config import ConfigError
    with pytest.raises(ConfigError, match=r"^--precision q4_0: q8_matmul: target .*expected an x86-64 llvm-cpu"):
        precision("q4_0").for_target("vulkan-spirv")


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_rows_gathered_out_of_the_tiles_are_the_dequantized_rows(bits):
    """`kernel_calls.block_rows` (the embedding of a tied table) at each packed width: the rows of
    the packed weight, each block's values times its f16 scale, exactly; at 6 and 4 bits every
    code occurs."""
    from emitter.builder import Builder
    from emitter.vision import render_module
    from runtime.artifact.compiler import compile_mlir
    from runtime.artifact.iree_module import LoadedModule

    n, k, rows = 64, 96, np.array([0, 17, 63, 17, 40], np.int32)
    q, scales = quant.block_weight(np.random.default_rng(bits).standard_normal((n, k), dtype=np.float32), bits)
    assert bits == 8 or set(np.unique(q)) == set(range(-(1 << (bits - 1)), 1 << (bits - 1)))
    b = Builder()
    out = block_rows(b, b.argument("w", (n, k * bits // 8), "i8"), b.argument("s", (n, k // 32), "f16"),
                               b.argument("rows", (len(rows),), "i32"))
    module = LoadedModule(compile_mlir(render_module(b, [("rows", out)], title="block rows"), "llvm-cpu"))
    got = module(q8_matmul.pack_weight(q, bits).reshape(n, -1), q8_matmul.pack_scales(scales).reshape(n, -1), rows)[0]
    assert np.array_equal(got, quant.dequantize(q, scales.astype(np.float32), 32)[rows])
