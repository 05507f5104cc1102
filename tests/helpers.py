"""Small test helpers that need neither torch nor a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_config(folder: Path, cfg, mutate=None, model_type: str = "qwen3_vl") -> Path:
    """A minimal config.json for `cfg`; `mutate(vision_dict)` edits the vision part first."""
    vision = cfg.to_hf_vision_config()
    if mutate:
        mutate(vision)
    path = Path(folder) / "config.json"
    path.write_text(json.dumps({"model_type": model_type, "vision_config": vision}))
    return path


def write_images(folder: Path, sizes, seed: int = 0, stem: str = "img") -> list[str]:
    """Random RGB PNGs of the given (width, height) sizes, `<stem><i>.png`; their paths."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    paths = []
    for i, (w, h) in enumerate(sizes):
        path = Path(folder) / f"{stem}{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return paths
