"""`python -m kernels [--dir DIR]`: build every hand-written kernel object (kernels/q8_matmul.c,
kernels/decode_attention.c) for every ISA (kernels/build.py `build_object`) into DIR,
default `$QWEN3VL_KERNEL_DIR` or ~/.cache/qwen3vl-kernels; each object is named by a hash of
its source, flags and compiler, so a rerun builds nothing. The install step (`make install`)
runs it. A missing C compiler or a failed build is one line on stderr and exit status 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kernels import build, decode_attention, q8_matmul

SOURCES = (q8_matmul.SOURCE, decode_attention.SOURCE)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the objects go (default: $QWEN3VL_KERNEL_DIR, else "
                        "~/.cache/qwen3vl-kernels)")
    args = parser.parse_args(argv)
    folder = args.dir or build.default_objects()
    try:
        for source in SOURCES:
            for isa in build.ISA_FLAGS:
                print(build.build_object(isa, folder, source))
    except build.KernelError as e:
        lines = str(e).splitlines()
        reason = next((line.strip() for line in lines[1:] if "error" in line), "")
        print(f"error: {lines[0]}{' ' + reason if reason else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
