"""The image processor (runtime.inputs.processor) and its policy (emitter.policy).

Torch-free: smart_resize, policy parsing and its errors, image errors (missing,
corrupt, truncated, zero-size, aspect ratio 201), and a plain-numpy restatement of
transformers' pipeline. Parity (`-m parity`): bit-exact against transformers'
Qwen2VLImageProcessorPil on generated images of every mode, size and policy."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from emitter.policy import (DEFAULT_POLICY, PolicyError, ProcessorPolicy, load_policy,
                            smart_resize)
from runtime.inputs.processor import (WIDE_MODES, ImageError, check_image_file, image_grid, process_image,
                               process_images)

# What Qwen/Qwen3-VL-*/preprocessor_config.json holds (no resample, rescale, do_*).
RELEASED = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Small pixel bounds keep every image (even 4000 px long) at <= ~100 patches.
SMALL = dataclasses.replace(DEFAULT_POLICY, min_pixels=64 * 64, max_pixels=128 * 128,
                            image_mean=CLIP_MEAN, image_std=CLIP_STD)


def rand_rgb(w, h, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# --------------------------------------------------------------------------- smart_resize


@pytest.mark.parametrize("h, w, expected", [
    (256, 256, (256, 256)),          # already on the grid
    (768, 1024, (768, 1024)),
    (1, 1, (256, 256)),              # min_pixels: scaled up to 256x256
    (40, 3, (960, 96)),              # tiny and narrow
    (5000, 5000, (4096, 4096)),      # max_pixels: beta = 5000/4096 exactly
    (4097, 4095, (4096, 4096)),   # rounds onto 4096^2, not over
    (1, 200, (32, 3648)),            # aspect ratio exactly 200 is allowed
    (6400, 32, (6400, 32)),
])
def test_smart_resize_default_bounds(h, w, expected):
    assert smart_resize(h, w, 32, 65536, 16777216) == expected
    assert DEFAULT_POLICY.resized_size(h, w) == expected
    assert DEFAULT_POLICY.grid_thw(h, w) == (1, expected[0] // 16, expected[1] // 16)


def test_smart_resize_rounds_half_to_even():
    # 48/32 = 1.5 -> 2, 80/32 = 2.5 -> 2 (Python round), 112/32 = 3.5 -> 4
    assert smart_resize(48, 80, 32, 1, 10**9) == (64, 64)
    assert smart_resize(112, 80, 32, 1, 10**9) == (128, 64)


def test_smart_resize_floor_never_below_factor():
    # 190:1 over the max: the short side floors to 0 and is clamped to one factor
    assert smart_resize(20, 3800, 32, 64 * 64, 128 * 128) == (32, 1760)


@pytest.mark.parametrize("h, w", [(1, 201), (201, 1), (3, 604), (1000, 4)])
def test_smart_resize_refuses_aspect_over_200(h, w):
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        smart_resize(h, w, 32, 65536, 16777216)


def test_smart_resize_invariants():
    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = (int(x) for x in rng.integers(1, 3000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        rh, rw = smart_resize(h, w, 32, 64 * 64, 128 * 128)
        assert rh % 32 == 0 and rw % 32 == 0 and rh >= 32 and rw >= 32


# --------------------------------------------------------------------------- policy


def test_released_config_is_the_default_policy():
    p = ProcessorPolicy.from_preprocessor_config(RELEASED, "x/preprocessor_config.json")
    assert p == DEFAULT_POLICY
    assert p.factor == 32 and p.patch_dim == 1536
    assert p.rescale_factor == 1 / 255 and p.resample == 3
    assert p.image_mean == (0.5, 0.5, 0.5) and isinstance(p.image_mean, tuple)


def test_policy_round_trips_and_is_canonical():
    p = dataclasses.replace(SMALL, resample=2, do_rescale=False)
    d = p.to_preprocessor_config()
    assert ProcessorPolicy.from_preprocessor_config(json.loads(json.dumps(d)), "rt") == p
    a = json.dumps(p.to_dict(), sort_keys=True)
    b = json.dumps(ProcessorPolicy(**p.to_dict()).to_dict(), sort_keys=True)
    assert a == b
    assert set(p.to_dict()) == {f.name for f in dataclasses.fields(ProcessorPolicy)}
    # ints given for floats canonicalize to floats: the identity does not depend on spelling
    q = ProcessorPolicy.from_preprocessor_config({**RELEASED, "image_mean": [0, 0, 0], "image_std": [1, 1, 1]}, "s")
    assert q.to_dict()["image_mean"] == [0.0, 0.0, 0.0] and isinstance(q.to_dict()["image_std"][0], float)
    assert hash(p) == hash(dataclasses.replace(p))


def test_min_max_pixels_fallback_and_precedence():
    no_size = {k: v for k, v in RELEASED.items() if k != "size"}
    p = ProcessorPolicy.from_preprocessor_config({**no_size, "min_pixels": 1024, "max_pixels": 4096}, "s")
    assert (p.min_pixels, p.max_pixels) == (1024, 4096)
    # like transformers' Qwen2VLImageProcessor.__init__: top-level min/max_pixels override size
    p = ProcessorPolicy.from_preprocessor_config({**RELEASED, "max_pixels": 1 << 20}, "s")
    assert (p.min_pixels, p.max_pixels) == (65536, 1 << 20)


def _policy_error(d, *needles):
    with pytest.raises(PolicyError) as e:
        ProcessorPolicy.from_preprocessor_config(d, "ckpt/preprocessor_config.json")
    msg = str(e.value)
    assert "ckpt/preprocessor_config.json" in msg and "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


@pytest.mark.parametrize("drop, field", [
    ("size", "size.shortest_edge"),
    ("patch_size", "patch_size"),
    ("temporal_patch_size", "temporal_patch_size"),
    ("merge_size", "merge_size"),
    ("image_mean", "image_mean"),
    ("image_std", "image_std"),
])
def test_policy_missing_field(drop, field):
    _policy_error({k: v for k, v in RELEASED.items() if k != drop}, f"'{field}'", "missing")


def test_policy_missing_longest_edge():
    _policy_error({**RELEASED, "size": {"shortest_edge": 65536}}, "'size.longest_edge'", "missing")


@pytest.mark.parametrize("patch, field, value, expected", [
    ({"size": {"shortest_edge": 70000, "longest_edge": 65536}}, "size.shortest_edge", "70000", "<="),
    ({"min_pixels": 10, "max_pixels": 5}, "min_pixels", "10", "<="),
    ({"resample": 7}, "resample", "7", "PIL resampling code"),
    ({"resample": "bicubic"}, "resample", "'bicubic'", "PIL resampling code"),
    ({"resample": True}, "resample", "True", "PIL resampling code"),
    ({"patch_size": 0}, "patch_size", "0", "positive integer"),
    ({"merge_size": -2}, "merge_size", "-2", "positive integer"),
    ({"size": {"shortest_edge": 0, "longest_edge": 10}}, "size.shortest_edge", "0", "positive integer"),
    ({"size": {"shortest_edge": 65536.0, "longest_edge": 1 << 24}}, "size.shortest_edge", "65536.0",
     "positive integer"),
    ({"image_mean": [0.5, 0.5]}, "image_mean", "[0.5, 0.5]", "3 finite numbers"),
    ({"image_std": [0.5, 0.5, 0.5, 0.5]}, "image_std", "[0.5, 0.5, 0.5, 0.5]", "3 finite numbers"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std", "[0.5, 0.0, 0.5]", "no zero"),
    ({"image_std": 0}, "image_std", "0", "no zero"),
    ({"image_mean": [0.5, "x", 0.5]}, "image_mean", "'x'", "3 finite numbers"),
    ({"rescale_factor": 0}, "rescale_factor", "0", "positive finite"),
    ({"do_resize": "yes"}, "do_resize", "'yes'", "true or false"),
    ({"size": 224}, "size", "224", "shortest_edge"),
])
def test_policy_bad_values(patch, field, value, expected):
    _policy_error({**RELEASED, **patch}, f"'{field}'", value, expected)


def test_policy_scalar_mean_broadcasts():
    p = ProcessorPolicy.from_preprocessor_config({**RELEASED, "image_mean": 0.5, "image_std": 0.5}, "s")
    assert p == DEFAULT_POLICY


def test_policy_direct_construction_is_validated():
    with pytest.raises(PolicyError, match="'resample' = 9"):
        dataclasses.replace(DEFAULT_POLICY, resample=9)
    with pytest.raises(PolicyError, match="'min_pixels'"):
        dataclasses.replace(DEFAULT_POLICY, min_pixels=1 << 30)


def test_load_policy(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(RELEASED))
    assert load_policy(tmp_path) == DEFAULT_POLICY

    combined = tmp_path / "combined"
    combined.mkdir()
    (combined / "processor_config.json").write_text(json.dumps({"image_processor": RELEASED}))
    assert load_policy(combined) == DEFAULT_POLICY

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PolicyError, match="preprocessor_config.json: missing"):
        load_policy(empty)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(PolicyError, match="not valid JSON"):
        load_policy(bad)

    (bad / "preprocessor_config.json").write_text(json.dumps({**RELEASED, "resample": 11}))
    with pytest.raises(PolicyError, match=r"bad/preprocessor_config.json: field 'resample' = 11"):
        load_policy(bad)


@pytest.mark.parametrize("field, value, config_field", [
    ("merge_size", 1, "spatial_merge_size"),      # same patch_dim: patches silently reordered
    ("patch_size", 14, "patch_size"),             # "fits no bucket" or a shape error
    ("temporal_patch_size", 3, "temporal_patch_size"),
])
def test_policy_disagreeing_with_config_is_refused(tmp_path, field, value, config_field):
    from emitter.config import PRESETS
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**RELEASED, field: value}))
    with pytest.raises(PolicyError) as e:
        load_policy(tmp_path, PRESETS["tiny"])
    msg = str(e.value)
    assert "\n" not in msg
    assert f"preprocessor_config.json: {field} = {value} disagrees with {tmp_path / 'config.json'}" in msg
    assert f"vision_config.{config_field} = " in msg
    assert load_policy(tmp_path).merge_size == (value if field == "merge_size" else 2)  # alone it parses

    combined = tmp_path / "combined"
    combined.mkdir()
    (combined / "processor_config.json").write_text(json.dumps({"image_processor": {**RELEASED, field: value}}))
    with pytest.raises(PolicyError, match=r"processor_config.json\[image_processor\]: .* disagrees with .*config.json"):
        load_policy(combined, PRESETS["tiny"])


def test_policy_mismatch_stops_build_before_compiling(tmp_path):
    """`qwen3vl build --model` names both files and compiles nothing."""
    import subprocess
    import sys
    from pathlib import Path
    from emitter.config import PRESETS
    from runtime.checkpoints.synthetic import write_checkpoint
    model = tmp_path / "model"
    write_checkpoint(model, PRESETS["tiny"])
    (model / "preprocessor_config.json").write_text(json.dumps({**RELEASED, "merge_size": 1}))
    cache = tmp_path / "cache"
    qwen3vl = Path(sys.executable).with_name("qwen3vl")
    r = subprocess.run([str(qwen3vl), "build", "--model", str(model), "--bucket", "64", "--cache-dir", str(cache)],
                       capture_output=True, text=True)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "merge_size = 1 disagrees with" in lines[0] and "spatial_merge_size = 2" in lines[0], r.stderr
    assert not any(cache.rglob("*.vmfb"))


# --------------------------------------------------------------------------- images


def _image_error(image, *needles, **kw):
    with pytest.raises(ImageError) as e:
        process_image(image, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_missing_and_non_file_paths(tmp_path):
    _image_error(tmp_path / "nope.png", "nope.png: no such image file")
    _image_error(str(tmp_path), f"{tmp_path}: is a directory, not an image file")
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)  # opening it would block: refused from its stat alone
    _image_error(fifo, "pipe.png: is a FIFO (named pipe), not an image file")
    for path, expected in [(tmp_path, "is a directory"), (fifo, "is a FIFO"), (tmp_path / "nope", "no such image file")]:
        with pytest.raises(ImageError, match=expected):
            check_image_file(path)
        with pytest.raises(ImageError, match=expected):
            image_grid(path)


def _png_header(path, width, height):
    """A PNG whose header says width x height and which holds no pixel data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
    return path


