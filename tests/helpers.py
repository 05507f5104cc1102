"""Small test helpers that need neither torch nor a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path


def write_config(folder: Path, cfg, mutate=None, model_type: str = "qwen3_vl") -> Path:
    """A minimal config.json for `cfg`; `mutate(vision_dict)` edits the vision part first."""
    vision = cfg.to_hf_vision_config()
    if mutate:
        mutate(vision)
    path = Path(folder) / "config.json"
    path.write_text(json.dumps({"model_type": model_type, "vision_config": vision}))
    return path
