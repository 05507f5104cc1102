"""Mixture-of-experts language models (qwen3_vl_moe, emitter/experts.py) against transformers'
Qwen3VLMoeForConditionalGeneration (f32, same checkpoint folder, same media): the prompt ids, the
greedy tokens and every step's logits (relL2 <= 1e-5) with images, with a video, and over a long
prompt prefilled in chunks; the expert stacks in Qwen's released layout ([E, in, out]) and in
transformers 5's ([E, out, in], its config naming num_local_experts); a dense layer among the
sparse ones (tiny-moe's layer 1). A lane of the server's batched module gives `generate`'s
logits bit for bit, in f32 and through the q8_0 / q4_0 block kernel's expert entry, whose
contraction is numpy's integer math bit for bit. Bad checkpoints get one line before any compile."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from conftest import rel_l2
from helpers import gradient_frames, write_images, write_video
from test_long_prompts import lane_logits, long_text, ours
from test_text_parity import SMALL_POLICY, TOL, reference_chat
from emitter.builder import Builder
from emitter.config import PRESETS
from emitter.experts import DOWN, GATE_UP, ROUTER
from emitter.quant import block_activations, block_weight
from emitter.text import weight_shapes
from emitter.text_config import TEXT_PREFIX, TEXT_PRESETS
from emitter.vision import render_module
from emitter import kernel_calls as calls
from emitter.targets import target_flags
from kernels import build
from kernels import q8_matmul as q8
from runtime.artifact.compiler import compile_mlir
from runtime.artifact.iree_module import LoadedModule
from runtime.checkpoints.synthetic_text import write_generation_checkpoint
from runtime.generator import Generator
from runtime.text import TextSession

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MOE = TEXT_PRESETS["tiny-moe"]
# 64 wide, so that every expert matmul is a whole number of the block kernel's tiles
WIDE = dataclasses.replace(MOE, hidden_size=64, moe_intermediate_size=96, intermediate_size=128)
WIDE_VISION = dataclasses.replace(PRESETS["tiny"], out_hidden_size=64)
PROMPT = "Describe the picture: what is shown here?"
STEPS = 12


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module")
def released(root):
    """tiny-moe as Qwen's files store it: experts [E, in, out], `num_experts`."""
    write_generation_checkpoint(root / "released", PRESETS["tiny"], MOE, seed=3, processor_policy_dict=SMALL_POLICY)
    return root / "released"


@pytest.fixture(scope="module")
def saved(root):
    """The same weights as transformers 5 saves them: experts [E, out, in], `num_local_experts`."""
    folder = root / "saved"
    write_generation_checkpoint(folder, PRESETS["tiny"], MOE, seed=3, processor_policy_dict=SMALL_POLICY,
                                expert_layout="transformers")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_local_experts"] = config["text_config"].pop("num_experts")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def images(root):
    return write_images(root, ((96, 64), (64, 130)))


def check(model_dir, root, messages, media_prompt, context=160, **generate):
    """Our greedy answer against transformers' (`reference_chat`)."""
    ids, tokens, logits = reference_chat(model_dir, messages, STEPS)
    assert len(tokens) == STEPS, "the reference stopped early: pick a seed that runs every step"
    gen = Generator(model_dir, buckets=(32, 64), context=context, cache_dir=root / "cache")
    got = gen.generate(media_prompt, max_new_tokens=STEPS, **generate)
    assert got.input_ids.tolist() == ids.tolist()
    assert got.tokens == tokens
    errors = [rel_l2(a, b) for a, b in zip(got.logits, logits)]
    assert max(errors) <= TOL, errors
    return got


@pytest.mark.parametrize("layout", ["released", "saved"])
def test_images_match_transformers_in_both_expert_layouts(request, root, images, layout):
    model_dir = request.getfixturevalue(layout)
    content = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": PROMPT}]
    check(model_dir, root, [{"role": "user", "content": content}], PROMPT, images=images)


def test_a_video_matches_transformers(released, root):
    video = write_video(root / "clip.mp4", gradient_frames(24, 256, 256, seed=9), rate=4)  # 12 frames sampled
    content = [{"type": "video", "video": video}, {"type": "text", "text": PROMPT}]
    check(released, root, [{"role": "user", "content": content}], PROMPT, context=640, videos=[video])


