"""Compile targets: the iree-compile flags for each, in one place (they are part of an
artifact's identity, so the emitter knows them; the runtime's compiler driver uses them), and
what a target resolves to on this machine (`resolved_device_target`, `host_cpu`).

The compiler (`iree.compiler`) is imported lazily, only to resolve a target: the device target
attribute iree-compile builds from the target's flags (for llvm-cpu with
`--iree-llvmcpu-target-cpu=host`: the host CPU name and feature string LLVM detects)."""

from __future__ import annotations

import re
from functools import lru_cache

INPUT_FLAGS = ("--iree-input-type=stablehlo",)

# name -> (runtime driver, flags). "llvm-cpu" bakes the host CPU's features in;
# distributes each data-tiled matmul in tiles of up to 2 MiB of operands, far more than
# IREE 3.13's default: the 2B tower x1.025-1.045 in f32 at buckets 256 and 512, x1.00-1.01
# in bf16 (docs/history/performance-notebook.md, "Matmul tile bytes"); and lets floating-point reductions
# reassociate (off by default at IREE 3.13's default opt level), so that sums and maxima
# along the contiguous dim (LayerNorm, softmax) run in vectors instead of one element at a
# time: the softmax statistics 28 -> 7 ms a 2B bf16 call (docs/history/performance-notebook.md, "Reductions");
# and moves a collapse of dims across an expand of others, so that RoPE, computed over the
# head's two halves, fuses into the head-major transpose that follows it (two dispatches
# fewer a block, docs/history/performance-notebook.md, "RoPE fused, squares that vectorize").
def _llvm_cpu(cpu: str) -> tuple[str, tuple[str, ...]]:
    return ("local-task", (
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        f"--iree-llvmcpu-target-cpu={cpu}",
        "--iree-opt-data-tiling",
        "--iree-llvmcpu-matmul-tile-bytes=2097152",
        "--iree-llvmcpu-reassociate-fp-reductions=true",
        "--iree-dispatch-creation-propagate-collapse-across-expands",
    ))


# "llvm-cpu-x86-64-v3": the same for any x86-64 CPU with AVX2 and FMA (Haswell, Zen 1-3 and
# later; no AVX-512, no bf16 dot product): a portable artifact, and how the suite runs the
# AVX2 code path on whatever x86-64 machine it is on.
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "llvm-cpu": _llvm_cpu("host"),
    "llvm-cpu-x86-64-v3": _llvm_cpu("x86-64-v3"),
    "cuda-sm80": ("cuda", (
        "--iree-hal-target-device=cuda",
        "--iree-cuda-target=sm_80",
    )),
    "rocm-gfx942": ("hip", (
        "--iree-hal-target-device=hip",
        "--iree-rocm-target=gfx942",
    )),
    "vulkan-spirv": ("vulkan", (
        "--iree-hal-target-backends=vulkan-spirv",
    )),
}
DEFAULT_TARGET = "llvm-cpu"


class TargetError(ValueError):
    """An unknown target, or one the compiler could not resolve on this machine."""


def target_flags(name: str) -> list[str]:
    """Every flag passed to iree-compile for `name`, input flags first."""
    if name not in TARGETS:
        raise TargetError(f"--target {name!r}: unknown target; expected one of {', '.join(TARGETS)}")
    return [*INPUT_FLAGS, *TARGETS[name][1]]


def runtime_driver(name: str) -> str:
    target_flags(name)
    return TARGETS[name][0]


# A trivial module: compiling it to `preprocessing` materializes the device target.
_PROBE = """func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %a, %a : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""
_DEVICE_RE = re.compile(r"util\.global private @__device_0 = (#hal\.device\.target<.*>) : !hal\.device")
_CPU_RE = re.compile(r'\bcpu = "([^"]*)"')
_FEATURES_RE = re.compile(r'\bcpu_features = "([^"]*)"')


@lru_cache(maxsize=None)
def resolved_device_target(flags: tuple[str, ...]) -> str:
    """The `#hal.device.target<...>` attribute iree-compile builds for these flags on
    this machine (host CPU name and features included for target-cpu=host). Stable
    across processes on one machine; computed once per process per flag set."""
    import iree.compiler as ireec
    try:
        text = ireec.compile_str(_PROBE, extra_args=[*flags, "--compile-to=preprocessing"])
    except ireec.CompilerToolError as e:
        raise TargetError(f"iree-compile could not resolve the target for flags {list(flags)}:\n{e}") from None
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    m = _DEVICE_RE.search(text)
    if not m:
        raise TargetError(f"iree-compile printed no device target for flags {list(flags)}")
    return m.group(1)


def host_cpu(device: str) -> tuple[str | None, str | None]:
    """(LLVM CPU name, its `cpu_features` string) of a resolved device target, None where absent."""
    cpu, features = _CPU_RE.search(device), _FEATURES_RE.search(device)
    return cpu.group(1) if cpu else None, features.group(1) if features else None
