"""llama.cpp GGUF text files as they are (runtime/checkpoints/gguf_text.py): written by
llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist,
runtime/bench/llamacpp.py) from a random checkpoint, Q8_0 by the converter and Q4_0 by
`gguf.quants.quantize` over the converter's f32 file rewritten with GGUFWriter. The session
in the file's bits against an f32 session over `gguf.quants.dequantize`'s weights (written
as a Hugging Face folder): logits relL2 <= 1e-5. Bad files are one line."""

from __future__ import annotations

import dataclasses
import re
import json

import numpy as np
import pytest

from conftest import rel_l2
from gguf_helpers import converted_checkpoint, dequantized_folder, model_folder, requantize
from helpers import chunked_logits, generate_logits
from emitter import quant
from emitter.text_config import TEXT_PRESETS
from runtime.checkpoints import gguf_text
from runtime.checkpoints.text import load_text_weights, model_text_config
from runtime.checkpoints.tensor_files import CheckpointError
from runtime.text import TextSession

gguf = pytest.importorskip("gguf")

# Widths that Q8_0's and Q4_0's blocks of 32 divide (the converter keeps other rows f16).
CFG = dataclasses.replace(TEXT_PRESETS["tiny"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, mrope_section=(6, 5, 5))
TOL = 1e-5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: GGUF path} written by llama.cpp's converter (and Q4_0 from its f32 file)."""
    work = tmp_path_factory.mktemp("gguf")
    ckpt, convert = converted_checkpoint(work, CFG, seed=5)
    out = {t: convert(f"text-{t}.gguf", "--outtype", t) for t in ("f32", "q8_0")}
    q4_0 = gguf.GGMLQuantizationType.Q4_0  # every matrix, the embedding table too (as llama-quantize's Q4_0)
    out["q4_0"] = requantize(out["f32"], work / "text-q4_0.gguf", lambda name, data: q4_0 if data.ndim == 2 else None)
    for t in ("f32", "q8_0"):
        out[f"mmproj-{t}"] = convert(f"mmproj-{t}.gguf", "--mmproj", "--outtype", t)
    out["hf"] = ckpt
    return out


def logits(model, cache, precision: str, steps: int = 2) -> np.ndarray:
    """`helpers.chunked_logits` over this file's vocabulary."""
    return chunked_logits(model, cache, precision, CFG.vocab_size, steps)


def test_config_from_metadata(files):
    """The text config read from the converter's `qwen3vl.*` keys is the checkpoint's."""
    cfg, _ = model_text_config(files["q8_0"])
    hf, _ = model_text_config(files["hf"])
    assert cfg == hf


@pytest.mark.parity
@pytest.mark.parametrize("kind, bits", [("q8_0", 8), ("q4_0", 4)])
def test_in_its_bits_is_llama_cpps_math_of_its_blocks(files, kind, bits, tmp_path):
    """The session over the GGUF file in its bits: every Q8_0 or Q4_0 matrix (the projections,
    the embedding table, lm_head) in the block kernel's tiles as the file holds it, each row's
    activations in Q8_0 blocks (llama.cpp's math), against numpy's integer math of the same
    blocks (transformers over gguf's dequantized weights, whose blocks llama.cpp's rule gives
    back exactly, every projection and lm_head in `q8_matmul.reference`, activations quantized
    as our graph does): relL2 <= 1e-5, greedy tokens equal. The f32 session over the
    dequantized weights differs (the control: the activations' blocks)."""
    from helpers import q4_0_blocks, q8_0_blocks
    from test_q8_0 import reference_logits

    path = files[kind]
    cfg, _ = model_text_config(path)
    layouts = quant.native_layouts(gguf_text.native_weights(path, cfg))
    assert len(layouts) >= 7 * CFG.num_hidden_layers + 1
    assert set(layouts.values()) == {quant.Layout(bits, 32, scales="f16", packed=True)}
    cache, steps = tmp_path / "cache", 3
    folder = dequantized_folder(path, tmp_path / "deq")
    ours = logits(path, cache, "native", steps)
    blocks = q8_0_blocks if bits == 8 else q4_0_blocks
    ref = reference_logits(folder, cfg, np.arange(37) * 7 % cfg.vocab_size, steps, "ours", blocks, blocks, blocks)
    assert ours.shape == ref.shape
    assert max(rel_l2(a, b) for a, b in zip(ours, ref)) <= TOL
    assert np.array_equal(ours.argmax(1), ref.argmax(1))
    assert rel_l2(ours, logits(folder, cache, "f32", steps)) > 100 * TOL
    original = logits(files["hf"], cache, "f32", steps)  # the prompt's row: the steps follow each side's tokens
    assert rel_l2(ours[0], original[0]) < (0.05 if bits == 8 else 0.5)  # quantized, but the same model


