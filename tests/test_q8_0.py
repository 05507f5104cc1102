"""--precision q8_0 (emitter/quant.py, kernels/q8_matmul.py): llama.cpp's Q8_0 weights (int8,
an f16 scale per 32 inputs, packed in the kernel's tiles when the archive is written) and
activations quantized per row and block of 32 at run time, every decoder projection and
lm_head (a tied one: the embedding table's tiles, whose rows the graph also gathers) through
the hand-written kernel linked into the module. The session's logits against transformers'
text model whose projections and lm_head run numpy's `q8_matmul.reference` of the same
integer math over the same weights, its embedding table the Q8_0 blocks dequantized; greedy
tokens equal; decode's attention through the second kernel (kernels/decode_attention.py),
lanes over a bf16 cache equal to each sequence alone. The graph form names the kernel's ISA
(the artifact identity, which does not depend on the kernel's folder); a width the kernel's
tiles do not divide is one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import rel_l2
from helpers import chunked_logits
from emitter import quant
from emitter.config import ConfigError
from emitter.precision import precision
from emitter.text import text_weights
from kernels import build, q8_matmul
from runtime.checkpoints.synthetic_text import write_text_model
from test_quant import CFG

TOL = 1e-5
STEPS = 3
UNTIED = dataclasses.replace(CFG, tie_word_embeddings=False)  # lm_head through the kernel too
# a vocabulary the kernel's tiles do not divide (llama.cpp takes any row count): the tables pad
ODD = dataclasses.replace(UNTIED, vocab_size=CFG.vocab_size - 7)


def ours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x's Q8_0 blocks as the q8_0 graph makes them: f32 scales (`quant.block_activations`)."""
    return quant.block_activations(x)[:2]


def llama_cpp(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x's Q8_0 blocks as llama.cpp's CPU matmul makes them (ggml `quantize_row_q8_0_ref`):
    d = max|x| / 127, q = roundf(x * (1 / d)) (half away from zero), d kept in f16."""
    m, k = x.shape
    g = x.reshape(m, k // quant.BLOCK, quant.BLOCK)
    d = (np.abs(g).max(axis=2) / np.float32(127)).astype(np.float32)
    inverse = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))
    scaled = g * inverse[:, :, None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int8)
    return q.reshape(m, k), d.astype(np.float16).astype(np.float32)


def q8_linear(weight, activations=ours, blocks=quant.block_weight):
    """A torch module computing x @ weight.T in Q8_0 x Q8_0, or Q4_0 x Q8_0 (`q8_matmul.reference`):
    the weight's blocks made by `blocks` (Q8_0's `quant.block_weight`) against x's made
    by `activations`."""
    import torch

    w = weight.detach().numpy() if hasattr(weight, "detach") else weight
    q, scales = blocks(w)

    class Q8(torch.nn.Module):
        def forward(self, x):
            rows = x.detach().numpy().reshape(-1, x.shape[-1])
            y = q8_matmul.reference(*activations(rows), q, scales)
            return torch.from_numpy(y.reshape(*x.shape[:-1], q.shape[0]))
    return Q8()


def table_numbers(w: np.ndarray, blocks=quant.block_weight) -> np.ndarray:
    """The embedding table's numbers: its `blocks` (ours: Q8_0 blocks with searched f16
    scales, or the head's of a tied table), dequantized."""
    q, scales = blocks(w)
    return quant.dequantize(q, scales.astype(np.float32), quant.BLOCK)


