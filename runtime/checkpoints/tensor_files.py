"""Safetensors files and checkpoint folders, read without loading them: a file's header,
one tensor's byte range read exactly (F32, F16 and BF16 widened to f32 exactly; U32 codes),
and the scan of a folder for the tensors of one model part (`ModelPart`: the vision tower,
the language model) through `model.safetensors.index.json` or every `*.safetensors`. Every
problem is a `CheckpointError` whose one-line message names the tensor and the file."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "F16", "BF16")
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint the weights cannot be read from; the message names tensor and file."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: file, dtype, shape and absolute byte range."""
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


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


def check_float(entry: TensorEntry) -> None:
    if entry.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{entry.name}: unsupported dtype {entry.dtype} (expected one of "
                              f"{', '.join(FLOAT_DTYPES)}) (in {entry.file})")


def read_float_tensor(entry: TensorEntry) -> np.ndarray:
    """A F32, F16 or BF16 tensor widened exactly to f32 (a new, writable array)."""
    check_float(entry)
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


def _safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())


@dataclass(frozen=True)
class ModelPart:
    """Which tensors of a checkpoint belong to one model part (the vision tower, the
    language model): the name prefixes (and whole names) that mark them, and how errors
    name the part."""
    what: str
    prefixes: tuple[str, ...]
    names: tuple[str, ...] = ()

    def holds(self, name: str) -> bool:
        return name.startswith(self.prefixes) or name in self.names

    def missing(self) -> str:
        return f"no {self.what} (no tensor named {' / '.join(p + '*' for p in self.prefixes)}"

def _add_entries(found: dict[str, TensorEntry], entries: dict[str, TensorEntry], part: ModelPart) -> None:
    for name, entry in entries.items():
        if not part.holds(name):
            continue
        if name in found:
            raise CheckpointError(f"{name}: present in two shards ({found[name].file.name} and "
                                  f"{entry.file.name}) (in {entry.file.parent})")
        found[name] = entry


def _check_shard_name(name: str, shard, index_path: Path) -> None:
    """An index entry names a file inside the model folder (symlinks allowed, as in a hub
    cache), never an absolute path or one that climbs out with `..`."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{name}: shard {shard!r} is not a file name (in {index_path})")
    parts = Path(shard).parts
    if Path(shard).is_absolute() or ".." in parts:
        raise CheckpointError(f"{name}: shard {shard!r} lies outside the model folder; expected a file "
                              f"name inside {index_path.parent} (in {index_path})")


def scan_tensors(model_dir: str | Path, part: ModelPart) -> tuple[dict[str, TensorEntry], str]:
    """Locate every tensor of `part` in a checkpoint folder without reading tensor data:
    through `model.safetensors.index.json` (every shard it names inside the folder, every
    tensor where it says) or every `*.safetensors`; a tensor in two shards is an error.

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
            _check_shard_name(name, shard, index_path)
            if part.holds(name):
                by_shard.setdefault(shard, []).append(name)
        if not by_shard:
            raise CheckpointError(f"{index_path}: {part.missing()})")
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
            # Every tensor of the part a shard holds counts, listed in the index or not, so a
            # tensor stored in two opened shards is caught.
            _add_entries(found, entries, part)
        for name, entry in found.items():
            mapped = weight_map.get(name)
            if mapped is not None and model_dir / str(mapped) != entry.file:
                raise CheckpointError(f"{name}: present in two shards ({mapped} per the index and "
                                      f"{entry.file.name}) (in {model_dir})")
        return found, str(index_path)
    files = _safetensors_files(model_dir)
    if not files:
        raise CheckpointError(f"{model_dir}: no {part.what} (no *.safetensors file)")
    for path in files:
        _add_entries(found, read_safetensors_header(path), part)
    if not found:
        raise CheckpointError(f"{model_dir}: {part.missing()} in {', '.join(p.name for p in files)})")
    where = str(files[0]) if len(files) == 1 else f"{model_dir}/*.safetensors"
    return found, where

