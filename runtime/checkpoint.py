"""Read the vision-tower weights of a checkpoint folder as exact f32 numpy arrays.

Two layouts are understood:

* Hugging Face: tensors named `model.visual.*` (some checkpoints store `visual.*`),
  one `model.safetensors` or shards listed by `model.safetensors.index.json`, or
  several `*.safetensors` without an index (their headers are scanned).
* MLX (mlx-vlm conversions): tensors named `vision_tower.*` with the same suffixes,
  the patch-embed conv stored channels-last [h, T, P, P, C], and linears (or the
  position table) optionally affine-quantized: `weight` uint32 [out, in*bits/32]
  holding a little-endian bit stream of `bits`-bit codes (least-significant bits
  first), `scales` and `biases` [out, in/group_size]; `w = q*scale + bias` in f32.

Only the vision tensors are read. With an index, only the shards holding vision
tensors are opened; within a shard only the vision tensors' byte ranges are read,
so a large checkpoint's text weights are never loaded. bf16 and f16 are widened to
f32 exactly. Every problem is a `CheckpointError` whose one-line message names the
tensor and the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emitter.config import CONV_WEIGHT, HF_PREFIX, VisionConfig, graph_weights, weight_schema

MLX_PREFIX = "vision_tower."
VISION_PREFIXES = (HF_PREFIX, "visual.", MLX_PREFIX)  # in order of preference
INDEX_NAME = "model.safetensors.index.json"
CONV_NAME = CONV_WEIGHT[len(HF_PREFIX):]  # the suffix every layout shares
FLOAT_DTYPES = ("F32", "F16", "BF16")
QUANT_BITS = (2, 3, 4, 5, 6, 8)
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint the vision weights cannot be read from; the message names tensor and file."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: file, dtype, shape and absolute byte range."""
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


# --------------------------------------------------------------------------- safetensors

def read_safetensors_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header (8-byte little-endian length, then JSON); no tensor data is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n} does not fit "
                                      f"the file's {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    base = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{name}: malformed header entry {info!r} (in {path})") from None
        if not 0 <= begin <= end or base + end > size:
            raise CheckpointError(f"{name}: byte range [{begin}, {end}) lies outside the data "
                                  f"({size - base} bytes) (in {path})")
        entries[name] = TensorEntry(name, path, dtype, shape, base + begin, base + end)
    return entries


def _read_raw(entry: TensorEntry) -> bytes:
    """The tensor's bytes, read with one seek and one read (nothing else of the file)."""
    try:
        with open(entry.file, "rb") as f:
            f.seek(entry.begin)
            data = f.read(entry.end - entry.begin)
    except OSError as e:
        raise CheckpointError(f"{entry.name}: cannot read ({e.strerror or e}) (in {entry.file})") from None
    if len(data) != entry.end - entry.begin:
        raise CheckpointError(f"{entry.name}: file is truncated (in {entry.file})")
    return data


def _check_size(entry: TensorEntry) -> None:
    count = int(np.prod(entry.shape, dtype=np.int64))
    want = count * _ITEMSIZE[entry.dtype]
    if entry.end - entry.begin != want:
        raise CheckpointError(f"{entry.name}: holds {entry.end - entry.begin} bytes but {entry.dtype} "
                              f"{list(entry.shape)} needs {want} (in {entry.file})")


def read_float_tensor(entry: TensorEntry) -> np.ndarray:
    """A F32, F16 or BF16 tensor widened exactly to f32 (a new, writable array)."""
    if entry.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{entry.name}: unsupported dtype {entry.dtype} (expected one of "
                              f"{', '.join(FLOAT_DTYPES)}) (in {entry.file})")
    _check_size(entry)
    raw = _read_raw(entry)
    if entry.dtype == "F32":
        out = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    elif entry.dtype == "F16":
        out = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    else:  # bf16 is the top half of an f32: shifting the bits up is exact
        out = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return out.reshape(entry.shape)


def read_uint32_tensor(entry: TensorEntry) -> np.ndarray:
    if entry.dtype != "U32":
        raise CheckpointError(f"{entry.name}: unsupported dtype {entry.dtype} for a quantized weight "
                              f"(expected U32) (in {entry.file})")
    _check_size(entry)
    return np.frombuffer(_read_raw(entry), dtype="<u4").astype(np.uint32).reshape(entry.shape)


# --------------------------------------------------------------------------- MLX affine