def reference_logits(folder, cfg, prompt: np.ndarray, steps: int, form: str = "ours",
                     blocks=quant.block_weight, head_blocks=quant.block_weight,
                     table_blocks=quant.block_weight, head_linear=None) -> np.ndarray:
    """transformers' Qwen3VLTextModel over the checkpoint with every projection in integer math
    (`q8_linear`; the weights' blocks by `blocks`: Q8_0's, or Q4_0's), lm_head in integer math
    over its `head_blocks` (Q8_0's, or q4_0's 6-bit; tied: the table's) and the embedding table's
    `table_numbers` (the head's blocks when tied, else `table_blocks`'; ours, or llama.cpp's
    rules: tests/helpers.py), or an untied lm_head as `head_linear(activations)` makes it (a
    GGUF file's Q6_K blocks: tests/test_gguf_k.py);
    activations quantized as our graph does ("ours") or as llama.cpp does ("llama.cpp"). The
    logits of the prompt's last row and of `steps` greedy steps (each step the whole sequence
    again: rows are independent in the kernel's math)."""
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    from test_text_2b import transformers_model

    activations = llama_cpp if form == "llama.cpp" else ours
    hf = transformers_model(folder, cfg)
    for layer in hf.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name.endswith("proj"):
                    setattr(parent, name, q8_linear(child.weight, activations, blocks))
    raw = hf.embed_tokens.weight.detach().numpy()
    table = table_numbers(raw, head_blocks if cfg.tie_word_embeddings else table_blocks)
    hf.embed_tokens.weight = torch.nn.Parameter(torch.from_numpy(table), requires_grad=False)
    weight = raw if cfg.tie_word_embeddings else next(
        load_file(str(f))["lm_head.weight"] for f in folder.glob("*.safetensors")
        if "lm_head.weight" in load_file(str(f)))
    module = head_linear(activations) if head_linear else q8_linear(weight, activations, head_blocks)
    head = lambda h: module(torch.from_numpy(h)).numpy()  # noqa: E731
    ids, rows = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps + 1):
            n = len(ids)
            hidden = hf(input_ids=torch.tensor([ids]),
                        position_ids=torch.arange(n)[None, None].expand(3, 1, n)).last_hidden_state
            rows.append(np.asarray(head(hidden[0, -1:].numpy())).reshape(-1))
            ids.append(int(np.argmax(rows[-1])))
    return np.stack(rows)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("q8_0")
    for name, cfg in (("tied", CFG), ("untied", UNTIED), ("odd", ODD)):
        write_text_model(root / name, cfg, seed=5)
    return root


@pytest.mark.parity
@pytest.mark.parametrize("name, cfg", [("untied", UNTIED), ("tied", CFG), ("odd", ODD)])
def test_q8_0_equals_numpys_integer_math(folders, name, cfg):
    """Prefill (two chunks: 32 rows, then 5) and greedy decode steps through the kernel
    against numpy's integer math of the same weights; against f32 it is quantized (the
    control: the comparison can fail). "odd": a vocabulary of 377 rows, the embedding table
    and lm_head padded to the tiles inside, the logits exactly the checkpoint's 377."""
    check_integer_math(folders, name, cfg, "q8_0", quant.block_weight)


def check_integer_math(folders, name: str, cfg, precision: str, blocks, head_blocks=quant.block_weight) -> None:
    """The session's logits under `precision` against `reference_logits` with the weights'
    `blocks` and lm_head's `head_blocks`: relL2 <= TOL, greedy tokens equal, and far from f32's."""
    ours = chunked_logits(folders / name, folders / "cache", precision, cfg.vocab_size, STEPS)
    prompt = np.arange(37) * 7 % cfg.vocab_size
    ref = reference_logits(folders / name, cfg, prompt, STEPS, blocks=blocks, head_blocks=head_blocks)
    assert ours.shape == ref.shape == (1 + STEPS, cfg.vocab_size)  # the checkpoint's vocabulary, padded or not
    errors = [rel_l2(a, b) for a, b in zip(ours, ref)]
    away = rel_l2(ours, chunked_logits(folders / name, folders / "cache", "f32", cfg.vocab_size, STEPS))
    print(f"{precision} ({name}) against numpy's integer math: relL2 {max(errors):.1e}; against f32 {away:.1e}")
    assert max(errors) <= TOL, errors
    assert np.array_equal(ours.argmax(1), ref.argmax(1))
    assert away > 100 * TOL, away


def test_q8_0_weights_are_q8_0_blocks_in_the_kernels_tiles():
    specs = {s.name: s for s in text_weights(UNTIED, "q8_0")}
    down, table = "model.language_model.layers.0.mlp.down_proj.weight", "model.language_model.embed_tokens.weight"
    assert (specs[down].dtype, specs[down].shape) == ("i8", (UNTIED.hidden_size, UNTIED.intermediate_size))
    assert specs[quant.scales_name(down)].dtype == "f16"
    assert specs["lm_head.weight"].dtype == "i8" and specs[quant.scales_name("lm_head.weight")].dtype == "f16"
    assert (specs[table].dtype, specs[table].shape) == ("i8", (UNTIED.vocab_size, UNTIED.hidden_size))  # packed
    assert specs[quant.scales_name(table)].dtype == "f16"
    w = np.random.default_rng(0).standard_normal((64, 96), dtype=np.float32)
    q, scales = quant.Layout(8, quant.BLOCK, packed=True).store(w)
    ref_q, ref_scales = quant.block_weight(w)
    assert np.array_equal(q.reshape(-1), q8_matmul.pack_weight(ref_q))
    assert np.array_equal(scales.reshape(-1), q8_matmul.pack_scales(ref_scales))