@pytest.mark.filterwarnings("error")
def test_grid_from_header_before_decoding(tmp_path):
    """A 144-megapixel image is sized from its header: the bucket check can refuse it
    before 1.8 GB are decoded (this file has no pixels at all: decoding it would fail)."""
    from runtime.inputs.packing import PackingError, pack
    big = _png_header(tmp_path / "big.png", 12000, 12000)
    assert image_grid(big) == (1, 256, 256) == DEFAULT_POLICY.grid_thw(12000, 12000)
    with pytest.raises(PackingError, match="big.png"):
        pack([image_grid(big)], [64, 512], [str(big)])
    _image_error(big, "big.png", "cannot decode")  # proof that it holds nothing to decode
    _image_error(_png_header(tmp_path / "wide.png", 2010, 10), "wide.png", "aspect ratio 201")
    with pytest.raises(ImageError, match="aspect ratio 201"):
        image_grid(tmp_path / "wide.png")


def test_run_says_what_a_bad_image_path_is(tmp_path):
    """`qwen3vl run`: a directory, a FIFO, a missing file and a 144-megapixel header each
    get one line and a non-zero exit, the last from its header (it holds no pixels)."""
    import subprocess
    import sys
    from pathlib import Path
    from emitter.config import PRESETS
    from runtime.checkpoints.synthetic import write_checkpoint
    model = tmp_path / "model"
    write_checkpoint(model, PRESETS["tiny"])
    os.mkfifo(tmp_path / "pipe.png")
    qwen3vl = Path(sys.executable).with_name("qwen3vl")
    cases = [(tmp_path / "pics", "is a directory, not an image file"),
             (tmp_path / "pipe.png", "is a FIFO (named pipe), not an image file"),
             (tmp_path / "nope.png", "no such image file"),
             (_png_header(tmp_path / "big.png", 12000, 12000), "65536 patches (grid (1, 256, 256)) fit no bucket")]
    (tmp_path / "pics").mkdir()
    for image, expected in cases:
        r = subprocess.run([str(qwen3vl), "run", "--model", str(model), "--bucket", "64", str(image),
                            "--cache-dir", str(tmp_path / "cache"), "-o", str(tmp_path / "out.safetensors")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and expected in r.stderr.strip().splitlines()[-1], r.stderr
        assert "Warning" not in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "out.safetensors").exists()


def test_image_grid_matches_processing_and_exif(tmp_path):
    for policy in (SMALL, DEFAULT_POLICY):
        for w, h in [(77, 33), (500, 130), (40, 3)]:
            img = rand_rgb(w, h, w)
            assert image_grid(img, policy) == process_image(img, policy)[1]
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 160 wide, shown 40 wide
    rand_rgb(160, 40, 3).save(tmp_path / "rotated.jpg", exif=exif.tobytes())
    assert image_grid(tmp_path / "rotated.jpg", SMALL) == process_image(tmp_path / "rotated.jpg", SMALL)[1]


WIDE = {"I;16": lambda: Image.fromarray(np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) * 16),
        "I": lambda: Image.fromarray(np.arange(64 * 64, dtype=np.int32).reshape(64, 64)),
        "F": lambda: Image.fromarray(np.linspace(0, 1, 64 * 64, dtype=np.float32).reshape(64, 64))}


