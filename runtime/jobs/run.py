"""`qwen3vl run`: images and videos through a vision session, features to a safetensors file."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from emitter.atomic import write_atomic
from emitter.config import VisionConfig
from emitter.targets import runtime_driver
from emitter.vision import largest_buffer_bytes

from emitter.identity import DEFAULT_LADDER

from runtime.artifact.build import make_plan
from runtime.outputs import check_finite, check_output_path
from runtime.inputs.packing import pack
from runtime.inputs.processor import check_image_file, image_grid, process_images
from runtime.vision import VisionOutput, VisionSession
from runtime.inputs.video import frame_grids, process_videos, video_grid


def save_features(path, out: VisionOutput, videos: VisionOutput | None = None) -> None:
    """image_embeds [M, D] f32, deepstack_features [K, M, D] f32, grid_thw [n, 3] int64;
    with `videos`, also video_embeds [V, D], video_deepstack_features [K, V, D] and
    video_grid_thw [v, 3]. Written to a temp file and renamed, so a failure leaves no
    partial file."""
    tensors = {
        "image_embeds": np.ascontiguousarray(out.image_embeds, np.float32),
        "deepstack_features": np.ascontiguousarray(out.deepstack_features, np.float32),
        "grid_thw": np.ascontiguousarray(out.grid_thw, np.int64),
    }
    if videos is not None:
        tensors.update(video_embeds=np.ascontiguousarray(videos.image_embeds, np.float32),
                       video_deepstack_features=np.ascontiguousarray(videos.deepstack_features, np.float32),
                       video_grid_thw=np.ascontiguousarray(videos.grid_thw, np.int64))
    write_atomic(path, save(tensors, metadata={"format": "qwen3vl-iree features v1"}))


def split_output(out: VisionOutput, image_count: int, video_grids, merge_unit: int):
    """One encoding of images then video frame groups -> (images' VisionOutput, videos')."""
    rows = sum(out.merged_counts(merge_unit)[:image_count])
    part = lambda lo, hi, grids: VisionOutput(out.image_embeds[lo:hi], out.deepstack_features[:, lo:hi],  # noqa: E731
                                              np.asarray(grids, np.int64).reshape(-1, 3), out.calls)
    return (part(0, rows, out.grid_thw[:image_count]),
            part(rows, len(out.image_embeds), video_grids))


def machine_memory() -> int:
    """Bytes of memory this process may use: physical memory, or a smaller cgroup or
    address-space limit (ulimit -v)."""
    limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        limits.append(address_space)
    try:
        cgroup = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cgroup.isdigit():
            limits.append(int(cgroup))
    except OSError:
        pass
    return min(limits)


def check_bucket_memory(cfg: VisionConfig, calls, target: str, asked: bool = True) -> None:
    """Refuse, before compiling, a call whose largest buffer alone exceeds the host's memory
    (`emitter.vision.largest_buffer_bytes`; CPU targets: a device's own memory is only
    known when it allocates). `asked`: the buckets came from --bucket (else a default
    bucket holds an image that large)."""
    if runtime_driver(target) not in ("local-task", "local-sync"):
        return
    memory = machine_memory()
    for call in sorted(calls, key=lambda c: -max(c.bucket, c.patches)):
        need = largest_buffer_bytes(cfg, call.bucket, max(call.bucket, call.patches) if asked else call.patches)
        if need > memory:
            raise ValueError(f"{'--bucket' if asked else 'bucket'} {call.bucket}: does not fit in memory: one of its "
                             f"buffers alone takes {need / 2**30:.1f} GiB, this machine has {memory / 2**30:.1f} GiB; "
                             f"use a smaller {'bucket' if asked else 'image'}")


def summary(session: VisionSession, out: VisionOutput, names, seconds: dict, videos: VisionOutput | None = None,
            decoded=()) -> str:
    lines = [f"model    {session.model_dir} (depth {session.cfg.depth}, hidden {session.cfg.hidden_size}, "
             f"out {session.cfg.out_hidden_size}, deepstack {list(session.cfg.deepstack_visual_indexes)})"]
    counts = out.merged_counts(session.cfg.merge_unit)
    for name, grid, count in zip(names, out.grid_thw, counts):
        lines.append(f"image    {name}: grid {tuple(int(v) for v in grid)} -> {count} tokens")
    if videos is not None:
        for video, grid, count in zip(decoded, videos.grid_thw, videos.merged_counts(session.cfg.merge_unit)):
            lines.append(f"video    {video.name}: {len(video.indices)} of {video.total_frames} frames "
                         f"({video.fps:g} fps), grid {tuple(int(v) for v in grid)} -> {count} tokens")
    calls = ", ".join(f"{c.bucket} ({c.patches} patches, inputs {list(c.images)})" for c in out.calls)
    lines.append(f"buckets  {calls}")
    outputs = (f"outputs  image_embeds {list(out.image_embeds.shape)}, "
               f"deepstack_features {list(out.deepstack_features.shape)}")
    if videos is not None:
        outputs += (f", video_embeds {list(videos.image_embeds.shape)}, "
                    f"video_deepstack_features {list(videos.deepstack_features.shape)}")
    lines.append(outputs)
    lines.append("seconds  " + ", ".join(f"{k} {v:.3f}" for k, v in seconds.items()))
    return "\n".join(lines)


def run_images(model, images, output=None, cache_dir=None, buckets=None, target=None, threads=None,
               progress=None, precision: str = "f32", weights: str = "parameters", dump_inputs=None,
               videos=()) -> str:
    """Encode `images` and `videos` with the checkpoint in `model`; write `output` if given;
    return the summary. `dump_inputs`: a folder for each call's inputs (`<NN>/call.json` and
    `<NN>/<input>.npy`). Images and video frame groups are packed together, images first."""
    names = [str(p) for p in images]
    video_names = [str(p) for p in videos]
    if not names and not video_names:
        raise ValueError("no input: give one or more IMAGE files or --video FILE")
    for name in names:
        check_image_file(name)  # missing, a directory, a FIFO...: say which
    if output:
        check_output_path(output, model, names + video_names)
    if dump_inputs and Path(dump_inputs).exists() and not Path(dump_inputs).is_dir():
        raise ValueError(f"--dump-inputs {dump_inputs}: is a file; expected a folder (created if missing)")
    plan = make_plan(str(model), None, buckets or DEFAULT_LADDER, target, precision=precision, weights=weights)
    headers = [video_grid(name, plan.video_policy) for name in video_names]  # headers only
    grids, labels = _inputs([image_grid(name, plan.policy) for name in names], names, headers, video_names)
    # Without --bucket, an image past the largest default bucket is a call of its own there.
    calls = pack(grids, plan.buckets, labels, open_top=not buckets)
    check_bucket_memory(plan.cfg, calls, plan.target, bool(buckets))  # before any write
    session = VisionSession(model, buckets=buckets, target=target, cache_dir=cache_dir, threads=threads,
                            progress=progress, precision=precision, weights=weights, dump_inputs=dump_inputs)
    t0 = time.perf_counter()
    pixel_values, grid_thw = process_images(names, session.policy, names=names)
    video_pixels, video_grids, decoded = process_videos(video_names, session.video_policy, video_names)
    grid_thw, labels = _inputs(grid_thw, names, video_grids, video_names)
    pixel_values = np.concatenate([pixel_values, video_pixels])
    t1 = time.perf_counter()
    needed = list(dict.fromkeys(call.bucket for call in session.pack(grid_thw, labels)))
    try:
        if len(needed) <= session.max_loaded:  # else loading them now would evict some before the run
            for bucket in needed:
                session.module(bucket)  # from the cache, compiled on a miss
        t2 = time.perf_counter()
        out = session.encode_pixels(pixel_values, grid_thw, labels)
    except MemoryError as e:
        what = ("--bucket", "bucket") if buckets else ("bucket", "image")
        raise ValueError(f"{what[0]} {max(needed)}: does not fit in memory ({e}); use a smaller {what[1]}") from None
    t3 = time.perf_counter()
    for name in ("image_embeds", "deepstack_features"):
        check_finite(name, getattr(out, name), "the tower")
    out, video_out = split_output(out, len(names), video_grids, session.cfg.merge_unit)
    video_out = video_out if video_names else None
    seconds = {"load": session.seconds["load"], "upload": session.seconds["upload"], "process": t1 - t0,
               "artifacts": t2 - t1, "run": t3 - t2}
    if output:
        save_features(output, out, video_out)
    return summary(session, out, names, seconds, video_out, decoded)


def _inputs(image_grids, names, video_grids, video_names):
    """The grids one call packs, images then each video's frame groups, with their labels."""
    grids = [tuple(int(v) for v in g) for g in np.asarray(image_grids, np.int64).reshape(-1, 3)]
    labels = list(names)
    for name, grid in zip(video_names, video_grids):
        groups = frame_grids([grid])
        grids += groups
        labels += [f"{name} (frame group {k})" for k in range(len(groups))]
    return grids, labels
