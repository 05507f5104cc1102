"""Videos: a file decoded with PyAV, frames sampled, resized and normalized as
transformers' `Qwen3VLVideoProcessor` does with the checkpoint's `VideoPolicy`, into
`pixel_values_videos` [patches, C*T*P*P] f32 and `video_grid_thw` (T, h, w).

Step by step, against transformers 5.24:

1. Header. PyAV's first video stream: its frame count (`stream.frames`; counted by
   decoding when the container does not store it, where transformers would fail) and
   `average_rate` as fps (24 when there is none, as `sample_frames` assumes).
2. Sampling (`VideoPolicy.sample_indices`): n = int(frames / fps * policy.fps), clamped
   to [min_frames, max_frames] and the frame count; indices `linspace(0, frames-1, n)`
   rounded. Frames are decoded in order (`to_ndarray(format="rgb24")`, as
   transformers' PyAV reader) and only the sampled ones kept.
3. Resize (`VideoPolicy.resized_size`: the video `smart_resize`, bounds over all
   frames) with torch's uint8 antialiased bicubic (or bilinear) kernel, the one
   torchvision runs for transformers on a CPU with AVX2, reproduced exactly in numpy
   (below). (Without AVX2, torchvision resizes in float32 instead: a level off here and
   there.)
4. Rescale and normalize: transformers' fused form, `(float32(x) - mean*255) /
   (std*255)` in float32, a function of the uint8 value and channel, so applied as a
   3x256 lookup table computed with the same float32 operations.
5. Patchify: the last temporal group padded with the last frame; rows ordered (group,
   block row, block col, merge row, merge col) of C*T*P*P values.

Frame-group timestamps (`Video.timestamps`) are the processor's `_calculate_timestamps`:
each group's first and last sampled index over fps, averaged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
from emitter.errors import one_line_error as _one_line
from emitter.video_policy import DEFAULT_VIDEO_POLICY, VideoPolicy

from runtime.inputs.processor import ImageError, check_image_file

DEFAULT_FPS = 24.0  # what Qwen3VLVideoProcessor assumes when a video gives no frame rate


class VideoError(ImageError):
    """A video that cannot be processed; the one-line message names the file."""


@dataclass(frozen=True)
class VideoInfo:
    """What the header says: frame count, frame rate (None when absent), frame size."""
    frames: int
    fps: float | None
    width: int
    height: int


@dataclass
class Video:
    """The sampled frames of one video: uint8 [n, H, W, 3], the frame indices they came
    from, and the video's frame rate (as the processor uses it: 24 when absent)."""
    name: str
    frames: np.ndarray
    indices: list[int]
    fps: float
    total_frames: int

    def timestamps(self, temporal_patch_size: int) -> list[float]:
        """Seconds of each temporal group (transformers' `_calculate_timestamps`)."""
        indices = list(self.indices)
        if len(indices) % temporal_patch_size:
            indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
        seconds = [i / self.fps for i in indices]
        m = temporal_patch_size
        return [(seconds[i] + seconds[i + m - 1]) / 2 for i in range(0, len(seconds), m)]


def _open(path, name: str):
    """`av.open` with the first video stream, problems as VideoError naming the file."""
    import av

    try:
        check_image_file(path, name)
    except ImageError as e:
        raise VideoError(str(e).replace("no such image file", "no such video file")
                         .replace("not an image file", "not a video file")) from None
    try:
        container = av.open(os.fspath(path))
    except av.FFmpegError as e:
        raise VideoError(f"{name}: not a video container PyAV/FFmpeg can read ({_one_line(e)})") from None
    if not container.streams.video:
        container.close()
        raise VideoError(f"{name}: holds no video stream PyAV/FFmpeg can find (an audio-only file, or a video "
                         f"cut short before its stream headers)")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        tag = stream.codec_tag if hasattr(stream, "codec_tag") else "?"
        container.close()
        raise VideoError(f"{name}: video codec not supported by this PyAV/FFmpeg build (codec tag {tag!r})")
    return container, stream


def _decode(container, stream, name: str):
    """Frames in decode order; decoding errors as VideoError."""
    import av

    try:
        yield from container.decode(stream)
    except av.FFmpegError as e:
        raise VideoError(f"{name}: cannot decode video ({_one_line(e)})") from None


