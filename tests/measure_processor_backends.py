"""Our processor (exact against transformers' PIL backend) against transformers' torchvision
backend (`Qwen2VLImageProcessor`), on one corpus, with the released policy: how far the
pixel values are apart, and what that does to the 2B tower's outputs (random weights,
transformers' own tower on both pixel sets). The figures quoted in docs/inputs.md, "Images".

Needs torch, transformers and torchvision:  .venv/bin/python tests/measure_processor_backends.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import numpy as np  # noqa: E402
from PIL import Image, ImageDraw, ImageFilter  # noqa: E402

from emitter.config import PRESETS  # noqa: E402
from emitter.policy import DEFAULT_POLICY  # noqa: E402
from runtime.inputs.processor import process_image  # noqa: E402
from torch_reference import import_torchvision, load_state_dict, make_vision_model  # noqa: E402
from torch_reference import random_vision_state_dict, run_vision_tower  # noqa: E402


def shapes(w: int, h: int, seed: int) -> Image.Image:
    """A smooth picture: blurred coloured ellipses (photo-like: no pixel-level noise)."""
    rng = np.random.default_rng(seed)
    colour = lambda: tuple(int(v) for v in rng.integers(0, 256, 3))  # noqa: E731
    img = Image.new("RGB", (w, h), colour())
    draw = ImageDraw.Draw(img)
    for _ in range(40):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        draw.ellipse([x, y, x + int(rng.integers(5, w // 2)), y + int(rng.integers(5, h // 2))], fill=colour())
    return img.filter(ImageFilter.GaussianBlur(2))


def noise(w: int, h: int, seed: int) -> Image.Image:
    """Uniform noise: the worst case for a resampling filter."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def corpus() -> dict[str, Image.Image]:
    """Sizes on the 32-pixel grid (not resized) and off it (resized)."""
    return {
        "demo.png 320x224": Image.open(HERE.parent / "assets" / "demo.png").convert("RGB"),
        "shapes 640x480": shapes(640, 480, 1),
        "shapes 256x256": shapes(256, 256, 3),
        "noise 256x256": noise(256, 256, 4),
        "shapes 300x500 (resized)": shapes(300, 500, 2),
        "shapes RGBA 400x300 (resized)": shapes(400, 300, 6).convert("RGBA"),
        "noise 500x333 (resized)": noise(500, 333, 5),
    }


def torchvision_processor(policy=DEFAULT_POLICY):
    if import_torchvision() is None:
        raise SystemExit("torchvision is not installed")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor(**copy.deepcopy(policy.to_preprocessor_config()))


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    policy = DEFAULT_POLICY
    level = policy.rescale_factor / policy.image_std[0]  # one uint8 step in pixel_values
    theirs = torchvision_processor(policy)
    cfg = PRESETS["qwen3-vl-2b"]
    weights = random_vision_state_dict(cfg, seed=0)
    model = make_vision_model(cfg)
    load_state_dict(model, weights)
    print("image | values off by >= 1 level | max levels | pixel relL2 | image_embeds relL2 | worst DeepStack relL2")
    for name, img in corpus().items():
        ours, grid = process_image(img.copy(), policy)
        ref = np.asarray(theirs(images=img, return_tensors="np")["pixel_values"], np.float32)
        levels = np.rint(np.abs(ref.astype(np.float64) - ours) / level)
        a = run_vision_tower(cfg, weights, ours, np.array([grid]), model=model)
        b = run_vision_tower(cfg, weights, ref, np.array([grid]), model=model)
        deepstack = max(rel_l2(a[f"deepstack_merger_list.{k}"], b[f"deepstack_merger_list.{k}"])
                        for k in range(len(cfg.deepstack_visual_indexes)))
        print(f"{name} | {float((levels >= 1).mean()):.2%} | {levels.max():.0f} | {rel_l2(ours, ref):.1e} | "
              f"{rel_l2(a['merger'], b['merger']):.1e} | {deepstack:.1e}", flush=True)


if __name__ == "__main__":
    main()
