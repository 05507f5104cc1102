"""`qwen3vl embed` on an embedding model (Qwen3-VL-Embedding: its sentence-transformers files,
or `--pooling last`): retrieval vectors, one row per item, in shards, resumable.

Items, in order, each once:
- an image file, or a folder's images (recursively, sorted): {"image"};
- a `.txt` file: one text item per line (blank lines skipped);
- a `.jsonl` file: one item per line, {"image": path (relative to the file's folder), "text",
  "instruction"}, each key optional (an item of neither image nor text embeds "NULL", as the
  model card's embedder does).

Each is embedded as the model card's embedder does it (runtime/embedding.py): the instruction
(the item's, else `--instruction`, else "Represent the user's input.") as the system message,
then the image, then the text; the last token's final normed hidden state, cut to
`--dimensions`, normalized. Every `batch` items become `OUT_DIR/vectors-NNNNN.safetensors`
(`embeddings` [n, dimensions] f32, row i the shard's item i; its metadata names them), then
`OUT_DIR/index.json` is rewritten whole: {"engine", "model", "weights", "format":
"retrieval", "dimensions", "instruction", "normalize", "items": [{"item", "shard", "row"} or
{"item", "error"}]}. An item's key is its image's absolute path, or `FILE:LINE` for a line
of a list. A rerun skips the keys the index holds (`--retry-failed`: not the failed ones),
and takes back a shard written after the index's last save.

The items are embedded by one Generator in this process, or on Ray Data by an actor pool
(`--ray-local N`, `--ray ADDRESS`; runtime/jobs/embed_ray.py), each actor one Generator
opened from the cache the driver filled (the weight archive; a text module compiled once,
under the cache's lock); only the driver writes, so a retried batch writes nothing twice.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from emitter.atomic import write_atomic
from emitter.errors import one_line_error as one_line

from runtime.artifact.archive import cached_text_archive
from runtime.embedding import Pooling, check_dimensions, embed, item_messages, instruction_text
from runtime.inputs.chat import Media
from runtime.jobs.embed import INDEX_NAME, IMAGE_SUFFIXES, check_out_dir, out_dir_lock
from runtime.text import POOLING_PROMPT_BUCKETS

SHARD_FORMAT = "qwen3vl-iree retrieval shard v1"


@dataclass
class Item:
    key: str
    image: str | None = None
    text: str | None = None
    instruction: str | None = None

    def parts(self) -> tuple[list[dict], list[Media]]:
        parts = ([{"type": "image"}] if self.image else []) + ([{"type": "text", "text": self.text}] if self.text else [])
        return parts, [Media("image", self.image, name=self.image)] if self.image else []


def list_items(inputs) -> list[Item]:
    """The items of INPUT... in order, each key once; ValueError naming a bad INPUT or line."""
    items: list[Item] = []
    for text in inputs:
        path = Path(text)
        if path.is_dir():
            items += [Item(str(p.absolute()), image=str(p.absolute())) for p in sorted(path.rglob("*"))
                      if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
        elif path.suffix.lower() in (".txt", ".jsonl") and path.is_file():
            items += _list_file(path)
        elif path.is_file():
            items.append(Item(str(path.absolute()), image=str(path.absolute())))
        else:
            raise ValueError(f"INPUT {text}: no such file or folder; expected images, folders of images, a .txt "
                             "file of text lines or a .jsonl file of {image, text} items")
    return list({item.key: item for item in reversed(items)}.values())[::-1]


def _list_file(path: Path) -> list[Item]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"INPUT {path}: cannot read it ({one_line(e)}); expected a UTF-8 text file") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key = f"{path.absolute()}:{number}"
        if path.suffix.lower() == ".txt":
            items.append(Item(key, text=line))
            continue
        try:
            value = json.loads(line)
            assert isinstance(value, dict) and set(value) <= {"image", "text", "instruction"}
            assert all(isinstance(v, str) for v in value.values())
        except (ValueError, AssertionError):
            raise ValueError(f"INPUT {path}:{number}: expected a JSON object of strings image, text, "
                             "instruction (each optional)") from None
        image = str((path.parent / value["image"]).absolute()) if value.get("image") else None
        items.append(Item(key, image, value.get("text"), value.get("instruction")))
    return items


class RetrievalIndex:
    """OUT_DIR/index.json of retrieval vectors, and the shards beside it."""

    def __init__(self, folder: Path, header: dict):
        self.folder, self.header, self.items = folder, header, []
        self.recovered = 0

    @property
    def path(self) -> Path:
        return self.folder / INDEX_NAME

    def load(self, retry_failed: bool) -> None:
        if self.path.exists():
            try:
                saved = json.loads(self.path.read_text(encoding="utf-8"))
                entries = saved["items"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"-o {self.folder}: {INDEX_NAME} is not a retrieval index ({one_line(e)}); "
                                 "choose another folder") from None
            for key, value in self.header.items():
                if key != "engine" and saved.get(key) != value:
                    raise ValueError(f"-o {self.folder}: holds vectors of another {key} ({saved.get(key)!r}, this "
                                     f"run: {value!r}); choose another folder")
            self.items = [e for e in entries if not (retry_failed and "error" in e)
                          and ("shard" not in e or (self.folder / e["shard"]).is_file())]
        listed = {e["shard"] for e in self.items if "shard" in e}
        for shard in sorted(self.folder.glob("vectors-*.safetensors")):
            if shard.name not in listed:
                self.recovered += self._recover(shard)

    def _recover(self, shard: Path) -> int:
        try:
            with safe_open(str(shard), "np") as f:
                meta = f.metadata() or {}
            keys = json.loads(meta["items"])
        except Exception:  # noqa: BLE001 - a foreign or damaged file: not ours to list
            return 0
        done = self.done()
        if meta.get("format") != SHARD_FORMAT or meta.get("weights") != self.header["weights"] or \
                any(k in done for k in keys):
            return 0
        self.items += [{"item": k, "shard": shard.name, "row": i} for i, k in enumerate(keys)]
        return len(keys)

    def done(self) -> set[str]:
        return {e["item"] for e in self.items}

    def next_shard(self) -> int:
        numbers = [int(p.name[8:-12]) for p in self.folder.glob("vectors-*.safetensors") if p.name[8:-12].isdigit()]
        return max(numbers, default=-1) + 1

    def write_shard(self, keys: list[str], rows: list[np.ndarray]) -> None:
        name = f"vectors-{self.next_shard():05d}.safetensors"
        meta = {"format": SHARD_FORMAT, "weights": self.header["weights"], "items": json.dumps(keys)}
        write_atomic(self.folder / name, save({"embeddings": np.stack(rows).astype(np.float32)}, metadata=meta))
        self.items += [{"item": k, "shard": name, "row": i} for i, k in enumerate(keys)]
        self.save()

    def save(self) -> None:
        head = json.dumps(self.header)[:-1]
        lines = ",\n".join(" " + json.dumps(e) for e in self.items)
        write_atomic(self.path, f'{head}, "items": [\n{lines}\n]}}\n' if lines else f'{head}, "items": []}}\n')


@dataclass(frozen=True)
class RetrievalSpec:
    """What opens an embedding model's Generator and embeds items with it, picklable (a Ray
    actor opens its own from it). `context` None: fitted to each item."""
    model: str
    cache_dir: str | None
    pooling: Pooling
    precision: str | None = None
    target: str | None = None
    threads: int | None = None
    context: int | None = None
    buckets: tuple[int, ...] = POOLING_PROMPT_BUCKETS
    instruction: str | None = None
    dimensions: int | None = None

    def open(self, say=None):
        from runtime.generator import Generator
        return Generator(self.model, self.buckets, context=self.context, target=self.target,
                         cache_dir=self.cache_dir, precision=self.precision, threads=self.threads, progress=say,
                         pooling=self.pooling)


def embed_item(gen, item: Item, spec: RetrievalSpec) -> tuple[np.ndarray | None, str | None]:
    """(vector, None), or (None, the one-line reason) when it is the item's fault
    (unreadable, too long for the context)."""
    parts, media = item.parts()
    try:
        vector, _ = embed(gen, item_messages(parts, item.instruction or spec.instruction), media, spec.dimensions)
        return vector, None
    except (ValueError, OSError) as e:
        return None, one_line(e)


class Embedder:
    """One Ray actor: one Generator, opened once; a batch of items -> a vector or an error each."""

    def __init__(self, spec: RetrievalSpec):
        self.spec, self.gen = spec, spec.open()

    def __call__(self, batch: dict) -> dict:
        vectors, errors = [], []
        for key, image, text, instruction in zip(batch["item"], batch["image"], batch["text"], batch["instruction"]):
            vector, error = embed_item(self.gen, Item(str(key), str(image) or None, str(text) or None,
                                                      str(instruction) or None), self.spec)
            vectors.append(b"" if vector is None else np.ascontiguousarray(vector, np.float32).tobytes())
            errors.append(error or "")
        return {"item": batch["item"], "vector": np.array(vectors, dtype=object),
                "error": np.array(errors, dtype=object)}


Result = tuple[str, np.ndarray | None, str | None]  # an item's key, and its vector or the reason it failed


def ray_results(engine, spec: RetrievalSpec, items: list[Item], batch: int) -> Iterator[Result]:
    """(key, vector, error) of each item, in order, from Ray actors (runtime/jobs/embed_ray.py's
    pool), `batch` items per call."""
    rows = [{"item": i.key, "image": i.image or "", "text": i.text or "", "instruction": i.instruction or ""}
            for i in items]
    for row in engine.map(Embedder, spec, rows, batch):
        error = str(row["error"])
        yield str(row["item"]), None if error else np.frombuffer(row["vector"], np.float32), error or None


def embed_items(model, inputs, out_dir, pooling, batch: int = 16, instruction: str | None = None,
                dimensions: int | None = None, precision=None, target=None, cache_dir=None, threads=None,
                retry_failed: bool = False, say=None, progress_bar: bool = True, context: int | None = None,
                buckets=POOLING_PROMPT_BUCKETS, ray_local: int | None = None,
                ray_address: str | None = None) -> "RetrievalSummary":
    """Retrieval vectors of every item of `inputs` not yet in OUT_DIR's index: one Generator
    opened with `pooling` in this process, or one per Ray actor (`ray_local` workers of a
    cluster of its own, or the cluster at `ray_address`)."""
    from tqdm import tqdm

    from runtime.artifact.cache import ArtifactCache
    from runtime.jobs.embed import check_options

    say = say or (lambda message: None)
    if batch < 1:
        raise ValueError(f"--batch {batch}: expected 1 or more items per shard")
    use_ray = check_options(batch, "native", ray_local, ray_address, threads)
    items = list_items(inputs)
    if not items:
        raise ValueError(f"INPUT {' '.join(map(str, inputs))}: no items found")
    folder = check_out_dir(out_dir, model)
    spec = RetrievalSpec(str(Path(model).absolute()), str(ArtifactCache(cache_dir).root.absolute()), pooling,
                         precision, target, threads, context, tuple(buckets), instruction, dimensions)
    gen = spec.open(say)  # checks the model; its text module is compiled when the first item needs it
    dimensions = check_dimensions(dimensions, gen.text.cfg.hidden_size, "--dimensions")
    with out_dir_lock(folder):
        text = gen.text  # the weights' identity (the module's follows the context fitted to each item)
        weights = Path(cached_text_archive(text.model_dir, text.cfg, text.precision, text.cache, say)).stem
        header = {"engine": "ray" if use_ray else "local", "weights": weights, "format": "retrieval",
                  "dimensions": dimensions or gen.text.cfg.hidden_size, "instruction": instruction_text(instruction),
                  "normalize": pooling.normalize}
        index = RetrievalIndex(folder, header)
        index.load(retry_failed)
        if index.recovered:
            say(f"index: took back {index.recovered} items from shards written after its last save")
        done = index.done()
        pending = [item for item in items if item.key not in done]
        if len(items) > len(pending):
            say(f"skipping {len(items) - len(pending)} items already in {index.path}")
        start, keys, rows, embedded, engine = time.perf_counter(), [], [], 0, None
        with tqdm(total=len(pending), unit="item", desc="embed", disable=not progress_bar, mininterval=0.5) as bar:
            try:
                if pending and use_ray:
                    from runtime.jobs.embed_ray import RayEngine
                    gen = None  # the actors open their own
                    engine = RayEngine(threads, ray_local, ray_address, say)
                    start = time.perf_counter()  # the cluster is up
                    results = ray_results(engine, spec, pending, batch)
                else:
                    results = ((i.key, *embed_item(gen, i, spec)) for i in pending)
                for key, vector, error in results:
                    if error is None:
                        keys.append(key)
                        rows.append(vector)
                        embedded += 1
                    else:
                        index.items.append({"item": key, "error": error})
                    bar.update(1)
                    if len(rows) >= batch:
                        index.write_shard(keys, rows)
                        keys, rows = [], []
            finally:
                if rows:
                    index.write_shard(keys, rows)
                index.save()
                if engine:
                    engine.close()
    wanted = {item.key for item in items}
    failed = sum(1 for e in index.items if "error" in e and e["item"] in wanted)
    return RetrievalSummary(embedded, time.perf_counter() - start, len(items) - len(pending), failed, index.path)


@dataclass
class RetrievalSummary:
    items: int
    seconds: float
    skipped: int
    failed: int
    index: Path

    def line(self) -> str:
        rate = self.items / self.seconds if self.seconds > 0 else 0.0
        return (f"embedded {self.items} items in {self.seconds:.1f} s, {rate:.2f} items/s; skipped {self.skipped}, "
                f"failed {self.failed}; index {self.index}")
