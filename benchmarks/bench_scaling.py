"""Time and peak memory of the compiled tower as the bucket grows (one large image
per bucket, our side only), each bucket in its own process so peak RSS is its own.

    .venv/bin/python benchmarks/bench_scaling.py --buckets 512 1024 2048 4096
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from emitter.atomic import check_writable, write_atomic
from emitter.cli import fail

HERE = Path(__file__).resolve().parent


def image_for(bucket: int) -> str:
    """A WxH image that the default processor turns into exactly `bucket` patches."""
    side = int(math.isqrt(bucket))
    w, h = (side, side) if side * side == bucket else (2 * int(math.isqrt(bucket // 2)), int(math.isqrt(bucket // 2)))
    assert w * h == bucket, bucket
    return f"{16 * w}x{16 * h}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--buckets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--precision", default="f32")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.json:
        try:
            check_writable(args.json, "--json")
        except ValueError as e:
            fail(str(e))
    rows = []
    for bucket in args.buckets:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, str(HERE / "bench_vision.py"), "--preset", args.preset, "--bucket",
                            str(bucket), "--images", image_for(bucket), "--no-torch", "--repeats", "2",
                            "--warmup", "1", "--precision", args.precision, "--json", out.name], check=True,
                           stdout=subprocess.DEVNULL)
            rows.append(json.loads(Path(out.name).read_text()))
    base = rows[0]
    print(f"{'bucket':>6} {'image':>10} {'seconds':>8} {'x time':>7} {'x patches':>9} {'GFLOP/s':>8} "
          f"{'peak RSS GB':>11} {'compile s':>9}")
    for r in rows:
        print(f"{r['bucket']:>6} {r['images']:>10} {r['ours_s']:8.2f} {r['ours_s'] / base['ours_s']:7.2f} "
              f"{r['bucket'] / base['bucket']:9.1f} {r['gflops']:8.0f} {r['peak_rss_bytes'] / 1e9:11.2f} "
              f"{r['compile_s']:9.1f}")
    if args.json:
        try:
            write_atomic(args.json, json.dumps(rows, indent=1) + "\n")
        except OSError as e:
            fail(str(e))


if __name__ == "__main__":
    main()
