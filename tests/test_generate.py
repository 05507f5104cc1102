"""`qwen3vl generate` and its inputs: the text config (both rope spellings, tying, the
mixture-of-experts fields), the tokenizer and template files, and one-line errors for bad input, each
before any compile and with nothing left on disk."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from emitter.config import ConfigError, PRESETS
from emitter.text_config import TEXT_PRESETS, TextConfig, text_config_from_hf
from emitter.precision import precision as precision_of
from runtime.checkpoints.synthetic import DEFAULT_PROCESSOR
from runtime.checkpoints.synthetic_text import write_generation_checkpoint
from runtime.inputs.tokenizer import ChatTokenizer, TokenizerError, expand_pads, user_message

QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")
SMALL_POLICY = dict(DEFAULT_PROCESSOR, size={"shortest_edge": 4096, "longest_edge": 32768})


def qwen3vl(*args):
    return subprocess.run([QWEN3VL, *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen") / "model"
    write_generation_checkpoint(folder, PRESETS["tiny"], TEXT_PRESETS["tiny"], seed=3,
                                processor_policy_dict=SMALL_POLICY)
    return folder


def copy_model(model, tmp_path, edit=None) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(model, folder)
    if edit:
        edit(folder)
    return folder


def hf_config(model) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


# --------------------------------------------------------------------------- config


@pytest.mark.parity
def test_both_rope_spellings_and_tying(model):
    new = hf_config(model)
    old = json.loads(json.dumps(new))
    rope = old["text_config"].pop("rope_parameters")
    old["text_config"]["rope_theta"] = rope.pop("rope_theta")
    old["text_config"]["rope_scaling"] = rope
    old["text_config"]["tie_word_embeddings"] = True  # transformers 5.24 reads the top level only
    cfg_new, ids = text_config_from_hf(new)
    cfg_old, _ = text_config_from_hf(old)
    assert cfg_new == TEXT_PRESETS["tiny"] and ids.image_token_id == new["image_token_id"] != 151655
    assert cfg_old == cfg_new
    assert text_config_from_hf(dict(new, tie_word_embeddings=True))[0].tie_word_embeddings
    transformers = pytest.importorskip("transformers")
    for config in (old, new, dict(new, tie_word_embeddings=True)):
        theirs = transformers.Qwen3VLConfig(**json.loads(json.dumps(config))).tie_word_embeddings
        assert text_config_from_hf(config)[0].tie_word_embeddings == theirs


@pytest.mark.parity
def test_defaults_of_a_config_that_names_none_are_transformers(model):
    """rope_theta and max_position_embeddings left out of text_config: the values
    transformers' Qwen3VLTextConfig gives them (5e5 and 128000, not the released 5e6 and
    262144)."""
    transformers = pytest.importorskip("transformers")
    config = hf_config(model)
    text = config["text_config"]
    del text["rope_parameters"]["rope_theta"], text["max_position_embeddings"]
    theirs = transformers.Qwen3VLConfig(**json.loads(json.dumps(config))).text_config
    ours, _ = text_config_from_hf(config)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 500000.0
    assert ours.max_position_embeddings == theirs.max_position_embeddings == 128000
    bare = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1, head_dim=8, mrope_section=(2, 1, 1))
    assert TextConfig(**bare).rope_theta == ours.rope_theta  # the dataclass's own default too


def test_moe_config_both_expert_count_spellings(model):
    """qwen3_vl_moe: the expert count as released configs name it (num_experts) and as
    transformers 5 writes it (num_local_experts); transformers' defaults where none is named;
    contradictions and impossible counts named."""
    config = dict(hf_config(model), model_type="qwen3_vl_moe")
    bare, _ = text_config_from_hf(config)
    assert (bare.num_experts, bare.num_experts_per_tok, bare.moe_intermediate_size, bare.decoder_sparse_step) == \
        (60, 4, 1408, 1) and bare.moe and all(bare.sparse(n) for n in range(bare.num_hidden_layers))
    for key in ("num_experts", "num_local_experts"):
        text = dict(config["text_config"], **{key: 8}, num_experts_per_tok=2, moe_intermediate_size=40,
                    mlp_only_layers=[1], decoder_sparse_step=1)
        cfg, _ = text_config_from_hf(dict(config, text_config=text))
        assert cfg.num_experts == 8 and [cfg.sparse(n) for n in range(3)] == [True, False, True]
    stepped, _ = text_config_from_hf(dict(config, text_config=dict(config["text_config"], decoder_sparse_step=2)))
    assert [stepped.sparse(n) for n in range(3)] == [False, True, False]  # (layer + 1) % step == 0
    for fields, expect in (({"num_experts": 8, "num_local_experts": 6}, "one expert count"),
                           ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok' = 5: expected at "
                                                                          "most num_experts \\(4\\)"),
                           ({"mlp_only_layers": [3]}, "mlp_only_layers' = \\[3\\]: expected layer indexes")):
        with pytest.raises(ConfigError, match=expect):
            text_config_from_hf(dict(config, text_config=dict(config["text_config"], **fields)))


def test_bad_mrope_section_named(model):
    config = hf_config(model)
    config["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 3]
    with pytest.raises(ConfigError, match=r"text_config\.rope_parameters\.mrope_section.*head_dim/2 \(8\)"):
        text_config_from_hf(config)


def test_mlx_layout_quantized_text_weights(model, tmp_path):
    """mlx-vlm names (language_model.model.*, language_model.lm_head) with 4-bit affine
    projections load as the dequantized HF weights."""
    from safetensors.numpy import load_file
    from runtime.checkpoints.vision import dequantize_mlx
    from runtime.checkpoints.synthetic import quantize_mlx, write_safetensors
    from runtime.checkpoints.text import load_text_weights

    cfg = TEXT_PRESETS["tiny"]
    hf = load_text_weights(model, cfg)
    folder = tmp_path / "mlx"
    folder.mkdir()
    tensors, expected = {}, {}
    for name, w in hf.items():
        stored = name.replace("model.language_model.", "language_model.model.").replace(
            "lm_head.", "language_model.lm_head.")
        if name.endswith("proj.weight"):
            packed, scales, biases = quantize_mlx(w, 4, 16)
            module = stored[:-len(".weight")]
            tensors.update({stored: ("U32", packed.shape, packed.tobytes()),
                            module + ".scales": ("F32", scales.shape, scales.tobytes()),
                            module + ".biases": ("F32", biases.shape, biases.tobytes())})
            expected[name] = dequantize_mlx(packed, scales, biases, 4, 16)
        else:
            tensors[stored] = ("F32", w.shape, w.tobytes())
            expected[name] = w
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps(dict(hf_config(model), quantization={"bits": 4, "group_size": 16})))
    loaded = load_text_weights(folder, cfg)
    assert list(loaded) == list(expected)
    for name in expected:
        np.testing.assert_array_equal(loaded[name], expected[name])
    assert not np.array_equal(loaded[name := "model.language_model.layers.0.mlp.up_proj.weight"], hf[name])
    assert load_file(model / "model.safetensors").keys() >= hf.keys()


# --------------------------------------------------------------------------- tokenizer


@pytest.mark.parity
def test_template_matches_transformers(model):
    transformers = pytest.importorskip("transformers")
    ours = ChatTokenizer(model)
    theirs = transformers.AutoTokenizer.from_pretrained(model)
    messages = user_message("Two images: which is larger?", 2)
    text = ours.render(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              chat_template=(model / "chat_template.jinja").read_text())
    assert ours.encode(text).tolist() == theirs(text)["input_ids"]  # as the processor tokenizes
    assert ours.eos_ids == tuple(json.loads((model / "generation_config.json").read_text())["eos_token_id"])


@pytest.mark.parity
def test_typed_special_tokens_are_plain_text(model):
    """`generate`'s prompt ids (`prompt_ids`, one image): the special tokens typed in the
    prompt are encoded as ordinary text (transformers' split_special_tokens=True), the
    template's own stay special, and a typed `<|image_pad|>` is no image's place."""
    transformers = pytest.importorskip("transformers")
    from emitter.text_config import TokenIds
    ours = ChatTokenizer(model)
    theirs = transformers.AutoTokenizer.from_pretrained(model)
    plain = transformers.AutoTokenizer.from_pretrained(model, split_special_tokens=True)
    config = json.loads((model / "config.json").read_text())
    ids = TokenIds(**{k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                              "vision_end_token_id")})
    typed = "A <|im_end|> and an <|image_pad|>."
    marked = ours.render(user_message("@", 1))
    head, tail = marked.split("@")
    piece = lambda text, tok=theirs: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    expected = expand_pads(np.array(piece(head) + piece(typed, plain) + piece(tail)), ids.image_token_id, [3])
    got = ours.prompt_ids(typed, ids, image_tokens=[3])
    assert got.tolist() == expected.tolist() and (got == ids.image_token_id).sum() == 3
    assert ours.prompt_ids("plain", ids, [3]).tolist() == expand_pads(
        ours.encode(ours.render(user_message("plain", 1))), ids.image_token_id, [3]).tolist()


def test_template_from_tokenizer_config_and_int_eos(model, tmp_path):
    def edit(folder):
        template = (folder / "chat_template.jinja").read_text()
        (folder / "chat_template.jinja").unlink()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))

    tok = ChatTokenizer(copy_model(model, tmp_path, edit))
    assert tok.eos_ids == (2,) and "<|im_start|>assistant" in tok.render(user_message("hi", 0))


def test_pad_expansion_counts_checked():
    assert expand_pads(np.array([1, 3, 5, 4, 3, 5, 4]), 5, [2, 3]).tolist() == [1, 3, 5, 5, 4, 3, 5, 5, 5, 4]
    with pytest.raises(TokenizerError, match="1 image pad token.*2 image"):
        expand_pads(np.array([3, 5, 4]), 5, [2, 3])


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize("case", ["json over config", "json over image", "logits over weights", "same file"])
def test_outputs_that_overwrite_an_input_or_each_other_are_refused(model, tmp_path, case):
    """--json and --save-logits are checked as `run`'s -o is: before any work, never an
    input image, a file of the checkpoint folder, or one file for both."""
    from PIL import Image
    folder = copy_model(model, tmp_path)
    image = tmp_path / "a.png"
    Image.new("RGB", (64, 64)).save(image)
    json_path, logits = {"json over config": (folder / "config.json", None),
                         "json over image": (image, None),
                         "logits over weights": (None, folder / "model.safetensors"),
                         "same file": (tmp_path / "out", tmp_path / "out")}[case]
    args = [*(["--json", json_path] if json_path else []), *(["--save-logits", logits] if logits else [])]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    out = qwen3vl("generate", "--model", folder, "--image", image, "--prompt", "Hi", "--prompt-bucket", 32,
                  "--context", 48, "--cache-dir", tmp_path / "cache", *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    flag = "--save-logits" if case in ("logits over weights", "same file") else "--json"
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), out.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert nothing_compiled(tmp_path / "cache") and out.stdout == ""


def test_logits_that_overflow_are_an_error_not_an_answer(model, tmp_path):
    """Finite weights scaled near f32's largest value: the logits are inf; one line, no
    token streamed, no file written."""
    from safetensors.numpy import load_file, save_file

    def huge(folder):
        tensors = load_file(folder / "model.safetensors")
        head = tensors["lm_head.weight"].astype(np.float64)
        tensors["lm_head.weight"] = (head * (3e38 / np.abs(head).max())).astype(np.float32)
        save_file(tensors, folder / "model.safetensors")

    folder = copy_model(model, tmp_path, huge)
    out = qwen3vl("generate", "--model", folder, "--prompt", "Hi", "--max-new-tokens", 3, "--json", tmp_path / "r.json",
                  "--save-logits", tmp_path / "l.npy", "--prompt-bucket", 32, "--context", 48,
                  "--cache-dir", tmp_path / "cache")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error: output logits: ") and "NaN or inf" in lines[-1], out.stderr
    assert [line for line in lines if line.startswith("error")] == lines[-1:] and "Traceback" not in out.stderr
    assert out.stdout == "" and not (tmp_path / "r.json").exists() and not (tmp_path / "l.npy").exists()


def test_generate_cli_json_and_logits(model, tmp_path):
    images = [str(tmp_path / "a.png")]
    from PIL import Image
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(images[0])
    out = qwen3vl("generate", "--model", model, "--image", images[0], "--prompt", "What is shown here?",
                  "--max-new-tokens", 5, "--json", tmp_path / "r.json", "--save-logits", tmp_path / "l.npy",
                  "--prompt-bucket", 32, "--context", 48, "--cache-dir", tmp_path / "cache")
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    logits = np.load(tmp_path / "l.npy")
    assert set(result) == {"prompt_tokens", "tokens", "text", "seconds"}
    assert set(result["seconds"]) >= {"vision", "prefill", "decode"}
    assert logits.shape == (len(result["tokens"]), TEXT_PRESETS["tiny"].vocab_size) and logits.dtype == np.float32
    assert result["tokens"] == logits.argmax(1).tolist() and 1 <= len(result["tokens"]) <= 5
    assert out.stdout == result["text"] + "\n"


def test_one_answer_lets_the_tower_go_before_the_language_model(model, tmp_path):
    """`keep_vision=False` (generate's one answer): the vision session is let go once the
    image is encoded, before the language model loads (nothing holds it: its weights are
    not resident beside the language model's), and the answer is the one a generator that
    keeps it gives; a second request with an image opens the tower again."""
    import weakref

    from PIL import Image
    from runtime.generator import Generator

    image = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(image)
    options = dict(buckets=(32,), context=48, cache_dir=tmp_path / "cache")
    kept = Generator(model, **options).generate("What is shown here?", [image], 3)
    gen = Generator(model, keep_vision=False, **options)
    session, towers, text_load = weakref.ref(gen.vision), [], gen.text._load

    def load():  # the language model loads: the tower must be gone (freed) by now
        towers.append((gen._vision, session()))
        return text_load()

    gen.text._load = load
    first = gen.generate("What is shown here?", [image], 3)
    assert towers == [(None, None)]
    assert first.tokens == kept.tokens and np.array_equal(first.logits, kept.logits)
    again = gen.generate("What is shown here?", [image], 3)
    assert again.tokens == kept.tokens and gen._vision is None


def test_precision_help_says_the_embedding_table_is_bf16_too():
    """bf16 rounds the text model's embedding table (stored bf16, not a matmul operand):
    `generate --help` says so beside the matmul-weight description."""
    out = qwen3vl("generate", "--help")
    assert out.returncode == 0 and "embedding table in bf16" in " ".join(out.stdout.split()), out.stdout


def make_moe(folder):
    (folder / "config.json").write_text(json.dumps(dict(hf_config(folder), model_type="qwen3_vl_moe")))


def drop_lm_head(folder):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")


def nothing_compiled(cache: Path) -> bool:
    return not cache.exists() or not list(cache.glob("*.vmfb"))


def edit_config(**fields):
    """An edit of config.json: `text_config.NAME` or top-level `NAME` fields set."""
    def edit(folder):
        config = hf_config(folder)
        for name, value in fields.items():
            section, _, key = name.rpartition("__")
            (config[section] if section else config)[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def header_only_png(path, size: int) -> str:
    """A PNG whose header says size x size and whose pixel data is cut off: it can be sized,
    not decoded."""
    from PIL import Image
    Image.new("L", (size, size)).save(path)
    data = path.read_bytes()
    path.write_bytes(data[:data.index(b"IDAT") + 16])
    return str(path)


@pytest.mark.parametrize("case", ["long-prompt", "small-context", "moe", "no-tokenizer", "no-template",
                                  "json-is-folder", "missing-image", "zero-tokens", "untied-without-head",
                                  "bad-utf8", "context-past-positions", "image-id-outside-vocab",
                                  "moe-in-text-config", "tokenizer-is-folder", "image-too-large"])
def test_bad_input_one_line_before_compile(model, tmp_path, case):
    args = ["--prompt", "What is shown here?", "--prompt-bucket", 32, "--context", 48]
    edit, expect = None, None
    if case == "long-prompt":
        args += ["--prompt", "describe " * 40]
        expect = "longer than the context of 48 tokens"
    elif case == "small-context":
        args += ["--max-new-tokens", 40]
        expect = "more than the context of 48 tokens"
    elif case == "moe":
        edit = make_moe  # a dense checkpoint's weights under a mixture-of-experts config
        expect = "model.language_model.layers.0.mlp.gate.weight: missing"
    elif case == "no-tokenizer":
        edit = lambda f: (f / "tokenizer.json").unlink()  # noqa: E731
        expect = "tokenizer.json: missing"
    elif case == "no-template":
        edit = lambda f: (f / "chat_template.jinja").unlink()  # noqa: E731
        expect = "no chat template"
    elif case == "json-is-folder":
        args += ["--json", tmp_path]
        expect = "--json"
    elif case == "missing-image":
        args += ["--image", tmp_path / "nope.png"]
        expect = "--image"
    elif case == "zero-tokens":
        args += ["--max-new-tokens", 0]
        expect = "--max-new-tokens 0: expected 1 or more"
    elif case == "untied-without-head":
        edit = drop_lm_head
        expect = "lm_head.weight: missing; config.json says the embeddings are untied"
    elif case == "bad-utf8":
        args += ["--prompt", "bad\udcff"]  # the byte 0xff of argv, as Python hands it over
        expect = "--prompt: not valid UTF-8 (byte 0xff at character 3)"
    elif case == "context-past-positions":
        edit = edit_config(text_config__max_position_embeddings=40)
        expect = "--context 48: more than the model's max_position_embeddings (40"
    elif case == "image-id-outside-vocab":
        edit = edit_config(image_token_id=TEXT_PRESETS["tiny"].vocab_size)
        expect = f"field 'image_token_id' = {TEXT_PRESETS['tiny'].vocab_size}: outside the vocabulary"
    elif case == "moe-in-text-config":
        edit = edit_config(text_config__num_experts=8)
        expect = ("text_config field 'num_experts' declares a mixture-of-experts language model, but model_type "
                  "is 'qwen3_vl'; expected 'qwen3_vl_moe'")
    elif case == "tokenizer-is-folder":
        edit = lambda f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.json").mkdir())  # noqa: E731
        expect = "tokenizer.json: is a folder"
    elif case == "image-too-large":  # the released pixel budget: 12000x12000 becomes 16384 tiny tokens
        edit = lambda f: (f / "preprocessor_config.json").write_text(json.dumps(dict(  # noqa: E731
            json.loads((f / "preprocessor_config.json").read_text()), size={"shortest_edge": 65536,
                                                                             "longest_edge": 16777216})))
        args += ["--image", header_only_png(tmp_path / "big.png", 12000)]
        expect = "the images alone: prompt of 16384 tokens: longer than the context of 48 tokens"
    folder = copy_model(model, tmp_path, edit)
    cache = tmp_path / "cache"
    out = qwen3vl("generate", "--model", folder, *args, "--cache-dir", cache)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], out.stderr
    assert nothing_compiled(cache) and out.stdout == ""


@pytest.mark.parametrize("preset,context,buckets", [
    ("tiny", 4096, (128, 2048)), ("tiny", 5000, (112,)),
    pytest.param("qwen3-vl-2b", 8192, (128, 8192), marks=pytest.mark.slow)])
def test_text_module_compiles_at_long_contexts(preset, context, buckets):
    """Codegen limits are shape dependent: decode over a 4096-slot cache once failed with
    "exceeded stack allocation limit" (a whole score row in one dispatch)."""
    import dataclasses
    from emitter.text_module import emit_text_module
    from emitter.text_shape import TextShape
    from runtime.artifact.compiler import compile_mlir

    cfg = dataclasses.replace(TEXT_PRESETS[preset], num_hidden_layers=1)
    assert compile_mlir(emit_text_module(cfg, TextShape(buckets, context, lanes=2), 3))


@pytest.mark.parity
def test_decode_space_clean_up_as_transformers(model, tmp_path):
    """tokenizer_config.json's clean_up_tokenization_spaces: transformers skips it for BPE
    unless forced; ours does the same."""
    transformers = pytest.importorskip("transformers")

    def edit(folder):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(clean_up_tokenization_spaces=True,
                      clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=forced)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))

    for forced in (False, True):
        folder = copy_model(model, tmp_path / str(forced), edit)
        ours = ChatTokenizer(folder)
        ids = ours.encode("what is here ? a cat , two birds .")
        theirs = transformers.AutoTokenizer.from_pretrained(folder).decode(ids.tolist(), skip_special_tokens=True)
        assert ours.decode(ids) == theirs
        assert (" ?" in theirs) != forced


def test_default_context_follows_the_model_and_the_memory(model, tmp_path, monkeypatch):
    """Without --context: serve takes 32768 tokens, at most max_position_embeddings and what
    half the memory the weights leave holds (never under 4096); generate takes the least
    ladder context that holds its prompt and answer, up to that."""
    import runtime.sizing as sizing

    per_token = sizing.kv_token_bytes(TEXT_PRESETS["tiny"])
    monkeypatch.setattr(sizing, "available_memory", lambda: 1 << 40)
    assert sizing.default_context(model) == (32768, "the default ceiling")
    assert sizing.default_context(model, "bf16")[0] == 32768
    monkeypatch.setattr(sizing, "available_memory", lambda: 2 * per_token * 10000)
    assert sizing.default_context(model) == (9728, "what half the memory the weights leave holds")
    monkeypatch.setattr(sizing, "available_memory", lambda: 2 * per_token * 10000 + 12345678)
    assert sizing.default_context(model, resident=12345678)[0] == 9728
    monkeypatch.setattr(sizing, "available_memory", lambda: 2 * per_token * 100)
    assert sizing.default_context(model)[0] == 4096
    monkeypatch.setattr(sizing, "available_memory", lambda: 1 << 40)
    folder = copy_model(model, tmp_path, lambda f: (f / "config.json").write_text(json.dumps(
        dict(hf_config(model), text_config=dict(hf_config(model)["text_config"], max_position_embeddings=20000)))))
    assert sizing.default_context(folder) == (20000, "the model's max_position_embeddings")
    assert [sizing.fitting_context(n, 20000) for n in (60, 4096, 4097, 9000, 16385)] == [4096, 4096, 8192, 16384,
                                                                                      20000]


def test_the_kv_cache_default_leaves_the_weights_their_memory(model, tmp_path, monkeypatch):
    """`weight_bytes` is what the weight archives hold (the language model's at f32, bf16
    and an MLX checkpoint's own 4 bits, the tower's beside it at its own), and the default pool is half of the memory
    they leave: serve's default on the 2B had taken half of what was free before the weights
    loaded, 12.3 GB of pool beside 8.5 GB of f32 weights, and was killed on a 24 GB machine."""
    import iree.runtime as rt

    import runtime.sizing as sizing
    import runtime.text as text
    from runtime.artifact.archive import cached_archive, cached_text_archive
    from runtime.artifact.build import vision_source
    from runtime.artifact.cache import ArtifactCache
    from runtime.checkpoints.synthetic_mlx import write_mlx_generation_checkpoint

    def held(path) -> int:
        index = rt.ParameterIndex()
        index.load(str(path), mmap=True)
        return sum(entry.length for _, entry in index.items())

    mlx = tmp_path / "mlx"
    write_mlx_generation_checkpoint(mlx, PRESETS["tiny"], TEXT_PRESETS["tiny"], bits=4, seed=3)
    cache = ArtifactCache(tmp_path / "cache")
    for folder, precision in ((model, "f32"), (model, "bf16"), (mlx, None)):
        asked = precision_of(precision) if precision else text.checkpoint_precision(folder)
        cfg, graph = text.text_precision(folder, text.load_text_config(folder)[0], asked, "llvm-cpu")
        tower_cfg, _, tower, *_ = vision_source(str(folder), None, asked.tower)
        language = held(cached_text_archive(folder, cfg, graph, cache))
        assert sizing.weight_bytes(folder, precision, vision=False) == language
        assert sizing.weight_bytes(folder, precision) == language + held(cached_archive(folder, tower_cfg, tower, cache))
    resident = sizing.weight_bytes(model, "f32")
    block = sizing.kv_token_bytes(TEXT_PRESETS["tiny"]) * sizing.BLOCK
    monkeypatch.setattr(sizing, "available_memory", lambda: resident + 2 * 1000 * block)
    blocks, note = sizing.kv_blocks(model, (64,), 4096, 4, resident=resident)
    assert blocks == 1000 and "half the memory the weights" in note, note
    assert sizing.kv_blocks(model, (64,), 4096, 4)[0] > 1000  # the same machine, the weights forgotten


@pytest.mark.slow
def test_image_larger_than_the_default_ladder(model, tmp_path):
    """An image of more patches than the default vision ladder's top (512) gets a bucket
    of its own (the next power of two) instead of a packing error."""
    from PIL import Image

    def edit(folder):
        policy = dict(SMALL_POLICY, size={"shortest_edge": 4096, "longest_edge": 1 << 20})
        (folder / "preprocessor_config.json").write_text(json.dumps(policy))

    folder = copy_model(model, tmp_path, edit)
    image = tmp_path / "big.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (512, 608, 3), dtype=np.uint8)).save(image)
    out = qwen3vl("generate", "--model", folder, "--image", image, "--prompt", "What is shown here?",
                  "--max-new-tokens", 2, "--json", tmp_path / "r.json", "--prompt-bucket", 512, "--context", 520,
                  "--cache-dir", tmp_path / "cache")
    assert out.returncode == 0, out.stderr
    merged = (512 // 16) * (608 // 16) // 4  # 1216 patches > 512: bucket 2048
    assert json.loads((tmp_path / "r.json").read_text())["prompt_tokens"] > merged


RESIDENT_PROBE = """
import sys, numpy as np
from runtime.text import TextSession
def anon():  # bytes of this process's anonymous resident memory
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) * 1024
start = anon()
session = TextSession(sys.argv[1], buckets=(64,), context=80, cache_dir=sys.argv[2])
session.module  # archive and module from the cache (the first run wrote them): map, pack, let the pages go
logits = session.prefill(np.arange(40) + 5, np.broadcast_to(np.arange(40), (3, 40)))
session.decode(int(np.argmax(logits)), 40)
print(anon() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_text_weights_resident_once(tmp_path):
    """After load and a prefill + decode, the session holds one copy of its weights: the
    one IREE packed (every matrix but the embedding table, which the graph gathers rows of
    straight from the mapped archive), not the checkpoint's arrays besides it, nor a second
    packing for the one-row decode matmuls. Measured here: 1.03-1.05x the packed bytes;
    4.8x before (host arrays kept beside the packed copy, decode packing its own)."""
    import dataclasses

    from emitter.text import text_weights
    from runtime.checkpoints.synthetic_text import write_text_model

    cfg = dataclasses.replace(TEXT_PRESETS["tiny"], vocab_size=32768, hidden_size=512, intermediate_size=2048,
                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                              mrope_section=(12, 10, 10))
    write_text_model(tmp_path / "m", cfg, seed=1)
    packed = sum(int(np.prod(s.shape)) * 4 for s in text_weights(cfg) if not s.name.endswith("embed_tokens.weight"))
    for _ in range(2):  # the first fills the cache; the second, a fresh process, is measured
        out = subprocess.run([sys.executable, "-c", RESIDENT_PROBE, tmp_path / "m", tmp_path / "cache"],
                             capture_output=True, text=True, check=True)
    grown = int(out.stdout.split()[-1])
    print(f"resident: {grown / packed:.2f}x the {packed / 1e6:.0f} MB of packed weights")
    assert 0.9 * packed < grown < 1.2 * packed, (grown, packed)
