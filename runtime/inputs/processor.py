"""The Qwen3-VL image processor: PIL images or image files to `pixel_values`
[patches, C*T*P*P] f32 and `grid_thw`, bit-identical to transformers' PIL backend,
`Qwen2VLImageProcessorPil`, run with the same `ProcessorPolicy`.

Not to its torchvision backend (`Qwen2VLImageProcessor`, which transformers picks
whenever torchvision is installed; the released preprocessor_config.json names it
`Qwen2VLImageProcessorFast`): that one resizes with torch's bicubic and normalizes with
a fused formula. On images already on the 32-pixel grid the two agree to one float32
step; on resized ones torch's bicubic differs from PIL's (docs/inputs.md, "Images", has the figures).

What transformers does, step by step, and how it is reproduced here:

1. Input. A path string goes through `image_utils.load_image`: `PIL.Image.open`,
   `ImageOps.exif_transpose`, `.convert("RGB")` (alpha dropped, not composited).
   A PIL image is used as given (no EXIF rotation).
2. RGB (`do_convert_rgb`, `image_transforms.convert_to_rgb`): an image with an "A" band
   (RGBA, LA, PA, LAB's "A" too) or a `transparency` entry in `info` (P, L, RGB with a
   tRNS chunk) is converted to RGBA and alpha-composited onto opaque white; any other
   mode goes through PIL's `convert("RGB")` (CMYK/YCbCr use PIL's matrices). Modes wider
   than 8 bits (I;16, I, F) are refused: PIL clamps them to 0..255, which transformers
   does too, turning a 16-bit photo white.
3. Resize (`do_resize`): `smart_resize` to multiples of patch*merge, then PIL
   `resize((w, h), resample)` on the uint8 RGB image.
4. Rescale (`do_rescale`): `uint8 -> float64 * rescale_factor -> float32`.
   Normalize (`do_normalize`): `(x - mean) / std` in float32 with mean and std cast to
   float32. Not fused. Both are functions of the uint8 value and channel only, so they
   are applied here as a 3x256 float32 lookup table computed with exactly those numpy
   operations: the result is the same bits.
5. Patchify: (C, gh/M, M, P, gw/M, M, P) -> (gh/M, gw/M, M, M, C, [T], P, P), the
   frame repeated to temporal_patch_size, rows of C*T*P*P; grid (1, gh, gw).
"""

from __future__ import annotations

import os
import stat
import warnings
from functools import lru_cache
from typing import Sequence, Union

import numpy as np
from PIL import Image, ImageOps

from emitter.errors import one_line_error
from emitter.policy import DEFAULT_POLICY, MAX_ASPECT_RATIO, ProcessorPolicy, smart_resize

ImageLike = Union[Image.Image, str, os.PathLike]

__all__ = [
    "ImageError",
    "ImageLike",
    "check_image_file",
    "image_grid",
    "load_image",
    "to_rgb",
    "process_image",
    "process_images",
    "smart_resize",
]


class ImageError(ValueError):
    """An image that cannot be processed; the one-line message names the image."""


def _name_of(image, name: str | None) -> str:
    if name:
        return name
    if isinstance(image, (str, os.PathLike)):
        return os.fspath(image)
    if isinstance(image, Image.Image):
        filename = getattr(image, "filename", "")
        if filename:
            return str(filename)
        return f"<{image.mode} image {image.width}x{image.height}>"
    return f"<{type(image).__name__}>"


def _one_line(e: BaseException) -> str:
    """A foreign library's exception, its type named (PIL's messages alone are often vague)."""
    return f"{type(e).__name__}: {one_line_error(e)}"


# Modes whose samples are wider than 8 bits. PIL's convert("RGB"), which transformers
# uses, clamps them to 0..255: a 16-bit photo comes out almost white. Refused here.
WIDE_MODES = {"I": "32-bit integer", "I;16": "16-bit", "I;16L": "16-bit", "I;16B": "16-bit",
              "I;16N": "16-bit", "F": "32-bit float"}


def check_image_file(path: str | os.PathLike, name: str | None = None) -> None:
    """A path that names a regular file; else ImageError saying what it is (missing, a
    directory, a FIFO...). Checked before opening: a FIFO would block the open."""
    name = _name_of(path, name)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ImageError(f"{name}: no such image file") from None
    except OSError as e:
        raise ImageError(f"{name}: cannot read ({e.strerror or e})") from None
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")
    raise ImageError(f"{name}: is {kind}, not an image file")