def test_w8a8_against_q8_0_at_equal_bits(files, tmp_path):
    """Logit quality at 8 bits: the distance of our w8a8 (int8 weights with a scale per output
    channel, int8 activations per row) from the f32 model, beside the distance of llama.cpp's
    Q8_0 file (run here in its bits: weights in blocks of 32, f32 activations) from it; and
    our int8 (groups of 64, f32 activations). Printed for docs/text.md; w8a8 is bounded at
    twice Q8_0's (a scale per 2048 inputs at 2B against one per 32)."""
    cache = tmp_path / "cache"
    original = logits(files["hf"], cache, "f32")
    away = {name: rel_l2(logits(path, cache, precision), original)
            for name, path, precision in (("q8_0", files["q8_0"], "mlx"), ("w8a8", files["hf"], "w8a8"),
                                          ("int8", files["hf"], "int8"))}
    print("distance from the f32 model: " + ", ".join(f"{k} {v:.2e}" for k, v in away.items()))
    assert 0 < away["q8_0"] < away["w8a8"] < 2 * away["q8_0"], away


@pytest.mark.parity
def test_our_q8_0_against_llama_cpps_q8_0_at_equal_bits(files, tmp_path):
    """The bar at equal bits: the distance of `--precision q8_0` (Q8_0 weights and
    activations, the kernel) from the f32 model is no worse than llama.cpp's Q8_0 math's:
    transformers with llama.cpp's CPU Q8_0 x Q8_0 in every projection and lm_head (its
    weights' rule, `helpers.q8_0_blocks`: max / 127 per block, where ours are searched; the
    activations' block scales in f16; tests/test_q8_0.py `reference_logits`). The Q8_0 file
    run here in its bits (f32 activations) is printed beside them."""
    from helpers import q8_0_blocks
    from test_q8_0 import reference_logits

    cache = tmp_path / "cache"
    original = logits(files["hf"], cache, "f32")
    ours = rel_l2(logits(files["hf"], cache, "q8_0"), original)
    prompt = np.arange(37) * 7 % CFG.vocab_size
    theirs = rel_l2(reference_logits(files["hf"], CFG, prompt, len(original) - 1, "llama.cpp", q8_0_blocks,
                                     q8_0_blocks, q8_0_blocks), original)
    weight_only = rel_l2(logits(files["q8_0"], cache, "native"), original)
    print(f"distance from the f32 model: our q8_0 {ours:.2e}, llama.cpp's Q8_0 math {theirs:.2e}, the Q8_0 file "
          f"in its bits with f32 activations {weight_only:.2e}")
    assert 0 < ours <= theirs, (ours, theirs)


@pytest.mark.parity
def test_our_q4_0_against_llama_cpps_q4_0_at_equal_bits(files, tmp_path):
    """The bar at 4 bits: the distance of `--precision q4_0` (Q4_0 weights with searched f16
    scales, Q8_0 activations, the kernel) from the f32 model is no worse than llama.cpp's
    Q4_0 x Q8_0 math's (transformers with ggml's Q4_0 rule, `helpers.q4_0_blocks`, against
    llama.cpp's Q8_0 activations in every projection; the table and lm_head in Q8_0 by its
    rule, `helpers.q8_0_blocks`: llama-quantize's Q6_K head falls back to Q8_0 at this width,
    and so does ours). Our int4 and the Q4_0 file in its bits (f32 activations) are printed
    beside them."""
    from helpers import q4_0_blocks, q8_0_blocks
    from test_q8_0 import reference_logits

    cache = tmp_path / "cache"
    original = logits(files["hf"], cache, "f32")
    ours = rel_l2(logits(files["hf"], cache, "q4_0"), original)
    prompt = np.arange(37) * 7 % CFG.vocab_size
    theirs = rel_l2(reference_logits(files["hf"], CFG, prompt, len(original) - 1, "llama.cpp", q4_0_blocks,
                                     q8_0_blocks, q8_0_blocks), original)
    int4 = rel_l2(logits(files["hf"], cache, "int4"), original)
    weight_only = rel_l2(logits(files["q4_0"], cache, "native"), original)
    print(f"distance from the f32 model: our q4_0 {ours:.3e}, llama.cpp's Q4_0 x Q8_0 math {theirs:.3e}, our int4 "
          f"{int4:.3e}, the Q4_0 file in its bits with f32 activations {weight_only:.3e}")
    assert 0 < ours <= theirs, (ours, theirs)


