"""Drive `qwen3vl serve` with N concurrent streaming clients; report throughput and latency.

Each client sends `--requests` streamed chat completions, one after another: one image
(assets/demo.png, as a data: URL) and a short prompt, `--new` new tokens (`ignore_eos`, so
every answer has exactly that many). `--prompts distinct` (the default) numbers each
request's text, so no two prompts are equal; `same` sends one prompt throughout. Per
concurrency:
- decode tokens/s: the tokens the decode steps gave / the seconds spent in them, from the
  server's metrics (what batching buys: a step reads the weights once for all sequences);
- output tokens/s: all completion tokens / the round's wall time (prefills included);
- time to first token p50/p95, and per-token latency p50/p95 (a request's (last - first
  token time) / (tokens - 1), other requests' prefills included);
- the mean decode batch the server saw.
The server runs with `--max-batch` = the largest concurrency.

    .venv/bin/python benchmarks/bench_serve.py --preset tiny --concurrency 1 2 4 8
    .venv/bin/python benchmarks/bench_serve.py --preset qwen3-vl-2b --precision bf16 --context 1024 \\
        --json serve-2b-bf16.json

`--multi-turn LINES` times a chat's second turn with and without the prefix cache instead;
`--chats LINES` runs max(--concurrency) chats of LINES lines and an image at once and
reports the server's peak RSS and the most KV blocks they held, beside the KV memory the
contiguous design (one whole-context row per --max-batch sequence) would need, computed:

    .venv/bin/python benchmarks/bench_serve.py --model /tmp/b2 --concurrency 8 --chats 175 \\
        --context 8192 --prompt-bucket 512 --kv-cache-dtype bf16 --kv-cache-memory 3.9

A `--preset` writes a random checkpoint (with a language model) under `--work` on first
use (the 2B one is 8.8 GB in f32); `--model DIR` uses a checkpoint folder instead.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import itertools
import json
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QWEN3VL = str(Path(sys.executable).parent / "qwen3vl")
RAY = False  # --ray-replicas given


def machine() -> dict:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    import os
    return {"cpu": fields.get("model name", platform.processor()), "cores": os.cpu_count()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint(args) -> Path:
    if args.model:
        return Path(args.model)
    folder = Path(args.work) / f"{args.preset}-answer"
    if not (folder / "config.json").is_file():
        subprocess.run([QWEN3VL, "random-checkpoint", folder, "--preset", args.preset, "--with-text"], check=True)
    return folder


def start_server(args, model: Path, port: int, extra=()) -> subprocess.Popen:
    command = [QWEN3VL, "serve", "--model", model, "--port", str(port), "--max-batch", str(max(args.concurrency)),
               "--max-waiting", "1000", "--context", str(args.context), "--precision", args.precision,
               "--kv-cache-dtype", args.kv_cache_dtype, "--cache-dir", args.cache_dir, *extra]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.ray_replicas:
        command += ["--ray", "local", "--replicas", str(args.ray_replicas)]
    if args.kv_cache_memory:
        command += ["--kv-cache-memory", str(args.kv_cache_memory)]
    for bucket in args.prompt_bucket or ():
        command += ["--prompt-bucket", str(bucket)]
    return wait_ready(subprocess.Popen(command), port, args.startup_timeout)


def wait_ready(server: subprocess.Popen, port: int, timeout: float) -> subprocess.Popen:
    """`server` once its /health answers 200; SystemExit if it exits or `timeout` s pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with status {server.returncode}")
        try:
            if get(port, "/health")[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(1)
    server.kill()
    raise SystemExit("server not ready in time")


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read().decode()


def one_request(port: int, body: bytes) -> dict:
    """One streamed completion: times of the request, of each content chunk, and usage."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise SystemExit(f"request failed: {response.status} {response.read()[:200]!r}")
    times, usage, text = [], None, []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            if choice["delta"].get("content") or choice.get("logprobs"):
                times.append(time.perf_counter())
                text.append(choice["delta"].get("content") or "")
    return {"start": start, "times": times, "tokens": usage["completion_tokens"], "prompt": usage["prompt_tokens"],
            "text": "".join(text)}


def user_turn(text: str) -> dict:
    image = base64.b64encode((ROOT / "assets" / "demo.png").read_bytes()).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                                        {"type": "text", "text": text}]}


def chat_body(args, messages) -> bytes:
    return json.dumps({"messages": messages, "max_tokens": args.new, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
                       "logprobs": True}).encode()


def body(args, number: int = 0) -> bytes:
    text = "Describe the image." + (f" This is request {number}." if args.prompts == "distinct" else "")
    return chat_body(args, [user_turn(text)])


def peak_rss_gb(pid: int) -> float:
    """The process's peak resident set (VmHWM), GB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return round(int(line.split()[1]) * 1024 / 1e9, 3)


def multi_turn(args, model: Path) -> list[dict]:
    """A chat of `args.multi_turn` lines of text and one image, then its second turn (the
    first, its answer, a question), on a server with the prefix cache and on one without:
    each turn's time to first token and prompt tokens; then `max(--concurrency)` such first
    turns at once (distinct texts), and the server's peak RSS."""
    out = []
    for cache in (True, False):
        port = free_port()
        server = start_server(args, model, port, [] if cache else ["--no-prompt-cache"])
        try:
            one_request(port, body(args))  # warm-up
            text = " ".join(f"Line {i}: a note about the picture." for i in range(args.multi_turn))
            first = [user_turn(text)]
            r1 = one_request(port, chat_body(args, first))
            second = first + [{"role": "assistant", "content": r1["text"]},
                              {"role": "user", "content": "And what else is in it?"}]
            r2 = one_request(port, chat_body(args, second))
            row = {"prefix_cache": cache, "turn1_prompt_tokens": r1["prompt"], "turn2_prompt_tokens": r2["prompt"],
                   "turn1_ttft_s": round(r1["times"][0] - r1["start"], 3),
                   "turn2_ttft_s": round(r2["times"][0] - r2["start"], 3)}
            row["turn2_over_turn1"] = round(row["turn2_ttft_s"] / row["turn1_ttft_s"], 3)
            if cache:
                bodies = (chat_body(args, [user_turn(f"Chat {i}. " + text)]) for i in itertools.count())
                clients = max(args.concurrency)
                round_of(port, bodies, clients, 1)
                row[f"peak_rss_gb_{clients}_chats"] = peak_rss_gb(server.pid)
            out.append(row)
        finally:
            server.terminate()
            server.wait(60)
    return out


def chats(args, model: Path) -> dict:
    """max(--concurrency) distinct chats of `args.chats` lines of text and one image at once,
    after a warm-up: the server's peak RSS, the most KV blocks in use (polled from /metrics
    while they run), and the KV memory of the contiguous design (a whole-context row per
    sequence), computed from the checkpoint's config."""
    from emitter.kv_pages import BLOCK
    from emitter.text_config import load_text_config
    from runtime.sizing import kv_token_bytes

    clients = max(args.concurrency)
    token_bytes = kv_token_bytes(load_text_config(model)[0], args.kv_cache_dtype)
    port = free_port()
    server = start_server(args, model, port)
    try:
        one_request(port, body(args))  # warm-up
        text = " ".join(f"Line {i}: a note about the picture." for i in range(args.chats))
        bodies = (chat_body(args, [user_turn(f"Chat {i}. " + text)]) for i in itertools.count())
        peak, done = [0], threading.Event()

        def poll():
            while not done.wait(0.2):
                peak[0] = max(peak[0], int(metric(get(port, "/metrics")[1], "qwen3vl_kv_cache_blocks_used")))

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            result = round_of(port, bodies, clients, 1)
        finally:
            done.set()
            poller.join()
        rss = peak_rss_gb(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    prompt = result["prompt_tokens"]
    return {"chats": clients, "prompt_tokens": prompt, "new_tokens": args.new,
            "peak_kv_blocks": peak[0], "peak_kv_gb": round(peak[0] * BLOCK * token_bytes / 1e9, 3),
            "held_tokens_kv_gb": round(sum(p + args.new for p in prompt) * token_bytes / 1e9, 3),
            "contiguous_kv_gb": round(clients * args.context * token_bytes / 1e9, 3),
            "peak_rss_gb": rss, "round": result}


def metric(text: str, name: str) -> float:
    """A metric's value in /metrics' text."""
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def batch_sizes(port: int) -> dict | None:
    """The decode steps so far, from the server's /metrics (None on Ray, where /metrics is
    one replica's)."""
    if RAY:
        return None
    text = get(port, "/metrics")[1]
    value = lambda name: metric(text, name)  # noqa: E731
    return {"steps": value("qwen3vl_decode_batch_size_count"), "sequences": value("qwen3vl_decode_batch_size_sum"),
            "step_seconds": value("qwen3vl_decode_step_seconds_sum")}


def percentile(values, q: float) -> float:
    """The q-quantile of `values`; NaN for none (a random model's answers may stream no text
    until their bytes make whole characters)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def round_of(port: int, bodies, clients: int, requests: int) -> dict:
    """One round: `clients` clients, `requests` each, the next body of `bodies` per request."""
    results, lock = [], threading.Lock()

    def client():
        for _ in range(requests):
            with lock:
                data = next(bodies)
            r = one_request(port, data)
            with lock:
                results.append(r)

    before = batch_sizes(port) or {"steps": 0, "sequences": 0, "step_seconds": 0}
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = batch_sizes(port) or before
    tokens = sum(r["tokens"] for r in results)
    prompts = [r["prompt"] for r in results]
    ttft = [r["times"][0] - r["start"] for r in results]
    per_token = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results if len(r["times"]) > 1]
    steps, decoded = after["steps"] - before["steps"], after["sequences"] - before["sequences"]
    step_seconds = after["step_seconds"] - before["step_seconds"]
    return {"concurrency": clients, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2),
            "decode_tokens_per_s": round(decoded / step_seconds, 2) if step_seconds else 0.0,
            "ttft_p50_s": round(percentile(ttft, 0.5), 4),
            "ttft_p95_s": round(percentile(ttft, 0.95), 4),
            "per_token_p50_ms": round(1000 * percentile(per_token, 0.5), 2),
            "per_token_p95_ms": round(1000 * percentile(per_token, 0.95), 2),
            "mean_decode_batch": round(decoded / steps, 2) if steps else 0.0, "prompt_tokens": prompts}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", help="Checkpoint folder (with a language model).")
    source.add_argument("--preset", default="tiny", help="A random checkpoint of this preset (default tiny).")
    p.add_argument("--work", default="/tmp/qwen3vl-bench-serve", help="Where --preset checkpoints are written.")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "qwen3vl-iree"))
    p.add_argument("--precision", choices=["f32", "bf16", "int8", "int4", "w8a8", "q8_0", "q4_0", "native"], default="f32")
    p.add_argument("--kv-cache-dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--kv-cache-memory", type=float, metavar="GB", help="The server's KV pool (default: its own).")
    p.add_argument("--prompt-bucket", type=int, action="append", help="The server's prefill buckets (repeatable).")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=2, help="Requests per client per round.")
    p.add_argument("--new", type=int, default=64, help="New tokens per request.")
    p.add_argument("--prompts", choices=["distinct", "same"], default="distinct",
                   help="Number each request's text (default), or send one prompt throughout.")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int)
    p.add_argument("--ray-replicas", type=int, metavar="N",
                   help="Serve as N replicas on a local Ray cluster (`qwen3vl serve --ray local`); the decode rate "
                        "and batch are then not reported (0), each replica has its own /metrics.")
    p.add_argument("--startup-timeout", type=float, default=3600)
    p.add_argument("--multi-turn", type=int, metavar="LINES",
                   help="Instead: a chat of LINES lines and an image, then its second turn, with and without the "
                        "prefix cache (turn-2 time to first token), and max(--concurrency) such chats at once "
                        "(the server's peak RSS).")
    p.add_argument("--chats", type=int, metavar="LINES",
                   help="Instead: max(--concurrency) chats of LINES lines and an image at once (the server's "
                        "peak RSS and KV blocks, beside a contiguous cache's need).")
    p.add_argument("--json", help="Write the report here.")
    args = p.parse_args(argv)
    global RAY
    RAY = bool(args.ray_replicas)
    model = checkpoint(args)
    if args.multi_turn or args.chats:
        report = {"machine": machine(), "model": str(model), "precision": args.precision,
                  "kv_cache_dtype": args.kv_cache_dtype, "context": args.context}
        if args.multi_turn:
            report["multi_turn"] = multi_turn(args, model)
        else:
            report["chats"] = chats(args, model)
        print(json.dumps(report, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return
    port = free_port()
    server = start_server(args, model, port)
    try:
        bodies = (body(args, i) for i in itertools.count())
        one_request(port, next(bodies))  # warm-up: the first call of each entry, the encoder cache
        rounds = [round_of(port, bodies, c, args.requests) for c in args.concurrency]
    finally:
        server.terminate()
        server.wait(60)
    report = {"machine": machine(), "model": str(model), "precision": args.precision,
              "kv_cache_dtype": args.kv_cache_dtype, "new_tokens": args.new, "threads": args.threads,
              "ray_replicas": args.ray_replicas, "context": args.context, "prompts": args.prompts, "rounds": rounds}
    print(f"{report['machine']['cpu']}, {report['machine']['cores']} cores; {model.name}, {args.precision} "
          f"(KV cache {args.kv_cache_dtype}), "
          f"{args.new} new tokens, one image, {args.prompts} prompts")
    print(f"{'clients':>7} {'decode tok/s':>12} {'output tok/s':>12} {'ttft p50':>9} {'ttft p95':>9} "
          f"{'ms/tok p50':>11} {'ms/tok p95':>11} {'batch':>6}")
    for r in rounds:
        print(f"{r['concurrency']:>7} {r['decode_tokens_per_s']:>12} {r['tokens_per_s']:>12} {r['ttft_p50_s']:>9} "
              f"{r['ttft_p95_s']:>9} {r['per_token_p50_ms']:>11} {r['per_token_p95_ms']:>11} "
              f"{r['mean_decode_batch']:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
