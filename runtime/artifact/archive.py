"""The weight archive (.irpa), of the vision tower and of the language model alike: the
graph's weights exactly as it takes them (MLX weights dequantized, or in their bits under
`--precision native`, as a GGUF's quantized tensors; the patch-embed conv flattened to
[hidden, patch_dim], matmul weights in bf16 under the bf16 precisions, in i8 / i4 with their
f32 group scales (and an affine weight's biases) beside them: emitter/quant.py), one
entry per weight, keyed by its checkpoint name; read by the module's globals under scope
`model`.

An archive is content-addressed: its identity hashes the checkpoint's stored tensors of
the part (bytes, dtypes, shapes), the quantization settings, the precision, the weight
schema and the code that transforms them, so it is written once per checkpoint content
and precision and reused from the cache. Each entry carries IREE's tensor metadata
(`TENSORv0:{"type": "Tensor", "dtype", "shape"}`), which `open_archive` checks against
the config before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import iree.runtime as rt

from emitter import quant
from kernels import q8_matmul
from emitter.config import VisionConfig
from emitter.precision import Precision, for_graph
from emitter.text import text_weights
from emitter.vision import graph_weights
from emitter.text_config import TextConfig
from emitter.identity import weight_schema_fields

from runtime.artifact.digests import Digests, sha256_range
from runtime.artifact.iree_module import return_freed_memory
from runtime.artifact.irpa import write_irpa
from runtime.checkpoints import (gguf_blocks, gguf_text, gguf_vision, mlx_quant, text as text_checkpoint,
                                 vision as checkpoint)

# Bump when what an archive holds changes in a way no other field records.
ARCHIVE_FORMAT = 1
METADATA_PREFIX = "TENSORv0:"
DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i8": "int8", "i4": "int4"}  # graph dtype -> metadata name
BITS = {"f32": 32, "bf16": 16, "f16": 16, "i8": 8, "i4": 4}

MADV_DONTNEED = 4  # Linux and macOS
_CODE = (Path(checkpoint.__file__), Path(gguf_vision.__file__), Path(gguf_text.__file__), Path(gguf_blocks.__file__),
         Path(quant.__file__), Path(q8_matmul.__file__), Path(__file__))  # the host transforms


def spec_bytes(spec) -> int:
    """Bytes one weight of a `WeightSpec` takes in an archive, and resident once loaded (i4: two a byte)."""
    return int(np.prod(spec.shape)) * BITS[spec.dtype] // 8


class ArchiveError(ValueError):
    """An archive that does not hold the graph's weights; the message names the tensor."""


def stored_quantization(model_dir: Path) -> dict:
    """config.json's quantization blocks as written (how MLX tensors are dequantized)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in ("quantization", "quantization_config") if isinstance(config, dict) and k in config}


def code_digest(code) -> str:
    """sha256 of the source files that transform a checkpoint's weights."""
    return hashlib.sha256(b"".join(Path(p).read_bytes() for p in code)).hexdigest()


def content_fields(model_dir, found: dict, specs, precision: Precision | str, code, digest=sha256_range) -> dict:
    """What decides either model's archive bytes beside its config: every stored tensor of
    the part (`found`: name, dtype, shape, sha256 of its bytes by `digest`), the
    quantization settings, the weight dtype, the weight schema of `specs`, and the source of
    the `code` that transforms them."""
    return {
        "precision": for_graph(precision).weights,  # bf16 and bf16-f32 share one archive
        "weight_schema": weight_schema_fields(specs),
        "quantization": stored_quantization(Path(model_dir)),
        "tensors": [[name, e.dtype, list(e.shape), digest(e.file, e.begin, e.end)]
                    for name, e in sorted(found.items())],
        "code_sha256": code_digest(code),
    }


def archive_fields(model_dir, cfg: VisionConfig, precision: Precision | str = "f32", digest=sha256_range) -> dict:
    """What decides the vision archive's bytes (`content_fields`). Reads the vision tensors
    once (`digest`: `digests.Digests` remembers them)."""
    mmproj = gguf_vision.mmproj_file(model_dir)
    if mmproj:  # a llama.cpp mmproj beside a GGUF text file: its sha256 in place of the tensors
        return {"archive_format": ARCHIVE_FORMAT, "vision_config": cfg.to_dict(),
                "precision": for_graph(precision).weights,
                "weight_schema": weight_schema_fields(graph_weights(cfg, precision)),
                **gguf_vision.content_fields(mmproj, digest), "code_sha256": code_digest(_CODE)}
    found, _ = checkpoint.scan_vision_tensors(model_dir)
    return {"archive_format": ARCHIVE_FORMAT, "vision_config": cfg.to_dict(),
            **content_fields(model_dir, found, graph_weights(cfg, precision), precision, _CODE, digest)}


