"""Read the vision-tower weights of a checkpoint folder as exact f32 numpy arrays.

Two layouts are understood:

* Hugging Face: tensors named `model.visual.*` (some checkpoints store `visual.*`),
  one `model.safetensors` or shards listed by `model.safetensors.index.json`, or
  several `*.safetensors` without an index (their headers are scanned).
* MLX (mlx-vlm conversions): tensors named `vision_tower.*` with the same suffixes,
  the patch-embed conv stored channels-last [h, T, P, P, C], and linears (or the
  position table) optionally affine-quantized (`mlx_quant`), with the bits and group
  size that config.json's `quantization` block gives each module (global, or a
  per-module entry as mlx-lm / mlx-vlm write them): the stored shapes must agree.

Only the vision tensors are read, and every one the checkpoint holds must be one the
config uses (a `depth` smaller than the checkpoint's is an error, not a silent cut).
Index entries must name files inside the folder. With an index, only the shards
holding vision tensors are opened; within a shard only the vision tensors' byte
ranges are read, so a large checkpoint's text weights are never loaded. bf16 and f16
are widened to f32 exactly. Every problem is a `CheckpointError` whose one-line
message names the tensor and the file. The files themselves (headers, byte ranges, the
folder scan) are read by `tensor_files`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emitter import quant
from emitter.config import CONV_WEIGHT, HF_PREFIX, MATMUL_WEIGHT_SUFFIXES, VisionConfig, weight_schema
from emitter.vision import graph_weights

from runtime.checkpoints.mlx_quant import (QUANT_BITS, QuantConfig, dequantize_mlx, quantization_config,
                                           unpack_bytes)
from runtime.checkpoints.tensor_files import (CheckpointError, ModelPart, TensorEntry, check_float, read_float_tensor,
                                              read_uint32_tensor, scan_tensors)

MLX_PREFIX = "vision_tower."
VISION_PREFIXES = (HF_PREFIX, "visual.", MLX_PREFIX)  # in order of preference
CONV_NAME = CONV_WEIGHT[len(HF_PREFIX):]  # the suffix every layout shares


# --------------------------------------------------------------------------- MLX settings

def _module_paths(module: str) -> tuple[str, ...]:
    """A module's stored path and its other spellings, as config entries may key it."""
    for prefix in VISION_PREFIXES:
        if module.startswith(prefix):
            rest = module[len(prefix):]
            return (module, *(p + rest for p in VISION_PREFIXES if p != prefix))
    return (module,)


