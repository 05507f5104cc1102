"""Benchmark the compiled language model against transformers' PyTorch one.

A text model at a preset's widths (default qwen3-vl-2b, all 28 decoder layers; `--layers`
for fewer) with random weights, for each `--precision` in turn (default f32 then bf16):
the same prompt; prefill (tokens/s) and greedy decode (ms/token, tokens/s), ours and
transformers' alternating in one process with the same thread count; min / median / max
over `--repeats`. Decode reads every weight once per token (lm_head included; the
embedding table only when it is lm_head) and the whole KV cache: the report gives the
GB/s of weights read against the memory read bandwidth measured in the same run, before
and after the timed runs.

    .venv/bin/python benchmarks/bench_text.py --layers 2 --prompt 128 --new 8 --repeats 2
    .venv/bin/python benchmarks/bench_text.py --json text.json          # 2B, full depth, f32 and bf16

Memory: one precision at a time, both models loaded (2B f32: 6.9 GB of weights each side).
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
from emitter.text_config import TEXT_PREFIX, TEXT_PRESETS  # noqa: E402
from runtime.text import TextSession  # noqa: E402
from runtime.checkpoints.synthetic_text import write_text_model  # noqa: E402
from runtime.bench.roof import memory_bandwidth_gbs  # noqa: E402


def ours_run(session: TextSession, ids, new: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds per token, greedy tokens)."""
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


def torch_model(folder: Path, cfg, precision: str):
    """transformers' Qwen3VLTextModel (sdpa) holding the checkpoint's tensors, in `precision`,
    and its lm_head matrix."""
    import torch
    from safetensors.torch import load_file
    from test_text_2b import transformers_model

    model = transformers_model(folder, cfg, attn_implementation="sdpa")
    if cfg.tie_word_embeddings:
        head = model.embed_tokens.weight
    else:
        head = next(t["lm_head.weight"] for t in map(load_file, sorted(folder.glob("*.safetensors")))
                    if "lm_head.weight" in t)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = model.to(dtype)
    return model, (model.embed_tokens.weight if cfg.tie_word_embeddings else head.to(dtype))


def decode_bytes(cfg, precision: str, context: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decode step reads: every weight but the embedding
    table (one row of it), unless it is lm_head; the whole f32 cache (it is masked, not cut)."""
    weights = sum(int(np.prod(s.shape)) * (2 if s.dtype == "bf16" else 4) for s in text_weights(cfg, precision)
                  if cfg.tie_word_embeddings or s.name != TEXT_PREFIX + "embed_tokens.weight")
    cache = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * context * cfg.head_dim * 4
    return weights, cache


def spread(values, scale: float = 1.0) -> dict:
    return {"min": min(values) * scale, "median": statistics.median(values) * scale, "max": max(values) * scale}


def side_report(results, prompt: int, weight_bytes: int) -> dict:
    prefill, decode = [r[0] for r in results], [r[1] for r in results]
    median_decode = statistics.median(decode)
    return {"prefill_s": spread(prefill), "prefill_tok_s": prompt / statistics.median(prefill),
            "decode_ms_token": spread(decode, 1e3), "decode_tok_s": 1 / median_decode,
            "weights_gbs": weight_bytes / median_decode / 1e9}


def bench_precision(folder: Path, cfg, precision: str, ids, args, cache_dir: Path) -> dict:
    """Both models in `precision`, alternating `args.repeats` times; then both freed."""
    bucket = 1 << max(ids.size - 1, 1).bit_length()
    start = time.perf_counter()
    session = TextSession(folder, buckets=(bucket,), context=args.context or bucket + args.new,
                          cache_dir=cache_dir, precision=precision)
    session.module  # archive, compile and load outside the clock
    build = time.perf_counter() - start
    model, head = torch_model(folder, cfg, precision)
    gc.collect()
    runs = {"ours": [], "torch": []}
    for _ in range(args.repeats):  # alternating
        runs["ours"].append(ours_run(session, ids, args.new))
        runs["torch"].append(torch_run(model, head, ids, args.new))
    weight_bytes, cache_bytes = decode_bytes(cfg, precision, session.context)
    report = {"precision": precision, "prompt_tokens": int(ids.size), "bucket": bucket, "context": session.context,
              "new_tokens": args.new, "repeats": args.repeats, "decode_weight_gb": weight_bytes / 1e9,
              "decode_kv_cache_gb": cache_bytes / 1e9, "ours_build_s": build,
              "same_tokens": all(o[2] == t[2] for o, t in zip(runs["ours"], runs["torch"])),
              "tokens": {name: results[-1][2] for name, results in runs.items()}}
    for name, results in runs.items():
        report[name] = side_report(results, ids.size, weight_bytes)
    report["prefill_speedup"] = report["torch"]["prefill_s"]["median"] / report["ours"]["prefill_s"]["median"]
    report["decode_speedup"] = (report["torch"]["decode_ms_token"]["median"]
                                / report["ours"]["decode_ms_token"]["median"])
    del session, model, head
    gc.collect()
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-vl-2b", choices=list(TEXT_PRESETS))
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--precision", nargs="+", choices=["f32", "bf16"], default=["f32", "bf16"])
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

    from runtime.vision import set_thread_count
    set_thread_count(args.threads)
    torch.set_num_threads(args.threads)
    cfg = TEXT_PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, num_hidden_layers=args.layers or cfg.num_hidden_layers)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt)
    report = {"preset": args.preset, "layers": cfg.num_hidden_layers, "threads": args.threads,
              "bandwidth_before": memory_bandwidth_gbs(args.threads), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        write_text_model(folder, cfg, seed=1)
        for precision in args.precision:
            report["runs"].append(bench_precision(folder, cfg, precision, ids, args, Path(tmp) / "cache"))
            print(json.dumps(report["runs"][-1], indent=1), flush=True)
    report["bandwidth_after"] = memory_bandwidth_gbs(args.threads)
    read = max(report["bandwidth_before"]["read_gbs"], report["bandwidth_after"]["read_gbs"])
    for run in report["runs"]:
        for name in ("ours", "torch"):
            run[name]["weights_share_of_read_bandwidth"] = run[name]["weights_gbs"] / read
    report["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