@pytest.mark.parametrize("mode", list(WIDE))
def test_wide_modes_are_refused(tmp_path, mode):
    """16-bit greyscale, 32-bit integer and float images: PIL's RGB conversion would clamp
    them to 0..255 (mostly white), so they are refused, from a PIL image or a file."""
    img = WIDE[mode]()
    assert img.mode == mode
    _image_error(img, f"mode {mode}", "clamped to 0..255", "convert it to 8 bits")
    path = tmp_path / ("deep.png" if mode == "I;16" else "deep.tiff")
    img.save(path)
    assert Image.open(path).mode in WIDE_MODES
    _image_error(path, path.name, "clamped to 0..255")


def test_corrupt_files(tmp_path):
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"definitely not an image" * 10)
    _image_error(junk, "junk.png", "cannot decode")
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    _image_error(empty, "empty.jpg", "cannot decode")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files(tmp_path, fmt):
    path = tmp_path / f"cut.{fmt.lower()}"
    rand_rgb(96, 64).save(path, format=fmt)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _image_error(path, "cut.", "cannot decode")
    _image_error(Image.open(path), "cut.", "cannot decode")  # lazily opened by the caller
    path.write_bytes(data)
    assert process_image(path, SMALL)[1] == (1, 4, 6)


@pytest.mark.parametrize("size", [(0, 0), (0, 7), (7, 0)])
def test_zero_size_image(size):
    _image_error(Image.new("RGB", size), "img-zero", "zero size", name="img-zero")


