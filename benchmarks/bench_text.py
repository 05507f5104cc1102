"""Benchmark the compiled language model against transformers' PyTorch one.

A text model at a preset's widths (default qwen3-vl-2b) with random weights, `--layers`
of its decoder layers (default all), f32 or bf16; the same prompt; prefill (tokens/s) and
greedy decode (ms/token, tokens/s), ours and transformers' alternating in one process
with the same thread count. Decode reads every weight once per token: the report gives
the GB/s of weights read against a memory bandwidth measured in the same run.

    .venv/bin/python benchmarks/bench_text.py --layers 4 --prompt 256 --new 16
    .venv/bin/python benchmarks/bench_text.py --precision bf16 --json text.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from emitter.text import text_weights  # noqa: E402
from emitter.text_config import TEXT_PRESETS  # noqa: E402
from runtime.generate import TextSession  # noqa: E402
from runtime.synthetic_text import random_text_weights, write_text_model  # noqa: E402


def memory_bandwidth_gbs(threads: int) -> float:
    """Read bandwidth: a 1 GiB f32 sum, best of 3 (torch, on `threads` threads)."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(1 << 28)
    best = min(_seconds(lambda: x.sum()) for _ in range(3))
    return x.numel() * 4 / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ours_run(session: TextSession, ids, new: int) -> tuple[float, float, list[int]]:
    n = ids.size
    positions = np.broadcast_to(np.arange(n), (3, n))
    start = time.perf_counter()
    logits = session.prefill(ids, positions)
    prefill = time.perf_counter() - start
    tokens = [int(np.argmax(logits))]
    start = time.perf_counter()
    for _ in range(new - 1):
        tokens.append(int(np.argmax(session.decode(tokens[-1], session.length))))
    return prefill, (time.perf_counter() - start) / max(new - 1, 1), tokens


def torch_run(model, head, ids, new: int) -> tuple[float, float, list[int]]:
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        hidden = model(input_ids=torch.from_numpy(ids)[None], cache=cache, use_cache=True).last_hidden_state
        logits = hidden[0, -1] @ head.T
        prefill = time.perf_counter() - start
        tokens = [int(logits.float().argmax())]
        start = time.perf_counter()
        for _ in range(new - 1):
            hidden = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).last_hidden_state
            tokens.append(int((hidden[0, -1] @ head.T).float().argmax()))
        return prefill, (time.perf_counter() - start) / max(new - 1, 1), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-vl-2b", choices=[k for k in TEXT_PRESETS if k != "tiny"] + ["tiny"])
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--new", type=int, default=16, help="new tokens (decode steps + 1)")
    p.add_argument("--context", type=int, help="KV-cache tokens (default: the bucket + new)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()

    import torch
    from torch_reference import import_torchvision
    import_torchvision()  # transformers imports torchvision: loadable beside torch+cpu
    from transformers import Qwen3VLTextConfig, Qwen3VLTextModel

    from runtime.session import set_thread_count
    set_thread_count(args.threads)
    torch.set_num_threads(args.threads)
    cfg = TEXT_PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers or cfg.num_hidden_layers)
    weights = random_text_weights(cfg, seed=1)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt)
    bucket = 1 << max(args.prompt - 1, 1).bit_length()
    with tempfile.TemporaryDirectory() as tmp:
        write_text_model(Path(tmp) / "m", cfg, seed=1)
        start = time.perf_counter()
        session = TextSession(Path(tmp) / "m", buckets=(bucket,), context=args.context or bucket + args.new,
                              cache_dir=Path(tmp) / "cache", precision=args.precision)
        session.module  # compile and load outside the clock
        build = time.perf_counter() - start
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = Qwen3VLTextModel(Qwen3VLTextConfig(**cfg.to_hf_text_config(), attn_implementation="sdpa"))
    prefix = "model.language_model."
    model.load_state_dict({k[len(prefix):]: torch.from_numpy(w) for k, w in weights.items()})
    model = model.to(dtype).eval()
    head = (model.embed_tokens.weight if cfg.tie_word_embeddings
            else torch.from_numpy(weights["lm_head.weight"]).to(dtype))
    del weights
    gc.collect()

    runs = {"ours": [], "torch": []}
    for _ in range(args.repeats):  # alternating
        runs["ours"].append(ours_run(session, ids, args.new))
        runs["torch"].append(torch_run(model, head, ids, args.new))
    weight_bytes = sum(int(np.prod(s.shape)) * (2 if s.dtype == "bf16" else 4)
                       for s in text_weights(cfg, args.precision))
    bandwidth = memory_bandwidth_gbs(args.threads)
    report = {"preset": args.preset, "layers": cfg.num_hidden_layers, "precision": args.precision,
              "prompt_tokens": args.prompt, "bucket": bucket, "context": session.context, "new_tokens": args.new,
              "threads": args.threads,
              "weight_gb": weight_bytes / 1e9, "memory_bandwidth_gbs": bandwidth, "ours_build_s": build,
              "same_tokens": runs["ours"][-1][2] == runs["torch"][-1][2],
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    for name, results in runs.items():
        prefill = statistics.median(r[0] for r in results)
        decode = statistics.median(r[1] for r in results)
        report[name] = {"prefill_s": prefill, "prefill_tok_s": args.prompt / prefill, "decode_ms_token": decode * 1e3,
                        "decode_tok_s": 1 / decode, "weights_gbs": weight_bytes / decode / 1e9}
    report["prefill_speedup"] = report["torch"]["prefill_s"] / report["ours"]["prefill_s"]
    report["decode_speedup"] = report["torch"]["decode_ms_token"] / report["ours"]["decode_ms_token"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
