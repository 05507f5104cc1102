"""Time, GFLOP/s and peak memory of `qwen3vl run` as the bucket grows: one image of exactly
`bucket` patches per bucket, one call, each bucket in its own process (its peak RSS is its own).

    .venv/bin/qwen3vl random-checkpoint /tmp/2b --preset qwen3-vl-2b
    .venv/bin/python benchmarks/bench_scaling.py --model /tmp/2b --buckets 512 2048 8192 16384
    .venv/bin/python benchmarks/bench_scaling.py --model /tmp/2b --buckets 2048 4096 8192 \
        --defaults --max-peak-ratio 1.5   # no --bucket; peak RSS at most 1.5x the first bucket's

`--defaults` runs `qwen3vl run` without `--bucket`, so each image goes to the default
buckets' module (`emitter.identity.DEFAULT_LADDER`: compiled once, any row count). `--max-peak-ratio R`
exits 1 when a bucket's peak RSS exceeds R times the first bucket's (the bounded-memory
check of the tower: memory grows about linearly with the patches, and the weights dominate).

The run is the product path: weights from the checkpoint's archive (memory-mapped, released
once packed), the artifact from the cache (compiled on a miss, outside the `run` seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from emitter.atomic import check_writable, write_atomic
from emitter.cli import fail
from emitter.config import load_model_config
from emitter.attention import attention_form
from runtime.bench.vision import vision_flops


def image_for(bucket: int, patch: int) -> tuple[int, int]:
    """(W, H) of an image that the processor turns into exactly `bucket` patches of `patch` pixels."""
    side = int(math.isqrt(bucket))
    w, h = (side, side) if side * side == bucket else (2 * int(math.isqrt(bucket // 2)), int(math.isqrt(bucket // 2)))
    assert w * h == bucket, bucket
    return patch * w, patch * h


def run_once(model: str, bucket: int, image: Path, cache_dir: str, threads: int, defaults: bool = False) -> dict:
    """`qwen3vl run` on one image in a child process: its seconds, the image's grid, and the
    child's own peak RSS (from wait4; this parent stays small, so what the child inherits
    across exec does not count)."""
    command = [str(Path(sys.executable).parent / "qwen3vl"), "run", "--model", model,
               *([] if defaults else ["--bucket", str(bucket)]),
               "--cache-dir", cache_dir, "--threads", str(threads), str(image)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if child.returncode:
        raise SystemExit(f"bucket {bucket}: qwen3vl run failed:\n{stderr.strip()}")
    seconds = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+)", stdout.split("seconds", 1)[1])}
    grid = tuple(int(v) for v in re.search(r"grid \((\d+), (\d+), (\d+)\)", stdout).groups())
    used = int(re.search(r"^buckets  (\d+) ", stdout, re.M).group(1))
    return {"seconds": seconds, "grid": grid, "bucket_used": used, "peak_rss_bytes": usage.ru_maxrss * 1024}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (e.g. from qwen3vl random-checkpoint)")
    p.add_argument("--buckets", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", help="artifact cache (default: a temporary folder)")
    p.add_argument("--defaults", action="store_true",
                   help="run without --bucket (the default buckets: one module, any size)")
    p.add_argument("--max-peak-ratio", type=float, metavar="R",
                   help="exit 1 when a bucket's peak RSS exceeds R times the first bucket's")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.json:
        try:
            check_writable(args.json, "--json")
        except ValueError as e:
            fail(str(e))
    from PIL import Image
    cfg = load_model_config(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or str(Path(tmp) / "cache")
        for bucket in args.buckets:
            w, h = image_for(bucket, cfg.patch_size)
            image = Path(tmp) / f"{w}x{h}.png"
            Image.fromarray(np.random.default_rng(bucket).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(image)
            result = run_once(args.model, bucket, image, cache_dir, args.threads, args.defaults)
            if not args.defaults and result["bucket_used"] != bucket:  # the defaults: 512 or 16384
                fail(f"bucket {bucket}: qwen3vl run used bucket {result['bucket_used']}")
            peak = result["peak_rss_bytes"]
            flops = vision_flops(cfg, [result["grid"]])
            run_s = result["seconds"]["run"]
            rows.append({"bucket": bucket, "image": f"{w}x{h}", "grid": result["grid"],
                         "attention": attention_form(bucket), "run_s": run_s, "gflop": flops / 1e9,
                         "gflops": flops / run_s / 1e9, "peak_rss_bytes": peak,
                         "artifacts_s": result["seconds"]["artifacts"]})
            r = rows[-1]
            print(f"{bucket:>6} {r['image']:>10} {r['attention']:>9} {run_s:9.2f} s {r['gflop']:9.0f} GFLOP "
                  f"{r['gflops']:6.0f} GFLOP/s  peak RSS {peak / 2**30:5.2f} GiB  compile+load "
                  f"{r['artifacts_s']:.1f} s", flush=True)
    base = rows[0]
    print(f"{'bucket':>6} {'x patches':>9} {'x GFLOP':>8} {'x time':>7}")
    for r in rows:
        print(f"{r['bucket']:>6} {r['bucket'] / base['bucket']:9.1f} {r['gflop'] / base['gflop']:8.1f} "
              f"{r['run_s'] / base['run_s']:7.1f}")
    if args.json:
        try:
            write_atomic(args.json, json.dumps(rows, indent=1) + "\n")
        except OSError as e:
            fail(str(e))
    if args.max_peak_ratio:
        ratios = {r["bucket"]: r["peak_rss_bytes"] / base["peak_rss_bytes"] for r in rows}
        print("peak RSS / bucket " + str(base["bucket"]) + "'s: "
              + ", ".join(f"{b} x{q:.2f}" for b, q in ratios.items()))
        over = [b for b, q in ratios.items() if q > args.max_peak_ratio]
        if over:
            print(f"FAIL: peak RSS over {args.max_peak_ratio}x at bucket {', '.join(map(str, over))}")
            sys.exit(1)
        print(f"ok: every peak RSS within {args.max_peak_ratio}x")


if __name__ == "__main__":
    main()