def test_unsupported_quant_type_is_one_line(files, tmp_path):
    bad = requantize(files["f32"], tmp_path / "mxfp4.gguf", gguf.GGMLQuantizationType.MXFP4)
    cfg, _ = model_text_config(bad)
    with pytest.raises(CheckpointError, match=r"^[\w.]+\.weight: GGUF type MXFP4 is not supported .*expected "
                                              r"one of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
                                              r"Q6_K$"):
        TextSession(bad, buckets=(32,), context=64, cache_dir=tmp_path / "c", precision="native")


def test_a_folder_holding_the_files(files, tmp_path):
    """A folder holding the text file and an mmproj file reads as the text file; two text
    files are one line."""
    import shutil

    shutil.copy(files["q8_0"], tmp_path / "Qwen3VL-Q8_0.gguf")
    (tmp_path / "mmproj-Qwen3VL-f16.gguf").write_bytes(b"GGUF")
    assert gguf_text.text_file(tmp_path) == tmp_path / "Qwen3VL-Q8_0.gguf"
    assert model_text_config(tmp_path) == model_text_config(files["q8_0"])
    shutil.copy(files["q4_0"], tmp_path / "Qwen3VL-Q4_0.gguf")
    with pytest.raises(CheckpointError,
                       match=r"2 GGUF text files \(Qwen3VL-Q4_0.gguf, Qwen3VL-Q8_0.gguf\); expected one"):
        model_text_config(tmp_path)


def test_unknown_architecture_is_one_line(files, tmp_path):
    bad = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(bad), arch="llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'llama' is not supported; expected 'qwen3vl'"):
        model_text_config(bad)


TEXTS = ["Hello world", "  leading spaces and trailing  ", "numbers 12345 and 3.14159, dates 2024-01-05",
         "I'm sure they'll say we've DONE it", "tabs\tand\nnew\n\nlines\r\n", "émigré naïve 東京 🙂 Ωμέγα",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n</think>\n",
         "<tool_call>{\"name\": \"f\"}</tool_call><|vision_start|><|image_pad|><|vision_end|>",
         "a<|endoftext|>b", "!!!??? ... --- ''' ```code```"]


def test_tokenizer_equals_the_checkpoints(files):
    """The tokenizer built from tokenizer.ggml.* gives the checkpoint tokenizer.json's ids
    on varied text, added and special tokens included, and decodes them back the same."""
    from tokenizers import Tokenizer

    from runtime.inputs.tokenizer import ChatTokenizer

    ours = ChatTokenizer(files["q8_0"])
    theirs = Tokenizer.from_file(str(files["hf"] / "tokenizer.json"))
    for text in TEXTS:
        ids = theirs.encode(text).ids
        assert ours.tokenizer.encode(text).ids == ids, text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    hf = json.loads((files["hf"] / "generation_config.json").read_text())["eos_token_id"]
    assert ours.eos_ids[0] in hf
    assert ours.template_text == (files["hf"] / "chat_template.jinja").read_text()