def probe_video(path, name: str | None = None) -> VideoInfo:
    """The header's frame count, fps and size; frames counted by decoding when the
    container does not store the count. VideoError for an unreadable file or no frames."""
    name = name or os.fspath(path)
    container, stream = _open(path, name)
    with container:
        frames = int(stream.frames or 0)
        if frames == 0:
            frames = sum(1 for _ in _decode(container, stream, name))
            _check_whole(frames, _declared_frames(container, stream), name)
        rate = stream.average_rate
        width, height = int(stream.width or 0), int(stream.height or 0)
    if frames == 0:
        raise VideoError(f"{name}: video has no frames")
    if width == 0 or height == 0:
        raise VideoError(f"{name}: video has zero size ({width}x{height})")
    return VideoInfo(frames, float(rate) if rate else None, width, height)


def _declared_frames(container, stream) -> float | None:
    """Frames the container's duration and the stream's rate promise (Matroska stores no
    frame count, only these), or None when it declares either not."""
    rate = stream.average_rate or stream.guessed_rate
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration:
        seconds = container.duration / 1_000_000  # AV_TIME_BASE
    else:
        return None
    return seconds * float(rate) if rate else None


def _check_whole(decoded: int, declared: float | None, name: str) -> None:
    """VideoError when fewer frames decode than the container declares (beyond a frame or
    5% of rounding): a file cut short would otherwise pass as a shorter clip."""
    if declared is not None and decoded + max(1.0, 0.05 * declared) < declared:
        raise VideoError(f"{name}: {decoded} frames decode of the {declared:.0f} its container's duration declares; "
                         f"the file is truncated or damaged")


def _grid(info: VideoInfo, count: int, height: int, width: int, policy: VideoPolicy, name: str):
    try:
        return policy.grid_thw(count, height, width)
    except ValueError as e:
        if count < policy.temporal_patch_size:
            raise VideoError(f"{name}: {count} frame(s) sampled of {info.frames}; the processor needs at least "
                             f"temporal_patch_size = {policy.temporal_patch_size}") from None
        raise VideoError(f"{name}: {width}x{height} frames: {_one_line(e)}") from None


def check_bounds(grid, count: int, policy: VideoPolicy, name: str) -> None:
    """Refuse a video whose sampled frames cannot fit the policy's pixel budget even at
    the smallest frame size (transformers then exceeds size.longest_edge silently)."""
    t, h, w = grid
    pixels = t * policy.temporal_patch_size * h * w * policy.patch_size**2
    if policy.do_resize and pixels > policy.max_pixels:
        raise VideoError(f"{name}: too long for the video policy: {count} sampled frames need at least {pixels} "
                         f"pixels, more than size.longest_edge = {policy.max_pixels}; lower max_frames or fps "
                         f"in video_preprocessor_config.json, or raise longest_edge")


def video_grid(path, policy: VideoPolicy = DEFAULT_VIDEO_POLICY, name: str | None = None,
               info: VideoInfo | None = None) -> tuple[int, int, int]:
    """The (T, h, w) grid `process_video` will give, from the header alone (frames not
    decoded when the container stores their count): sizes a video before decoding it."""
    name = name or os.fspath(path)
    info = info or probe_video(path, name)
    count = len(policy.sample_indices(info.frames, info.fps))
    grid = _grid(info, count, info.height, info.width, policy, name)
    check_bounds(grid, count, policy, name)
    return grid


def load_video(path, policy: VideoPolicy = DEFAULT_VIDEO_POLICY, name: str | None = None,
               info: VideoInfo | None = None) -> Video:
    """Decode the sampled frames of a video file (uint8 RGB, as PyAV's rgb24); `info`:
    its header, when already probed."""
    name = name or os.fspath(path)
    info = info or probe_video(path, name)
    indices = policy.sample_indices(info.frames, info.fps)
    wanted = set(indices)
    picked: dict[int, np.ndarray] = {}
    container, stream = _open(path, name)
    with container:
        for i, frame in enumerate(_decode(container, stream, name)):
            if i > indices[-1]:
                break
            if i in wanted:
                picked[i] = frame.to_ndarray(format="rgb24")
    if len(picked) < len(wanted):
        raise VideoError(f"{name}: video ends before frame {indices[-1]} (the header says {info.frames} frames); "
                         f"the file is truncated or damaged")
    frames = np.stack([picked[i] for i in indices])
    return Video(name, frames, indices, info.fps or DEFAULT_FPS, info.frames)


