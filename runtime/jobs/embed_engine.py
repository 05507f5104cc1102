"""What an embed engine runs: the picklable spec a session opens from, one batch of images
encoded into per-image results, and the local engine (one session in this process). The
Ray engine (`embed_ray`) runs the same `encode_batch` in its actors; the job that drives
either (`embed`) writes the shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from emitter.errors import Failure, one_line_error as one_line


from runtime.inputs.processor import image_grid, process_image


class EngineError(Failure):
    """The engine itself failed (not one image): one line; what was written is kept."""


@dataclass(frozen=True)
class SessionSpec:
    """What opens a session, picklable (Ray actors open their own from it). `buckets` None:
    the default ladder, grown for larger images (`VisionSession.fit`)."""
    model: str
    cache_dir: str
    buckets: tuple[int, ...] | None = None
    target: str | None = None
    precision: str = "f32"
    threads: int | None = None

    def open(self):
        from runtime.vision import VisionSession
        return VisionSession(self.model, buckets=self.buckets, target=self.target, cache_dir=self.cache_dir,
                             threads=self.threads, precision=self.precision)


@dataclass
class Embedded:
    """One image's result: `features` [1 + K, tokens, out_hidden] f32 (the main embeddings,
    then each DeepStack feature), or `error`, one line."""
    image: str
    grid: tuple[int, int, int] | None = None
    features: np.ndarray | None = None
    error: str | None = None


def encode_batch(session, images: list[str]) -> list[Embedded]:
    """Encode `images` together (packed as `qwen3vl run` packs them); an image that cannot
    be read or fits no bucket (of a session with fixed buckets) becomes a failed result
    instead of an exception."""
    results = [Embedded(image) for image in images]
    good, pixels = [], []
    for result in results:
        try:
            grid = image_grid(result.image, session.policy)  # header only
            session.pack([grid], [result.image])
            values, result.grid = process_image(result.image, session.policy)
        except (ValueError, OSError) as e:
            result.error = one_line(e)
            continue
        good.append(result)
        pixels.append(values)
    if not good:
        return results
    try:
        out = session.encode_pixels(np.concatenate(pixels), [r.grid for r in good], [r.image for r in good])
    except MemoryError as e:
        for result in good:
            result.error = f"out of memory encoding this batch ({one_line(e)}); use a smaller --batch or bucket"
        return results
    stacked = np.concatenate([out.image_embeds[None], out.deepstack_features]).astype(np.float32)
    start = 0
    for result, rows in zip(good, out.merged_counts(session.cfg.merge_unit)):
        result.features = stacked[:, start:start + rows]
        start += rows
        if not np.isfinite(result.features).all():
            result.features, result.error = None, "outputs are NaN or inf; the tower overflowed f32"
    return results


def local_engine(session, images: list[str], batch: int) -> Iterator[Embedded]:
    """One session in this process, `batch` images per call."""
    for start in range(0, len(images), batch):
        yield from encode_batch(session, images[start:start + batch])