def test_generate_text_only_from_the_gguf_file(files, tmp_path):
    """`qwen3vl generate --model text-q8_0.gguf` (its bits, tokenizer and template from the
    file) gives the logits of the same command under `--precision q8_0` over the Hugging Face
    folder whose text weights are gguf's dequantization of the file (their Q8_0 blocks are the
    file's: the same kernel math): within 1e-5. An image without the mmproj is one line."""
    import shutil
    import subprocess
    import sys

    from safetensors.numpy import load_file, save_file

    path, folder = files["q8_0"], tmp_path / "deq"
    shutil.copytree(files["hf"], folder)
    cfg, _ = model_text_config(path)
    tensors = {**load_file(str(folder / "model.safetensors")), **load_text_weights(path, cfg)}
    save_file(tensors, str(folder / "model.safetensors"))
    cache = tmp_path / "cache"
    ours = generate_logits(path, None, None, cache, tmp_path)
    ref = generate_logits(folder, None, "q8_0", cache, tmp_path)
    assert rel_l2(ours, ref) <= TOL
    out = subprocess.run([sys.executable, "-c", "from runtime.commands.main import main; main()", "generate",
                          "--model", path, "--image", files["hf"] / "config.json", "--prompt", "hi", "--cache-dir",
                          cache], capture_output=True, text=True)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (f"error: --model {path}: a GGUF text file alone has no vision "
                                                   "tower for the image; expected its mmproj GGUF too (llama.cpp's "
                                                   "--mmproj)")


# --------------------------------------------------------------------------- the mmproj (vision)

def test_mmproj_config_policy_and_weights(files):
    """The converter's `clip.*` keys give the checkpoint's vision config and image policy;
    the f32 file's weights are the checkpoint's bit for bit (conv frames rejoined, DeepStack
    re-indexed); the Q8_0 file's are gguf's own dequantization, near them."""
    from emitter.config import load_model_config
    from emitter.policy import load_policy
    from gguf.quants import dequantize

    from runtime.checkpoints import gguf_vision
    from runtime.checkpoints.vision import load_vision_weights

    hf = load_model_config(files["hf"])
    cfg = gguf_vision.vision_config(files["mmproj-f32"])
    assert cfg == hf and cfg.deepstack_visual_indexes == (1, 2)
    assert gguf_vision.processor_policy(files["mmproj-f32"], cfg) == load_policy(files["hf"], hf)
    ref = load_vision_weights(files["hf"], hf)
    ours = gguf_vision.load_vision_weights(files["mmproj-f32"], cfg)
    assert list(ours) == list(ref)
    for name in ref:
        np.testing.assert_array_equal(ours[name], ref[name], err_msg=name)
    q8 = gguf_vision.load_vision_weights(files["mmproj-q8_0"], cfg)
    t = next(t for t in gguf.GGUFReader(files["mmproj-q8_0"]).tensors if t.name == "v.deepstack.2.fc1.weight")
    assert t.tensor_type.name == "Q8_0"
    np.testing.assert_array_equal(q8["model.visual.deepstack_merger_list.1.linear_fc1.weight"],
                                  dequantize(t.data, t.tensor_type).reshape(256, 256))
    assert max(rel_l2(q8[k], ref[k]) for k in ref) < 0.01


def test_generate_with_an_image_equals_the_original_checkpoint(files, tmp_path):
    """`qwen3vl generate --model FOLDER --image X` (the f32 text file beside its f32 mmproj)
    gives the logits of the same command over the Hugging Face checkpoint both were converted
    from: within 1e-5; `--model TEXT --mmproj FILE` the same."""
    from PIL import Image

    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(image)
    cache = tmp_path / "cache"
    outs = [tmp_path / n for n in ("folder", "ref", "pair")]
    for o in outs:
        o.mkdir()
    ours = generate_logits(model_folder(files, tmp_path), image, None, cache, outs[0])
    ref = generate_logits(files["hf"], image, "f32", cache, outs[1])
    assert rel_l2(ours, ref) <= TOL
    run = cli("generate", "--model", files["f32"], "--mmproj", files["mmproj-f32"], "--image", image, "--prompt",
              "What is it?", "--max-new-tokens", "2", "--prompt-bucket", "64", "--context", "96", "--cache-dir",
              cache, "--save-logits", outs[2] / "pair.npy")
    assert run.returncode == 0, run.stderr
    assert rel_l2(np.load(outs[2] / "pair.npy"), ref) <= TOL