@pytest.mark.parametrize("size", [(201, 1), (1, 201), (402, 2)])
def test_aspect_ratio_201_refused(size):
    msg = _image_error(Image.new("L", size), "wide.png", "aspect ratio 201", name="wide.png")
    assert "200" in msg
    process_image(Image.new("L", (200, 1)))  # exactly 200 passes


def test_wrong_type_and_unconvertible_mode():
    _image_error(np.zeros((4, 4, 3), np.uint8), "expected a PIL image or a path")
    _image_error(Image.new("La", (8, 8)), "cannot convert mode La")
    no_rgb = dataclasses.replace(SMALL, do_convert_rgb=False)
    _image_error(Image.new("RGBA", (64, 64)), "do_convert_rgb off", policy=no_rgb)


def test_do_resize_off_needs_grid_multiples():
    p = dataclasses.replace(SMALL, do_resize=False)
    assert process_image(rand_rgb(96, 64), p)[1] == (1, 4, 6)
    _image_error(rand_rgb(100, 64), "not a multiple of 32", policy=p)


def test_shapes_and_batching():
    a, b = rand_rgb(256, 256, 1), rand_rgb(300, 200, 2)
    pa, ga = process_image(a)
    assert pa.shape == (256, 1536) and pa.dtype == np.float32 and ga == (1, 16, 16)
    assert pa.flags.c_contiguous and -1.0 <= pa.min() and pa.max() <= 1.0
    pv, grid = process_images([a, b])
    assert grid.dtype == np.int64 and grid.tolist() == [[1, 16, 16], list(process_image(b)[1])]
    assert pv.shape == (int(np.prod(grid, axis=1).sum()), 1536)
    assert np.array_equal(pv[:256], pa)
    # the still frame is repeated across the temporal patch
    rows = pa.reshape(256, 3, 2, 256)
    assert np.array_equal(rows[:, :, 0], rows[:, :, 1])
    empty_pv, empty_grid = process_images([])
    assert empty_pv.shape == (0, 1536) and empty_grid.shape == (0, 3)
    with pytest.raises(ImageError, match=r"image 1 \(<L image 300x1>\)"):
        process_images([a, Image.new("L", (300, 1))])