def quant_settings(key: str, entry: TensorEntry, qconfig: QuantConfig | None,
                    paths: tuple[str, ...], n_in: int) -> tuple[int, int]:
    """(bits, group_size) the config gives a stored quantized weight, checked to be usable."""
    if qconfig is None:
        raise CheckpointError(f"{key}: quantized ({entry.dtype}) but {entry.file.parent / 'config.json'} has "
                              f"no 'quantization' block giving bits and group_size (as mlx-vlm writes it)")
    settings, source = qconfig.module(paths)
    if settings is None:
        raise CheckpointError(f"{key}: quantized ({entry.dtype}) but {source} is false (unquantized) "
                              f"(in {entry.file})")
    mode = settings.get("mode", "affine")
    if mode != "affine":
        raise CheckpointError(f"{key}: quantization mode {mode!r} ({source}) is not supported; "
                              f"expected 'affine' (in {entry.file})")
    bits, group_size = settings.get("bits"), settings.get("group_size")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in QUANT_BITS:
        raise CheckpointError(f"{key}: {source} gives bits {bits!r}; expected one of "
                              f"{', '.join(map(str, QUANT_BITS))}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0 or n_in % group_size:
        raise CheckpointError(f"{key}: {source} gives group_size {group_size!r}; expected a positive "
                              f"divisor of the weight's {n_in} inputs")
    return bits, group_size


# --------------------------------------------------------------------------- folder scan

VISION = ModelPart("vision weights", VISION_PREFIXES)


def scan_vision_tensors(model_dir: str | Path) -> tuple[dict[str, TensorEntry], str]:
    """`scan_tensors` of the vision tower."""
    return scan_tensors(model_dir, VISION)


def _choose_prefix(found: dict[str, TensorEntry]) -> str:
    for prefix in VISION_PREFIXES:
        if prefix + CONV_NAME in found:
            return prefix
    for prefix in VISION_PREFIXES:
        if any(name.startswith(prefix) for name in found):
            return prefix
    raise AssertionError("unreachable: found holds only vision names")


# --------------------------------------------------------------------------- matching

@dataclass(frozen=True)
class StoredWeight:
    """One graph weight as the checkpoint stores it, checked from the headers alone:
    `quant` is (bits, group_size, scales entry, biases entry) for an MLX-quantized one."""
    hf_name: str
    shape: tuple[int, ...]  # the graph's
    entry: TensorEntry
    quant: tuple[int, int, TensorEntry, TensorEntry] | None = None


def _indexed_count(found: dict[str, TensorEntry], stem: str) -> int:
    """1 + the largest k of the tensors named `{stem}{k}.*` (0 if none)."""
    ks = [name[len(stem):].split(".", 1)[0] for name in found if name.startswith(stem)]
    return 1 + max((int(k) for k in ks if k.isdigit()), default=-1)


def check_structure(found: dict[str, TensorEntry], prefix: str, cfg: VisionConfig, where: str) -> None:
    """The config's block and DeepStack-merger counts against the tensors the checkpoint
    holds; names only, so a wild `depth` fails before anything is built per block."""
    blocks = _indexed_count(found, prefix + "blocks.")
    if cfg.depth != blocks:
        raise CheckpointError(f"config.json: vision_config.depth = {cfg.depth}, but the checkpoint holds {blocks} "
                              f"blocks ({prefix}blocks.0-{blocks - 1} in {where})")
    mergers = _indexed_count(found, prefix + "deepstack_merger_list.")
    taps = len(cfg.deepstack_visual_indexes)
    if taps != mergers:
        raise CheckpointError(f"config.json: vision_config.deepstack_visual_indexes = "
                              f"{list(cfg.deepstack_visual_indexes)} names {taps} DeepStack blocks, but the "
                              f"checkpoint holds {mergers} DeepStack mergers ({prefix}deepstack_merger_list.* "
                              f"in {where})")


def _is_quantized(key: str, entry: TensorEntry, found: dict[str, TensorEntry]) -> bool:
    return entry.dtype == "U32" or (key.endswith(".weight") and key[:-7] + ".scales" in found)


def _quantized_layout(key: str, entry: TensorEntry, found: dict[str, TensorEntry], shape: tuple[int, ...],
                      qconfig: QuantConfig | None) -> tuple[int, int, TensorEntry, TensorEntry]:
    """An MLX affine-quantized weight's stored shapes checked against the bits and group
    size the config gives its module (never guessed from the shapes)."""
    module = key[: -len(".weight")] if key.endswith(".weight") else key
    if len(shape) != 2:
        raise CheckpointError(f"{key}: quantized, but only 2-D weights can be (expected "
                              f"{list(shape)}) (in {entry.file})")
    if entry.dtype != "U32":
        raise CheckpointError(f"{key}: unsupported dtype {entry.dtype} for a quantized weight (it has "
                              f"{module}.scales; expected U32) (in {entry.file})")
    out, n_in = shape
    paths = _module_paths(module)
    bits, group_size = quant_settings(key, entry, qconfig, paths, n_in)
    scales_e, biases_e = found.get(module + ".scales"), found.get(module + ".biases")
    if scales_e is None:
        raise CheckpointError(f"{key}: quantized ({entry.dtype}) but {module}.scales is missing "
                              f"(in {entry.file})")
    if biases_e is None:
        raise CheckpointError(f"{key}: quantized but {module}.biases is missing (in {entry.file})")
    if (n_in * bits) % 32 or entry.shape != (out, n_in * bits // 32):
        raise CheckpointError(f"{key}: stored shape {list(entry.shape)}, but {bits}-bit codes for a "
                              f"{list(shape)} weight pack into [{out}, {n_in * bits / 32:g}] uint32 "
                              f"(bits {bits} from {qconfig.module(paths)[1]}) (in {entry.file})")
    groups = (out, n_in // group_size)
    for e in (scales_e, biases_e):
        check_float(e)
        if e.shape != groups:
            raise CheckpointError(f"{e.name}: stored shape {list(e.shape)}, but group_size {group_size} "
                                  f"over a {list(shape)} weight needs {list(groups)} (in {e.file})")
    return bits, group_size, scales_e, biases_e


def _conv_layouts(cfg: VisionConfig) -> dict[tuple[int, ...], str]:
    """The stored shapes the patch-embed conv may take, each with its layout."""
    h, c, t, p, _ = cfg.conv_shape
    return {cfg.conv_shape: "hf", (h, t, p, p, c): "channels-last", (h, cfg.patch_dim): "flat"}


def _stored_weight(hf_name: str, shape: tuple[int, ...], prefix: str, found: dict[str, TensorEntry],
                   qconfig: QuantConfig | None, cfg: VisionConfig, where: str) -> StoredWeight:
    key = prefix + hf_name[len(HF_PREFIX):]
    entry = found.get(key)
    if entry is None:
        raise CheckpointError(f"{key}: missing (in {where})")
    if hf_name == CONV_WEIGHT:
        check_float(entry)
        if entry.shape not in _conv_layouts(cfg):
            hf_shape, mlx_shape = list(_conv_layouts(cfg))[:2]
            raise CheckpointError(f"{key}: unexpected shape {list(entry.shape)} (expected {list(hf_shape)}, or "
                                  f"{list(mlx_shape)} channels-last) (in {entry.file})")
        return StoredWeight(hf_name, shape, entry)
    if _is_quantized(key, entry, found):
        return StoredWeight(hf_name, shape, entry, _quantized_layout(key, entry, found, shape, qconfig))
    paths = _module_paths(key[: -len(".weight")]) if key.endswith(".weight") else ()
    if paths and qconfig is not None and qconfig.names_module(paths):
        raise CheckpointError(f"{key}: stored unquantized ({entry.dtype}), but {qconfig.module(paths)[1]} "
                              f"gives it quantization settings (in {entry.file})")
    check_float(entry)
    if entry.shape != shape:
        raise CheckpointError(f"{key}: unexpected shape {list(entry.shape)} (expected {list(shape)}) "
                              f"(in {entry.file})")
    return StoredWeight(hf_name, shape, entry)


def _check_all_used(found: dict[str, TensorEntry], used: set[str]) -> None:
    """Every vision tensor the checkpoint holds is one the config reads."""
    unused = sorted(set(found) - used)
    if unused:
        first = found[unused[0]]
        raise CheckpointError(f"{first.name}: a vision tensor the config does not use ({len(unused)} unused "
                              f"in all); config.json does not match the checkpoint (in {first.file})")


def check_checkpoint(model_dir: str | Path, cfg: VisionConfig) -> list[StoredWeight]:
    """Match `cfg` against the vision tensors of a checkpoint folder, from the safetensors
    headers (and index) alone, no tensor data read: block and DeepStack-merger counts
    first (so a wild `depth` fails before anything is built per block), then every graph
    weight present with a usable dtype and shape (each quantized one against the bits and
    group size config.json's `quantization` gives it), and no vision tensor left unused.
    Returns the graph weights in `weight_schema(cfg)` order."""
    model_dir = Path(model_dir)
    found, where = scan_vision_tensors(model_dir)
    prefix = _choose_prefix(found)
    check_structure(found, prefix, cfg, where)
    qconfig = quantization_config(model_dir)
    stored = [_stored_weight(name, shape, prefix, found, qconfig, cfg, where) for name, shape in weight_schema(cfg)]
    used = {s.entry.name for s in stored} | {e.name for s in stored if s.quant for e in s.quant[2:]}
    _check_all_used(found, used)
    return stored


# --------------------------------------------------------------------------- loading

def _read_stored(s: StoredWeight, cfg: VisionConfig) -> np.ndarray:
    """One graph weight as exact f32: widened or dequantized, the conv reordered to
    (C, T, P, P) and flattened, finiteness checked."""
    if s.quant:
        bits, group_size, scales_e, biases_e = s.quant
        packed = read_uint32_tensor(s.entry)
        scales, biases = read_float_tensor(scales_e), read_float_tensor(biases_e)
        for arr, e in ((scales, scales_e), (biases, biases_e)):
            if not np.isfinite(arr).all():
                raise CheckpointError(f"{e.name}: non-finite values (in {e.file})")
        w = dequantize_mlx(packed, scales, biases, bits, group_size)
    else:
        w = read_float_tensor(s.entry)
        if s.hf_name == CONV_WEIGHT and _conv_layouts(cfg)[w.shape] == "channels-last":
            w = w.transpose(0, 4, 1, 2, 3)  # [h, T, P, P, C] -> [h, C, T, P, P]
        w = w.reshape(s.shape)
    if not np.isfinite(w).all():
        bad = int(np.size(w) - np.count_nonzero(np.isfinite(w)))
        raise CheckpointError(f"{s.entry.name}: {bad} non-finite values (in {s.entry.file})")
    return np.ascontiguousarray(w, dtype=np.float32)


def read_affine(entry: TensorEntry, bits: int, scales_e: TensorEntry, biases_e: TensorEntry,
                shape: tuple[int, int], held: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An MLX affine-quantized [out, in] weight (its stored layout checked) as the archive
    holds it in its bits (or in `held` bits, `quant.held_bits`): `quant.from_affine`'s q
    [in, out] re-centred, scales and biases f32, converted a block of rows at a time; never
    in f32."""
    scales, biases = read_float_tensor(scales_e), read_float_tensor(biases_e)
    for arr, e in ((scales, scales_e), (biases, biases_e)):
        if not np.isfinite(arr).all():
            raise CheckpointError(f"{e.name}: non-finite values (in {e.file})")
    packed = read_uint32_tensor(entry)
    return quant.from_affine((unpack_bytes(rows, bits) for rows in quant.row_blocks(packed)), shape, scales, biases,
                             held or bits)


def vision_native_weights(model_dir: str | Path, cfg: VisionConfig) -> tuple[tuple[str, int, int], ...]:
    """(Hugging Face name, bits, group size) of each linear the folder stores MLX-quantized in
    bits that run as stored (8 and 4), from the headers and config.json
    (`VisionConfig.native_weights`; other bits, and the position table, are expanded to f32).
    Its calls being many rows, each is dequantized per call: a 4-bit one whose outputs IREE
    cannot tile in i4 is listed, and held, at 8 bits (`quant.held_bits`)."""
    return tuple((s.hf_name, quant.held_bits(s.quant[0], s.shape[0]), s.quant[1])
                 for s in check_checkpoint(model_dir, cfg)
                 if s.quant and s.quant[0] in quant.STORAGE_DTYPE and s.hf_name.endswith(MATMUL_WEIGHT_SUFFIXES))


def vision_arrays(model_dir: str | Path, cfg: VisionConfig, precision: str = "f32") -> Iterator[np.ndarray]:
    """The graph's ordered weight arguments (`graph_weights(cfg, precision)`), each in the
    dtype the graph takes, yielded one weight at a time: f32, bf16 (round to nearest even), or
    for `cfg.native_weights` in their bits (`read_affine`: q, then its scales and biases)."""
    import ml_dtypes
    stored = {s.hf_name: s for s in check_checkpoint(model_dir, cfg)}
    affine = {name: bits for name, bits, _ in cfg.native_weights}
    pending = {}
    for w in graph_weights(cfg, precision):
        if w.name in pending:  # made with its weight, just before
            yield pending.pop(w.name)
        elif w.name in affine:
            s = stored[w.name]
            q, pending[quant.scales_name(w.name)], pending[quant.biases_name(w.name)] = read_affine(
                s.entry, s.quant[0], *s.quant[2:], s.shape, held=affine[w.name])
            yield q
        else:
            a = _read_stored(stored[w.name], cfg)
            yield a if w.dtype == "f32" else a.astype(ml_dtypes.bfloat16)


def load_vision_weights(model_dir: str | Path, cfg: VisionConfig) -> dict[str, np.ndarray]:
    """The graph's weight arguments as f32 arrays, keyed by their Hugging Face names in
    `weight_schema(cfg)` order; the patch-embed conv flattened to [hidden, patch_dim] in
    (C, T, P, P) order. Everything `check_checkpoint` checks is checked before any tensor
    data is read."""
    return {s.hf_name: _read_stored(s, cfg) for s in check_checkpoint(model_dir, cfg)}


def weights_in_order(weights: dict[str, np.ndarray], cfg: VisionConfig, precision: str = "f32") -> list[np.ndarray]:
    """The arrays of `load_vision_weights` as the graph's ordered weight arguments, each
    in the dtype the graph takes under `precision` (bf16: round to nearest even)."""
    import ml_dtypes
    return [weights[w.name] if w.dtype == "f32" else weights[w.name].astype(ml_dtypes.bfloat16)
            for w in graph_weights(cfg, precision)]
