"""The video-processor policy: every setting that decides which frames of a video are
used and the pixel values they become, parsed from a checkpoint's
`video_preprocessor_config.json`.

Pure Python, like `emitter.policy`: the emitter hashes `VideoPolicy.to_dict()` into an
artifact's identity beside the image policy (the compiled graph depends on neither beyond
the patch, temporal and merge sizes, which must equal the config's; the identity holds
both so that a cached artifact always names the whole input contract it was built for),
and `runtime.inputs.video` applies it.

Parsing follows transformers' `Qwen3VLVideoProcessor`: the file is found where
`AutoVideoProcessor` looks (`processor_config.json`'s `video_processor` object, else
`video_preprocessor_config.json`, else `preprocessor_config.json`; last, where
transformers would give up, the combined file's `image_processor`, so that every folder
whose image policy reads also has a video policy), and every setting
the file leaves out takes that class's default (these defaults are Qwen3-VL's own, so
nothing is refused for being absent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from .policy import (_CHECKS, MAX_ASPECT_RATIO, PREPROCESSOR_CONFIG, PROCESSOR_CONFIG, VIDEO_PREPROCESSOR_CONFIG,
                     PatchSizes, PolicyError, _bad, _flag, _is_number, _positive_int, _read_json, check_matches_config)

# transformers 5.24's Qwen3VLVideoProcessor class attributes.
VIDEO_CLASS_DEFAULTS = {
    "min_pixels": 128 * 32 * 32,   # size.shortest_edge
    "max_pixels": 32 * 32 * 768,   # size.longest_edge
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": (0.5, 0.5, 0.5),
    "image_std": (0.5, 0.5, 0.5),
    "rescale_factor": 1 / 255,
    "resample": 3,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "do_sample_frames": True,
    "fps": 2.0,
    "num_frames": None,
    "min_frames": 4,
    "max_frames": 768,
    "cap_pixels_per_frame": False,  # transformers: None, treated as False (with a warning)
    "max_video_tokens": 768,
}


def _optional(check):
    return lambda s, n, v: None if v is None else check(s, n, v)


def _positive_number(source, name, v) -> float:
    if not _is_number(v) or v <= 0:
        _bad(source, name, v, "a positive number")
    return float(v)


_VIDEO_CHECKS = dict(_CHECKS, do_sample_frames=_flag, fps=_optional(_positive_number),
                     num_frames=_optional(_positive_int), min_frames=_positive_int, max_frames=_positive_int,
                     cap_pixels_per_frame=_flag, max_video_tokens=_positive_int)


def video_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' `qwen3_vl.video_processing_qwen3_vl.smart_resize`, operation for
    operation: (resized_height, resized_width), multiples of `factor`, with the pixel
    bounds counted over all `num_frames` frames. ValueError (transformers' conditions)
    for fewer frames than `temporal_factor` or an aspect ratio over 200."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VideoPolicy(PatchSizes):
    """Everything that decides the frames sampled from a video and their pixel values."""

    min_pixels: int = VIDEO_CLASS_DEFAULTS["min_pixels"]
    max_pixels: int = VIDEO_CLASS_DEFAULTS["max_pixels"]
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    do_sample_frames: bool = True
    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    def __post_init__(self):
        values = _check_video({f.name: getattr(self, f.name) for f in fields(self)}, {}, "VideoPolicy")
        for k, v in values.items():
            object.__setattr__(self, k, v)

    def frame_count(self, total_frames: int, video_fps: float | None) -> int:
        """How many frames `sample_indices` takes from a video of `total_frames`:
        `Qwen3VLVideoProcessor.sample_frames` (fps of 24 when the video gives none)."""
        if not self.do_sample_frames:
            return total_frames
        if self.num_frames is not None:
            return self.num_frames
        if self.fps is not None:
            n = int(total_frames / (video_fps or 24) * self.fps)
            return min(max(n, self.min_frames), self.max_frames, total_frames)
        return min(max(total_frames, self.min_frames), self.max_frames)

    def sample_indices(self, total_frames: int, video_fps: float | None) -> list[int]:
        """Frame indices used, as `Qwen3VLVideoProcessor.sample_frames` picks them:
        `np.linspace(0, total - 1, n).round()` (computed here without numpy: the same
        float64 values, rounded half to even)."""
        n = self.frame_count(total_frames, video_fps)
        if not self.do_sample_frames:
            return list(range(total_frames))
        return [round(v) for v in _linspace(0.0, float(total_frames - 1), n)]

    def resized_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame is resized to; unchanged when do_resize is off.
        ValueError (transformers') for too few frames or an aspect ratio over 200."""
        if not self.do_resize:
            if num_frames < 1:
                raise ValueError("t:0 frames")
            return height, width
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # Qwen3VLVideoProcessor.resize's per-frame cap
            per_frame = max(min(self.max_video_tokens * self.factor**2, self.max_pixels // num_frames),
                            int(self.min_pixels * 1.05))
            max_pixels = per_frame * num_frames
        return video_smart_resize(num_frames, height, width, self.temporal_patch_size, self.factor,
                                  self.min_pixels, max_pixels)

    def grid_thw(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of `num_frames` sampled frames of this size (the last
        temporal group padded with the last frame)."""
        h, w = self.resized_size(num_frames, height, width)
        t = -(-num_frames // self.temporal_patch_size)
        return t, h // self.patch_size, w // self.patch_size

    @classmethod
    def from_config(cls, d: dict, source: str = VIDEO_PREPROCESSOR_CONFIG) -> "VideoPolicy":
        """Parse a video processor dict as `Qwen3VLVideoProcessor(**d)` reads it: pixel
        bounds from `size.shortest_edge` / `size.longest_edge`, everything absent or null
        from the class defaults (a null `fps` means no fps sampling, as there)."""
        if not isinstance(d, dict):
            raise PolicyError(f"{source}: expected a JSON object, got {type(d).__name__}")
        size = d.get("size")
        if size is not None and not isinstance(size, dict):
            _bad(source, "size", size, "an object with 'shortest_edge' and 'longest_edge'")
        size = size or {}
        values = dict(VIDEO_CLASS_DEFAULTS)
        names = {"min_pixels": "size.shortest_edge", "max_pixels": "size.longest_edge"}
        if size:  # transformers takes the file's size dict whole
            for field, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if not size.get(edge):
                    _bad(source, f"size.{edge}", size.get(edge), "a positive integer pixel count (transformers "
                         "needs both edges)")
                values[field] = size[edge]
        for field in VIDEO_CLASS_DEFAULTS:
            if field in ("min_pixels", "max_pixels"):
                continue
            if field == "fps" and "fps" in d:
                values["fps"] = d["fps"]  # null is meaningful: no fps sampling
            elif d.get(field) is not None:
                values[field] = d[field]
        if values["fps"] is not None and values["num_frames"] is not None and values["do_sample_frames"]:
            raise PolicyError(f"{source}: fields 'fps' = {values['fps']!r} and 'num_frames' = "
                              f"{values['num_frames']!r} are both set: expected one of them (transformers refuses "
                              f"both)")
        return cls(**_check_video(values, names, source))

    def to_dict(self) -> dict:
        """Canonical JSON-able dict (field order fixed, tuples as lists), for identity hashing."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def to_config(self) -> dict:
        """A `video_preprocessor_config.json` dict that transformers and `from_config`
        both read back as this policy."""
        out = {"size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}}
        for k, v in self.to_dict().items():
            if k not in ("min_pixels", "max_pixels"):
                out[k] = v
        out.update(video_processor_type="Qwen3VLVideoProcessor", processor_class="Qwen3VLProcessor")
        return out


def _linspace(start: float, stop: float, n: int) -> list[float]:
    """numpy.linspace(start, stop, n) in float64, the same arithmetic: start + i * step,
    the last value exactly `stop`."""
    if n <= 0:
        return []
    if n == 1:
        return [start]
    step = (stop - start) / (n - 1)
    values = [start + i * step for i in range(n)]
    values[-1] = stop
    return values


def _check_video(values: dict, names: dict, source: str) -> dict:
    out = {k: _VIDEO_CHECKS[k](source, names.get(k, k), values[k]) for k in _VIDEO_CHECKS}
    if out["min_pixels"] > out["max_pixels"]:
        raise PolicyError(f"{source}: field 'size.shortest_edge' = {out['min_pixels']!r} is greater than field "
                          f"'size.longest_edge' = {out['max_pixels']!r}: expected shortest_edge <= longest_edge")
    if out["min_frames"] > out["max_frames"]:
        raise PolicyError(f"{source}: field 'min_frames' = {out['min_frames']!r} is greater than field "
                          f"'max_frames' = {out['max_frames']!r}: expected min_frames <= max_frames")
    return out


# The released Qwen3-VL video_preprocessor_config.json.
DEFAULT_VIDEO_POLICY = VideoPolicy(min_pixels=4096, max_pixels=25165824)


def _read_video_policy(model_dir: Path) -> tuple[VideoPolicy, str]:
    """The folder's video policy and the file (or file[object]) it came from, found
    where transformers' `AutoVideoProcessor` looks."""
    combined = model_dir / PROCESSOR_CONFIG
    d = _read_json(combined) if combined.is_file() else None
    if isinstance(d, dict) and isinstance(d.get("video_processor"), dict):
        source = f"{combined}[video_processor]"
        return VideoPolicy.from_config(d["video_processor"], source), source
    for name in (VIDEO_PREPROCESSOR_CONFIG, PREPROCESSOR_CONFIG):
        path = model_dir / name
        if path.is_file():
            return VideoPolicy.from_config(_read_json(path), str(path)), str(path)
    if isinstance(d, dict) and isinstance(d.get("image_processor"), dict):  # where load_policy read the images'
        source = f"{combined}[image_processor]"
        return VideoPolicy.from_config(d["image_processor"], source), source
    path = model_dir / VIDEO_PREPROCESSOR_CONFIG
    raise PolicyError(f"{path}: missing: a checkpoint folder needs its {VIDEO_PREPROCESSOR_CONFIG} (or a "
                      f"{PREPROCESSOR_CONFIG}) to process videos")


def load_video_policy(model_dir: str | Path, cfg=None) -> VideoPolicy:
    """The video policy of a checkpoint folder; with `cfg` (its vision config), checked to
    agree with it on patch, temporal, merge and channel sizes."""
    model_dir = Path(model_dir)
    policy, source = _read_video_policy(model_dir)
    if cfg is not None:
        check_matches_config(policy, cfg, source, str(model_dir / "config.json"))
    return policy


__all__ = ["DEFAULT_VIDEO_POLICY", "VIDEO_CLASS_DEFAULTS", "VideoPolicy", "load_video_policy",
           "video_smart_resize"]