def _numpy_reference(image: Image.Image, policy: ProcessorPolicy) -> np.ndarray:
    """transformers' PIL pipeline restated in plain numpy (RGB input, no alpha)."""
    h, w = policy.resized_size(image.height, image.width)
    x = np.array(image.convert("RGB").resize((w, h), resample=policy.resample)).transpose(2, 0, 1)
    x = (x.astype(np.float64) * policy.rescale_factor).astype(np.float32)
    mean = np.array(policy.image_mean, np.float32)
    std = np.array(policy.image_std, np.float32)
    x = ((x.T - mean) / std).T
    P, M, T = policy.patch_size, policy.merge_size, policy.temporal_patch_size
    gh, gw = h // P, w // P
    x = x.reshape(3, gh // M, M, P, gw // M, M, P).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], T, P, P))
    return x.reshape(gh * gw, 3 * T * P * P)


@pytest.mark.parametrize("policy", [SMALL, DEFAULT_POLICY,
                                    dataclasses.replace(SMALL, patch_size=14, temporal_patch_size=3)])
def test_matches_plain_numpy_pipeline(policy):
    for seed, (w, h) in enumerate([(77, 33), (256, 256), (500, 130)]):
        img = rand_rgb(w, h, seed)
        pv, _ = process_image(img, policy)
        assert np.array_equal(pv, _numpy_reference(img, policy))


# --------------------------------------------------------------------------- parity


def _make(mode: str, w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    u8 = lambda *shape: rng.integers(0, 256, (h, w, *shape), dtype=np.uint8)  # noqa: E731
    if mode in ("RGB", "RGBA", "CMYK", "YCbCr", "LAB"):
        return Image.frombytes(mode, (w, h), u8(len(mode) if mode != "YCbCr" else 3).tobytes())
    if mode in ("L", "LA"):
        return Image.frombytes(mode, (w, h), u8(len(mode)).tobytes())
    if mode == "L+trns":
        im = Image.frombytes("L", (w, h), u8().tobytes())
        im.info["transparency"] = 7
        return im
    if mode == "RGB+trns":
        im = Image.frombytes("RGB", (w, h), (u8(3) & 0x0F).tobytes())
        im.info["transparency"] = (3, 5, 7)
        return im
    if mode in ("P", "P+trns", "PA"):
        im = Image.frombytes("P", (w, h), (u8() & 0x1F).tobytes())
        im.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tobytes())
        if mode == "P+trns":
            im.info["transparency"] = 3
        return im.convert("PA") if mode == "PA" else im
    if mode == "1":
        return Image.fromarray(rng.integers(0, 2, (h, w)).astype(bool))
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 1024, (h, w), dtype=np.uint16))  # clamps at 255
    if mode == "I":
        return Image.fromarray(rng.integers(-100, 400, (h, w), dtype=np.int32))
    if mode == "F":
        return Image.fromarray(rng.uniform(-10, 300, (h, w)).astype(np.float32))
    raise AssertionError(mode)