def graph_arrays(model_dir, cfg: VisionConfig, precision: Precision | str = "f32") -> Iterator[tuple[str, np.ndarray]]:
    """(checkpoint name, array as the graph takes it) for every weight, in graph order, one at a time."""
    mmproj = gguf_vision.mmproj_file(model_dir)
    weights = (gguf_vision.vision_arrays(mmproj, cfg, precision) if mmproj
               else checkpoint.vision_arrays(model_dir, cfg, precision))
    return ((spec.name, array) for spec, array in zip(graph_weights(cfg, precision), weights))


def tensor_metadata(shape, dtype: str) -> str:
    meta = {"type": "Tensor", "dtype": DTYPE_NAMES[dtype], "shape": list(shape)}
    return METADATA_PREFIX + json.dumps(meta)


def write_archive(path: str | os.PathLike, named_arrays, cfg: VisionConfig, precision: Precision | str = "f32") -> None:
    """Write the vision graph's .irpa whole or not at all (see `write_entries`)."""
    write_entries(path, named_arrays, graph_weights(cfg, precision))


def write_entries(path: str | os.PathLike, named_arrays, specs) -> None:
    """Write `(name, array)` pairs, one per weight spec in order, as an .irpa whole or not
    at all (temp file beside it, fsync, rename). The pairs may come from a generator: each
    array is written as it comes and let go before the next (`irpa.write_irpa`), so the
    writer holds one tensor, not the model."""
    path = Path(path)
    specs = list(specs)
    entries = [(s.name, spec_bytes(s), tensor_metadata(s.shape, s.dtype)) for s in specs]

    def arrays():
        for spec, (name, array) in zip(specs, named_arrays):
            if spec.name != name:
                raise ArchiveError(f"{name}: written where the graph expects {spec.name}")
            yield array

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp.{os.getpid()}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write_irpa(f, entries, arrays())
            f.flush()
            os.fchmod(f.fileno(), 0o644)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _entry_shape_dtype(entry) -> tuple[list | None, str | None]:
    text = bytes(entry.metadata).decode("utf-8", "replace")
    if not text.startswith(METADATA_PREFIX):
        return None, None
    try:
        meta = json.loads(text[len(METADATA_PREFIX):])
        return list(meta["shape"]), meta["dtype"]
    except (ValueError, KeyError, TypeError):
        return None, None


def open_archive(path: str | os.PathLike, cfg: VisionConfig, precision: Precision | str = "f32") -> rt.ParameterIndex:
    """The vision graph's archive, memory-mapped and checked (see `open_entries`)."""
    return open_entries(path, graph_weights(cfg, precision))


def open_entries(path: str | os.PathLike, specs) -> rt.ParameterIndex:
    """The archive memory-mapped (not read) as an IREE parameter index, after checking that
    it holds exactly the weights `specs` name: every name, shape, dtype and byte length.
    ArchiveError naming the first tensor that does not match."""
    index = rt.ParameterIndex()
    try:
        index.load(str(path), mmap=True)
    except Exception as e:  # IREE raises ValueError/RuntimeError for a file it cannot parse
        raise ArchiveError(f"{path}: not a readable IREE parameter archive ({str(e).splitlines()[0]})") from None
    entries = dict(index.items())
    for spec in specs:
        entry = entries.pop(spec.name, None)
        want = f"{DTYPE_NAMES[spec.dtype]} {list(spec.shape)}"
        if entry is None:
            raise ArchiveError(f"{spec.name}: missing from {path}; expected {want}")
        shape, dtype = _entry_shape_dtype(entry)
        if shape != list(spec.shape) or dtype != DTYPE_NAMES[spec.dtype]:
            raise ArchiveError(f"{spec.name}: is {dtype} {shape} in {path}; expected {want}")
        nbytes = spec_bytes(spec)
        if entry.length != nbytes:
            raise ArchiveError(f"{spec.name}: holds {entry.length} bytes in {path}; expected {nbytes} ({want})")
    if entries:
        raise ArchiveError(f"{sorted(entries)[0]}: in {path} but not a weight of this config; "
                           f"expected only the graph's {len(specs)} weights")
    return index


def entry_arrays(index: rt.ParameterIndex, specs) -> list[np.ndarray]:
    """Read-only numpy views of the archive's entries for `specs` (graph weights), in order:
    no copy, they read the mapped file (an i4 entry: its bytes, two values to a byte)."""
    import ml_dtypes
    entries = dict(index.items())
    dtypes = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16, "i8": np.int8}
    return [np.asarray(entries[w.name].file_view) if w.dtype == "i4" else
            np.asarray(entries[w.name].file_view).view(dtypes[w.dtype]).reshape(w.shape) for w in specs]


