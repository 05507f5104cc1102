"""`qwen3vl embed`: a collection of images -> features in shards, resumable.

The driver lists the images, skips those the index already holds, and hands the rest
to an engine (one local session, `embed_engine`, or Ray Data, `embed_ray`). Results come back
one image at a time, in input order; every `batch` encoded images become one shard,
`OUT_DIR/shard-NNNNN.safetensors`, written whole, then `OUT_DIR/index.json`, written
whole. Each shard also names its images in its metadata, so a shard whose index write
was lost (a crash between the two) is taken back into the index on the next run: a
crash loses at most the shard in flight, and no image is ever in two shards.

An image that cannot be read, or fits no bucket, is recorded in the index as failed,
with its one-line reason; the job goes on.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from emitter.atomic import check_writable, write_atomic
from emitter.errors import one_line_error as one_line
from emitter.identity import DEFAULT_LADDER

from runtime.jobs.embed_engine import Embedded, SessionSpec, local_engine
from runtime.outputs import check_output_folder

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
LIST_SUFFIX = ".txt"
INDEX_NAME = "index.json"
LOCK_NAME = ".embed.lock"
SHARD_FORMAT = "qwen3vl-iree embed shard v1"
FORMATS = ("native", "vllm")


# --------------------------------------------------------------------------- inputs

def list_images(inputs: Iterable[str]) -> list[str]:
    """Absolute image paths, in order, each once: a folder gives its images (recursively,
    by suffix, sorted), a `.txt` file the paths it lists (one a line; blank lines and
    `#` comments skipped; relative to the list's folder), any other file itself.
    ValueError naming an INPUT that does not exist."""
    paths: list[str] = []
    for text in inputs:
        item = Path(text)
        if item.is_dir():
            paths += sorted(str(p) for p in item.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        elif item.suffix.lower() == LIST_SUFFIX and item.is_file():
            paths += [str(item.parent / line.strip()) for line in _list_lines(item)]
        elif item.exists():
            paths.append(text)
        else:
            raise ValueError(f"INPUT {text}: no such file or folder; expected image files, folders of images "
                             f"or a .txt file listing image paths")
    return list(dict.fromkeys(os.path.abspath(p) for p in paths))


def _list_lines(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"INPUT {path}: cannot read the list ({getattr(e, 'strerror', None) or e}); "
                         f"expected a UTF-8 text file, one image path a line") from None
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


# --------------------------------------------------------------------------- shards and index

def shard_tensors(results: list[Embedded], fmt: str) -> dict[str, np.ndarray]:
    """native: image_embeds [M, D], deepstack_features [K, M, D]; vllm: image_embeds
    [M, D * (1 + K)] (main then each DeepStack feature, as vLLM's Qwen3-VL takes
    precomputed embeddings); both with grid_thw [n, 3] int64, rows in image order."""
    features = np.concatenate([r.features for r in results], axis=1)  # [1 + K, M, D]
    grids = np.array([r.grid for r in results], np.int64).reshape(-1, 3)
    if fmt == "vllm":
        return {"image_embeds": np.ascontiguousarray(np.concatenate(list(features), axis=1)), "grid_thw": grids}
    return {"image_embeds": np.ascontiguousarray(features[0]),
            "deepstack_features": np.ascontiguousarray(features[1:]), "grid_thw": grids}


@dataclass
class EmbedIndex:
    """OUT_DIR/index.json: the engine, the model (artifact identity), the weights (archive
    identity), the format, and one entry per image, encoded (shard, start, rows, grid_thw)
    or failed (error)."""
    out_dir: Path
    engine: str
    model: str
    weights: str
    format: str
    images: list[dict] = field(default_factory=list)
    recovered: int = 0  # images taken back from shards the index did not list
    missing: int = 0  # images the index listed in shards no longer there, or truncated

    @property
    def path(self) -> Path:
        return self.out_dir / INDEX_NAME

    def header(self) -> dict:
        return {"engine": self.engine, "model": self.model, "weights": self.weights, "format": self.format}

    def load(self, retry_failed: bool = False) -> None:
        """The index already there, checked to be this model's and format's, less the
        entries whose shard file is gone, plus any shard on disk the index does not list
        yet (its metadata names its images)."""
        if self.path.exists():
            try:
                saved = json.loads(self.path.read_text(encoding="utf-8"))
                entries = saved["images"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"-o {self.out_dir}: {INDEX_NAME} is not an embed index ({one_line(e)}); "
                                 f"choose another folder") from None
            for key in ("model", "weights", "format"):
                if saved.get(key) != getattr(self, key):
                    raise ValueError(f"-o {self.out_dir}: holds embeddings of another {key} "
                                     f"({saved.get(key)!r}, this run: {getattr(self, key)!r}); "
                                     f"choose another folder")
            self.images = [e for e in entries if not (retry_failed and "error" in e)]
        rows = self._shard_rows({e["shard"] for e in self.images if "shard" in e})
        kept = [e for e in self.images if "shard" not in e or e["start"] + e["rows"] <= rows[e["shard"]]]
        self.missing, self.images = len(self.images) - len(kept), kept  # their rows are gone: embed them again
        listed = {e["shard"] for e in self.images if "shard" in e}
        for shard in sorted(self.out_dir.glob("shard-*.safetensors")):
            if shard.name not in listed:
                self.recovered += self._recover(shard)

    def _shard_rows(self, names) -> dict[str, int]:
        """Rows each named shard holds, read from its header and checked whole (its size
        what the header says, its layout this index's); 0 for a shard missing, truncated
        or damaged, whose images are then embedded again."""
        rows = {}
        for name in names:
            try:
                with safe_open(str(self.out_dir / name), "np") as f:
                    ok = (f.metadata() or {}).get("layout") == self.format and "grid_thw" in f.keys()
                    rows[name] = f.get_slice("image_embeds").get_shape()[0] if ok else 0
            except Exception:  # noqa: BLE001 - safetensors raises its own errors for a bad file
                rows[name] = 0
        return rows

    def _recover(self, shard: Path) -> int:
        """Take a shard's images back from its metadata (a shard written, its index not)."""
        try:
            with safe_open(str(shard), "np") as f:
                meta = f.metadata() or {}
            entries = json.loads(meta["images"])
        except Exception:  # noqa: BLE001 - a foreign or damaged file: not ours to list
            return 0
        if meta.get("format") != SHARD_FORMAT or meta.get("model") != self.model or \
                meta.get("weights") != self.weights or meta.get("layout") != self.format:
            return 0
        done = self.done()
        fresh = [dict(e, shard=shard.name) for e in entries if e["image"] not in done]
        if len(fresh) != len(entries):  # would duplicate rows: the index wins
            return 0
        self.images += fresh
        return len(fresh)

    def done(self) -> set[str]:
        return {e["image"] for e in self.images}

    def failed(self) -> list[dict]:
        return [e for e in self.images if "error" in e]

    def next_shard(self) -> int:
        numbers = [int(p.name[6:-12]) for p in self.out_dir.glob("shard-*.safetensors") if p.name[6:-12].isdigit()]
        return max(numbers, default=-1) + 1

    def save(self) -> None:
        """Atomically; one image a line."""
        head = json.dumps(self.header())[:-1]
        lines = ",\n".join(" " + json.dumps(entry) for entry in self.images)
        write_atomic(self.path, f'{head}, "images": [\n{lines}\n]}}\n' if lines else f'{head}, "images": []}}\n')


class ShardWriter:
    """Buffers encoded images and writes every `batch` of them as one shard, then the
    index; failures go into the index as they come."""

    def __init__(self, index: EmbedIndex, batch: int):
        self.index, self.batch = index, batch
        self.buffer: list[Embedded] = []
        self.number = index.next_shard()
        self.rows = self.encoded = self.errors = 0

    def add(self, result: Embedded) -> None:
        if result.error is not None:
            self.index.images.append({"image": result.image, "error": result.error})
            self.errors += 1
        else:
            self.buffer.append(result)
        if len(self.buffer) >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Write the buffered images' shard (if any), then the index."""
        if self.buffer:
            name = f"shard-{self.number:05d}.safetensors"
            entries, start = [], 0
            for r in self.buffer:
                rows = r.features.shape[1]
                entries.append({"image": r.image, "start": start, "rows": rows, "grid_thw": list(r.grid)})
                start += rows
            meta = {"format": SHARD_FORMAT, "model": self.index.model, "weights": self.index.weights,
                    "layout": self.index.format, "images": json.dumps(entries)}
            write_atomic(self.index.out_dir / name, save(shard_tensors(self.buffer, self.index.format), metadata=meta))
            self.index.images += [dict(e, shard=name) for e in entries]
            self.number += 1
            self.rows += start
            self.encoded += len(self.buffer)
            self.buffer = []
        self.index.save()


# --------------------------------------------------------------------------- the job

def check_out_dir(out_dir, model) -> Path:
    """OUT_DIR: a folder (created if missing, its parent must exist), writable now, and
    not the checkpoint folder (a shard there would be read as a weight file)."""
    folder = check_output_folder(out_dir, model)
    if not folder.exists():
        try:
            folder.mkdir()
        except OSError as e:
            raise ValueError(f"-o {out_dir}: cannot create the folder ({e.strerror or e})") from None
    check_writable(folder / INDEX_NAME, "-o")
    return folder


def prepare(spec: SessionSpec, progress=None) -> tuple[str, str]:
    """Build (or find) the artifact module and the weight archive in the cache, once,
    before any worker starts: (artifact identity, archive identity)."""
    from runtime.artifact.archive import cached_archive
    from runtime.artifact.build import build_artifact, make_plan
    from runtime.artifact.cache import ArtifactCache

    plan = make_plan(spec.model, None, spec.buckets, spec.target, precision=spec.precision, weights="parameters",
                     progress=progress)
    cache = ArtifactCache(spec.cache_dir)
    cache.ensure_root()
    identity = build_artifact(plan, cache, progress).identity
    archive = cached_archive(spec.model, plan.cfg, plan.precision, cache, progress)
    return identity, archive.stem


@dataclass
class Summary:
    images: int
    rows: int
    seconds: float
    skipped: int
    failed: int
    index: Path

    def line(self) -> str:
        rate = self.images / self.seconds if self.seconds > 0 else 0.0
        return (f"embedded {self.images} images ({self.rows} rows) in {self.seconds:.1f} s, {rate:.2f} images/s; "
                f"skipped {self.skipped}, failed {self.failed}; index {self.index}")


def embed(model, inputs, out_dir, batch: int = 16, fmt: str = "native", precision: str = "f32", buckets=None,
          target=None, cache_dir=None, threads=None, ray_local: int | None = None, ray_address: str | None = None,
          retry_failed: bool = False, say=None, progress_bar: bool = True) -> Summary:
    """Embed every image of `inputs` not yet in OUT_DIR's index; engine: Ray when
    `ray_local` or `ray_address`, else one local session."""
    from runtime.artifact.build import make_plan
    from runtime.artifact.cache import ArtifactCache

    say = say or (lambda message: None)
    use_ray = check_options(batch, fmt, ray_local, ray_address, threads)
    make_plan(str(model), None, buckets or DEFAULT_LADDER, target, precision=precision)  # checks the model first
    images = list_images(inputs)
    if not images:
        raise ValueError(f"INPUT {' '.join(inputs)}: no images found (suffixes {' '.join(IMAGE_SUFFIXES)})")
    folder = check_out_dir(out_dir, model)
    with out_dir_lock(folder):
        spec = SessionSpec(str(Path(model).absolute()), str(ArtifactCache(cache_dir).root.absolute()),
                           tuple(buckets) if buckets else None, target, precision, threads)
        identity, weights = prepare(spec, say)
        index = EmbedIndex(folder, "ray" if use_ray else "local", identity, weights, fmt)
        pending = resume(index, images, retry_failed, say)
        writer = ShardWriter(index, batch)
        start = time.perf_counter()
        engine = None
        try:
            if pending and use_ray:
                from runtime.jobs.embed_ray import RayEngine
                engine = RayEngine(threads, ray_local, ray_address, say)
                start = time.perf_counter()  # the cluster is up
            if pending:
                results = engine.results(spec, pending, batch) if engine else local_engine(spec.open(), pending, batch)
                _drain(results, writer, len(pending), progress_bar)
            writer.flush()
        finally:
            if engine:
                engine.close()
    wanted = set(images)
    failed = sum(1 for e in index.failed() if e["image"] in wanted)
    return Summary(writer.encoded, writer.rows, time.perf_counter() - start, len(images) - len(pending), failed,
                   index.path)


def check_options(batch: int, fmt: str, ray_local: int | None, ray_address: str | None,
                  threads: int | None = None) -> bool:
    """Fail before any work on a bad option; whether Ray runs the job."""
    if batch < 1:
        raise ValueError(f"--batch {batch}: expected 1 or more images per shard")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads {threads}: expected a count of IREE worker threads, 1 or more")
    if threads is not None and ray_local is not None and threads > ray_local:
        raise ValueError(f"--threads {threads}: each actor takes that many CPUs, and --ray-local {ray_local} "
                         f"has {ray_local}; use at most {ray_local}")
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    if ray_local is None and ray_address is None:
        return False
    from runtime.jobs.embed_ray import check_ray
    check_ray(ray_local, ray_address)
    return True


@contextmanager
def out_dir_lock(folder: Path):
    """One writer per OUT_DIR: an exclusive flock on OUT_DIR/.embed.lock for the job."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"-o {folder}: another qwen3vl embed is writing there; wait for it to end "
                             f"or choose another folder") from None
        yield
    finally:
        os.close(fd)


def resume(index: EmbedIndex, images: list[str], retry_failed: bool, say) -> list[str]:
    """Load the index (taking back unlisted shards) and say what it lets us skip; the
    images still to embed, in order."""
    index.load(retry_failed)
    done = index.done()
    pending = [image for image in images if image not in done]
    if index.recovered:
        say(f"index: took back {index.recovered} images from shards written after its last save")
    if index.missing:
        say(f"index: {index.missing} images are listed in shards missing or damaged; embedding them again")
    skipped = len(images) - len(pending)
    if skipped:
        failed = len({e["image"] for e in index.failed()} & set(images))
        say(f"skipping {skipped} images already in {index.path}"
            + (f" ({failed} of them failed; --retry-failed tries those again)" if failed else ""))
    return pending


def _drain(results: Iterator[Embedded], writer: ShardWriter, total: int, progress_bar: bool) -> None:
    """Every result into the writer, a tqdm bar (images/s) on stderr; the buffered shard
    is written even after an error or an interrupt (what was encoded is kept)."""
    from tqdm import tqdm

    with tqdm(total=total, unit="img", desc="embed", disable=not progress_bar, mininterval=0.5) as bar:
        try:
            for result in results:
                writer.add(result)
                bar.update(1)
                if writer.errors:
                    bar.set_postfix(failed=writer.errors, refresh=False)
        finally:
            writer.flush()