def test_a_long_chunked_prompt_matches_transformers_and_a_lane_is_bit_equal(released, root, images):
    """About 750 tokens with an image, prefilled in chunks of 64; then the same prompt as one
    of two lanes of the server's module: `generate`'s logits, bit for bit."""
    chat = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                         {"type": "text", "text": long_text(400, 1)}]}]
    ids, tokens, logits = reference_chat(released, chat, STEPS)
    gen = Generator(released, buckets=(16, 64), context=1024, cache_dir=root / "cache")
    prompt, got, got_logits = ours(gen, chat, STEPS)
    assert prompt.ids.tolist() == ids.tolist() and ids.size > 10 * 64
    assert got == tokens
    errors = [rel_l2(a, b) for a, b in zip(got_logits, logits)]
    assert max(errors) <= TOL, errors
    batch = TextSession(released, (16, 64), 1024, 2, cache_dir=root / "cache", lanes=2)
    assert lane_logits(batch, prompt, tokens[:3]) == [x.tobytes() for x in got_logits[:4]]


@pytest.fixture(scope="module")
def wide(root):
    write_generation_checkpoint(root / "wide", WIDE_VISION, WIDE, seed=3, processor_policy_dict=SMALL_POLICY)
    return root / "wide"


@pytest.mark.parametrize("precision,bound", [("bf16", 0.01), ("q8_0", 0.03), ("q4_0", 0.15)])
def test_quantized_experts_stay_near_and_lanes_are_bit_equal(wide, root, images, precision, bound):
    """Experts in bf16, or through the block kernel (q8_0, q4_0): the first answer's logits near
    transformers' f32 ones, and a lane of the batched module equal to `generate`'s, bit for bit."""
    content = [{"type": "image", "image": images[0]}, {"type": "text", "text": PROMPT}]
    _, tokens, logits = reference_chat(wide, [{"role": "user", "content": content}], 2)
    gen = Generator(wide, buckets=(32, 64), context=160, cache_dir=root / "cache", precision=precision)
    chat = [{"role": "user", "content": content}]
    prompt, got, got_logits = ours(gen, chat, 4)
    assert rel_l2(got_logits[0], logits[0]) <= bound
    batch = TextSession(wide, (32, 64), 160, 2, cache_dir=root / "cache", lanes=2, precision=precision)
    assert lane_logits(batch, prompt, got[:3]) == [x.tobytes() for x in got_logits[:4]]


