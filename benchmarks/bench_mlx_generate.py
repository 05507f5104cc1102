"""A random MLX-quantized checkpoint of a preset's full size answers an image question through
`qwen3vl generate` in its bits: does it fit, and what does it cost.

The checkpoint (`qwen3vl random-checkpoint --with-text --layout mlx --bits`: every linear's
codes drawn in their bits, never a float copy; tower and language model) is written into
`--folder`, then `qwen3vl generate` runs twice in fresh processes with one image: cold (it
writes the weight archives and compiles both modules into `--folder`/cache) and warm (from
the cache). Each run's process tree (the CLI and its iree-compile children) is sampled every
0.2 s: printed are the tree's peak RSS and each program's, the child's own ru_maxrss, the
archives' and modules' sizes, the compile and archive-writing times from the command's
progress lines, and prefill and decode from its --json.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_mlx_generate.py --preset qwen3-vl-8b --folder /tmp/mlx8b

Disk: about 5 GB of checkpoint and 6 GB of cache for the 4-bit 8B (`--keep` leaves them; by
default the folder is removed at the end). Memory: see docs/text.md ("MLX-quantized
checkpoints in their bits"); run one at a time. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

GB = 1e9


def rss(pid: int) -> int:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                stack += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def run_sampled(cmd: list[str], log: Path) -> dict:
    """Run `cmd` (stdout and stderr into `log`), sampling its process tree's RSS."""
    peaks, stop = {"tree": 0}, threading.Event()
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

        def sample():
            while not stop.is_set():
                total = 0
                for p in tree(child.pid):
                    r = rss(p)
                    total += r
                    try:
                        name = Path(f"/proc/{p}/comm").read_text().strip()
                    except OSError:
                        continue
                    peaks[name] = max(peaks.get(name, 0), r)
                peaks["tree"] = max(peaks["tree"], total)
                stop.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.monotonic()
        _, status, usage = os.wait4(child.pid, 0)
        stop.set()
        sampler.join()
    return {"rc": os.waitstatus_to_exitcode(status), "wall": time.monotonic() - start,
            "maxrss": usage.ru_maxrss * 1024, "peaks": peaks}


def generate(folder: Path, image: Path, tokens: int, name: str) -> dict:
    out = folder / f"{name}.json"
    cmd = [sys.executable, "-c", "from runtime.commands.main import main; main()", "generate", "--model",
           str(folder / "model"), "--image", str(image), "--prompt", "What is in this picture?",
           "--max-new-tokens", str(tokens), "--cache-dir", str(folder / "cache"), "--json", str(out)]
    result = run_sampled(cmd, folder / f"{name}.log")
    text = (folder / f"{name}.log").read_text()
    if result["rc"]:
        raise SystemExit(f"{name}: qwen3vl generate failed:\n{text[-3000:]}")
    result["answer"] = json.loads(out.read_text())
    result["progress"] = [line for line in text.splitlines() if re.search(r"compiled in|writing .*irpa", line)]
    return result


def report(name: str, r: dict) -> None:
    a, s = r["answer"], r["answer"]["seconds"]
    decode_ms = 1e3 * s["decode"] / max(len(a["tokens"]) - 1, 1)
    programs = ", ".join(f"{k} {v / GB:.2f}" for k, v in sorted(r["peaks"].items()) if k != "tree")
    print(f"{name}: wall {r['wall']:.0f} s; peak RSS of the process tree {r['peaks']['tree'] / GB:.2f} GB "
          f"(per program: {programs}; ru_maxrss {r['maxrss'] / GB:.2f} GB)")
    print(f"  {a['prompt_tokens']} prompt tokens, {len(a['tokens'])} new; vision {s['vision']:.1f} s, build "
          f"{s.get('build', 0):.1f} s, prefill {s['prefill']:.1f} s, decode {decode_ms:.0f} ms/token")
    for line in r["progress"]:
        print("  " + line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-vl-8b")
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--group", type=int, default=64, choices=[32, 64, 128])
    parser.add_argument("--folder", type=Path, required=True, help="new or empty: checkpoint, cache and logs")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--image-size", type=int, nargs=2, default=(320, 256), metavar=("W", "H"))
    parser.add_argument("--keep", action="store_true", help="leave the checkpoint and cache in --folder")
    args = parser.parse_args(argv)
    import numpy as np
    from PIL import Image

    args.folder.mkdir(parents=True, exist_ok=True)
    if any(args.folder.iterdir()):
        raise SystemExit(f"--folder {args.folder}: not empty; expected a new or empty folder")
    try:
        w, h = args.image_size
        image = args.folder / "image.png"
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(image)
        cmd = [sys.executable, "-c", "from runtime.commands.main import main; main()", "random-checkpoint",
               str(args.folder / "model"), "--preset", args.preset, "--with-text", "--layout", "mlx", "--dtype",
               "bf16", "--bits", str(args.bits), "--group-size", str(args.group)]
        written = run_sampled(cmd, args.folder / "write.log")
        if written["rc"]:
            raise SystemExit((args.folder / "write.log").read_text())
        size = sum(p.stat().st_size for p in (args.folder / "model").glob("*.safetensors"))
        print(f"{args.preset}, {args.bits}-bit groups of {args.group}: checkpoint {size / GB:.2f} GB written in "
              f"{written['wall']:.0f} s, peak RSS {written['peaks']['tree'] / GB:.2f} GB")
        for name in ("cold", "warm"):
            report(name, generate(args.folder, image, args.max_new_tokens, name))
        for kind in ("irpa", "vmfb"):
            for p in sorted((args.folder / "cache").rglob(f"*.{kind}")):
                print(f"  {p.name[:12]}...{kind}: {p.stat().st_size / 1e6:.1f} MB")
    finally:
        if not args.keep:
            shutil.rmtree(args.folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