def unpack_mlx(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint32 [rows, words] -> uint32 codes [rows, words*32/bits].

    Each row is a little-endian bit stream (code i occupies bits [i*bits, (i+1)*bits),
    least-significant first across the little-endian words): MLX's packing for every
    width, 2/4/8 within one word and 3/5/6 across byte triples/quintuples."""
    packed = np.ascontiguousarray(packed, dtype="<u4")
    rows, words = packed.shape
    if 32 % bits == 0:
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        codes = (packed[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
        return codes.reshape(rows, words * (32 // bits))
    n = words * 32 // bits
    stream = np.unpackbits(packed.view(np.uint8).reshape(rows, words * 4), axis=1, bitorder="little")
    stream = stream[:, : n * bits].reshape(rows, n, bits).astype(np.uint32)
    return (stream << np.arange(bits, dtype=np.uint32)).sum(axis=2, dtype=np.uint32)


def pack_mlx(codes: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `unpack_mlx`: codes [rows, n] (each < 2**bits) -> uint32 [rows, n*bits/32]."""
    codes = np.asarray(codes, dtype=np.uint32)
    rows, n = codes.shape
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole 32-bit words")
    stream = ((codes[:, :, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    packed = np.packbits(stream.reshape(rows, n * bits), axis=1, bitorder="little")
    return packed.view("<u4").astype(np.uint32).reshape(rows, n * bits // 32)


def dequantize_mlx(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                   bits: int, group_size: int) -> np.ndarray:
    """MLX affine dequantization in f32: w[r, c] = q[r, c]*scales[r, c//g] + biases[r, c//g]."""
    q = unpack_mlx(packed, bits).astype(np.float32)
    s = np.repeat(np.asarray(scales, dtype=np.float32), group_size, axis=1)
    b = np.repeat(np.asarray(biases, dtype=np.float32), group_size, axis=1)
    return q * s + b


def _quantization_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict) and ("bits" in q or "group_size" in q or "mode" in q):
            return q
    return {}


def _module_quant(qconfig: dict, module: str, hf_module: str) -> dict:
    """The quantization settings that apply to one module: a per-module override keyed by
    its path (stored or Hugging Face spelling) if there is one, else the global ones."""
    for key in (module, hf_module):
        override = qconfig.get(key)
        if isinstance(override, dict):
            return {**qconfig, **override}
        if override is False:
            return {"disabled": True}
    return qconfig


# --------------------------------------------------------------------------- folder scan

def _safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())


def _is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def _add_entries(found: dict[str, TensorEntry], entries: dict[str, TensorEntry]) -> None:
    for name, entry in entries.items():
        if not _is_vision(name):
            continue
        if name in found:
            raise CheckpointError(f"{name}: present in two shards ({found[name].file.name} and "
                                  f"{entry.file.name}) (in {entry.file.parent})")
        found[name] = entry


def scan_vision_tensors(model_dir: str | Path) -> tuple[dict[str, TensorEntry], str]:
    """Locate every vision tensor of a checkpoint folder without reading tensor data.

    Returns (entries by stored name, a description of where they were looked for)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a readable folder")
    index_path = model_dir / INDEX_NAME
    found: dict[str, TensorEntry] = {}
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{index_path}: not a readable JSON index ({e})") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: no 'weight_map' object")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if _is_vision(name):
                by_shard.setdefault(str(shard), []).append(name)
        if not by_shard:
            raise CheckpointError(f"{index_path}: no vision weights (no tensor named "
                                  f"{' / '.join(p + '*' for p in VISION_PREFIXES)})")
        for shard, names in sorted(by_shard.items()):
            shard_path = model_dir / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{names[0]}: its shard {shard} is missing "
                                      f"(referenced by {index_path})")
            entries = read_safetensors_header(shard_path)
            for name in names:
                if name not in entries:
                    raise CheckpointError(f"{name}: missing from {shard_path} (where {INDEX_NAME} "
                                          f"places it)")
            # Every vision tensor a shard holds counts, listed in the index or not, so a
            # tensor stored in two opened shards is caught.
            _add_entries(found, entries)
        for name, entry in found.items():
            mapped = weight_map.get(name)
            if mapped is not None and model_dir / str(mapped) != entry.file:
                raise CheckpointError(f"{name}: present in two shards ({mapped} per the index and "
                                      f"{entry.file.name}) (in {model_dir})")
        return found, str(index_path)
    files = _safetensors_files(model_dir)
    if not files:
        raise CheckpointError(f"{model_dir}: no vision weights (no *.safetensors file)")
    for path in files:
        _add_entries(found, read_safetensors_header(path))
    if not found:
        raise CheckpointError(f"{model_dir}: no vision weights (no tensor named "
                              f"{' / '.join(p + '*' for p in VISION_PREFIXES)} in "
                              f"{', '.join(p.name for p in files)})")
    where = str(files[0]) if len(files) == 1 else f"{model_dir}/*.safetensors"
    return found, where


def _choose_prefix(found: dict[str, TensorEntry]) -> str:
    for prefix in VISION_PREFIXES:
        if prefix + CONV_NAME in found:
            return prefix
    for prefix in VISION_PREFIXES:
        if any(name.startswith(prefix) for name in found):
            return prefix
    raise AssertionError("unreachable: found holds only vision names")


# --------------------------------------------------------------------------- loading

def _read_quantized(key: str, entry: TensorEntry, found: dict[str, TensorEntry],
                    shape: tuple[int, ...], qconfig: dict) -> np.ndarray:
    module = key[: -len(".weight")] if key.endswith(".weight") else key
    scales_e, biases_e = found.get(module + ".scales"), found.get(module + ".biases")
    hf_module = HF_PREFIX + module[len(MLX_PREFIX):] if module.startswith(MLX_PREFIX) else module
    mode = _module_quant(qconfig, module, hf_module).get("mode", "affine")
    if scales_e is None:
        raise CheckpointError(f"{key}: quantized ({entry.dtype}) but {module}.scales is missing "
                              f"(in {entry.file})")
    if biases_e is None:
        extra = f"; quantization mode {mode!r} is not supported (only 'affine')" if mode != "affine" else ""
        raise CheckpointError(f"{key}: quantized but {module}.biases is missing{extra} (in {entry.file})")
    if len(shape) != 2:
        raise CheckpointError(f"{key}: quantized, but only 2-D weights can be (expected "
                              f"{list(shape)}) (in {entry.file})")
    out, n_in = shape
    packed = read_uint32_tensor(entry)
    if packed.ndim != 2 or packed.shape[0] != out:
        raise CheckpointError(f"{key}: unexpected shape {list(packed.shape)} for a packed {list(shape)} "
                              f"weight (in {entry.file})")
    words = packed.shape[1]
    bits = words * 32 // n_in
    if words * 32 % n_in or bits not in QUANT_BITS:
        raise CheckpointError(f"{key}: unexpected shape {list(packed.shape)}: {words} words per row do "
                              f"not pack {n_in} codes of 2, 3, 4, 5, 6 or 8 bits (in {entry.file})")
    scales = read_float_tensor(scales_e)
    biases = read_float_tensor(biases_e)
    if scales.ndim != 2 or scales.shape[0] != out or scales.shape[1] == 0 or n_in % scales.shape[1]:
        raise CheckpointError(f"{module}.scales: unexpected shape {list(scales.shape)} for a "
                              f"{list(shape)} weight (in {scales_e.file})")
    if biases.shape != scales.shape:
        raise CheckpointError(f"{module}.biases: unexpected shape {list(biases.shape)} (expected "
                              f"{list(scales.shape)}, as the scales) (in {biases_e.file})")
    group_size = n_in // scales.shape[1]
    for arr, e in ((scales, scales_e), (biases, biases_e)):
        if not np.isfinite(arr).all():
            raise CheckpointError(f"{e.name}: non-finite values (in {e.file})")
    # The shapes fix bits and group size unambiguously, so a config whose `quantization`
    # block (or a per-module override in it) is absent or spelled differently still loads.
    return dequantize_mlx(packed, scales, biases, bits, group_size)


def _conv_to_hf(key: str, w: np.ndarray, entry: TensorEntry, cfg: VisionConfig) -> np.ndarray:
    hf_shape = cfg.conv_shape
    h, c, t, p, _ = hf_shape
    mlx_shape = (h, t, p, p, c)
    if w.shape == hf_shape:
        return w
    if w.shape == mlx_shape:  # channels-last (MLX): [h, T, P, P, C] -> [h, C, T, P, P]
        return np.ascontiguousarray(w.transpose(0, 4, 1, 2, 3))
    if w.shape == (h, cfg.patch_dim):
        return w.reshape(hf_shape)
    raise CheckpointError(f"{key}: unexpected shape {list(w.shape)} (expected {list(hf_shape)}, or "
                          f"{list(mlx_shape)} channels-last) (in {entry.file})")


def load_vision_weights(model_dir: str | Path, cfg: VisionConfig) -> dict[str, np.ndarray]:
    """The graph's weight arguments as f32 arrays, keyed by their Hugging Face names in
    `weight_schema(cfg)` order; the patch-embed conv flattened to [hidden, patch_dim]
    in (C, T, P, P) order."""
    model_dir = Path(model_dir)
    found, where = scan_vision_tensors(model_dir)
    prefix = _choose_prefix(found)
    qconfig = _quantization_config(model_dir)
    out: dict[str, np.ndarray] = {}
    for hf_name, shape in weight_schema(cfg):
        suffix = hf_name[len(HF_PREFIX):]
        key = prefix + suffix
        entry = found.get(key)
        if entry is None:
            raise CheckpointError(f"{key}: missing (in {where})")
        is_conv = suffix == CONV_NAME
        quantized = entry.dtype == "U32" or (key.endswith(".weight") and key[:-7] + ".scales" in found)
        if quantized and not is_conv:
            w = _read_quantized(key, entry, found, shape, qconfig)
        else:
            w = read_float_tensor(entry)
        if is_conv:
            w = _conv_to_hf(key, w, entry, cfg).reshape(shape)
        elif w.shape != shape:
            raise CheckpointError(f"{key}: unexpected shape {list(w.shape)} (expected {list(shape)}) "
                                  f"(in {entry.file})")
        if not np.isfinite(w).all():
            bad = int(np.size(w) - np.count_nonzero(np.isfinite(w)))
            raise CheckpointError(f"{key}: {bad} non-finite values (in {entry.file})")
        out[hf_name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def weights_in_order(weights: dict[str, np.ndarray], cfg: VisionConfig, precision: str = "f32") -> list[np.ndarray]:
    """The arrays of `load_vision_weights` as the graph's ordered weight arguments, each
    in the dtype the graph takes under `precision` (bf16: round to nearest even)."""
    import ml_dtypes
    return [weights[w.name] if w.dtype == "f32" else weights[w.name].astype(ml_dtypes.bfloat16)
            for w in graph_weights(cfg, precision)]
