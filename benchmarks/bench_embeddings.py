"""Benchmark retrieval embeddings: `qwen3vl serve --pooling last` against transformers running
the same random checkpoint, in one run.

A random checkpoint at a preset's widths (default qwen3-vl-2b, every layer; `--layers` for
fewer), both sides in f32 (or both in bf16, `--precision bf16`) with the same thread count. Two kinds of item, as the model card's
embedder formats them (the default instruction as the system message, then the item): a
short text, and one `--image` sized image alone. For each kind, `--batch` distinct items:
- batch 1: the items one after another (ours: one `/v1/embeddings` request each;
  transformers: one forward each);
- the server's batch: all `--batch` items at once (ours: text items as one request's `input`
  list, image items as concurrent `messages` requests, batched on the device by the server;
  transformers: one padded forward of all of them, right-padded and pooled at each item's
  last token, as the model card's embedder does).
Each side's time runs from the items (text, image files) to the normalized vectors:
processing, the forward, pooling; ours over HTTP on localhost. The items are new in every
round and mode, so the server's encoder and prefix caches hit only what they share (the
instruction's blocks). Rounds alternate the sides;
figures are items/s, min / median / max over `--rounds`, and the ratio of medians. The
vectors of the two sides are compared (relL2) so the race is between equal answers. Each
row's rate is also GFLOP/s of useful work (`item_gflop`: the tower and the language model's
linears over the item's real tokens, less those ours found in its prefix cache) beside the cores' FMA peak (benchmarks/fma_peak.py,
measured after the race): how far a side is from what the machine can do.

    .venv/bin/python benchmarks/bench_embeddings.py --layers 2 --rounds 2     # quick
    .venv/bin/python benchmarks/bench_embeddings.py --json embeddings.json     # 2B, full depth

Memory: the server's model and transformers' at once (2B f32: about 9 GB each).
"""

from __future__ import annotations

import argparse
import base64
import gc
import http.client
import io
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_serve import free_port, wait_ready  # noqa: E402
from runtime.embedding import item_messages  # noqa: E402

QWEN3VL = str(Path(sys.executable).with_name("qwen3vl"))
DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # ours --precision -> transformers' dtype
WORDS = ("screenshot settings page dark mode invoice total table chart revenue quarter login form error "
         "dialog button menu photo street night cat dog receipt map route weather forecast").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, 8 + i % 5)) for i in range(n)]  # 8 to 12 words


