"""llama.cpp's K-quants in their bits (runtime/checkpoints/gguf_blocks.py): Q4_K and Q5_K as
the affine layout in groups of 32, Q6_K as int8 symmetric in groups of 16, Q8_0 and Q4_0
symmetric in groups of 32 (no biases). The unpacking against `gguf.quants.dequantize` over
real block bytes; a Q4_K_M-style file (Q4_K, a Q6_K table, a Q5_K, a Q4_1 and a Q5_0 tensor, f32
norms: llama.cpp's converter's f32 file re-encoded by the tests' encoder, gguf_encode.py) run in
its bits against the f32 session over gguf's dequantization of the same file: logits
relL2 <= 1e-5, text and mmproj; a Q4_0 file with a Q6_K lm_head (llama.cpp's Q4_0 mix), both
through the block kernel, against numpy's integer math of the file's blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import rel_l2
from emitter import quant
from emitter.precision import NATIVE
from emitter.vision import graph_weights
from emitter.text import text_weights
from emitter.text_config import TEXT_PRESETS
from runtime.checkpoints import gguf_blocks, gguf_text
from runtime.checkpoints.text import model_text_config

gguf = pytest.importorskip("gguf")
from gguf_encode import encode  # noqa: E402
from gguf_helpers import converted_checkpoint, dequantized_folder, model_folder, requantize  # noqa: E402

# Widths that the K-quants' super-blocks of 256 divide: every projection's inputs.
CFG = dataclasses.replace(TEXT_PRESETS["tiny"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, mrope_section=(12, 10, 10))
TOL = 1e-5
Q = gguf.GGMLQuantizationType


def q4_k_m(name: str, data: np.ndarray):
    """llama.cpp's Q4_K_M mix, in small: Q4_K for the matrices, one Q5_K, one Q4_1 and one
    Q5_0 tensor, and Q6_K for the embedding table (gathered on the native path); norms as they
    are (f32). (Q4_K_M's Q6_K lm_head, attn_v and ffn_down would run through the block kernel's
    q6k entry, against Q8_0 activations: `test_q6_k_head_on_the_kernel_is_its_integer_math`;
    Q8_0 and Q4_0 matrices: tests/test_gguf.py.)"""
    if data.ndim != 2:
        return None
    if name == "token_embd.weight":
        return Q.Q6_K
    return {"blk.1.attn_k.weight": Q.Q5_K, "blk.1.attn_q.weight": Q.Q4_1,
            "blk.1.attn_output.weight": Q.Q5_0}.get(name, Q.Q4_K)


def q4_0_q6_k_head(name: str, data: np.ndarray):
    """llama-quantize's Q4_0 mix: every matrix Q4_0 (the embedding table too), lm_head Q6_K."""
    return None if data.ndim != 2 else Q.Q6_K if name == "output.weight" else Q.Q4_0