MODES = ["RGB", "RGBA", "L", "LA", "P", "P+trns", "PA", "CMYK", "I;16", "I", "F", "1",
         "L+trns", "RGB+trns", "YCbCr", "LAB"]
SIZES = [(1, 1), (3, 40), (40, 3), (1, 190), (190, 1), (2, 380), (380, 2), (1, 200), (200, 1),
         (20, 3800), (3800, 20), (31, 33), (32, 32), (48, 80), (80, 48), (127, 129), (128, 128),
         (129, 127), (255, 257), (17, 900), (500, 300), (700, 1000), (1000, 700), (64, 4096)]
POLICIES = {
    "small": SMALL,
    "small-nearest": dataclasses.replace(SMALL, resample=0),
    "small-lanczos": dataclasses.replace(SMALL, resample=1),
    "small-bilinear": dataclasses.replace(SMALL, resample=2),
    "small-box": dataclasses.replace(SMALL, resample=4),
    "small-hamming": dataclasses.replace(SMALL, resample=5),
    "small-half": dataclasses.replace(SMALL, image_mean=(0.5,) * 3, image_std=(0.5,) * 3),
    "no-rescale": dataclasses.replace(SMALL, do_rescale=False),
    "no-normalize": dataclasses.replace(SMALL, do_normalize=False),
    "raw": dataclasses.replace(SMALL, do_rescale=False, do_normalize=False),
    "p14-t3": dataclasses.replace(SMALL, patch_size=14, temporal_patch_size=3, min_pixels=56 * 56),
    "no-resize": dataclasses.replace(SMALL, do_resize=False),
    "no-convert": dataclasses.replace(SMALL, do_convert_rgb=False),
    "default": DEFAULT_POLICY,
}
# (mode, (w, h), policy): every mode on every size class, cycling through the policies.
CASES = [(MODES[i % len(MODES)], SIZES[i % len(SIZES)], list(POLICIES)[i % 11]) for i in range(64)]
CASES += [
    ("RGB", (256, 256), "default"), ("RGBA", (1024, 768), "default"), ("L", (5, 900), "default"),
    ("P+trns", (300, 200), "default"), ("I;16", (1, 1), "default"), ("CMYK", (2100, 1300), "p14-t3"),
    ("RGB", (96, 64), "no-resize"), ("RGBA", (64, 64), "no-resize"), ("RGB", (300, 100), "no-convert"),
    ("YCbCr", (100, 300), "no-convert"),
]

_HF = {}


def _hf(policy_name):
    if policy_name not in _HF:
        mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        # transformers mutates the `size` dict it is given: hand it a copy
        config = copy.deepcopy(POLICIES[policy_name].to_preprocessor_config())
        _HF[policy_name] = mod.Qwen2VLImageProcessorPil(**config)
    return _HF[policy_name]


def _assert_same(hf_out, pv, grid):
    ref = np.asarray(hf_out["pixel_values"])
    assert ref.dtype == np.float32 and ref.shape == pv.shape
    assert float(np.abs(ref - pv).max(initial=0.0)) == 0.0
    assert np.array_equal(ref, pv)
    assert np.asarray(hf_out["image_grid_thw"]).tolist() == np.asarray(grid).reshape(-1, 3).tolist()


@pytest.mark.parity
@pytest.mark.parametrize("mode, size, policy_name", CASES, ids=[f"{m}-{s[0]}x{s[1]}-{p}" for m, s, p in CASES])
def test_parity_with_transformers(mode, size, policy_name):
    pytest.importorskip("transformers")
    policy = POLICIES[policy_name]
    seed = sum(map(ord, mode)) * 7919 + size[0] * 31 + size[1]
    img = _make(mode, *size, seed)
    if mode in WIDE_MODES and policy.do_convert_rgb:
        # transformers converts with PIL's clamp to 0..255; we refuse (test_wide_modes_are_refused)
        with pytest.raises(ImageError, match="clamped to 0..255"):
            process_image(img.copy(), policy)
        img = img.convert("RGB")
    pv, grid = process_image(img.copy(), policy)
    _assert_same(_hf(policy_name)(images=img), pv, grid)


