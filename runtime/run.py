"""`qwen3vl run`: images through a vision session, features to a safetensors file."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from emitter.atomic import write_atomic

from .packing import pack
from .processor import check_image_file, image_grid, process_images
from .session import VisionOutput, VisionSession


def save_features(path, out: VisionOutput) -> None:
    """image_embeds [M, D] f32, deepstack_features [K, M, D] f32, grid_thw [n, 3] int64;
    written to a temp file and renamed, so a failure leaves no partial file."""
    tensors = {
        "image_embeds": np.ascontiguousarray(out.image_embeds, np.float32),
        "deepstack_features": np.ascontiguousarray(out.deepstack_features, np.float32),
        "grid_thw": np.ascontiguousarray(out.grid_thw, np.int64),
    }
    write_atomic(path, save(tensors, metadata={"format": "qwen3vl-iree features v1"}))


def check_output_path(path) -> None:
    """Fail before any work if the output folder is missing."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ValueError(f"-o {path}: folder {parent} does not exist")


def summary(session: VisionSession, out: VisionOutput, names, seconds: dict) -> str:
    lines = [f"model    {session.model_dir} (depth {session.cfg.depth}, hidden {session.cfg.hidden_size}, "
             f"out {session.cfg.out_hidden_size}, deepstack {list(session.cfg.deepstack_visual_indexes)})"]
    counts = out.merged_counts(session.cfg.merge_unit)
    for name, grid, count in zip(names, out.grid_thw, counts):
        lines.append(f"image    {name}: grid {tuple(int(v) for v in grid)} -> {count} tokens")
    calls = ", ".join(f"{c.bucket} ({c.patches} patches, images {list(c.images)})" for c in out.calls)
    lines.append(f"buckets  {calls}")
    lines.append(f"outputs  image_embeds {list(out.image_embeds.shape)}, "
                 f"deepstack_features {list(out.deepstack_features.shape)}")
    lines.append("seconds  " + ", ".join(f"{k} {v:.3f}" for k, v in seconds.items()))
    return "\n".join(lines)


def run_images(model, images, output=None, cache_dir=None, buckets=None, target=None, threads=None,
               progress=None, precision: str = "f32", weights: str = "parameters", dump_inputs=None) -> str:
    """Encode `images` with the checkpoint in `model`; write `output` if given; return the summary.
    `dump_inputs`: a folder for each call's inputs (`<NN>/call.json` and `<NN>/<input>.npy`)."""
    if output:
        check_output_path(output)
    names = [str(p) for p in images]
    for name in names:
        check_image_file(name)  # missing, a directory, a FIFO...: say which
    if dump_inputs and Path(dump_inputs).exists() and not Path(dump_inputs).is_dir():
        raise ValueError(f"--dump-inputs {dump_inputs}: is a file; expected a folder (created if missing)")
    session = VisionSession(model, buckets=buckets, target=target, cache_dir=cache_dir, threads=threads,
                            progress=progress, precision=precision, weights=weights, dump_inputs=dump_inputs)
    t0 = time.perf_counter()
    pack([image_grid(name, session.policy) for name in names], session.buckets, names)  # headers only: fits?
    pixel_values, grid_thw = process_images(names, session.policy, names=names)
    t1 = time.perf_counter()
    needed = list(dict.fromkeys(call.bucket for call in pack(grid_thw, session.buckets, names)))
    if len(needed) <= session.max_loaded:  # else loading them now would evict some before the run
        for bucket in needed:
            session.module(bucket)  # from the cache, compiled on a miss
    t2 = time.perf_counter()
    out = session.encode_pixels(pixel_values, grid_thw, names)
    t3 = time.perf_counter()
    seconds = {"load": session.seconds["load"], "upload": session.seconds["upload"], "process": t1 - t0,
               "artifacts": t2 - t1, "run": t3 - t2}
    if output:
        save_features(output, out)
    return summary(session, out, names, seconds)
