"""GGUF files for the tests (tests/test_gguf.py, tests/test_gguf_k.py): a random
checkpoint converted by llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python
sdist, runtime/bench/llamacpp.py), a file re-encoded by GGUFWriter (gguf's quantize, or the
K-quants by gguf_encode.py), gguf's dequantization of a file as a Hugging Face folder, and
a folder holding a text file beside its mmproj as llama.cpp users download them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from emitter.config import preset
from runtime.bench import llamacpp
from runtime.checkpoints import gguf_text
from runtime.checkpoints.synthetic import write_safetensors
from runtime.checkpoints.synthetic_text import write_generation_checkpoint
from runtime.checkpoints.text import load_text_weights, model_text_config


def converted_checkpoint(work, cfg, seed: int):
    """(a random checkpoint in work/hf with the text config `cfg` and Qwen's pre-tokenizer,
    convert(file name, *converter options) -> the path llama.cpp's converter wrote in work)."""
    ckpt = work / "hf"
    vision = dataclasses.replace(preset("tiny"), out_hidden_size=cfg.hidden_size)
    write_generation_checkpoint(ckpt, vision, cfg, seed=seed)
    qwen2_pre_tokenizer(ckpt / "tokenizer.json")
    llamacpp.DEFAULT_WORK.mkdir(parents=True, exist_ok=True)
    src = llamacpp.fetch_source(llamacpp.DEFAULT_WORK, llamacpp.VERSION)
    llamacpp.patch_converter(src)
    return ckpt, lambda name, *args: llamacpp.convert(src, ckpt, work / name, list(args), work / "convert.log")


def qwen2_pre_tokenizer(path):
    """The random tokenizer given the pre-tokenizer of Qwen's own tokenizer.json (the split
    then byte-level without its regex), so that it is the tokenizer a real Qwen3-VL has."""
    tj = json.loads(path.read_text())
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": gguf_text.QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    path.write_text(json.dumps(tj))


def requantize(src, dst, qtype, arch=gguf_text.ARCH, fields=None, drop=()):
    """The file at `src` rewritten with GGUFWriter, its 2-D weights but the embedding table
    quantized to `qtype` (None: as they are; a function of the tensor's name and f32 data:
    each tensor's type or None) by `gguf.quants.quantize`, or for the K-quants the tests'
    encoder (gguf_encode.py); `fields` replace metadata values, the tensors named in `drop`
    are left out (metadata and the other tensors as they are)."""
    import gguf

    from gguf_encode import ENCODERS, encode

    if not callable(qtype):
        qtype = (lambda kind: lambda name, data: kind if data.ndim == 2 and name != "token_embd.weight" else None)(
            qtype)
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), arch=arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        value = (fields or {}).get(key, f.contents())
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name in drop:
            continue
        kind = qtype(t.name, data)
        if kind is not None:
            raw = encode(data, kind.name) if kind.name in ENCODERS else gguf.quants.quantize(data, kind)
            w.add_tensor(t.name, raw, raw_shape=gguf.quants.quant_shape_to_byte_shape(data.shape, kind),
                         raw_dtype=kind)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def dequantized_folder(path, folder):
    """A Hugging Face folder of the GGUF file's weights as `gguf.quants.dequantize` gives them."""
    cfg, _ = model_text_config(path)
    folder.mkdir()
    weights = load_text_weights(path, cfg)
    write_safetensors(folder / "model.safetensors",
                      {k: ("F32", w.shape, memoryview(np.ascontiguousarray(w)).cast("B")) for k, w in weights.items()})
    model_type = "qwen3_vl_moe" if cfg.num_experts else "qwen3_vl"
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "tie_word_embeddings":
                                                    cfg.tie_word_embeddings, "text_config": cfg.to_hf_text_config()}))
    return folder


def model_folder(files, tmp_path, text="f32", mmproj="f32", name="model"):
    """A folder holding the text file and its mmproj, as llama.cpp users download them."""
    import os

    folder = tmp_path / name
    folder.mkdir()
    os.link(files[text], folder / f"Qwen3VL-{text}.gguf")
    os.link(files[f"mmproj-{mmproj}"], folder / f"mmproj-Qwen3VL-{mmproj}.gguf")
    return folder