@lru_cache(maxsize=32)
def _pixel_table(policy: VideoPolicy) -> np.ndarray:
    """[3, 256] float32: each uint8 value per channel as transformers' torchvision
    backend rescales and normalizes it (`rescale_and_normalize`, fused when both)."""
    x = np.arange(256, dtype=np.float32)
    mean = np.array(policy.image_mean, np.float32)
    std = np.array(policy.image_std, np.float32)
    if policy.do_normalize:
        if policy.do_rescale:  # mean and std scaled by 1/rescale_factor, in float32
            scale = np.float32(1.0 / policy.rescale_factor)
            mean, std = mean * scale, std * scale
        table = (x[None, :] - mean[:, None]) / std[:, None]
    elif policy.do_rescale:
        table = np.broadcast_to(x * np.float32(policy.rescale_factor), (3, 256))
    else:
        table = np.broadcast_to(x, (3, 256))
    table = np.ascontiguousarray(table, dtype=np.float32)
    table.flags.writeable = False
    return table


def _resized_frames(video: Video, policy: VideoPolicy) -> np.ndarray:
    """uint8 [n, H', W', 3]: every frame resized to the video smart_resize size."""
    frames = video.frames
    n, height, width = frames.shape[:3]
    try:
        new_h, new_w = policy.resized_size(n, height, width)
    except ValueError as e:
        if n < policy.temporal_patch_size:
            raise VideoError(f"{video.name}: {n} frame(s) sampled of {video.total_frames}; the processor needs "
                             f"at least temporal_patch_size = {policy.temporal_patch_size}") from None
        raise VideoError(f"{video.name}: {width}x{height} frames: {_one_line(e)}") from None
    if (new_h, new_w) == (height, width):
        return frames
    if policy.resample not in AA_FILTERS:
        raise VideoError(f"{video.name}: resample {policy.resample} of the video policy: this resizes videos with "
                         f"bicubic (3) or bilinear (2) only, as torchvision does them; expected one of those")
    if new_w != width:
        frames = _resample_axis(frames, 2, new_w, policy.resample)
    if new_h != height:
        frames = _resample_axis(frames, 1, new_h, policy.resample)
    return frames


# --------------------------------------------------------------------------- torch's uint8 resize
# torchvision resizes a uint8 video on the CPU with torch's antialiased separable
# kernel (aten/src/ATen/native/cpu/UpSampleKernel.cpp, the AVX2 uint8 path): per axis,
# PIL's filter support and centering, weights normalized in float64, then rounded to
# int16 at the largest precision the axis's largest weight allows; each output value is
# the integer dot product plus half a unit, shifted down and clamped to 0..255; the width
# first, then the height, through a uint8 intermediate. Reproduced here exactly (the
# integer sums are exact in float64).


def _cubic(x: float, a: float = -0.5) -> float:
    """HelperInterpCubic::aa_filter (a = -0.5, PIL's), its operation order."""
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return 0.0


def _linear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


AA_FILTERS = {3: (_cubic, 4), 2: (_linear, 2)}  # PIL resample code -> (filter, interp_size)