def _check_mode(image: Image.Image, name: str) -> None:
    if image.mode in WIDE_MODES:
        raise ImageError(
            f"{name}: mode {image.mode} ({WIDE_MODES[image.mode]} samples) would be clamped to 0..255 by the "
            f"RGB conversion (transformers' too: mostly white); convert it to 8 bits per channel first"
        )


def _open(path: str | os.PathLike, name: str) -> Image.Image:
    """`PIL.Image.open`, lazily (header only), with the file's problems as ImageError."""
    check_image_file(path, name)
    try:
        with warnings.catch_warnings():  # a large image is sized before decoding: PIL's warning is noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(path)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, zlib/struct errors...
        raise ImageError(f"{name}: cannot decode image ({_one_line(e)})") from None
    if image.width == 0 or image.height == 0:
        image.close()
        raise ImageError(f"{name}: image has zero size ({image.width}x{image.height})")
    return image


def _upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) after `ImageOps.exif_transpose`, read from the header."""
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:
        orientation = 1
    return (image.height, image.width) if orientation in (5, 6, 7, 8) else image.size


def load_image(path: str | os.PathLike, name: str | None = None) -> Image.Image:
    """Open an image file the way transformers' `load_image` does: EXIF-rotated and
    converted to RGB (mode "RGB", decoded, file closed). Modes wider than 8 bits are refused."""
    name = _name_of(path, name)
    with _open(path, name) as im:
        _check_mode(im, name)
        try:
            return ImageOps.exif_transpose(im).convert("RGB")
        except Exception as e:
            raise ImageError(f"{name}: cannot decode image ({_one_line(e)})") from None


def image_grid(image: ImageLike, policy: ProcessorPolicy = DEFAULT_POLICY,
               name: str | None = None) -> tuple[int, int, int]:
    """The (t, h, w) patch grid `process_image` will give, from a path's header alone
    (nothing decoded): lets a caller check that an image fits before decoding it."""
    name = _name_of(image, name)
    if isinstance(image, (str, os.PathLike)):
        with _open(image, name) as im:
            width, height = _upright_size(im)
    elif isinstance(image, Image.Image):
        width, height = image.size
    else:
        raise ImageError(f"{name}: expected a PIL image or a path, got {type(image).__name__}")
    new_h, new_w = _resized_size(height, width, policy, name)
    return 1, new_h // policy.patch_size, new_w // policy.patch_size


def _resized_size(height: int, width: int, policy: ProcessorPolicy, name: str) -> tuple[int, int]:
    """`smart_resize` (or the grid check when do_resize is off), errors as ImageError."""
    if width == 0 or height == 0:
        raise ImageError(f"{name}: image has zero size ({width}x{height})")
    if not policy.do_resize:
        f = policy.factor
        if height % f or width % f:
            raise ImageError(
                f"{name}: {width}x{height} is not a multiple of {f} (patch_size*merge_size) "
                f"and the policy has do_resize off"
            )
        return height, width
    long_side, short_side = max(height, width), min(height, width)
    if long_side / short_side > MAX_ASPECT_RATIO:  # transformers' exact condition
        raise ImageError(
            f"{name}: {width}x{height} has aspect ratio {long_side / short_side:.6g}; "
            f"the processor refuses more than {MAX_ASPECT_RATIO} (crop or pad it)"
        )
    return smart_resize(height, width, policy.factor, policy.min_pixels, policy.max_pixels)


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `image_transforms.convert_to_rgb` for a PIL image: alpha (an "A"
    band or a `transparency` entry) composited onto white, otherwise `convert("RGB")`."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


@lru_cache(maxsize=32)
def _pixel_table(policy: ProcessorPolicy) -> np.ndarray:
    """[3, 256] float32: the rescaled and normalized value of each uint8 per channel,
    computed with the numpy operations and dtypes transformers uses."""
    x = np.arange(256, dtype=np.uint8)
    if policy.do_rescale:  # image_transforms.rescale: float64 multiply, then float32
        x = (x.astype(np.float64) * policy.rescale_factor).astype(np.float32)
    if policy.do_normalize:  # image_transforms.normalize: float32 (x - mean) / std
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.array(policy.image_mean, dtype=x.dtype)
        std = np.array(policy.image_std, dtype=x.dtype)
        table = (x[None, :] - mean[:, None]) / std[:, None]
    else:
        table = np.broadcast_to(x, (3, 256))
    table = np.ascontiguousarray(table, dtype=np.float32)  # patchify: asarray(float32)
    table.flags.writeable = False
    return table


def _rgb_array(image: ImageLike, policy: ProcessorPolicy, name: str) -> np.ndarray:
    """Decode, convert and resize: the uint8 [H, W, 3] array transformers normalizes."""
    if isinstance(image, (str, os.PathLike)):
        image_grid(image, policy, name)  # sized from the header: refused before decoding
        image = load_image(image, name)
    elif not isinstance(image, Image.Image):
        raise ImageError(f"{name}: expected a PIL image or a path, got {type(image).__name__}")
    width, height = image.size
    new_h, new_w = _resized_size(height, width, policy, name)  # before decoding
    try:
        image.load()  # a lazily opened file decodes here: truncation shows up now
    except Exception as e:
        raise ImageError(f"{name}: cannot decode image ({_one_line(e)})") from None

    try:
        if policy.do_convert_rgb:
            _check_mode(image, name)
            rgb = to_rgb(image)
        else:
            arr = np.asarray(image)
            if arr.dtype != np.uint8 or arr.shape != (height, width, 3):
                raise ImageError(
                    f"{name}: mode {image.mode} is not 3-channel uint8 and the policy has "
                    f"do_convert_rgb off (transformers fails on it too)"
                )
            rgb = Image.fromarray(arr)  # transformers' to_pil_image before resizing
    except ImageError:
        raise
    except Exception as e:
        raise ImageError(f"{name}: cannot convert mode {image.mode} to RGB ({_one_line(e)})") from None

    if policy.do_resize:
        try:
            rgb = rgb.resize((new_w, new_h), resample=policy.resample)
        except Exception as e:
            raise ImageError(f"{name}: cannot resize to {new_w}x{new_h} ({_one_line(e)})") from None
    return np.asarray(rgb)


def _patchify(rgb: np.ndarray, policy: ProcessorPolicy) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [gh*gw, 3*T*P*P] in transformers' patch order."""
    P, M, T = policy.patch_size, policy.merge_size, policy.temporal_patch_size
    H, W, C = rgb.shape
    gh, gw = H // P, W // P
    n = gh * gw
    # (bh, mh, py, bw, mw, px, C) -> (bh, bw, mh, mw, C, py, px)
    blocks = rgb.reshape(gh // M, M, P, gw // M, M, P, C).transpose(0, 3, 1, 4, 6, 2, 5)
    index = blocks.reshape(n, C, 1, P * P).astype(np.uint16)
    index += (np.arange(C, dtype=np.uint16) * 256).reshape(1, C, 1, 1)
    values = np.take(_pixel_table(policy).reshape(-1), index)  # [n, C, 1, P*P] float32
    out = np.empty((n, C, T, P * P), dtype=np.float32)
    out[...] = values  # the still frame repeated temporal_patch_size times
    return out.reshape(n, C * T * P * P)


def process_image(
    image: ImageLike, policy: ProcessorPolicy = DEFAULT_POLICY, name: str | None = None
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (pixel_values float32 [patches, C*T*P*P], grid_thw (1, gh, gw)).

    `image` is a PIL image or a path; `name` (default: the path or the PIL filename)
    is what error messages call it. Raises ImageError (a ValueError)."""
    name = _name_of(image, name)
    rgb = _rgb_array(image, policy, name)
    P = policy.patch_size
    grid = (1, rgb.shape[0] // P, rgb.shape[1] // P)
    return _patchify(rgb, policy), grid


def process_images(
    images: Sequence[ImageLike],
    policy: ProcessorPolicy = DEFAULT_POLICY,
    names: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Several images -> (pixel_values concatenated in order, grid_thw int64 [n, 3])."""
    if isinstance(images, (str, os.PathLike, Image.Image)):
        images = [images]
    if names is not None and len(names) != len(images):
        raise ValueError(f"got {len(names)} names for {len(images)} images")
    pixels, grids = [], []
    for i, image in enumerate(images):
        name = names[i] if names is not None else None
        if name is None and isinstance(image, Image.Image) and not getattr(image, "filename", ""):
            name = f"image {i} ({_name_of(image, None)})"
        pv, grid = process_image(image, policy, name=name)
        pixels.append(pv)
        grids.append(grid)
    if not pixels:
        return np.zeros((0, policy.patch_dim), np.float32), np.zeros((0, 3), np.int64)
    pixel_values = pixels[0] if len(pixels) == 1 else np.concatenate(pixels, axis=0)
    return pixel_values, np.array(grids, dtype=np.int64).reshape(-1, 3)
