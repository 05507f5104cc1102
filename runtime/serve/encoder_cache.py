"""The tower's rows of images and videos already seen, kept by the server (an LRU bounded
in bytes). The key is a sha256 over the medium's processed pixels and grid: the same file
bytes under the same processor policy give the same pixels, and the tower's output
depends on nothing else (the precision is fixed for a server's lifetime)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

from runtime.inputs.chat import ProcessedMedia, Rows, encode_joint


def media_key(medium: ProcessedMedia) -> str:
    digest = hashlib.sha256(f"{medium.kind}:{medium.grid}:{medium.pixels.shape}".encode())
    digest.update(np.ascontiguousarray(medium.pixels).data)
    return digest.hexdigest()


class EncoderCache:
    """`encode(processed)` with `chat.encode_joint`'s contract (`session()`: the vision
    session); each medium not held is run through the tower alone, then held (least
    recently used dropped past `max_bytes`)."""

    def __init__(self, session, max_bytes: int, metrics=None):
        self.session, self.max_bytes, self.metrics = session, max_bytes, metrics
        self.entries: OrderedDict[str, Rows] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def __call__(self, processed: list[ProcessedMedia]) -> list[Rows]:
        return [self._one(m) for m in processed]

    def _one(self, medium: ProcessedMedia) -> Rows:
        key = media_key(medium)
        with self.lock:
            rows = self.entries.get(key)
            if rows is not None:
                self.entries.move_to_end(key)
                self._count("encoder_hits")
                return rows
        rows = encode_joint(self.session, [medium])[0]
        rows = (rows[0].copy(), rows[1].copy())
        self._count("encoder_misses")
        self._put(key, rows)
        return rows

    def _put(self, key: str, rows: Rows) -> None:
        size = rows[0].nbytes + rows[1].nbytes
        if size > self.max_bytes:
            return
        with self.lock:
            if key not in self.entries:
                self.entries[key] = rows
                self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self.entries.popitem(last=False)
                self.bytes -= old[0].nbytes + old[1].nbytes
            if self.metrics:
                self.metrics.encoder_bytes.set(self.bytes)

    def _count(self, name: str) -> None:
        if self.metrics:
            getattr(self.metrics, name).inc()