@pytest.mark.parametrize("bits", [8, 4])
def test_expert_kernel_is_numpys_integer_math_bit_for_bit(tmp_path, bits):
    """Rows sorted by expert, some experts chosen by none, one by a single row, one by five
    (a pass of the 4-row loop and a remainder): each row's outputs are the one-matrix
    kernel's numpy math against its own expert, bit for bit."""
    e, n, k = 5, 64, 96
    counts = [2, 0, 1, 5, 0]
    m = sum(counts)
    rng = np.random.default_rng(bits)
    stack = [block_weight(rng.standard_normal((n, k), dtype=np.float32), bits) for _ in range(e)]
    x = rng.standard_normal((m, k), dtype=np.float32)
    xq, dx, xs = block_activations(x)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    obj = build.build_object(calls.target_isa(tuple(target_flags("llvm-cpu"))), tmp_path, q8.SOURCE)
    b = Builder()
    args = [b.argument("xq", (m, k), "i8"), b.argument("dx", (m, k // 32)), b.argument("xs", (m, k // 32), "i32"),
            b.argument("offsets", (e + 1,), "i32"), b.argument("chosen", (e,), "i32"),
            b.argument("w", (e, n, k * bits // 8), "i8"),
            b.argument("s", (e, n, k // 32), "f16")]
    y = calls.expert_matmul(b, *args, obj)
    module = LoadedModule(compile_mlir(render_module(b, [("y", y)], title="expert kernel test"), "llvm-cpu"))
    w = np.stack([q8.pack_weight(q, bits).reshape(n, -1) for q, _ in stack])
    s = np.stack([q8.pack_scales(scales).reshape(n, -1) for _, scales in stack])
    chosen = np.array([x for x, c in enumerate(counts) if c] + [-1] * counts.count(0), np.int32)
    (got,) = module(xq, dx, xs, offsets, chosen, w, s)
    for expert, (q, scales) in enumerate(stack):
        rows = slice(offsets[expert], offsets[expert + 1])
        if counts[expert]:
            assert np.array_equal(got[rows], q8.reference(xq[rows], dx[rows], q, scales)), expert


def test_the_30b_a3b_preset_has_the_released_shapes():
    cfg = TEXT_PRESETS["qwen3-vl-30b-a3b"]
    shapes = dict(weight_shapes(cfg))
    layer = f"{TEXT_PREFIX}layers.47."
    assert shapes[layer + ROUTER] == (128, 2048)
    assert shapes[layer + GATE_UP] == (128, 2 * 768, 2048) and shapes[layer + DOWN] == (128, 2048, 768)
    assert shapes[layer + "self_attn.q_proj.weight"] == (32 * 128, 2048)
    assert shapes[layer + "self_attn.k_proj.weight"] == (4 * 128, 2048)
    assert all(cfg.sparse(n) for n in range(48)) and cfg.num_experts_per_tok == 8
    total = sum(int(np.prod(s)) for s in shapes.values())
    assert 30.4e9 < total < 30.6e9, total  # "30B"


def copy_model(model, tmp_path, edit):
    folder = tmp_path / "m"
    shutil.copytree(model, folder)
    edit(folder)
    return folder


def reshaped(name: str, shape):
    """An edit storing tensor `name` of layer 0 as zeros of `shape`."""
    def edit(folder):
        from safetensors.numpy import load_file, save_file
        tensors = load_file(folder / "model.safetensors")
        tensors[f"{TEXT_PREFIX}layers.0.{name}"] = np.zeros(shape, np.float32)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return edit


def text_config(**fields):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config["text_config"].update(fields)
        (folder / "config.json").write_text(json.dumps(config))
    return edit


@pytest.mark.parametrize("case", ["router", "experts-neither", "experts-ambiguous", "top-k"])
def test_bad_moe_checkpoints_get_one_line_before_compile(released, tmp_path, case):
    from test_generate import nothing_compiled, qwen3vl
    e, d, i = MOE.num_experts, MOE.hidden_size, MOE.moe_intermediate_size
    edit, expect = {
        "router": (reshaped(ROUTER, (e, d + 1)), f"layers.0.mlp.gate.weight: stored shape [{e}, {d + 1}]: expected "
                                                 f"[{e}, {d}]"),
        "experts-neither": (reshaped(GATE_UP, (e, d, i)), f"layers.0.mlp.experts.gate_up_proj: stored shape "
                                                          f"[{e}, {d}, {i}]: expected [{e}, {2 * i}, {d}]"),
        "experts-ambiguous": (lambda f: (text_config(moe_intermediate_size=24)(f),
                                         reshaped(DOWN, (e, d, d // 2))(f), reshaped(GATE_UP, (e, d, d))(f)),
                              "gate_up_proj: stored shape [8, 48, 48] is both [E, out, in] and [E, in, out]"),
        "top-k": (text_config(num_experts_per_tok=e + 1), f"'text_config.num_experts_per_tok' = {e + 1}: expected "
                                                          f"at most num_experts ({e})"),
    }[case]
    folder = copy_model(released, tmp_path, edit)
    cache = tmp_path / "cache"
    out = qwen3vl("generate", "--model", folder, "--prompt", "hi", "--prompt-bucket", 32, "--context", 48,
                  "--cache-dir", cache)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], out.stderr
    assert nothing_compiled(cache)


def test_serve_run_and_embed_take_a_moe_checkpoint(released, tmp_path):
    """`qwen3vl serve` over the tiny-moe checkpoint answers an image chat through the openai
    client (streamed too) with `qwen3vl generate`'s answer; `run` and `embed` encode images
    with its tower."""
    from serve_helpers import Server, chat, generate, user
    from test_generate import qwen3vl

    shutil.copytree(released, tmp_path / "model")  # the served model's name: its folder's
    server = Server(tmp_path, model=tmp_path / "model")
    try:
        text, finish, usage = chat(server, [user("What is it?", server.images[:1])], max_tokens=8)
        streamed, _, _ = chat(server, [user("What is it?", server.images[:1])], stream=True, max_tokens=8)
        solo = generate(server, "What is it?", server.images[:1], 8)
        assert text == streamed == solo["text"] and usage["completion_tokens"] == len(solo["tokens"]) > 0
    finally:
        server.process.kill()
        server.process.wait()
    out = qwen3vl("run", "--model", released, str(server.images[0]), "--output", tmp_path / "run.safetensors",
                  "--cache-dir", tmp_path / "cache")
    assert out.returncode == 0 and (tmp_path / "run.safetensors").exists(), out.stderr
    out = qwen3vl("embed", "--model", released, server.allowed, "--output", tmp_path / "embeds", "--cache-dir",
                  tmp_path / "cache")
    assert out.returncode == 0 and (tmp_path / "embeds" / "index.json").exists(), out.stderr
