"""The processor policies: every setting that decides the pixel values fed to the
vision tower, parsed from a checkpoint's `preprocessor_config.json` (images,
`ProcessorPolicy`) and `video_preprocessor_config.json` (videos, `VideoPolicy`).

Pure Python (no numpy, no PIL): the emitter hashes `ProcessorPolicy.to_dict()` into
an artifact's identity, and the runtime's `runtime.inputs.processor` applies it.

Parsing follows what transformers' `Qwen2VLImageProcessorPil(**config)` does with the
same dict, with one deliberate difference: the settings whose transformers class
defaults are Qwen2-VL's (pixel bounds 56*56 / 28*28*1280, patch size 14, CLIP mean and
std, temporal and merge size) must be present in the file; a missing one raises
`PolicyError` instead of silently yielding Qwen2-VL pixels. The settings that the
released Qwen3-VL files leave out (resample, rescale_factor, do_*) take transformers'
class defaults (BICUBIC, 1/255, all true), exactly as transformers does, and are
recorded in the policy (and so in the artifact identity).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

PREPROCESSOR_CONFIG = "preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"  # combined layout: {"image_processor": {...}, "video_processor": ...}
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"

# PIL resampling filters by their integer code (PIL.Image.Resampling).
RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}

# Defaults transformers' Qwen2VLImageProcessor applies when the file is silent; they
# are the same for Qwen2-VL, Qwen2.5-VL and Qwen3-VL.
CLASS_DEFAULTS = {
    "resample": 3,
    "rescale_factor": 1 / 255,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
}

MAX_ASPECT_RATIO = 200


class PolicyError(ValueError):
    """A preprocessor config the pixels cannot be decided from; names the file and field."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `qwen2_vl.image_processing_pil_qwen2_vl.smart_resize`, operation for
    operation (same float arithmetic, Python `round` = half to even).

    Returns (resized_height, resized_width), both multiples of `factor`. Raises
    ValueError (transformers' condition and message) when the aspect ratio exceeds 200,
    and ValueError for a zero-sized input (transformers divides by zero there).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image has zero size ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# --------------------------------------------------------------------------- checks


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bad(source: str, name: str, value, expected: str):
    raise PolicyError(f"{source}: field '{name}' = {value!r}: expected {expected}")


def _positive_int(source, name, v) -> int:
    if not _is_int(v) or v <= 0:
        _bad(source, name, v, "a positive integer")
    return v


def _triple(source, name, v, *, nonzero: bool) -> tuple[float, float, float]:
    if _is_number(v):  # transformers broadcasts a scalar to every channel
        v = [v] * 3
    if not isinstance(v, (list, tuple)) or len(v) != 3 or not all(_is_number(x) for x in v):
        _bad(source, name, v, "3 finite numbers (one per RGB channel)")
    if nonzero and any(x == 0 for x in v):
        _bad(source, name, v, "no zero entry (pixels are divided by it)")
    return tuple(float(x) for x in v)


def _rescale(source, name, v) -> float:
    if not _is_number(v) or v <= 0:
        _bad(source, name, v, "a positive finite number (1/255 for uint8 pixels)")
    return float(v)


def _resample(source, name, v) -> int:
    if not _is_int(v) or v not in RESAMPLE_NAMES:
        codes = ", ".join(f"{k} ({n})" for k, n in RESAMPLE_NAMES.items())
        _bad(source, name, v, f"a PIL resampling code: {codes}")
    return v


def _flag(source, name, v) -> bool:
    if not isinstance(v, bool):
        _bad(source, name, v, "true or false")
    return v


_CHECKS = {
    "min_pixels": _positive_int,
    "max_pixels": _positive_int,
    "patch_size": _positive_int,
    "temporal_patch_size": _positive_int,
    "merge_size": _positive_int,
    "image_mean": lambda s, n, v: _triple(s, n, v, nonzero=False),
    "image_std": lambda s, n, v: _triple(s, n, v, nonzero=True),
    "rescale_factor": _rescale,
    "resample": _resample,
    "do_resize": _flag,
    "do_rescale": _flag,
    "do_normalize": _flag,
    "do_convert_rgb": _flag,
}


def _check_all(values: dict, names: dict, source: str) -> dict:
    """Validate every field; `names` maps a policy field to the name the source uses."""
    out = {k: _CHECKS[k](source, names.get(k, k), values[k]) for k in _CHECKS}
    if out["min_pixels"] > out["max_pixels"]:
        lo, hi = names.get("min_pixels", "min_pixels"), names.get("max_pixels", "max_pixels")
        raise PolicyError(
            f"{source}: field '{lo}' = {out['min_pixels']!r} is greater than field '{hi}' = "
            f"{out['max_pixels']!r}: expected {lo} <= {hi}"
        )
    return out


# --------------------------------------------------------------------------- policy


class PatchSizes:
    """The sizes derived from a policy's patch_size, temporal_patch_size and merge_size,
    one place each (image and video policies alike)."""

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (patch_size * merge_size)."""
        return self.patch_size * self.merge_size

    @property
    def in_channels(self) -> int:
        return 3

    @property
    def patch_dim(self) -> int:
        """Length of one row of pixel_values: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ProcessorPolicy(PatchSizes):
    """Everything that decides the pixel values (and the patch grid) of an image."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = CLASS_DEFAULTS["rescale_factor"]
    resample: int = CLASS_DEFAULTS["resample"]
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self):
        values = _check_all({f.name: getattr(self, f.name) for f in fields(self)}, {}, "ProcessorPolicy")
        for k, v in values.items():  # canonical types: tuples of floats, float rescale
            object.__setattr__(self, k, v)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image is resized to (`smart_resize`); unchanged when
        do_resize is off. Raises ValueError for an aspect ratio over 200."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of a still image of this size."""
        h, w = self.resized_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_patches(self, height: int, width: int) -> int:
        t, h, w = self.grid_thw(height, width)
        return t * h * w

    # Parsing and writing.
    @classmethod
    def from_preprocessor_config(cls, d: dict, source: str = PREPROCESSOR_CONFIG) -> "ProcessorPolicy":
        """Parse a `preprocessor_config.json` dict. Pixel bounds: top-level
        `min_pixels`/`max_pixels` when present and not null (transformers lets them
        override `size`), else `size.shortest_edge`/`size.longest_edge`."""
        if not isinstance(d, dict):
            raise PolicyError(f"{source}: expected a JSON object, got {type(d).__name__}")
        size = d.get("size")
        if size is not None and not isinstance(size, dict):
            _bad(source, "size", size, "an object with 'shortest_edge' and 'longest_edge'")
        size = size or {}

        values, names = {}, {}
        for field, top, edge in (("min_pixels", "min_pixels", "shortest_edge"),
                                 ("max_pixels", "max_pixels", "longest_edge")):
            if d.get(top) is not None:
                values[field], names[field] = d[top], top
            elif size.get(edge) is not None:
                values[field], names[field] = size[edge], f"size.{edge}"
            else:
                raise PolicyError(
                    f"{source}: field 'size.{edge}' (or '{top}') is missing: expected a positive "
                    f"integer pixel count; refusing to fall back to Qwen2-VL defaults"
                )
        for field in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std"):
            if d.get(field) is None:
                raise PolicyError(
                    f"{source}: field '{field}' is missing: required (transformers' class default "
                    f"is Qwen2-VL's, not this checkpoint's)"
                )
            values[field] = d[field]
        for field, default in CLASS_DEFAULTS.items():
            values[field] = default if d.get(field) is None else d[field]
        return cls(**_check_all(values, names, source))

    def to_dict(self) -> dict:
        """Canonical JSON-able dict (field order fixed, tuples as lists, floats as
        floats), for artifact identity hashing."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def to_preprocessor_config(self) -> dict:
        """A `preprocessor_config.json` dict that transformers and
        `from_preprocessor_config` both read back as this policy."""
        return {
            "size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "merge_size": self.merge_size,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor,
            "resample": self.resample,
            "do_resize": self.do_resize,
            "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize,
            "do_convert_rgb": self.do_convert_rgb,
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
        }


# The released Qwen3-VL preprocessor_config.json (every size, dense and MoE).
DEFAULT_POLICY = ProcessorPolicy(
    min_pixels=65536,
    max_pixels=16777216,
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    rescale_factor=1 / 255,
    resample=3,
    do_resize=True,
    do_rescale=True,
    do_normalize=True,
    do_convert_rgb=True,
)


def _read_json(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PolicyError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PolicyError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None


# Sizes the processor and the vision config must agree on: (policy field, config field).
SHARED_SIZES = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                ("merge_size", "spatial_merge_size"), ("in_channels", "in_channels"))


def check_matches_config(policy: ProcessorPolicy, cfg, policy_source: str, config_source: str) -> None:
    """Refuse a policy whose patch, temporal, merge or channel size differs from the vision
    config's (`cfg`, an `emitter.config.VisionConfig`): the pixels would be cut or ordered
    for another graph. PolicyError naming both files."""
    for ours, theirs in SHARED_SIZES:
        a, b = getattr(policy, ours), getattr(cfg, theirs)
        if a != b:
            raise PolicyError(
                f"{policy_source}: {ours} = {a} disagrees with {config_source}: vision_config.{theirs} = {b}; "
                f"expected the same value in both files"
            )


def _read_policy(model_dir: Path) -> tuple[ProcessorPolicy, str]:
    """The folder's policy and the file (or file[object]) it came from."""
    path = model_dir / PREPROCESSOR_CONFIG
    if path.is_file():
        return ProcessorPolicy.from_preprocessor_config(_read_json(path), source=str(path)), str(path)
    combined = model_dir / PROCESSOR_CONFIG
    if combined.is_file():
        d = _read_json(combined)
        if isinstance(d, dict) and isinstance(d.get("image_processor"), dict):
            source = f"{combined}[image_processor]"
            return ProcessorPolicy.from_preprocessor_config(d["image_processor"], source=source), source
    raise PolicyError(f"{path}: missing: a checkpoint folder needs its {PREPROCESSOR_CONFIG}")


def load_policy(model_dir: str | Path, cfg=None) -> ProcessorPolicy:
    """Read `<model_dir>/preprocessor_config.json` (or, when only the combined layout
    is there, the `image_processor` object of `processor_config.json`). With `cfg` (the
    folder's vision config), also check that the two files agree (`check_matches_config`)."""
    model_dir = Path(model_dir)
    policy, source = _read_policy(model_dir)
    if cfg is not None:
        check_matches_config(policy, cfg, source, str(model_dir / "config.json"))
    return policy
