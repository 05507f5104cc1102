"""Building the hand-written kernels' objects: the C compiler search, the flags of each ISA,
and one bare-metal ELF object per source, ISA and compiler, cached on disk by their hash.

IREE links such an object into its executables (its embedded-ELF object mechanism): a graph
names it by file name alone (emitter/kernel_calls.py), and iree-compile finds it through
`search_flags`, so that the graph, and so the artifact identity, is the same whatever folder
holds it. `make install` builds every kernel for every ISA (`python -m kernels`); a missing
object is built on first use (`object_name`)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

OBJECTS_ENV = "QWEN3VL_KERNEL_DIR"  # where `default_objects` keeps the built objects
# Bare-metal object flags (IREE's embedded ELF: no libc, no TLS, position independent); no FMA
# contraction, so that the float math is the documented order (each kernel's `reference`, bit for bit).
COMMON_FLAGS = ("-std=c17", "-O3", "-ffreestanding", "-fPIC", "-fvisibility=hidden", "-fno-plt",
                "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-exceptions",
                "-ffunction-sections", "-fdata-sections", "-ffp-contract=off")
ISA_FLAGS = {
    "avx512vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi2"),
}
ISA_TITLES = {"avx512vnni": "AVX-512 VNNI", "avx2": "AVX2"}  # each ISA's name in module headers
# LLVM target features each ISA's object needs, best first.
ISA_FEATURES = {"avx512vnni": ("+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni"), "avx2": ("+avx2",)}


class KernelError(ValueError):
    """A shape, weight or target a kernel cannot take, or an object that did not build."""


def isa_for_features(features: str) -> str:
    """The best ISA whose features an LLVM `cpu_features` string ("+avx2,+fma,...") has."""
    have = set(features.split(","))
    for isa, needed in ISA_FEATURES.items():
        if have.issuperset(needed):
            return isa
    raise KernelError(f"q8_matmul: target features {features[:80]!r}...: expected AVX2 or AVX-512 VNNI")


def compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelError("q8_matmul: no C compiler: expected $CC, cc, gcc or clang on PATH (--precision q8_0's "
                      "kernel is built from source; install gcc or clang)")


def default_objects() -> Path:
    """The folder of the objects a graph links: `$QWEN3VL_KERNEL_DIR`, else
    `$XDG_CACHE_HOME/qwen3vl-kernels` (~/.cache/qwen3vl-kernels)."""
    if os.environ.get(OBJECTS_ENV):
        return Path(os.environ[OBJECTS_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen3vl-kernels"


def search_flags() -> list[str]:
    """iree-compile flags that find an object a graph names by file name: `default_objects()`."""
    return [f"--iree-hal-executable-object-search-path={default_objects()}"]


def build_object(isa: str, out_dir: str | os.PathLike, source: Path) -> Path:
    """`source` (kernels/q8_matmul.c, kernels/decode_attention.c, or a benchmark's baseline
    version of one) compiled for `isa` into `out_dir`, named by the source's stem and a hash of
    the source, flags and compiler (so a stale object is never reused); written whole or not at all."""
    source = Path(source)
    if isa not in ISA_FLAGS:
        raise KernelError(f"{source.stem}: ISA {isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    cc = compiler()
    flags = [*COMMON_FLAGS, *ISA_FLAGS[isa]]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *flags, version]).encode()).hexdigest()[:16]
    out = Path(out_dir) / f"{source.stem}-{isa}-{key}.o"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        done = subprocess.run([cc, *flags, "-c", str(source), "-o", str(part)], capture_output=True, text=True)
        if done.returncode:
            raise KernelError(f"{source.stem}: {cc} failed for {isa}:\n{done.stderr.strip()}")
        os.replace(part, out)
    return out


def object_name(isa: str, source: Path) -> str:
    """The file name of `source`'s object for `isa`, built into `default_objects()` if not
    there (by `make install`, else on first use); the name alone, so that a graph naming it does
    not depend on the folder (iree-compile finds it: `search_flags`)."""
    return build_object(isa, default_objects(), source).name