@pytest.mark.parity
def test_parity_errors_with_transformers():
    pytest.importorskip("transformers")
    for size in [(201, 1), (1, 201)]:
        img = _make("RGB", *size, 0)
        with pytest.raises(ValueError, match="aspect ratio"):
            _hf("small")(images=img)
        with pytest.raises(ImageError, match="aspect ratio"):
            process_image(img, SMALL)


@pytest.mark.parity
def test_transformers_clamps_wide_modes_to_white(tmp_path):
    """Why 16-bit files are refused: transformers' PIL backend reads a 16-bit greyscale
    gradient (0..65535) as pixels clamped at 255, so almost all of it is white (1.0)."""
    pytest.importorskip("transformers")
    path = tmp_path / "deep.png"
    WIDE["I;16"]().save(path)
    ref = np.asarray(_hf("small-half")(images=str(path))["pixel_values"])
    assert (ref == 1.0).mean() > 0.9
    _image_error(path, "deep.png", "mode I;16", "clamped to 0..255")


@pytest.mark.parity
def test_parity_paths_and_batches(tmp_path):
    """A path goes through transformers' load_image (EXIF rotation, convert("RGB"))."""
    pytest.importorskip("transformers")
    files = []
    rgba = _make("RGBA", 150, 90, 1)
    rgba.save(tmp_path / "alpha.png")
    files.append(tmp_path / "alpha.png")
    p = _make("P", 120, 70, 2)
    p.save(tmp_path / "trns.png", transparency=3)
    files.append(tmp_path / "trns.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 (the stored image is sideways)
    _make("RGB", 160, 40, 3).save(tmp_path / "rotated.jpg", exif=exif.tobytes(), quality=90)
    files.append(tmp_path / "rotated.jpg")
    _make("L", 33, 900, 5).save(tmp_path / "gray.gif")
    files.append(tmp_path / "gray.gif")

    for path in files:
        pv, grid = process_image(path, SMALL)
        _assert_same(_hf("small")(images=str(path)), pv, grid)
    assert process_image(tmp_path / "rotated.jpg", SMALL)[1][1:] == tuple(
        d // 16 for d in SMALL.resized_size(160, 40))  # rotated: 40 wide, 160 tall

    mixed = [_make("RGB", 64, 200, 6), str(files[0]), _make("LA", 90, 90, 7)]
    pv, grid = process_images(mixed, SMALL)
    _assert_same(_hf("small")(images=mixed), pv, grid)
    assert grid.shape == (3, 3)


# --------------------------------------------------------------------------- torchvision backend


@pytest.mark.parity
def test_torchvision_backend_difference_is_what_the_readme_says():
    """transformers' torchvision backend (`Qwen2VLImageProcessor`, picked whenever torchvision
    is installed) is not what we match: on the 32-pixel grid (no resize) the pixel values
    differ only by its fused normalization (under 1.2e-7); once resized, torch's bicubic
    differs from PIL's: at most one uint8 level on a smooth picture, many on noise.
    Measured on the 2B tower by tests/measure_processor_backends.py (figures in docs/inputs.md, "Images")."""
    from measure_processor_backends import noise, shapes, torchvision_processor
    theirs = torchvision_processor()
    level = DEFAULT_POLICY.rescale_factor / DEFAULT_POLICY.image_std[0]

    def levels(img):
        ours, grid = process_image(img.copy())
        out = theirs(images=img, return_tensors="np")
        ref = np.asarray(out["pixel_values"])
        assert ref.shape == ours.shape and np.asarray(out["image_grid_thw"]).tolist() == [list(grid)]
        return np.abs(ref.astype(np.float64) - ours) / level

    for img in (shapes(640, 480, 1), noise(256, 256, 4)):  # on the grid: same uint8 values
        assert 0 < levels(img).max() * level <= 1.2e-7
    smooth = levels(shapes(300, 500, 2))
    assert np.rint(smooth).max() == 1 and 0 < (smooth >= 0.5).mean() < 0.005
    assert np.rint(levels(noise(500, 333, 5))).max() >= 10