def test_an_answer_parses_each_file_once(files, tmp_path):
    """`qwen3vl generate` over a folder of a text file and its mmproj, with an image, parses
    each GGUF file once (`gguf_text.parsed`; the 2B's Q4_0 file had been parsed 15 times an
    answer, 6 s each for its vocabulary's metadata: 98 s of a 4-token answer, now 21 s)."""
    import ast
    import subprocess
    import sys

    from PIL import Image

    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(image)
    code = ("import collections, sys, gguf\n"
            "seen, init = collections.Counter(), gguf.GGUFReader.__init__\n"
            "def counted(self, path, *args, **kwargs):\n"
            "    seen[str(path)] += 1\n"
            "    init(self, path, *args, **kwargs)\n"
            "gguf.GGUFReader.__init__ = counted\n"
            "from runtime.commands.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(dict(seen))\n")
    folder = model_folder(files, tmp_path)
    out = subprocess.run([sys.executable, "-c", code, "generate", "--model", str(folder), "--image", str(image),
                          "--prompt", "What is it?", "--max-new-tokens", "2", "--prompt-bucket", "64",
                          "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert sorted(seen.values()) == [1, 1], seen


def cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "from runtime.commands.main import main; main()", *map(str, args)],
                          capture_output=True, text=True)


def test_serve_answers_an_image_chat_from_the_folder(files, tmp_path):
    """`qwen3vl serve --model FOLDER` (Q8_0 text beside the Q8_0 mmproj) answers an image
    chat through the openai client with `qwen3vl generate`'s answer over the same folder."""
    from serve_helpers import Server, chat, generate, user

    server = Server(tmp_path, model=model_folder(files, tmp_path, "q8_0", "q8_0"))
    try:
        text, finish, usage = chat(server, [user("What is it?", server.images[:1])], max_tokens=8)
        solo = generate(server, "What is it?", server.images[:1], 8)
        assert text == solo["text"] and usage["completion_tokens"] == len(solo["tokens"]) > 0
    finally:
        server.process.kill()
        server.process.wait()


@pytest.mark.parametrize("change, message", [
    (dict(fields={"clip.projector_type": "qwen2vl_merger"}),
     r"projector type 'qwen2vl_merger' is not supported; expected 'qwen3vl_merger' \(the Qwen3-VL vision tower\)$"),
    (dict(drop=("mm.2.weight",)),
     r"the tensor mm\.2\.weight \(for model\.visual\.merger\.linear_fc2\.weight\) is missing$"),
    (dict(arch="llama"), r"GGUF architecture 'llama' is not an mmproj; expected 'clip'")])
def test_bad_mmproj_is_one_line(files, tmp_path, change, message):
    """A wrong projector type, a missing tensor or a file that is no mmproj: one line naming
    it, from `generate` before anything is compiled."""
    bad = requantize(files["mmproj-f32"], tmp_path / "mmproj-bad.gguf", None, **{"arch": "clip", **change})
    run = cli("generate", "--model", files["q8_0"], "--mmproj", bad, "--image", files["hf"] / "config.json",
              "--prompt", "hi", "--cache-dir", tmp_path / "cache")
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(message, last), run.stderr
    assert "compil" not in run.stderr


def test_q8_0_mmproj_in_its_bits_equals_f32_over_gguf_dequantize(files, tmp_path):
    """The tower of a Q8_0 mmproj with its linears in their bits (the default `native`:
    symmetric, groups of 32) against the f32 tower over gguf's dequantization of the same file:
    embeddings and DeepStack features within 1e-5; every linear runs in its bits."""
    from PIL import Image

    from runtime.vision import VisionSession

    folder = model_folder(files, tmp_path, "f32", "q8_0")
    image = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(image)
    ours, ref = (VisionSession(folder, precision=p, cache_dir=tmp_path / "cache") for p in ("native", "f32"))
    assert len(ours.cfg.native_weights) == 4 * 4 + 2 + 2 * 2 and not ref.cfg.native_weights
    a, b = ours.encode([image]), ref.encode([image])
    assert rel_l2(a.image_embeds, b.image_embeds) <= TOL
    assert rel_l2(a.deepstack_features, b.deepstack_features) <= TOL
    assert ours.archive_path.stat().st_size < 0.7 * ref.archive_path.stat().st_size