def mmproj_mix(name: str, data: np.ndarray):
    """The mmproj's linears whose inputs 256 divides in K-quants (merger Q4_K and Q6_K,
    DeepStack mergers Q5_K and Q4_K), the others Q4_1 (MLP up), Q5_1 (MLP down) or Q8_0;
    the conv, position table, norms and biases as they are."""
    if data.ndim != 2 or name == "v.position_embd.weight":
        return None
    if data.shape[1] % 256:
        return Q.Q4_1 if ".ffn_up." in name else Q.Q5_1 if ".ffn_down." in name else Q.Q8_0
    return {"mm.0.weight": Q.Q4_K, "mm.2.weight": Q.Q6_K}.get(name, Q.Q5_K if ".fc1." in name else Q.Q4_K)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: path}: the checkpoint, the converter's f32 text and mmproj files and their
    re-encodings in the mixes above."""
    work = tmp_path_factory.mktemp("gguf-k")
    ckpt, convert = converted_checkpoint(work, CFG, seed=7)
    f32 = convert("text-f32.gguf", "--outtype", "f32")
    mmproj = convert("mmproj-f32.gguf", "--mmproj", "--outtype", "f32")
    return {"hf": ckpt, "f32": f32, "mmproj-f32": mmproj,
            "q4_k_m": requantize(f32, work / "text-q4_k_m.gguf", q4_k_m),
            "q4_0": requantize(f32, work / "text-q4_0.gguf", q4_0_q6_k_head),
            "mmproj-q4_k_m": requantize(mmproj, work / "mmproj-q4_k_m.gguf", mmproj_mix, arch="clip")}


@pytest.mark.parametrize("kind", list(gguf_blocks.LAYOUTS))
def test_unpacked_blocks_are_ggufs_numbers(kind):
    """Each type's blocks (the K-quants' written by the tests' encoder, the others by gguf's
    quantize) unpacked into the layout give exactly `gguf.quants.dequantize`'s
    numbers; the symmetric types carry no biases."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((5, 768)) * rng.uniform(0.01, 2, (5, 1))).astype(np.float32)
    w[1, 256:512] = 0  # an all-zero super-block
    w[2] = np.abs(w[2])  # a row without negatives (Q4_K's min 0)
    qtype = Q[kind]
    raw = encode(w, kind) if kind.endswith("_K") else gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    per_block = 256 if kind.endswith("_K") else 32
    q, scales, biases = gguf_blocks.signed(kind, raw.reshape(5, 768 // per_block, -1))
    layout = gguf_blocks.LAYOUTS[kind]
    assert (biases is not None) == layout.affine and q.dtype == np.int8
    assert q.min() >= -(1 << (layout.bits - 1)) and q.max() < (1 << (layout.bits - 1))
    np.testing.assert_array_equal(quant.dequantize(q, scales, layout.group, biases), ref)
    assert rel_l2(ref, w) < 0.1  # the encoding is one of the weight


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0"])
def test_a_tensor_in_its_bits_as_the_archive_holds_it(kind, tmp_path):
    """`gguf_blocks.in_bits` over a file's tensor of more rows than one block of
    `quant.BLOCK_ROWS`: q transposed (i8, or i4 nibbles), scales and any biases whose
    numbers are gguf's dequantization of the tensor."""
    rows, k = quant.BLOCK_ROWS + 4, 512
    w = np.random.default_rng(5).standard_normal((rows, k)).astype(np.float32)
    qtype, path = Q[kind], tmp_path / "one.gguf"
    raw = encode(w, kind) if kind.endswith("_K") else gguf.quants.quantize(w, qtype)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tensor("w", raw, raw_shape=gguf.quants.quant_shape_to_byte_shape(w.shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = gguf.GGUFReader(path).tensors[0]
    q, scales, biases = gguf_blocks.in_bits(t)
    layout = gguf_blocks.LAYOUTS[kind]
    if layout.bits == 4:  # two's-complement nibbles, element 2i low
        pairs = np.stack([q & np.uint8(0xF), q >> np.uint8(4)], axis=-1).reshape(-1)
        q = ((pairs ^ np.uint8(8)).astype(np.int8) - np.int8(8))
    ours = quant.dequantize(q.reshape(k, rows).T.copy(), scales, layout.group, biases)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype).reshape(w.shape))


def test_q4_k_m_in_its_bits_equals_f32_over_gguf_dequantize(files, tmp_path):
    """The Q4_K_M-style file in its bits (the default precision: native) against the f32
    session over gguf's dequantization of the same file: logits relL2 <= 1e-5 (32-row
    prefill dequantizes, the last row and decode run split-K, groups of 16 and 32). Every
    matrix runs in its type's layout; the distance to the unquantized checkpoint is printed."""
    from helpers import chunked_logits
    from runtime.text import checkpoint_precision

    path = files["q4_k_m"]
    assert checkpoint_precision(path) == NATIVE
    cfg, _ = model_text_config(path)
    layouts = quant.native_layouts(gguf_text.native_weights(path, cfg))
    assert len(layouts) == 7 * CFG.num_hidden_layers + 2
    assert set(layouts.values()) == {gguf_blocks.LAYOUTS[k] for k in ("Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0")}
    prefix = "model.language_model.layers.0."
    assert layouts["model.language_model.embed_tokens.weight"] == quant.Layout(8, 16)  # Q6_K
    assert layouts[prefix + "mlp.up_proj.weight"] == quant.Layout(4, 32, affine=True)  # Q4_K
    native = dataclasses.replace(cfg, native_weights=gguf_text.native_weights(path, cfg))
    biases = {s.name for s in text_weights(native, "f32") if s.name.endswith("biases")}
    assert len(biases) == sum(layout.affine for layout in layouts.values())  # none for the symmetric ones
    cache = tmp_path / "cache"
    ours = chunked_logits(path, cache, "native", CFG.vocab_size, 2)
    ref = chunked_logits(dequantized_folder(path, tmp_path / "deq"), cache, "f32", CFG.vocab_size, 2)
    assert rel_l2(ours, ref) <= TOL
    original = chunked_logits(files["hf"], cache, "f32", CFG.vocab_size, 2)
    distance = rel_l2(ours, original)
    print(f"Q4_K_M-style logits: relL2 {rel_l2(ours, ref):.2e} against f32 over gguf's dequantization, "
          f"{distance:.3f} against the unquantized checkpoint")
    assert distance < 0.5  # quantized, but the same model


@pytest.mark.parity
def test_q6_k_head_on_the_kernel_is_its_integer_math(files, tmp_path):
    """A Q4_0 file with a Q6_K lm_head (llama.cpp's Q4_0 mix) in its bits: the Q4_0 matrices and
    the Q6_K head through the block kernel (the q6k entry: the file's codes, int8 sub-scales and
    d, not a bit changed), each row's activations in Q8_0 blocks, against numpy's integer math of
    the same blocks (transformers over gguf's dequantized weights, the projections in
    `q8_matmul.reference` over llama.cpp's Q4_0 blocks of them, lm_head in
    `q8_matmul.reference_q6_k` over the file's Q6_K blocks): relL2 <= 1e-5, greedy tokens equal."""
    from helpers import chunked_logits, q4_0_blocks
    from kernels import q8_matmul
    from test_q8_0 import reference_logits

    path = files["q4_0"]
    cfg, _ = model_text_config(path)
    layouts = quant.native_layouts(gguf_text.native_weights(path, cfg))
    assert layouts.pop("lm_head.weight") == quant.Q6_K_TILES
    assert set(layouts.values()) == {quant.Layout(4, 32, scales="f16", packed=True)}
    head = next(t for t in gguf_text.reader(path).tensors if t.name == "output.weight")
    n, k = gguf_blocks.shape_of(head)
    q, sc, d = gguf_blocks.q6_k_parts(np.asarray(head.data, np.uint8).reshape(n, k // 256, -1))
    np.testing.assert_array_equal(  # the file's numbers
        d.astype(np.float32).repeat(256, 1) * sc.astype(np.float32).repeat(16, 1) * q,
        gguf.quants.dequantize(head.data, Q.Q6_K).reshape(n, k))

    def q6_k_linear(activations):
        torch = pytest.importorskip("torch")

        class Q6K(torch.nn.Module):
            def forward(self, x):
                rows = x.detach().numpy().reshape(-1, x.shape[-1])
                y = q8_matmul.reference_q6_k(*activations(rows), q, sc, d)
                return torch.from_numpy(y.reshape(*x.shape[:-1], n))
        return Q6K()

    # 2 steps: the third's sequence puts one of the body's Q8_0 activation codes on a rounding tie
    # between the session and transformers (6.3e-3 apart with lm_head in Q4_0 too, the Q6_K head aside)
    cache, steps = tmp_path / "cache", 2
    ours = chunked_logits(path, cache, "native", cfg.vocab_size, steps)
    ref = reference_logits(dequantized_folder(path, tmp_path / "deq"), cfg, np.arange(37) * 7 % cfg.vocab_size, steps,
                           "ours", q4_0_blocks, table_blocks=q4_0_blocks, head_linear=q6_k_linear)
    assert ours.shape == ref.shape
    assert max(rel_l2(a, b) for a, b in zip(ours, ref)) <= TOL
    assert np.array_equal(ours.argmax(1), ref.argmax(1))


def test_k_quant_mmproj_in_its_bits_equals_f32_over_gguf_dequantize(files, tmp_path):
    """The tower of an mmproj with K-quant, Q4_1, Q5_1 and Q8_0 linears in their bits against the f32
    tower over gguf's dequantization of the same file: embeddings and DeepStack features
    within 1e-5; every quantized linear runs in its type's layout."""
    from PIL import Image

    from runtime.vision import VisionSession

    folder = model_folder(files, tmp_path, "f32", "q4_k_m")
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(image)
    ours, ref = (VisionSession(folder, precision=p, cache_dir=tmp_path / "cache") for p in ("native", "f32"))
    layouts = quant.native_layouts(ours.cfg.native_weights)
    assert len(layouts) == 4 * 4 + 2 + 2 * 2 and not ref.cfg.native_weights
    assert set(layouts.values()) == {gguf_blocks.LAYOUTS[k] for k in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_1", "Q5_1")}
    specs = {s.name for s in graph_weights(ours.cfg, "f32")}
    assert sum(n.endswith("biases") for n in specs) == sum(v.affine for v in layouts.values())
    a, b = ours.encode([image]), ref.encode([image])
    assert rel_l2(a.image_embeds, b.image_embeds) <= TOL
    assert rel_l2(a.deepstack_features, b.deepstack_features) <= TOL
