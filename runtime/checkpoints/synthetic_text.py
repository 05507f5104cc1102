"""A random-weight Qwen3-VL checkpoint that can answer: the vision checkpoint of
`synthetic.write_checkpoint` plus a whole language model, a byte-level BPE tokenizer
trained on the spot (with Qwen's special tokens), a chat template and a generation
config. Written without torch; transformers loads it as it loads a released one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from emitter.atomic import folder_atomic, write_atomic
from emitter.config import VisionConfig
from emitter.experts import is_expert
from emitter.text import text_weights
from emitter.text_config import DENSE_MODEL_TYPE, LM_HEAD, MOE_MODEL_TYPE, TEXT_PREFIX, TextConfig

from runtime.checkpoints.synthetic import (check_new_folder, safetensors_header, write_checkpoint,
                                           write_safetensors)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
# Added after training, as Qwen3's vocabulary adds them (not special: they decode as text).
TOOL_AND_THINK_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
TEMPLATES = Path(__file__).parent / "chat_templates"


def chat_template(thinking: bool = False) -> str:
    """Qwen3-VL-Instruct's chat template (chat_template.json of Qwen/Qwen3-VL-2B/8B-Instruct,
    byte for byte: tools rendered into the system turn, calls as `<tool_call>{json}</tool_call>`);
    `thinking`: the same with the Thinking models' generation prompt (`<think>` opened),
    closed empty when `enable_thinking` is false (as Qwen3's templates do)."""
    text = (TEMPLATES / "qwen3_vl_instruct.jinja").read_text(encoding="utf-8")
    if thinking:
        prompt = "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
        assert text.endswith(prompt)
        text = text[:-len(prompt)] + ("    {{- '<|im_start|>assistant\\n' }}\n"
                                      "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
                                      "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
                                      "    {%- else %}\n"
                                      "        {{- '<think>\\n' }}\n"
                                      "    {%- endif %}\n{%- endif %}\n")
    return text


WORDS = ("the a image cat dog bird red green blue left right small large describe what is shown here "
         "picture photo sky tree house road two three one and of in on with near far").split()


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE (the `tokenizers` library) trained on random sentences of WORDS:
    the special tokens first (ids 0..6), then the 256 bytes, then merges, then the four
    TOOL_AND_THINK_TOKENS as added tokens (the last ids below vocab_size)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(seed)
    corpus = [" ".join(rng.choice(WORDS, 12)) + "." for _ in range(400)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TOOL_AND_THINK_TOKENS), special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_AND_THINK_TOKENS])
    return tokenizer