def release_mapped_pages(index: rt.ParameterIndex) -> bool:
    """Let the kernel drop the archive's pages from this process's resident memory, once the
    module's initializer has packed the weights: `madvise(MADV_DONTNEED)` over the mapping.
    The mapping is read-only and file-backed, so any page read later (the norms, biases and
    position table the graph reads unpacked) faults back in from the file. False where the
    call is not available."""
    import ctypes
    views = [np.asarray(entry.file_view) for _, entry in index.items()]
    if not views:
        return False
    low = min(v.__array_interface__["data"][0] for v in views)
    high = max(v.__array_interface__["data"][0] + v.nbytes for v in views)
    start = low // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(high - start), MADV_DONTNEED) == 0
    except (OSError, AttributeError):
        return False


def remembered(cache, fields_of):
    """`fields_of(digest)` with the checkpoint digests remembered under the cache's root
    (`digests.Digests`: the bytes are read again only for files whose stat changed)."""
    digests = Digests(cache.root)
    fields = fields_of(digests)
    digests.save()
    return fields


def cached_entries(cache, fields: dict, specs, arrays, label: str, precision: Precision | str, progress=None) -> Path:
    """The archive of `fields` from the cache (its size and sha256 checked against the
    manifest), written on a miss from `arrays()` ((name, array) pairs in `specs` order: the
    checkpoint is read, checked and converted only then). Both models' archives."""
    report = progress or (lambda message: None)

    def write(path: Path) -> None:
        report(f"{label}: writing {path.name} ({precision}, {sum(map(spec_bytes, specs)) / 1e9:.2f} GB) ...")
        write_entries(path, arrays(), specs)
        return_freed_memory()  # the converted tensors' heap, so that a first run peaks no higher than the next

    path, _ = cache.get_or_write(fields, "irpa", write, progress)
    return path


def cached_archive(model_dir, cfg: VisionConfig, precision: Precision | str, cache, progress=None) -> Path:
    """The vision archive for this checkpoint content and precision (`cached_entries`)."""
    return cached_entries(cache, remembered(cache, lambda digest: archive_fields(model_dir, cfg, precision, digest)),
                          graph_weights(cfg, precision),
                          lambda: graph_arrays(model_dir, cfg, precision), "weights", precision, progress)


# --------------------------------------------------------------------------- the language model's

# Bump when what a text archive holds changes in a way no other field records.
TEXT_ARCHIVE_FORMAT = 1
_TEXT_CODE = (Path(checkpoint.__file__), Path(mlx_quant.__file__), Path(text_checkpoint.__file__), Path(quant.__file__),
              Path(gguf_text.__file__), Path(gguf_blocks.__file__), Path(__file__))


def text_archive_fields(model_dir, cfg: TextConfig, precision: Precision | str = "f32", digest=sha256_range) -> dict:
    """What decides a text archive's bytes: every stored text tensor (name, dtype, shape,
    sha256 of its bytes by `digest`), the quantization settings, the config, the precision,
    the weight schema and the source of the code that transforms them. Reads the text
    tensors once (a GGUF file: its sha256 in their place)."""
    if text_checkpoint.gguf_text.is_gguf(model_dir):
        return {"kind": "qwen3vl-text-weights", "archive_format": TEXT_ARCHIVE_FORMAT, "text_config": cfg.to_dict(),
                "precision": for_graph(precision).weights,
                "weight_schema": weight_schema_fields(text_weights(cfg, precision)),
                **text_checkpoint.gguf_text.content_fields(model_dir, digest),
                "code_sha256": code_digest(_TEXT_CODE)}
    found, _ = text_checkpoint.scan_text_tensors(Path(model_dir))
    return {"kind": "qwen3vl-text-weights", "archive_format": TEXT_ARCHIVE_FORMAT, "text_config": cfg.to_dict(),
            **content_fields(model_dir, found, text_weights(cfg, precision), precision, _TEXT_CODE, digest)}


def cached_text_archive(model_dir, cfg: TextConfig, precision: Precision | str, cache, progress=None) -> Path:
    """The text archive for this checkpoint content and precision from the cache (size and
    sha256 checked against the manifest), written on a miss: the checkpoint is read, checked
    and converted only then."""
    fields = remembered(cache, lambda digest: text_archive_fields(model_dir, cfg, precision, digest))
    return cached_entries(cache, fields, text_weights(cfg, precision),
                          lambda: text_checkpoint.text_arrays(model_dir, cfg, precision),
                          "text weights", "the checkpoint's own bits" if cfg.native_weights else precision, progress)


def open_text_archive(path, cfg: TextConfig, precision: Precision | str = "f32"):
    """The text archive memory-mapped as an IREE parameter index, checked to hold exactly
    the graph's weights (ArchiveError naming the first that does not)."""
    return open_entries(path, text_weights(cfg, precision))
