"""The machine's matmul roof: the best GFLOP/s any library here reaches on a large square
matmul, in f32 and with bf16 operands (f32 accumulation), measured in the calling process.

Three contenders, each timed at every size and the best kept: numpy's BLAS (OpenBLAS) in a
subprocess with `OPENBLAS_CORETYPE` and `OPENBLAS_L2_SIZE` unset (some machines set them,
and they slow a current OpenBLAS; f32 only), torch's matmul when torch is installed, and
IREE's own matmul compiled here with the runtime's flags. A number from a program that is
not the best matmul on the machine is not a roof, so it takes the maximum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from emitter.precision import precision as precision_of

DEFAULT_SIZES = (2048, 4096)

_NUMPY_SCRIPT = """
import json, sys, time
import numpy as np
n, repeats = int(sys.argv[1]), int(sys.argv[2])
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
a @ b
times = []
for _ in range(repeats):
    start = time.perf_counter()
    a @ b
    times.append(time.perf_counter() - start)
print(json.dumps(min(times)))
"""


def gflops(n: int, seconds: float) -> float:
    return 2 * n ** 3 / seconds / 1e9


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth_gbs(threads: int) -> dict:
    """Read bandwidth (a 1 GiB f32 sum) and STREAM triad bandwidth (a = b + s c over three
    1 GiB arrays, 3 GiB moved), torch on `threads` threads, best of 5 each."""
    import torch
    torch.set_num_threads(threads)
    n = 1 << 28
    b, c = torch.ones(n), torch.ones(n)
    a = torch.empty(n)
    read = best_time(lambda: b.sum(), 5)
    triad = best_time(lambda: torch.add(b, c, alpha=3.0, out=a), 5)
    return {"read_gbs": n * 4 / read / 1e9, "triad_gbs": 3 * n * 4 / triad / 1e9}


def numpy_gflops(n: int, threads: int, repeats: int) -> float:
    """numpy (OpenBLAS) f32 in a fresh interpreter: BLAS reads its thread count and core
    type once, at load, so they are set there."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env.update(OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", _NUMPY_SCRIPT, str(n), str(repeats)], env=env,
                          capture_output=True, text=True, check=True)
    return gflops(n, json.loads(done.stdout))


def torch_gflops(n: int, precision: str, threads: int, repeats: int) -> float:
    import torch
    torch.set_num_threads(threads)
    dtype = torch.float32 if precision == "f32" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    with torch.inference_mode():
        return gflops(n, best_time(lambda: a @ b, repeats))


def iree_operand_dtypes(precision: str) -> tuple[str, str]:
    """(activations, weights): a matmul's operand dtypes as the graphs of `precision` take them."""
    p = precision_of(precision)
    return p.activations, p.weights


def iree_matmul_mlir(n: int, precision: str) -> str:
    """One n x n x n dot_general with operands as the graphs of `precision` take them
    (`iree_operand_dtypes`), accumulating in f32."""
    a, b = iree_operand_dtypes(precision)
    return (f"module @roof {{\n"
            f"  func.func @main(%a: tensor<{n}x{n}x{a}>, %b: tensor<{n}x{n}x{b}>) -> tensor<{n}x{n}xf32> {{\n"
            f"    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : "
            f"(tensor<{n}x{n}x{a}>, tensor<{n}x{n}x{b}>) -> tensor<{n}x{n}xf32>\n"
            f"    return %0 : tensor<{n}x{n}xf32>\n  }}\n}}\n")


def iree_gflops(n: int, precision: str, config, repeats: int, extra_flags=()) -> float:
    """IREE's llvm-cpu matmul with the runtime's compile flags, operands resident on the
    device (with data tiling each call also packs both operands: O(n^2) against O(n^3))."""
    import ml_dtypes

    from runtime.artifact.compiler import compile_mlir
    from runtime.artifact.iree_module import LoadedModule

    module = LoadedModule(compile_mlir(iree_matmul_mlir(n, precision), extra_flags=extra_flags),
                          config=config, module_name="roof")
    dtypes = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
    rng = np.random.default_rng(0)
    a, b = (module.upload(rng.standard_normal((n, n), dtype=np.float32).astype(dtypes[t]))
            for t in iree_operand_dtypes(precision))
    return gflops(n, best_time(lambda: module.function(a, b), repeats))


def measure_roof(config, threads: int, sizes=DEFAULT_SIZES, forms=None, repeats: int = 3,
                 with_torch: bool = True, progress=None) -> dict:
    """{precision: {"gflops": best, "by": "<library> <n>", "all": {contender: GFLOP/s}}} for
    each precision in `forms` ({precision asked: the graph precision it is built as}; default
    f32 and bf16 as asked): only those, so an f32 bench times no bf16 matmul. IREE's contender
    runs the graph precision (bf16-f32 on a CPU without a double-rate bf16 dot product; with
    none at all, IREE's bf16 x bf16 matmul is scalar). `config`: the IREE runtime config the
    caller runs on."""
    forms = forms or {"f32": "f32", "bf16": "bf16"}
    contenders = {precision: {} for precision in forms}
    for n in sizes:
        if "f32" in forms:
            contenders["f32"][f"numpy {n}"] = numpy_gflops(n, threads, repeats)
        for precision, form in forms.items():
            if with_torch:
                contenders[precision][f"torch {n}"] = torch_gflops(n, precision, threads, repeats)
            contenders[precision][f"iree {n}"] = iree_gflops(n, form, config, repeats)
        if progress:
            progress(f"roof at {n}: " + ", ".join(f"{precision} {name} {g:.0f}" for precision, c in contenders.items()
                                                  for name, g in c.items() if name.endswith(f" {n}")))
    roof = {}
    for precision, found in contenders.items():
        by = max(found, key=found.get)
        roof[precision] = {"gflops": found[by], "by": by, "all": found}
    return roof