def images(n: int, size: int, seed: int = 0) -> list[bytes]:
    """n distinct PNGs of `size` x `size`: smooth colour fields with noise."""
    from PIL import Image

    out = []
    for i in range(seed, seed + n):
        rng = np.random.default_rng(100 + i)
        y, x = np.mgrid[0:size, 0:size] / size
        rgb = np.stack([np.sin(3 * x + i), np.cos(2 * y - i), x * y], axis=-1) * 100 + 128
        rgb = np.clip(rgb + rng.normal(0, 20, rgb.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


# -- ours: the server --------------------------------------------------------
def start_server(model: Path, port: int, args) -> subprocess.Popen:
    command = [QWEN3VL, "serve", "--model", str(model), "--port", str(port), "--pooling", "last",
               "--max-batch", str(args.batch), "--threads", str(args.threads), "--precision", args.precision,
               "--context", str(args.context), "--kv-cache-memory", str(args.kv_cache_memory), "--no-web-ui"]
    command += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    for bucket in args.prompt_bucket or ():
        command += ["--prompt-bucket", str(bucket)]
    return wait_ready(subprocess.Popen(command), port, args.startup_timeout)


TOKENS: dict[str, list[int]] = {}  # prompt tokens of each item ours embedded, by kind (the server's usage)
CACHED: dict[tuple, list[float]] = {}  # (kind, mode) -> prompt tokens an item the prefix cache held


def prefix_hits(port: int) -> float:
    """The server's prompt tokens found in its prefix cache so far (/metrics)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    found = re.search(r"^qwen3vl_prefix_cache_hit_tokens_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def post(port: int, body: dict, kind: str) -> list[np.ndarray]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/embeddings", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    answer = r.read().decode()
    if r.status != 200:
        raise SystemExit(f"/v1/embeddings: {r.status} {answer}")
    answer = json.loads(answer)
    TOKENS.setdefault(kind, []).append(answer["usage"]["prompt_tokens"] / len(answer["data"]))
    return [np.asarray(d["embedding"], np.float32) for d in answer["data"]]


def image_body(png: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}


def ours(port: int, kind: str, items: list, together: bool) -> list[np.ndarray]:
    if kind == "text":
        return post(port, {"input": items}, kind) if together else [post(port, {"input": t}, kind)[0] for t in items]
    if not together:
        return [post(port, image_body(png), kind)[0] for png in items]
    with ThreadPoolExecutor(len(items)) as pool:
        return [rows[0] for rows in pool.map(lambda png: post(port, image_body(png), kind), items)]


# -- transformers ------------------------------------------------------------
class Reference:
    """transformers' Qwen3VLModel of the checkpoint, embedding as the model card's embedder:
    the chat rendered with the generation prompt, right padding, the last real token's final
    hidden state, L2-normalized."""

    def __init__(self, model: Path, threads: int, precision: str):
        import torch
        from torch_reference import import_torchvision

        import_torchvision()  # transformers imports torchvision: loadable beside torch+cpu
        from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = Qwen3VLForConditionalGeneration.from_pretrained(model, dtype=getattr(torch, DTYPES[precision])).model.eval()
        self.processor = AutoProcessor.from_pretrained(model)
        self.processor.tokenizer.padding_side = "right"

    def embed(self, kind: str, items: list) -> list[np.ndarray]:
        from PIL import Image

        torch = self.torch
        part = {"type": "text"} if kind == "text" else {"type": "image"}
        chats = [item_messages([dict(part, text=item) if kind == "text" else part]) for item in items]
        prompts = [self.processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        pictures = None if kind == "text" else [Image.open(io.BytesIO(png)).convert("RGB") for png in items]
        inputs = self.processor(text=prompts, images=pictures, padding=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state
            last = inputs["attention_mask"].sum(dim=1) - 1
            vectors = torch.nn.functional.normalize(hidden[torch.arange(len(items)), last], p=2, dim=-1)
        return list(vectors.float().numpy())


# -- the race ----------------------------------------------------------------
def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def items(kind: str, n: int, seed: int, args) -> list:
    return texts(n, seed) if kind == "text" else images(n, args.image, seed)


def race(port: int, reference: Reference, args) -> dict:
    """Distinct items in every round and mode (the server's encoder and prefix caches hit only
    what items share: the instruction's blocks), the sides alternating first."""
    rows, worst = {}, 0.0
    kinds = ("text", "image")
    for kind in kinds:  # warm-up: compiles, caches, both sides' first calls
        reference.embed(kind, items(kind, 1, 999, args))
        ours(port, kind, items(kind, 1, 998, args), False)
    for round_ in range(args.rounds):
        for k, kind in enumerate(kinds):
            for m, (mode, together) in enumerate((("batch 1", False), (f"batch {args.batch}", True))):
                batch = items(kind, args.batch, 10 * (4 * round_ + 2 * k + m), args)
                sides = [("ours", lambda: ours(port, kind, batch, together)),
                         ("transformers", lambda: (reference.embed(kind, batch) if together
                                                   else [reference.embed(kind, [i])[0] for i in batch]))]
                results = {}
                for name, fn in (sides if round_ % 2 == 0 else sides[::-1]):
                    hits = prefix_hits(port)
                    seconds, results[name] = timed(fn)
                    if name == "ours":
                        CACHED.setdefault((kind, mode), []).append((prefix_hits(port) - hits) / len(batch))
                    rows.setdefault((kind, mode), {}).setdefault(name, []).append(len(batch) / seconds)
                worst = max(worst, *(rel_l2(a, b) for a, b in zip(results["ours"], results["transformers"])))
                gc.collect()
    table = []
    for (kind, mode), sides in rows.items():
        ours_rate, theirs = spread(sides["ours"]), spread(sides["transformers"])
        table.append({"items": kind, "mode": mode, "ours_items_per_s": ours_rate,
                      "transformers_items_per_s": theirs, "ratio": ours_rate["median"] / theirs["median"],
                      "round_ratios": [a / b for a, b in zip(sides["ours"], sides["transformers"])]})
    tokens = {kind: f"{min(n):.0f}-{max(n):.0f}" for kind, n in TOKENS.items()}
    return {"rows": table, "max_rel_l2": worst, "prompt_tokens_per_item": tokens}


def item_gflop(model: Path, kind: str, tokens: float, image: int) -> float:
    """An item's useful work, GFLOP: the language model's linears over `tokens` prompt tokens
    (attention's products left out), plus the tower over one `image`-sided image for an image
    item. A lower bound: padding and attention are not counted."""
    from emitter.config import load_model_config
    from runtime.bench.vision import vision_flops
    from runtime.checkpoints.text import model_text_config

    t, _ = model_text_config(model)
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    per_token = 2 * t.num_hidden_layers * t.hidden_size * (2 * q + 2 * kv + 3 * t.intermediate_size)
    flops = per_token * tokens
    if kind == "image":
        v = load_model_config(model)
        side = image // v.patch_size
        flops += vision_flops(v, [(1, side, side)])
    return flops / 1e9


def roofs(model: Path, result: dict, args) -> None:
    """Each row's GFLOP/s (items/s x an item's useful GFLOP: transformers computes every prompt
    token, ours those its prefix cache did not hold) beside the cores' FMA peak in this
    precision, measured now (benchmarks/fma_peak.py)."""
    import tempfile

    import fma_peak

    with tempfile.TemporaryDirectory() as tmp:
        fma_peak.main(["--threads", str(args.threads), "--repeats", "3", "--json", f"{tmp}/peak.json"])
        peak = json.loads(Path(f"{tmp}/peak.json").read_text())[args.precision]["best"]
    result["fma_peak_gflops"] = peak
    for row in result["rows"]:
        tokens, cached = statistics.mean(TOKENS[row["items"]]), statistics.mean(CACHED[row["items"], row["mode"]])
        row["cached_tokens_per_item"] = cached
        row["item_gflop"] = {side: item_gflop(model, row["items"], tokens - skipped, args.image)
                             for side, skipped in (("ours", cached), ("transformers", 0))}
        for side in ("ours", "transformers"):
            row[f"{side}_gflops"] = row[f"{side}_items_per_s"]["median"] * row["item_gflop"][side]


def checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    folder = Path(args.work) / f"{args.preset}-{args.layers or 'all'}-embed"
    if not (folder / "config.json").is_file():
        command = [QWEN3VL, "random-checkpoint", str(folder), "--preset", args.preset, "--with-text"]
        subprocess.run(command + (["--layers", str(args.layers)] if args.layers else []), check=True)
    return folder


def cpu_line() -> str:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{fields.get('model name', platform.processor())} ({' '.join(isa)})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--layers", type=int, help="the language model's first N layers only")
    p.add_argument("--model", help="a checkpoint folder (default: a random one of --preset in --work)")
    p.add_argument("--work", default="/tmp/qwen3vl-bench", help="where the random checkpoint is written")
    p.add_argument("--cache-dir", help="the artifact cache (default: the user's)")
    p.add_argument("--batch", type=int, default=4, help="items per kind; the server's --max-batch")
    p.add_argument("--image", type=int, default=256, help="image side in pixels")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=2048, help="the server's --context (items are short)")
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="the server's KV cache, GB")
    p.add_argument("--prompt-bucket", type=int, action="append", help="the server's --prompt-bucket (repeatable)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=list(DTYPES), default="f32",
                   help="both sides': the server's --precision, transformers' dtype")
    p.add_argument("--startup-timeout", type=float, default=3600)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    model = checkpoint(args)
    port = free_port()
    server = start_server(model, port, args)
    try:
        reference = Reference(model, args.threads, args.precision)
        result = race(port, reference, args)
    finally:
        server.terminate()
        server.wait()
    del reference
    gc.collect()
    roofs(model, result, args)
    result.update(cpu=cpu_line(), threads=args.threads, preset=args.preset, layers=args.layers,
                  prompt_buckets=args.prompt_bucket or "the server's default",
                  image=f"{args.image}x{args.image}", precision=f"{args.precision} (both)", rounds=args.rounds)
    print(f"{result['cpu']}, {args.threads} threads, {args.preset}"
          f"{f' ({args.layers} layers)' if args.layers else ''}, {args.precision}; vectors relL2 <= {result['max_rel_l2']:.1e}; "
          f"prompt tokens an item: {result['prompt_tokens_per_item']}")
    print(f"{'items':6} {'mode':8} {'ours items/s':>22} {'transformers items/s':>22} {'ratio':>6}  "
          f"cached  GFLOP/s ours / theirs, of the {args.precision} FMA peak {result['fma_peak_gflops']:.0f}")
    for row in result["rows"]:
        fmt = lambda s: f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"  # noqa: E731
        pct = lambda side: f"{row[side + '_gflops']:.0f} ({row[side + '_gflops'] / result['fma_peak_gflops']:.0%})"  # noqa: E731
        print(f"{row['items']:6} {row['mode']:8} {fmt(row['ours_items_per_s']):>22} "
              f"{fmt(row['transformers_items_per_s']):>22} {row['ratio']:>5.2f}x  {row['cached_tokens_per_item']:6.1f}  "
              f"{pct('ours')} / {pct('transformers')}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
