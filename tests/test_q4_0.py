"""--precision q4_0 (emitter/quant.py, kernels/q8_matmul.py): llama.cpp's Q4_0 weights (4-bit,
-8..7, an f16 scale per 32 inputs searched for the least squared error, packed two codes to a
byte in the kernel's tiles when the archive is written) against activations quantized per row
and block of 32 at run time (Q8_0's), every decoder projection and an untied lm_head through the
hand-written kernel linked into the module; an untied lm_head in Q8_0 through the same kernel.
The session's logits against transformers' text model whose projections run numpy's
`q8_matmul.reference` of the same integer math over the same weights (the embedding table in
Q8_0 blocks, as q8_0's: its rows gathered out of the tiles, and a tied lm_head through the
kernel in Q8_0); greedy tokens equal. The graph
form names the kernel's ISA (the artifact identity)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from emitter import quant
from emitter.identity import graph_precision
from emitter.text import text_weights
from kernels import q8_matmul
from test_q8_0 import CFG, UNTIED, check_integer_math, folders  # noqa: F401 (the fixture)

Q4_0 = functools.partial(q8_matmul.quantize_weight, bits=4)  # our Q4_0 blocks (searched f16 scales)


@pytest.mark.parity
@pytest.mark.parametrize("name, cfg", [("untied", UNTIED), ("tied", CFG)])
def test_q4_0_equals_numpys_integer_math(folders, name, cfg):
    """Prefill (two chunks: 32 rows, then 5) and greedy decode steps through the kernel
    against numpy's integer math of the same weights; against f32 it is quantized (the
    control: the comparison can fail)."""
    check_integer_math(folders, name, cfg, "q4_0", Q4_0)


def test_q4_0_weights_are_q4_0_blocks_in_the_kernels_tiles():
    """Projections: 16 bytes of codes and an f16 scale a block of 32 (Q4_0's 4.5 bits a
    weight); an untied lm_head and the embedding table in Q8_0 blocks in the kernel's 8-bit
    tiles (as llama.cpp keeps `output` wider)."""
    specs = {s.name: s for s in text_weights(UNTIED, "q4_0")}
    down, table = "model.language_model.layers.0.mlp.down_proj.weight", "model.language_model.embed_tokens.weight"
    assert (specs[down].dtype, specs[down].shape) == ("i8", (UNTIED.hidden_size, UNTIED.intermediate_size // 2))
    assert specs[quant.scales_name(down)].dtype == "f16"
    assert specs["lm_head.weight"].shape == (UNTIED.vocab_size, UNTIED.hidden_size)
    assert specs[quant.scales_name("lm_head.weight")].dtype == "f16"
    assert (specs[table].dtype, specs[table].shape) == ("i8", (UNTIED.vocab_size, UNTIED.hidden_size))  # packed
    assert specs[quant.scales_name(table)].dtype == "f16"
    w = np.random.default_rng(0).standard_normal((64, 96), dtype=np.float32)
    q, scales = quant.PRECISION_LAYOUTS["q4_0"].store(w)
    ref_q, ref_scales = Q4_0(w)
    assert q.shape == (64, 48) and np.array_equal(q.reshape(-1), q8_matmul.pack_weight(ref_q, 4))
    assert np.array_equal(scales.reshape(-1), q8_matmul.pack_scales(ref_scales))


def test_the_kernels_isa_is_part_of_the_identity():
    """q4_0 builds a graph form named by the target's ISA; its archive differs from q8_0's."""
    from emitter.identity import text_artifact_fields
    from emitter.text_shape import TextShape
    assert graph_precision("q4_0", "llvm-cpu-x86-64-v3") == "q4_0-avx2"
    assert graph_precision("q4_0", "llvm-cpu") in quant.KERNEL_ISA
    fields = {p: text_artifact_fields(CFG, TextShape((32,), 64), 0, p)
              for p in ("q4_0-avx512vnni", "q4_0-avx2", "q8_0-avx2")}
    assert fields["q4_0-avx2"]["graph_sha256"] != fields["q4_0-avx512vnni"]["graph_sha256"]
    assert fields["q4_0-avx2"]["weight_schema"] == fields["q4_0-avx512vnni"]["weight_schema"]  # one archive
    assert fields["q4_0-avx2"]["weight_schema"] != fields["q8_0-avx2"]["weight_schema"]


def test_a_target_without_the_kernel_is_one_line():
    from emitter.config import ConfigError
    with pytest.raises(ConfigError, match=r"^--precision q4_0: q8_matmul: target .*expected an x86-64 llvm-cpu"):
        graph_precision("q4_0", "vulkan-spirv")
