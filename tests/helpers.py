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


def generate_logits(model, image, precision: str | None, cache, out_dir: Path, max_new_tokens: int = 2) -> np.ndarray:
    """`qwen3vl generate` with one image (None: text only) at `precision` (None: no
    --precision, the default; prompt bucket 64, context 96) in a subprocess: its saved
    [new tokens, vocab] logits; the command's stderr on failure."""
    import subprocess
    import sys

    path = Path(out_dir) / f"{precision or 'default'}.npy"
    flag = ["--precision", precision] if precision else []
    out = subprocess.run([sys.executable, "-c", "from runtime.commands.main import main; main()", "generate",
                          "--model", model, *(["--image", image] if image else []), "--prompt", "What is it?",
                          "--max-new-tokens",
                          str(max_new_tokens), *flag, "--prompt-bucket", "64", "--context", "96",
                          "--cache-dir", cache, "--save-logits", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return np.load(path)


def gradient_frames(n: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """n smooth RGB frames (moving gradients plus a little noise): uint8 [n, h, w, 3]."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for i in range(n):
        base = np.stack([x * 3 + i * 11, y * 2 + i * 7, (x + y) + i * 5], -1) % 256
        frames.append(np.clip(base + rng.integers(-8, 9, base.shape), 0, 255).astype(np.uint8))
    return np.stack(frames)


def write_video(path, frames: np.ndarray, rate: int = 10, codec: str = "mpeg4", fmt: str | None = None) -> str:
    """Encode uint8 [n, h, w, 3] frames with PyAV; the path."""
    import av
    container = av.open(str(path), "w", format=fmt)
    stream = container.add_stream(codec, rate=rate)
    stream.height, stream.width = frames.shape[1:3]
    stream.pix_fmt = "yuv420p"
    if codec == "mpeg4":
        stream.options = {"qscale": "2"}
    for frame in frames:
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()
    return str(path)


def decode_all(path) -> tuple[np.ndarray, float]:
    """Every frame of a file, as transformers' PyAV reader decodes them, and its fps."""
    import av
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        return np.stack(frames), float(stream.average_rate)


def chunked_logits(model, cache, precision: str, vocab: int, steps: int) -> np.ndarray:
    """A TextSession's logits of a 37-token prompt (two chunks of bucket 32: 32 rows
    dequantize, the last row and the decode steps run split-K) and of `steps` greedy decode
    steps, [1 + steps, vocab]."""
    from runtime.text import TextSession

    session = TextSession(model, buckets=(32,), context=64, cache_dir=cache, precision=precision)
    n = 37
    rows = [session.prefill(np.arange(n) * 7 % vocab, np.broadcast_to(np.arange(n), (3, n)))]
    for step in range(steps):
        rows.append(session.decode(int(np.argmax(rows[-1])), n + step))
    return np.stack(rows)


def q8_0_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, K] int8 in -127..127, d [N, K/32] f16) of f32 w [N, K] by llama.cpp's Q8_0 rule
    (ggml `quantize_row_q8_0_ref`): per block of 32, d = max|w| / 127, q = roundf(w * (1 / d))
    (half away from zero) with d in f32, then d kept in f16."""
    n, k = w.shape
    groups = np.asarray(w, np.float32).reshape(n, k // 32, 32)
    d = np.abs(groups).max(axis=2) / np.float32(127)
    inverse = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))
    scaled = groups * inverse[:, :, None]
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))
    return q.astype(np.int8).reshape(n, k), d.astype(np.float16)


def q4_0_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, K] int8 in -8..7, d [N, K/32] f16) of f32 w [N, K] by llama.cpp's Q4_0 rule
    (ggml `quantize_row_q4_0_ref`): per block of 32, d = the signed max / -8,
    q = min(floor(w / d + 8.5), 15) - 8 with d in f32, then d kept in f16."""
    n, k = w.shape
    groups = np.asarray(w, np.float32).reshape(n, k // 32, 32)
    top = np.take_along_axis(groups, np.abs(groups).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    d = top / np.float32(-8)
    inverse = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, np.float32(1), d))
    q = np.minimum(np.floor(groups * inverse[:, :, None] + np.float32(8.5)), 15) - 8
    return q.astype(np.int8).reshape(n, k), d.astype(np.float16)


def exec_after(setup: str, command: list[str]) -> list[str]:
    """`command` run after the Python statements `setup` (a resource limit, a signal's
    disposition) in a launcher that then execs it, for a child of the test process: what a
    preexec_fn would do, without Python code between fork and exec in a process with threads
    (there a garbage collection in the child can hang it for good)."""
    import sys
    return [sys.executable, "-S", "-c", f"{setup}; import os, sys; os.execv(sys.argv[1], sys.argv[1:])", *command]
