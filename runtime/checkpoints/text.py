"""Read the language model's weights of a checkpoint folder as exact f32 numpy arrays,
keyed by their Hugging Face names (`model.language_model.*`, `lm_head.weight`).

Hugging Face layout (one `model.safetensors`, shards listed by
`model.safetensors.index.json`, or several `*.safetensors`), f32, bf16 or f16 (widened
exactly). MLX names (`language_model.model.*`, `language_model.lm_head.weight`, as
mlx-vlm's sanitize writes them) too, affine-quantized or not: dequantized to f32 as the
vision loader does (bits and group size from config.json's `quantization`), or, under
`--precision native`, kept in their bits (`native_weights`, `read_affine`). Only the
text tensors' byte ranges are read, one weight at a time. Every problem is a
`CheckpointError` naming the tensor and the file.

The session does not hold these arrays: `artifact.archive.cached_text_archive` writes them once, in the
dtypes the graph takes, as a weight archive (.irpa) in the artifact cache, keyed by the
checkpoint's content like the vision archive (runtime/artifact/archive.py); the session maps it,
IREE packs the weights from it at load, and then the mapped pages are let go.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from emitter import experts, quant
from emitter.config import ConfigError
from emitter.text import text_weights, weight_layouts, weight_shapes
from emitter.text_config import LM_HEAD, TEXT_PREFIX, TextConfig, TokenIds, load_text_config

from runtime.checkpoints import vision as checkpoint
from runtime.checkpoints.tensor_files import (CheckpointError, ModelPart, TensorEntry, read_float_tensor,
                                              read_uint32_tensor, scan_tensors)
from runtime.checkpoints.mlx_quant import QuantConfig, dequantize_mlx, quantization_config, unpack_bytes
from runtime.checkpoints import gguf_text

# (prefix of the decoder's tensors, name of lm_head) per layout, in order of preference.
LAYOUTS = ((TEXT_PREFIX, LM_HEAD), ("language_model.model.", "language_model.lm_head.weight"))


# lm_head by the module, so that an MLX-quantized head's .scales and .biases come with it.
TEXT = ModelPart("language-model weights", tuple(prefix for prefix, _ in LAYOUTS) +
                 tuple(head[: -len("weight")] for _, head in LAYOUTS))


def model_text_config(model) -> tuple[TextConfig, TokenIds]:
    """The text config and special-token ids of `--model`: a checkpoint folder's config.json,
    or a llama.cpp GGUF text file's metadata (runtime/checkpoints/gguf_text.py)."""
    return gguf_text.text_config(model) if gguf_text.is_gguf(model) else load_text_config(model)


def scan_text_tensors(model_dir: Path) -> tuple[dict[str, TensorEntry], str]:
    """Every text tensor of the folder (names to byte ranges), and where they were found
    (`tensor_files.scan_tensors`: the same index, shard and duplicate checks as the vision side)."""
    return scan_tensors(model_dir, TEXT)


class Part(NamedTuple):
    """One stored tensor of a decoder weight: its stored name, where it lies, and the shape
    it holds as the graph takes it ([out, in], or an expert stack's [E, out, in])."""
    key: str
    entry: TensorEntry
    shape: tuple[int, ...]


