"""The Q8_0 / 6-bit / Q4_0 kernel's loop alone, outside IREE: two versions of kernels/q8_matmul.c
(this one, B, and `--baseline`, A) on the same [6144, 2048] weights, against a plain read of
the same bytes, alternating round by round in one process (benchmarks/lab/q8_loop.c: `--threads`
workers pulling 128-output workgroups off one counter, as IREE's workers do; at least
`--megabytes` of distinct weights, so that one row reads them from DRAM). Prints ms per
projection, the GB/s of weight and scale bytes, and that rate over the read's (the roof) for
each ISA, row count and weight width (8, 6 or 4 bits, or 6k: GGUF's Q6_K through the q6k entry;
a baseline older than the 6-bit or the Q6_K entry runs this one's in its place: "base missing"). Both builds use the kernel's own flags
(kernels/build.py `COMMON_FLAGS`, `ISA_FLAGS`); A's and B's results are compared bit for bit.

    git show main:kernels/q8_matmul.c > /tmp/q8_main.c
    .venv/bin/python benchmarks/lab/bench_q8_loop.py --baseline /tmp/q8_main.c --rows 1 --isa avx512vnni avx2
    .venv/bin/python benchmarks/lab/bench_q8_loop.py --baseline /tmp/q8_main.c --rows 512 --threads 1 --megabytes 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import build, q8_matmul  # noqa: E402

HARNESS = Path(__file__).with_name("q8_loop.c")


def build_loop(isa: str, a: Path, b: Path, folder: Path) -> Path:
    """The harness linked with `a` and `b` built for `isa` (their entries renamed apart)."""
    cc = build.compiler()
    objects = []
    for name, source in (("A", a), ("B", b)):
        obj = folder / f"{isa}-{name}.o"
        subprocess.run([cc, *build.COMMON_FLAGS, *build.ISA_FLAGS[isa], "-fvisibility=default",
                        *(f"-D{entry}={entry.split('_')[0]}_{name}"
                          for entry in (*q8_matmul.ENTRIES.values(), q8_matmul.Q6_K_ENTRY)),
                        *(f"-D{entry}={entry}_{name}" for entry in q8_matmul.EXPERT_ENTRIES.values()),  # apart, unused
                        "-c", str(source), "-o", str(obj)], check=True)
        objects.append(str(obj))
    exe = folder / f"q8_loop-{isa}"
    subprocess.run([cc, "-O2", "-mavx2", "-pthread", str(HARNESS), *objects, "-o", str(exe)], check=True)
    return exe


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, default=q8_matmul.SOURCE,
                   help="the other version of kernels/q8_matmul.c (A; default: this one, a noise check)")
    p.add_argument("--isa", nargs="+", default=list(build.ISA_FLAGS), choices=list(build.ISA_FLAGS))
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--bits", nargs="+", default=["8", "4"], choices=[*map(str, sorted(q8_matmul.ENTRIES)), "6k"],
                   help="weight widths; 6k: GGUF's Q6_K (the q6k entry)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--megabytes", type=float, default=400)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for isa in args.isa:
            exe = build_loop(isa, args.baseline, q8_matmul.SOURCE, Path(tmp))
            for m in args.rows:
                for bits in args.bits:
                    done = subprocess.run([str(exe), str(m), str(bits), str(args.threads), str(args.megabytes),
                                           str(args.rounds)], capture_output=True, text=True, check=True)
                    r = json.loads(done.stdout)
                    weight = 6144 * 2048 * 13 // 16 if bits == "6k" else 6144 * 2048 * int(bits) // 8
                    roof = weight / r["read_ms"] / 1e6
                    r.update(isa=isa, m=m, bits=bits, roof_gbs=roof, loadavg=os.getloadavg()[0])
                    for side in "ab":
                        r[f"{side}_gbs"] = r["weight_bytes"] / r[f"{side}_ms"] / 1e6
                    out.append(r)
                    base = " (base missing: this one)" if r["base_missing"] else ""
                    print(f"{isa:<10} M={m:<4} {bits} bits{base}: base {r['a_ms']:.3f} ms ({r['a_gbs']:.1f} GB/s, "
                          f"{100 * r['a_gbs'] / roof:.0f}% of read), this {r['b_ms']:.3f} ms ({r['b_gbs']:.1f} GB/s, "
                          f"{100 * r['b_gbs'] / roof:.0f}%), this/base {r['b_ms'] / r['a_ms']:.3f}, read "
                          f"{roof:.1f} GB/s, same bits {r['same']}, load {r['loadavg']:.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