def random_text_weights(cfg: TextConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """f32 weights by Hugging Face name (see `random_text_tensors`)."""
    return dict(random_text_tensors(cfg, seed))


def random_text_tensors(cfg: TextConfig, seed: int = 0):
    """(Hugging Face name, f32 weight) in `text_weights` order, drawn one at a time:
    embeddings N(0, 1), projections N(0, 1/fan_in) (o_proj and down_proj at half gain),
    RMSNorm weights 1 + 0.1 N(0, 1), so that the logits spread over several units and
    greedy choices are well separated."""
    rng = np.random.default_rng(seed)
    for spec in text_weights(cfg):
        z = rng.standard_normal(spec.shape, dtype=np.float32)
        if spec.name.endswith("norm.weight"):
            w = 1.0 + 0.1 * z
        elif spec.name.endswith("embed_tokens.weight"):
            w = z
        else:  # [out, in], or an expert stack [E, out, in]
            gain = 0.5 if spec.name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")) else 1.0
            w = z * np.float32(gain / np.sqrt(spec.shape[-1]))
        yield spec.name, np.ascontiguousarray(w, np.float32)


def write_text_model(folder, cfg: TextConfig, seed: int = 0, config: dict | None = None,
                     shard_bytes: int = 1 << 30) -> None:
    """A language-model-only checkpoint of random f32 weights (`random_text_tensors`) in a
    new folder: shards of about `shard_bytes` with `model.safetensors.index.json`, and a
    config.json (`config` on top of the text config and tying). Drawn and written a shard
    at a time, so memory stays near one shard even at a full preset's size."""
    from runtime.checkpoints.tensor_files import INDEX_NAME

    folder = Path(folder)
    folder.mkdir()
    weight_map, shard, size = {}, {}, 0

    def flush():
        name = f"model-{len(set(weight_map.values())):05d}.safetensors"
        write_safetensors(folder / name, {k: ("F32", w.shape, memoryview(w).cast("B")) for k, w in shard.items()})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, w in stored_text_tensors(cfg, seed):
        shard[name] = w
        size += w.nbytes
        if size >= shard_bytes:
            flush()
            size = 0
    if shard:
        flush()
    _write_json(folder / INDEX_NAME, {"metadata": {}, "weight_map": weight_map})
    model_type = MOE_MODEL_TYPE if cfg.num_experts else DENSE_MODEL_TYPE
    _write_json(folder / "config.json", {"model_type": model_type, "tie_word_embeddings": cfg.tie_word_embeddings,
                                         "text_config": cfg.to_hf_text_config(), **(config or {})})


EXPERT_LAYOUTS = ("released", "transformers")


def write_generation_checkpoint(model_dir, vision: VisionConfig, text: TextConfig, seed: int = 0,
                                processor_policy_dict: dict | None = None, thinking: bool = False,
                                expert_layout: str = "released") -> None:
    """Write the folder (new or empty; whole or not at all: built in a temp folder beside
    it, then renamed). The text hidden size must be the vision tower's out_hidden_size.
    `thinking`: the Thinking variant of the chat template (`chat_template`). A text config
    with experts makes a `qwen3_vl_moe` checkpoint, its expert stacks stored as Qwen's files
    store them (`expert_layout` "released": [E, in, out]) or as transformers 5 saves them
    ("transformers": [E, out, in])."""
    if text.hidden_size != vision.out_hidden_size:
        raise ValueError(f"text hidden_size {text.hidden_size} != vision out_hidden_size {vision.out_hidden_size}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout {expert_layout!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")
    model_dir = Path(model_dir)
    check_new_folder(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with folder_atomic(model_dir) as tmp:
        write_checkpoint(tmp, vision, seed=seed, processor_policy_dict=processor_policy_dict,
                         model_type=MOE_MODEL_TYPE if text.num_experts else DENSE_MODEL_TYPE)
        _add_language_model(tmp, text, seed, thinking, expert_layout)


def _add_language_model(model_dir: Path, text: TextConfig, seed: int, thinking: bool = False,
                        expert_layout: str = "released") -> None:
    """Tokenizer, template, generation config and the whole text model into a vision checkpoint."""
    from safetensors.numpy import load_file
    stored = {name: a for name, a in load_file(str(model_dir / "model.safetensors")).items()
              if not name.startswith(TEXT_PREFIX) and name != LM_HEAD}
    _write_with_text(model_dir / "model.safetensors", stored, text, seed + 7, expert_layout)
    add_language_files(model_dir, text, seed, thinking)


def stored_text_tensors(text: TextConfig, seed: int, expert_layout: str = "released"):
    """`random_text_tensors` as a checkpoint stores them: expert stacks transposed to
    [E, in, out] in the "released" layout."""
    for name, w in random_text_tensors(text, seed):
        if is_expert(name) and expert_layout == "released":
            w = np.ascontiguousarray(w.transpose(0, 2, 1))
        yield name, w


def add_language_files(model_dir: Path, text: TextConfig, seed: int, thinking: bool = False) -> None:
    """What a checkpoint holds for its language model beside the weights: the tokenizer,
    its ids and the text config in config.json, the chat template, the generation config."""
    tokenizer = train_tokenizer(text.vocab_size, seed)
    if tokenizer.get_vocab_size() > text.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size {text.vocab_size}")
    ids = {name: tokenizer.token_to_id(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]

    config = json.loads((model_dir / "config.json").read_text())
    config.update(ids, tie_word_embeddings=text.tie_word_embeddings, text_config=text.to_hf_text_config())
    config["text_config"]["eos_token_id"] = eos[0]
    _write_json(model_dir / "config.json", config)
    write_atomic(model_dir / "tokenizer.json", tokenizer.to_str())
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": 262144, "add_prefix_space": False})
    write_atomic(model_dir / "chat_template.jinja", chat_template(thinking).encode())
    _write_json(model_dir / "generation_config.json", {"eos_token_id": eos, "pad_token_id": eos[1],
                                                       "do_sample": False})


def _write_with_text(path: Path, stored: dict[str, np.ndarray], text: TextConfig, seed: int,
                     expert_layout: str = "released") -> None:
    """One safetensors file: the `stored` tensors, then the random text weights, drawn and
    written one at a time (a whole 2B preset never sits in memory). Inside the temp folder
    that is renamed whole; written beside `path` and renamed over it, since `stored` may
    have been read from it."""
    entries = [(name, _tag(a), a.shape, a.nbytes) for name, a in stored.items()]
    flip = expert_layout == "released"
    entries += [(s.name, "F32", (s.shape[0], s.shape[2], s.shape[1]) if flip and is_expert(s.name) else s.shape,
                 int(np.prod(s.shape)) * 4) for s in text_weights(text)]
    new = path.with_name(path.name + ".new")
    with open(new, "wb") as f:
        f.write(safetensors_header(entries, {"format": "pt"}))
        for a in stored.values():
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
        for _, w in stored_text_tensors(text, seed, expert_layout):
            f.write(memoryview(w.astype("<f4", copy=False)).cast("B"))
    os.replace(new, path)


def _tag(a: np.ndarray) -> str:
    return {"float32": "F32", "float16": "F16", "uint32": "U32"}[str(a.dtype)]


def _write_json(path: Path, value: dict) -> None:
    write_atomic(path, (json.dumps(value, indent=2) + "\n").encode())