def quantized_layout(key: str, entry: TensorEntry, found: dict[str, TensorEntry], shape: tuple[int, ...],
                     qconfig: QuantConfig | None) -> tuple[int, int, TensorEntry, TensorEntry]:
    """(bits, group, scales entry, biases entry) of an MLX affine-quantized [out, in] weight
    (or a stack of experts [E, out, in], mlx-vlm's switch_mlp); bits, group size and mode from
    config.json's `quantization` (the module's own entry first; `checkpoint.quant_settings`, as
    the vision side checks them), checked against the stored shapes."""
    module = key[: -len(".weight")]
    *stack, out, n_in = shape
    bits, group = checkpoint.quant_settings(key, entry, qconfig, (module,), n_in)
    scales_e, biases_e = found.get(module + ".scales"), found.get(module + ".biases")
    if scales_e is None or biases_e is None:
        raise CheckpointError(f"{key}: quantized, but {module}.scales or .biases is missing (in {entry.file})")
    groups = (*stack, out, n_in // group)
    if entry.shape != (*stack, out, n_in * bits // 32) or scales_e.shape != groups or biases_e.shape != groups:
        raise CheckpointError(f"{key}: stored shapes {list(entry.shape)}, {list(scales_e.shape)}, "
                              f"{list(biases_e.shape)} do not pack a {list(shape)} weight at {bits} bits, group "
                              f"{group} (in {entry.file})")
    return bits, group, scales_e, biases_e


def is_quantized(key: str, entry: TensorEntry, found: dict[str, TensorEntry]) -> bool:
    return entry.dtype == "U32" or key[: -len("weight")] + "scales" in found


def read_quantized(key: str, entry: TensorEntry, found: dict[str, TensorEntry], shape: tuple[int, ...],
                   qconfig: QuantConfig | None) -> np.ndarray:
    """An MLX affine-quantized [out, in] weight (or [E, out, in] stack) dequantized to f32
    (`quantized_layout`)."""
    bits, group, scales_e, biases_e = quantized_layout(key, entry, found, shape, qconfig)
    rows = int(np.prod(shape[:-1]))
    w = dequantize_mlx(read_uint32_tensor(entry).reshape(rows, -1), read_float_tensor(scales_e).reshape(rows, -1),
                       read_float_tensor(biases_e).reshape(rows, -1), bits, group)
    return w.reshape(shape)


def read_affine(parts: tuple[Part, ...], found: dict[str, TensorEntry], qconfig: QuantConfig | None,
                held: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An MLX affine-quantized weight as the archive holds it in its bits (or in `held` bits,
    `quant.held_bits`), never in f32: [out, in] as `quant.from_affine` gives it (q [in, out]
    re-centred, scales and biases f32); an expert stack, stored whole or per projection
    (`experts.switch_parts`, their rows concatenated: gate, then up), expert by expert:
    q [E, in, out] (at 4 bits [E, in * out / 2] bytes), scales and biases [E, out, groups]."""
    layouts = [quantized_layout(part.key, part.entry, found, part.shape, qconfig) for part in parts]
    bits = layouts[0][0]
    if len(parts) == 1 and len(parts[0].shape) == 2:
        return checkpoint.read_affine(parts[0].entry, bits, *layouts[0][2:], parts[0].shape, held)
    packed = [read_uint32_tensor(part.entry) for part in parts]
    scales, biases = ([_finite(read_float_tensor(e), e) for e in entries]
                      for entries in ([l[2] for l in layouts], [l[3] for l in layouts]))
    e, n_in = parts[0].shape[0], parts[0].shape[-1]
    shape = (sum(part.shape[1] for part in parts), n_in)
    stack = []
    for x in range(e):
        codes = np.concatenate([unpack_bytes(p[x], bits) for p in packed])
        stack.append(quant.from_affine(quant.row_blocks(codes), shape, np.concatenate([s[x] for s in scales]),
                                       np.concatenate([b[x] for b in biases]), held or bits))
    return tuple(np.stack(arrays) for arrays in zip(*stack))


def _finite(arr: np.ndarray, entry: TensorEntry) -> np.ndarray:
    if not np.isfinite(arr).all():
        raise CheckpointError(f"{entry.name}: non-finite values (in {entry.file})")
    return arr


def text_entries(model_dir, cfg: TextConfig) -> tuple[dict[str, tuple[Part, ...]], dict[str, TensorEntry]]:
    """Where each of the decoder's weights is stored, from the safetensors headers alone:
    {Hugging Face name: its parts} in `weight_shapes` order (one `Part`, but for an expert
    stack stored per projection as mlx-vlm's switch_mlp stores it: `stored_parts`), and every
    text tensor found. CheckpointError for a missing weight, a float expert or router shape
    that disagrees with the config, or a layer count that does. A GGUF file: its tensors
    checked (`gguf_text.text_tensors`), ({}, {})."""
    if gguf_text.is_gguf(model_dir):
        gguf_text.text_tensors(model_dir, cfg)
        return {}, {}
    model_dir = Path(model_dir)
    found, where = scan_text_tensors(model_dir)
    prefix, head = next(((p, h) for p, h in LAYOUTS if p + "embed_tokens.weight" in found), LAYOUTS[0])
    out = {}
    for name, shape in weight_shapes(cfg):
        key = head if name == LM_HEAD else prefix + name[len(TEXT_PREFIX):]
        out[name] = parts = stored_parts(key, shape, found, where, key == head)
        for part in parts:
            if (name.endswith(experts.ROUTER) or experts.is_expert(name)) and not is_quantized(*part[:2], found):
                check_expert_shape(*part)
    stem = prefix + "layers."
    layers = {n[len(stem):].split(".", 1)[0] for n in found if n.startswith(stem)}
    if len(layers) != cfg.num_hidden_layers:
        raise CheckpointError(f"text_config.num_hidden_layers = {cfg.num_hidden_layers} does not match the "
                              f"checkpoint, which holds {len(layers)} decoder layers (in {where})")
    used = {part.key for parts in out.values() for part in parts}
    used |= {key[: -len("weight")] + part for key in used for part in ("scales", "biases")}
    if cfg.tie_word_embeddings:
        used.add(head)  # stored beside tied embeddings: transformers ties it away, so do we
    unused = sorted(name for name in found if name not in used and not name.endswith(".inv_freq"))
    if unused:
        raise CheckpointError(f"{unused[0]}: a language-model tensor this config does not use"
                              f"{f' (and {len(unused) - 1} more)' if len(unused) > 1 else ''} (in {where})")
    return out, found


def stored_parts(key: str, shape: tuple[int, ...], found: dict[str, TensorEntry], where: str,
                 head: bool = False) -> tuple[Part, ...]:
    """The stored tensors of the weight stored as `key` (of the graph's `shape`): itself, or
    for an expert stack that the folder stores per projection, mlx-vlm's switch_mlp stacks
    (`experts.switch_parts`: gate_proj and up_proj for gate_up_proj). CheckpointError naming
    the missing tensor (the switch_mlp one where some of them are stored)."""
    if key in found:
        return (Part(key, found[key], tuple(shape)),)
    if experts.is_expert(key):
        switch = experts.switch_parts(key, shape)
        missing = [part for part, _ in switch if part not in found]
        if not missing:
            return tuple(Part(part, found[part], s) for part, s in switch)
        if len(missing) < len(switch):
            key = missing[0]
    hint = "; config.json says the embeddings are untied (tie_word_embeddings false)" if head else ""
    raise CheckpointError(f"{key}: missing{hint} (in {where})")


def check_expert_shape(key: str, entry: TensorEntry, shape: tuple[int, ...]) -> bool:
    """A mixture-of-experts router's or float expert stack's stored shape against the config's
    (a whole gate_up_proj or down_proj in either layout, `experts.orientation`; a switch_mlp
    stack as [E, out, in]); whether it is stored transposed. CheckpointError naming the
    tensor and its file."""
    if experts.is_expert(key):
        try:
            return experts.orientation(key, entry.shape, shape, entry.file)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
    if tuple(entry.shape) != tuple(shape):
        what = "[num_experts, hidden_size]" if len(shape) == 2 else "[num_experts, out, in]"
        raise CheckpointError(f"{key}: stored shape {list(entry.shape)}: expected {list(shape)} ({what} of the "
                              f"config) (in {entry.file})")
    return False


def native_weights(model_dir, cfg: TextConfig) -> tuple[tuple, ...]:
    """(Hugging Face name, bits, group size) of each weight the folder stores MLX-quantized in
    bits that run as stored (8 and 4, `quant.STORAGE_DTYPE`), from the headers and config.json
    (`TextConfig.native_weights`; other bits are expanded to f32 at load). An expert stack
    stored per projection is one weight: its parts quantized alike (else CheckpointError).
    CheckpointError where there is none. A GGUF file's quantized weights
    (`gguf_text.native_weights`)."""
    if gguf_text.is_gguf(model_dir):
        out = gguf_text.native_weights(model_dir, cfg)
        if not out:
            raise CheckpointError(f"{model_dir}: --precision native: no language-model weight is quantized "
                                  f"(expected some of {', '.join(gguf_text.LAYOUTS)}; nothing runs in its bits)")
        return out
    entries, found = text_entries(model_dir, cfg)
    qconfig = quantization_config(Path(model_dir))
    out = []
    for name, _ in weight_shapes(cfg):
        parts = entries[name]
        quantized = [is_quantized(part.key, part.entry, found) for part in parts]
        if not any(quantized):
            continue
        forms = [quantized_layout(part.key, part.entry, found, part.shape, qconfig)[:2] if q else None
                 for part, q in zip(parts, quantized)]
        if len(set(forms)) > 1:
            said = ", ".join(f"{part.key} " + (f"{form[0]}-bit groups of {form[1]}" if form else "float")
                             for part, form in zip(parts, forms))
            raise CheckpointError(f"{name}: its parts are stored in different forms ({said}): expected one "
                                  f"(in {parts[0].entry.file})")
        bits, group = forms[0]
        if bits in quant.STORAGE_DTYPE:
            out.append((name, bits, group))
    if not out:
        raise CheckpointError(f"{model_dir}: --precision native: no language-model weight is MLX-quantized in 8 or 4 "
                              "bits (expected a checkpoint as mlx-vlm's convert --quantize writes it)")
    return tuple(out)


def read_text_weight(parts: tuple[Part, ...], found: dict[str, TensorEntry], qconfig: QuantConfig | None
                     ) -> np.ndarray:
    """One of the decoder's weights as exact f32 (widened, or dequantized from MLX's layout),
    each part checked for its shape and for non-finite values; an expert stack stored per
    projection, its parts' rows concatenated (gate, then up)."""
    arrays = [read_part(*part, found, qconfig) for part in parts]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1)


def read_part(key: str, entry: TensorEntry, shape: tuple[int, ...], found: dict[str, TensorEntry],
              qconfig: QuantConfig | None) -> np.ndarray:
    """One stored tensor of a decoder weight as exact f32 (`read_text_weight`)."""
    if is_quantized(key, entry, found):
        w = read_quantized(key, entry, found, shape, qconfig)
    elif experts.is_expert(key):  # [E, out, in], whichever way the file holds it
        w = read_float_tensor(entry)
        if check_expert_shape(key, entry, shape):
            w = np.ascontiguousarray(w.transpose(0, 2, 1))
    else:
        w = read_float_tensor(entry)
    if w.shape != shape:
        raise CheckpointError(f"{key}: unexpected shape {list(w.shape)} (expected {list(shape)}) (in {entry.file})")
    return _finite(w, entry)


def load_text_weights(model_dir, cfg: TextConfig) -> dict[str, np.ndarray]:
    """The decoder's weights as f32 arrays, keyed by Hugging Face name in `weight_shapes`
    order (lm_head absent when tied); a GGUF file's by `gguf.quants.dequantize`."""
    if gguf_text.is_gguf(model_dir):
        return gguf_text.load_text_weights(model_dir, cfg)
    entries, found = text_entries(model_dir, cfg)
    qconfig = quantization_config(Path(model_dir))
    return {name: read_text_weight(entries[name], found, qconfig) for name, _ in weight_shapes(cfg)}


def text_arrays(model_dir, cfg: TextConfig, precision: str = "f32") -> Iterator:
    """(name, array) in graph order (`text_weights(cfg, precision)`), each in the dtype the
    graph takes, yielded one weight at a time (no f32 copy of the whole model): f32; bf16 (round
    to nearest even); int8, int4 (`quant.stored`, the weight then its scales); an MLX weight
    run in its bits (`cfg.native_weights`: `read_affine`, the weight, its scales and biases;
    an expert stack's too)."""
    import ml_dtypes
    if gguf_text.is_gguf(model_dir):
        yield from gguf_text.text_arrays(model_dir, cfg, precision)
        return
    entries, found = text_entries(model_dir, cfg)
    qconfig = quantization_config(Path(model_dir))
    layouts = weight_layouts(cfg, precision, [name for name, _ in weight_shapes(cfg)])
    pending = {}
    for s in text_weights(cfg, precision):
        if s.name in pending:  # made with its weight, just before
            yield (s.name, pending.pop(s.name))
            continue
        layout, parts = layouts.get(s.name), entries[s.name]
        if layout and layout.affine:
            q, pending[quant.scales_name(s.name)], pending[quant.biases_name(s.name)] = read_affine(
                parts, found, qconfig, layout.bits)
        elif layout:
            q, pending[quant.scales_name(s.name)] = layout.store(read_text_weight(parts, found, qconfig))
        else:
            w = read_text_weight(parts, found, qconfig)
            q = w if s.dtype == "f32" else w.astype(ml_dtypes.bfloat16)
        yield (s.name, q)
