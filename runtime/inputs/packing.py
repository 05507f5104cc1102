"""The graph's per-call host inputs, in one place: packing images into buckets, and
for each call the patches padded to whole row units, position-interpolation corners and weights,
rotary (row, col) ids and attention segment ids.

The math follows transformers' `vision_utils` (bilinear, aligned corners, taps
clamped at the border, merge-window patch order) in f32, so the graph sees the
same numbers the reference computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from emitter.config import VisionConfig
from emitter.vision import call_rows, input_specs


class PackingError(ValueError):
    """Images that cannot be packed into the built buckets."""


@dataclass(frozen=True)
class Call:
    """One graph call: a bucket and the images (indices into the request) it holds."""
    bucket: int
    images: tuple[int, ...]
    patches: int


def patch_count(grid) -> int:
    t, h, w = (int(v) for v in grid)
    return t * h * w


def pack(grids, buckets, names=None, open_top: bool = False) -> list[Call]:
    """Pack images in order into the smallest bucket that holds them; start a new call
    when the next image would overflow the largest bucket. With `open_top` (the default
    buckets: an entry's rows are a run-time count) an image larger than the largest bucket
    gets a call of its own there; else it is a PackingError."""
    ladder = sorted(set(int(b) for b in buckets))
    if not ladder:
        raise PackingError("no buckets to pack into")
    largest = ladder[-1]
    calls, current, used = [], [], 0

    def close():
        if current:
            calls.append(Call(next((b for b in ladder if b >= used), largest), tuple(current), used))

    for i, grid in enumerate(grids):
        n = patch_count(grid)
        if n > largest and not open_top:
            name = names[i] if names else f"image {i}"
            raise PackingError(f"{name}: {n} patches (grid {tuple(int(v) for v in grid)}) fit no bucket; "
                               f"the largest bucket is {largest} patches (add a bucket of at least {n}, "
                               f"e.g. --bucket {n})")
        if current and used + n > largest:
            close()
            current, used = [], 0
        current.append(i)
        used += n
    close()
    return calls


def merge_window_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch of one frame, in merge-window order (block row, block col,
    row in block, col in block)."""
    within = np.arange(h * w)
    blocks_w = w // merge
    in_col = within % merge
    in_row = (within // merge) % merge
    block_col = (within // (merge * merge)) % blocks_w
    block_row = within // (merge * merge * blocks_w)
    return block_row * merge + in_row, block_col * merge + in_col


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor+1 clamped) and weights along one axis, aligned corners."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    frac = src - floor
    taps = np.stack([floor, floor + 1], axis=1).astype(np.int64).clip(0, side - 1)
    distance = np.abs(np.stack([frac - np.float32(0), frac - np.float32(1)], axis=1))
    weights = np.maximum(np.float32(1) - distance, np.float32(0))
    return taps, weights.astype(np.float32)


def position_corners(grid, cfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Indices [4, n] into the position table and weights [4, n] for one image or video."""
    t, h, w = (int(v) for v in grid)
    side = cfg.grid_side
    rows, cols = merge_window_rows_cols(h, w, cfg.spatial_merge_size)
    h_taps, h_weights = _axis_taps(rows, h, side)
    w_taps, w_weights = _axis_taps(cols, w, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return np.tile(index.T, (1, t)), np.tile(weight.T, (1, t))


def host_inputs(pixel_values: np.ndarray, grids, cfg: VisionConfig, bucket: int,
                open_top: bool = False) -> list[np.ndarray]:
    """The per-call inputs for images packed in order into `bucket`'s entry, in argument
    order: the patches padded to whole row units (`emitter.vision.call_rows`), not to the
    bucket. More patches than the bucket holds are a PackingError, unless `open_top` (`pack`)."""
    grids = [tuple(int(v) for v in g) for g in grids]
    n = sum(patch_count(g) for g in grids)
    if pixel_values.shape != (n, cfg.patch_dim):
        raise PackingError(f"pixel_values: shape {pixel_values.shape}, expected ({n}, {cfg.patch_dim}) "
                           f"for grids {grids}")
    if n > bucket and not open_top:
        raise PackingError(f"{n} patches do not fit bucket {bucket}")
    rows = call_rows(cfg, bucket, n)
    patches = np.zeros((rows, cfg.patch_dim), np.float32)
    patches[:n] = pixel_values
    pos_index = np.zeros((4, rows), np.int32)
    pos_weight = np.zeros((4, rows), np.float32)
    rope_pos = np.zeros((2, rows), np.int32)
    # Padding patches: each its own segment, after every real frame's id.
    segment_ids = np.arange(rows, dtype=np.int32)
    start, segment = 0, 0
    for t, h, w in grids:
        count = t * h * w
        index, weight = position_corners((t, h, w), cfg)
        pos_index[:, start:start + count] = index
        pos_weight[:, start:start + count] = weight
        grid_rows, grid_cols = merge_window_rows_cols(h, w, cfg.spatial_merge_size)
        rope_pos[:, start:start + count] = np.tile(np.stack([grid_rows, grid_cols]), (1, t))
        segment_ids[start:start + count] = np.repeat(np.arange(segment, segment + t), h * w)
        start, segment = start + count, segment + t
    segment_ids[n:] = np.arange(segment, segment + rows - n)
    arrays = [patches, pos_index, pos_weight, rope_pos, segment_ids]
    for array, (name, shape, dtype) in zip(arrays, input_specs(cfg, rows)):
        assert array.shape == shape and array.dtype == {"f32": np.float32, "i32": np.int32}[dtype], name
    return arrays