def test_the_kernels_isa_is_part_of_the_identity():
    """q8_0 builds a graph form named by the target's ISA: the host's (AVX-512 VNNI here, or
    AVX2) and x86-64-v3's AVX2 differ in precision and graph (the linked object)."""
    from emitter.identity import text_artifact_fields
    from emitter.text_shape import TextShape
    assert precision("q8_0").for_target("llvm-cpu-x86-64-v3").name == "q8_0-avx2"
    host = precision("q8_0").for_target("llvm-cpu")
    assert host.family == "q8_0" and host.isa
    fields = {p: text_artifact_fields(CFG, TextShape((32,), 64), 0, p) for p in ("q8_0-avx512vnni", "q8_0-avx2")}
    assert fields["q8_0-avx2"]["graph_sha256"] != fields["q8_0-avx512vnni"]["graph_sha256"]
    assert fields["q8_0-avx2"]["weight_schema"] == fields["q8_0-avx512vnni"]["weight_schema"]  # one archive


def test_the_identity_does_not_depend_on_the_kernel_folder(tmp_path, monkeypatch):
    """Two `$QWEN3VL_KERNEL_DIR`s, one identity: the graph names the object by file name (a
    hash of its source, flags and compiler), built into each folder: the projections' and
    the decode attention's."""
    from emitter.identity import text_artifact_fields
    from kernels import decode_attention
    from emitter.text_shape import TextShape
    fields = []
    for folder in ("one", "two"):
        monkeypatch.setenv(build.OBJECTS_ENV, str(tmp_path / folder))
        fields.append(text_artifact_fields(CFG, TextShape((32,), 64), 0, "q8_0-avx2"))
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == sorted(
            [build.build_object("avx2", tmp_path, s).name for s in (q8_matmul.SOURCE, decode_attention.SOURCE)])
    assert fields[0] == fields[1]
    assert str(tmp_path) not in json.dumps(fields[0])


def test_a_target_without_the_kernel_is_one_line():
    with pytest.raises(ConfigError, match=r"^--precision q8_0: q8_matmul: target .*expected an x86-64 llvm-cpu"):
        precision("q8_0").for_target("vulkan-spirv")


def test_outputs_the_tiles_do_not_divide_are_one_line():
    cfg = dataclasses.replace(CFG, num_key_value_heads=1)  # k_proj: 16 outputs
    with pytest.raises(ConfigError, match=r"k_proj.weight: shape \[16, 64\]: expected \[N, K\] with N a multiple of "
                                          r"32 \(the q8_0 kernel's tiles\)"):
        text_weights(cfg, "q8_0")


def test_lanes_through_the_attention_kernel_equal_each_alone(folders):
    """Decode and prefill attend through kernels/decode_attention.py in the q8_0 graph, here
    over a bf16 cache: sequences admitted between steps and decoded together (1, 2 and 4-lane steps, each
    lane its own table) give, lane by lane, what each gives alone, bit for bit."""
    from emitter.text import attention_object
    from emitter.text_module import emit_text_module
    from emitter.text_shape import TextShape
    from runtime.inputs.chat import Prompt
    from runtime.text import TextSession
    from test_kv_pages import batched_runs, solo_runs

    shape = dict(buckets=(16,), context=48, precision="q8_0", kv_cache_dtype="bf16")
    assert attention_object(CFG, TextShape((16,), 48, kv_dtype="bf16"), precision("q8_0").for_target())
    module = emit_text_module(CFG, TextShape((16,), 48, kv_dtype="bf16"), 0, precision("q8_0").for_target())
    assert "@decode_attention_" in module and "@chunk_attention_16x" in module  # prefill's too
    rng = np.random.default_rng(2)
    prompts = [Prompt(ids, np.repeat(np.arange(ids.size)[None], 3, 0), 0)
               for ids in (rng.integers(0, CFG.vocab_size, n) for n in (5, 11, 2))]
    solo = solo_runs(folders / "tied", folders / "cache", prompts, shape)
    session = TextSession(folders / "tied", cache_dir=folders / "cache", lanes=4, **shape)
    session.pool.take(5)  # other blocks than the one-sequence session's
    tokens, logits = batched_runs(session, prompts, starts=[0, 2, 5])
    for i, run in enumerate(solo):
        assert tokens[i] == [t for t, _ in run]
        for ours, (_, theirs) in zip(logits[i], run):
            assert np.array_equal(ours, theirs), i