@lru_cache(maxsize=64)
def _axis_weights(size_in: int, size_out: int, resample: int) -> tuple[np.ndarray, int]:
    """[size_out, size_in] int16 weights (as float64) and their precision in bits."""
    fn, interp_size = AA_FILTERS[resample]
    scale = size_in / size_out
    support = interp_size * 0.5 * scale if scale >= 1.0 else interp_size * 0.5
    max_taps = int(np.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    rows, wt_max = [], 0.0
    for i in range(size_out):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), size_in) - xmin, 0), max_taps)
        w = [fn((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for v in w:
            total += v
        if total != 0.0:
            w = [v / total for v in w]
            wt_max = max([wt_max] + w)
        rows.append((xmin, w))
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    matrix = np.zeros((size_out, size_in))
    for i, (xmin, w) in enumerate(rows):
        for j, v in enumerate(w):
            v *= 1 << precision
            matrix[i, xmin + j] = int(v - 0.5) if v < 0 else int(v + 0.5)  # C's truncating cast
    matrix.flags.writeable = False
    return matrix, precision


def _resample_axis(frames: np.ndarray, axis: int, size: int, resample: int) -> np.ndarray:
    """One pass of torch's uint8 antialiased resize along `axis` of uint8 frames."""
    matrix, precision = _axis_weights(frames.shape[axis], size, resample)
    x = np.moveaxis(frames, axis, -1).astype(np.float64)
    acc = (x @ matrix.T).astype(np.int64) + (1 << (precision - 1))
    return np.moveaxis(np.clip(acc >> precision, 0, 255).astype(np.uint8), -1, axis)


def _patchify(frames: np.ndarray, policy: VideoPolicy) -> np.ndarray:
    """uint8 [n, H, W, 3] -> float32 [groups*gh*gw, 3*T*P*P] in transformers' order."""
    P, M, T = policy.patch_size, policy.merge_size, policy.temporal_patch_size
    if len(frames) % T:  # the last group padded with the last frame
        frames = np.concatenate([frames, np.repeat(frames[-1:], T - len(frames) % T, axis=0)])
    n, H, W, C = frames.shape
    values = _pixel_table(policy)[np.arange(C), frames]  # [n, H, W, C] float32
    blocks = values.reshape(n // T, T, H // P // M, M, P, W // P // M, M, P, C)
    # (group, t, bh, mh, py, bw, mw, px, C) -> (group, bh, bw, mh, mw, C, t, py, px)
    return np.ascontiguousarray(blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)).reshape(-1, C * T * P * P)


def process_video(video, policy: VideoPolicy = DEFAULT_VIDEO_POLICY,
                  name: str | None = None) -> tuple[np.ndarray, tuple[int, int, int], Video]:
    """One video (a path or a `Video`) -> (pixel_values float32 [patches, C*T*P*P],
    grid_thw (T, h, w), the decoded `Video` for its timestamps). Raises VideoError."""
    if not isinstance(video, Video):
        path = video
        name = name or os.fspath(path)
        info = probe_video(path, name)
        video_grid(path, policy, name, info)  # sized from the header: refused before decoding
        video = load_video(path, policy, name, info)
    frames = _resized_frames(video, policy)
    P = policy.patch_size
    grid = (-(-len(frames) // policy.temporal_patch_size), frames.shape[1] // P, frames.shape[2] // P)
    check_bounds(grid, len(frames), policy, video.name)
    return _patchify(frames, policy), grid, video


def process_videos(videos: Sequence, policy: VideoPolicy = DEFAULT_VIDEO_POLICY,
                   names: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray, list[Video]]:
    """Several videos -> (pixel_values_videos concatenated in order, video_grid_thw
    int64 [n, 3], the decoded videos)."""
    pixels, grids, decoded = [], [], []
    for i, video in enumerate(videos):
        pv, grid, v = process_video(video, policy, names[i] if names else None)
        pixels.append(pv)
        grids.append(grid)
        decoded.append(v)
    if not pixels:
        return np.zeros((0, 3 * policy.temporal_patch_size * policy.patch_size**2), np.float32), \
            np.zeros((0, 3), np.int64), []
    return np.concatenate(pixels), np.array(grids, np.int64).reshape(-1, 3), decoded


def prompt_groups(video: Video, grid, policy: VideoPolicy) -> tuple[list[float], int]:
    """What the prompt writes for a video (`ChatTokenizer.prompt_ids`): its groups'
    timestamps and the merged tokens of one group."""
    _, h, w = (int(v) for v in grid)
    return video.timestamps(policy.temporal_patch_size), h * w // policy.merge_size**2


def frame_grids(grid_thw) -> list[tuple[int, int, int]]:
    """A video grid (T, h, w) as T grids (1, h, w), one per temporal group, in order.
    The tower treats each group alone (attention, positions and merging are per group),
    so encoding the groups as separate inputs gives the same rows, and a long video can
    be split across calls at group boundaries."""
    return [(1, int(h), int(w)) for t, h, w in np.asarray(grid_thw).reshape(-1, 3) for _ in range(int(t))]


def encode_video_pixels(session, pixel_values: np.ndarray, grid_thw, names=None):
    """Processed videos (pixel_values_videos, video_grid_thw) through a `VisionSession`:
    each temporal group packed as a grid of its own (`frame_grids`), the rows joined back
    in order. A `VisionOutput` whose grid_thw holds the video grids."""
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    tp = session.video_policy.temporal_patch_size
    labels = [f"{names[i] if names else f'video {i}'} (frame group {k}, frames {tp * k}..{tp * k + tp - 1})"
              for i, (t, _, _) in enumerate(grids) for k in range(int(t))]
    out = session.encode_pixels(pixel_values, frame_grids(grids), labels)
    out.grid_thw = grids
    return out


def encode_videos(session, videos, names=None):
    """Video files -> a `VisionOutput` (rows of every video in order, grid_thw [n, 3]);
    the decoded `Video`s (timestamps) in `out.videos`."""
    names = list(names) if names else [os.fspath(v) if not isinstance(v, Video) else v.name for v in videos]
    pixel_values, grids, decoded = process_videos(videos, session.video_policy, names)
    out = encode_video_pixels(session, pixel_values, grids, names)
    out.videos = decoded
    return out
