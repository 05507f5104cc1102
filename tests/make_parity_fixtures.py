"""Regenerate tests/fixtures/tiny_parity.safetensors: the `tiny` preset's random checkpoint
(seed 0), a packed batch of three entries (images (1, 8, 8) and (1, 4, 6), a video (2, 4, 4)),
and every stage of transformers' Qwen3VLVisionModel on it (see torch_reference.stage_keys).

Needs torch and transformers:  .venv/bin/python tests/make_parity_fixtures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import json  # noqa: E402

import numpy as np  # noqa: E402

from emitter.config import PRESETS  # noqa: E402
from torch_reference import random_vision_state_dict, run_vision_tower, stage_keys  # noqa: E402

PRESET = "tiny"
SEED = 0
GRID_THW = np.array([[1, 8, 8], [1, 4, 6], [2, 4, 4]], dtype=np.int64)
PIXEL_SEED = 1
OUT = HERE / "fixtures" / "tiny_parity.safetensors"


def make_pixel_values(cfg, grid_thw: np.ndarray, seed: int = PIXEL_SEED) -> np.ndarray:
    """Normal(0, 0.5) clipped to [-1, 1], [N, patch_dim] f32 (graph parity needs no processor)."""
    n = int(np.prod(grid_thw, axis=1).sum())
    rng = np.random.default_rng(seed)
    return np.clip(0.5 * rng.standard_normal((n, cfg.patch_dim), dtype=np.float32), -1.0, 1.0)


_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}


def save_deterministic(tensors: dict[str, np.ndarray], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file byte-for-byte reproducibly (sorted JSON header; safetensors'
    own writer orders the metadata map differently from run to run)."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset, blobs = 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _DTYPES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)
    tmp.replace(path)


def main() -> None:
    import torch
    import transformers

    cfg = PRESETS[PRESET]
    weights = random_vision_state_dict(cfg, SEED)
    pixel_values = make_pixel_values(cfg, GRID_THW)
    stages = run_vision_tower(cfg, weights, pixel_values, GRID_THW)
    assert list(stages) == stage_keys(cfg)

    tensors: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        tensors[f"weight.{name}"] = value
    tensors["pixel_values"] = pixel_values
    tensors["grid_thw"] = GRID_THW
    for key, value in stages.items():
        tensors[f"stage.{key}"] = value
    metadata = {
        "preset": PRESET,
        "seed": str(SEED),
        "pixel_seed": str(PIXEL_SEED),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "stage_keys": ",".join(stages),
        "generator": "tests/make_parity_fixtures.py",
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_deterministic(tensors, OUT, metadata)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
