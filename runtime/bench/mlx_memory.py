"""The memory of an MLX-quantized language model run in its bits (`--precision mlx`) beside
the same checkpoint expanded to f32: a checkpoint quantized by the real `mx.quantize` in
mlx-vlm's layout (`write_mlx_text`), and one fresh process per run (`measure`) that opens a
`TextSession`, answers a prompt and a decode step, and reports its peak RSS (VmHWM) and
anonymous resident memory above what it held before. The first run of a precision writes
the weight archive (the checkpoint read and converted), a second one only maps and loads it.
Used by benchmarks/bench_mlx_memory.py and tests/test_mlx_bits.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from emitter.text_config import TextConfig
from runtime.checkpoints.synthetic_mlx import stored_name
from runtime.checkpoints.synthetic_text import random_text_tensors


CHILD = """
import json, sys
import numpy as np
from runtime.text import TextSession

def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

rss, anon = status("VmRSS:"), status("RssAnon:")
session = TextSession(sys.argv[1], buckets=(64,), context=80, cache_dir=sys.argv[2], precision=sys.argv[3])
session.module
loaded = status("RssAnon:") - anon
logits = session.prefill(np.arange(40) + 5, np.broadcast_to(np.arange(40), (3, 40)))
session.decode(int(np.argmax(logits)), 40)
print(json.dumps({"peak": status("VmHWM:") - rss, "loaded": loaded, "answered": status("RssAnon:") - anon,
                  "archive": session.archive_path.stat().st_size}))
"""


def write_mlx_text(folder: Path, cfg: TextConfig, bits: int, group: int, modules: dict | None = None,
                   seed: int = 3) -> dict:
    """A language model quantized by mx.quantize in mlx-vlm's layout, config.json's
    `quantization` block as it writes it: every 2-D weight at `bits` / `group` unless
    `modules` gives its module (keyed by stored path) other settings, or False (kept f32).
    Returns {Hugging Face name: mx.dequantize of each quantized weight, f32}."""
    import mlx.core as mx

    modules = modules or {}
    folder.mkdir(parents=True)
    arrays, expected = {}, {}
    for name, w in random_text_tensors(cfg, seed=seed):
        key = stored_name(name)
        module = key[: -len(".weight")]
        settings = modules.get(module, {"bits": bits, "group_size": group})
        if w.ndim != 2 or settings is False:
            arrays[key] = mx.array(w)
            continue
        packed, scales, biases = mx.quantize(mx.array(w), group_size=settings["group_size"], bits=settings["bits"])
        arrays.update({key: packed, module + ".scales": scales, module + ".biases": biases})
        expected[name] = np.array(mx.dequantize(packed, scales, biases, group_size=settings["group_size"],
                                                bits=settings["bits"]), np.float32)
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_vl", "tie_word_embeddings": cfg.tie_word_embeddings,
        "text_config": cfg.to_hf_text_config(),
        "quantization": {"group_size": group, "bits": bits, "mode": "affine", **modules}}))
    return expected


def measure(model_dir: Path, cache: Path, precision: str) -> dict:
    """One fresh process's bytes above its start: `peak` RSS (VmHWM), anonymous memory
    once `loaded` and once `answered` (a 40-token prefill and a decode step), and the
    `archive`'s size."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(cache), precision],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
