"""One projection's decode forms from DRAM: weight-only int8, int4 and MLX affine (split-K)
against bf16 and the integer forms (int8 activations quantized in the graph x int8 or int4
weights, accumulated in i32), ms per call and GB/s of weights, beside the read bandwidth
measured in the same process.

One [N, K] projection (default 6144x2048, Qwen3-VL-2B's gate/up) at M rows (default 1, 2, 4, 8
and 512). Each form's module holds enough distinct weights (module globals from a parameter
index, as the real graphs hold them) that one sweep reads at least `--megabytes` of them
(default 400 MB: more than the L3, so they come from DRAM); its functions compute
`--per-call` projections each, and a sweep calls every function once. Forms alternate sweep by
sweep, `--rounds` times; the median sweep gives ms per projection. Forms:

- int8 / int4 / mlx4: the weight-only forms (emitter/layers.py `quantized_project`: split-K
  up to SPLIT_K_ROWS rows, dequantized into the data-tiled matmul above) of `--precision
  int8|int4` (groups of 64, a scale each) and of an MLX affine checkpoint (4 bits, groups of
  64, a scale and a bias each); decode's batched step runs them at 2-8 rows (its lanes);
- bf16: bf16 weights widened inside the data-tiled f32 matmul (`--precision bf16` on AVX-512);
- w8a8-gN / w4a8-gN: int8 (int4) weights in groups of N with one f32 scale each
  (`emitter.quant`'s layout) and x quantized in the graph per row and group of N to int8
  (emitter/layers.py `integer_project`: an i8 x i8 (i8 x i4) -> i32 `dot_general` batched
  over the groups, i32 -> f32 times both scales, summed over the groups). `-row`: one group
  of all K inputs (a weight scale per output channel, an x scale per row: `--precision w8a8`),
  a plain i8 x i8 -> i32 matmul, which IREE's data tiling packs into s8s8s32 tiles.
- q8k / q8k-avx2: llama.cpp's Q8_0 x Q8_0 math (int8 weights and activations in blocks of 32,
  a scale per block on both sides) in a hand-written C kernel that iree-compile links into
  the executable (emitter/kernel_calls.py): the target's best ISA (AVX-512 VNNI or AVX2), or its
  AVX2 build on the same target. q4k / q4k-avx2: llama.cpp's Q4_0 x Q8_0 math in the same
  kernel (4-bit weights, Q4_0's 18 bytes a block of 32 with its f16 scale).

`--quality` prints, instead of timing, each integer form's relL2 from the f32 projection in
numpy (the same math: `quant.integer_matmul`, `q8_matmul.reference`) on x with a few outlier
input channels, as LLM activations have. `--save DIR` writes each form's module and weights
(`FORM-mM.vmfb`, `FORM.irpa`, `x-mM.npy`) for IREE's own tools, e.g. a dispatch profile:

    iree-benchmark-module --device=local-task --module=DIR/q8k-m1.vmfb --parameters=model=DIR/q8k.irpa \
        --function=f0 --input=@DIR/x-m1.npy --device_profiling_mode=host-execution \
        --device_profiling_output=q8k.trace && iree-profile dispatch q8k.trace

`--asm DIR` also dumps each form's executables (M = 1) and counts the dot-product
instructions in them (vpdpbusd / vpdpwssd: AVX-512 VNNI; vpmaddubsw / vpmaddwd) against the
float ones (vfmadd*ps, vdpbf16ps) and the int->float converts (vcvtdq2ps).

    .venv/bin/python benchmarks/lab/bench_w8a8.py --rounds 5 --asm /tmp/w8a8-asm
    .venv/bin/python benchmarks/lab/bench_w8a8.py --rows 1 2 4 8 --forms int8 int4 mlx4
    .venv/bin/python benchmarks/lab/bench_w8a8.py --rows 1 --forms int8 w8a8-row --flags=--iree-llvmcpu-enable-ukernels=all
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from emitter import quant  # noqa: E402
from emitter.builder import Builder  # noqa: E402
from emitter.kernel_calls import block_matmul, target_isa  # noqa: E402
from emitter.layers import integer_project, project, quantized_blocks, quantized_project  # noqa: E402
from emitter.module import function, render  # noqa: E402
from emitter.quant import QuantizedWeight  # noqa: E402
from emitter.targets import target_flags  # noqa: E402
from kernels import build, q8_matmul  # noqa: E402
from runtime.artifact.iree_module import device_config, parameters_module  # noqa: E402
from runtime.bench.roof import memory_bandwidth_gbs  # noqa: E402
from runtime.vision import set_thread_count  # noqa: E402

WEIGHT_ONLY = ("int8", "int4", "mlx4")
KERNEL_FORMS = ("q8k", "q8k-avx2", "q4k", "q4k-avx2")  # kernels/q8_matmul.py
FORMS = (*WEIGHT_ONLY, "bf16", "w8a8-row", "w8a8-g32", "w8a8-g64", "w8a8-g256", "w4a8-row", *KERNEL_FORMS)
ASM_COUNTS = ("vpdpbusd", "vpdpwssd", "vpmaddubsw", "vpmaddwd", "vfmadd", "vdpbf16ps", "vcvtdq2ps", "vpmovsxbd",
              "vpmovsxbw")


def form_layout(form: str, k: int) -> tuple[int, int]:
    """(bits, group) of a form's weights; bf16: (16, k)."""
    if form == "bf16":
        return 16, k
    if form in WEIGHT_ONLY:
        return (8 if form == "int8" else 4), quant.GROUP
    if form in KERNEL_FORMS:
        return (4 if form.startswith("q4") else 8), q8_matmul.BLOCK
    bits = 8 if form.startswith("w8") else 4
    size = form.split("-")[1]
    return bits, k if size == "row" else int(size[1:])


def weight_bytes(form: str, n: int, k: int) -> int:
    """Bytes one projection reads: the weight in its bits plus its scales (f32; f16 in the
    kernel forms, as Q8_0 stores them)."""
    bits, group = form_layout(form, k)
    scales = 0 if bits == 16 else n * (k // group) * (2 if form in KERNEL_FORMS else 4)
    return n * k * bits // 8 + scales * (2 if form == "mlx4" else 1)


def kernel_object(form: str, objects: Path, source: Path = q8_matmul.SOURCE) -> Path:
    """The kernel object a kernel form links: the compile target's ISA, or AVX2, built from `source`."""
    isa = "avx2" if form.endswith("-avx2") else target_isa(tuple(target_flags("llvm-cpu")))
    return build.build_object(isa, objects, source)


def module_text(form: str, n: int, k: int, m: int, count: int, per_call: int, objects: Path | None = None,
                source: Path = q8_matmul.SOURCE) -> str:
    """`count` distinct weights as parameter globals, functions f0.. each projecting x by
    `per_call` of them; a kernel form (q8k, q4k) links its kernel object, built from `source` into
    `objects`."""
    bits, group = form_layout(form, k)
    functions, globals_ = [], []
    for f in range(count // per_call):
        b = Builder(activations="f32" if form == "bf16" else None if form in WEIGHT_ONLY + KERNEL_FORMS else "i8")
        x = b.argument("x", (m, k))
        results = []
        for i in range(f * per_call, (f + 1) * per_call):
            if form in KERNEL_FORMS:
                w = b.parameter(f"w{i}", (n * k * bits // 8,), "i8", f"w{i}")
                s = b.parameter(f"s{i}", (n * k // group,), "f16", f"s{i}")
                y = block_matmul(b, *quantized_blocks(b, x, f"p{i}_x"), w, s, kernel_object(form, objects, source), f"p{i}")
            elif bits == 16:
                w = b.parameter(f"w{i}", (n, k), "bf16", f"w{i}")
                y = project(b, x, w, hint=f"p{i}")
            else:
                biases = b.parameter(f"b{i}", (n, k // group), "f32", f"b{i}") if form == "mlx4" else None
                w = QuantizedWeight(b.parameter(f"q{i}", (k, n), quant.STORAGE_DTYPE[bits], f"q{i}"),
                                    b.parameter(f"s{i}", (n, k // group), "f32", f"s{i}"), biases)
                project_ = quantized_project if form in WEIGHT_ONLY else integer_project
                y = project_(b, x, w, f"p{i}")
            results.append((f"y{i - f * per_call}", y))
        functions.append(function(b, f"f{f}", results))
        globals_ += [g for g in b.globals if g not in globals_]  # a kernel's executable: once
    return render("bench", f"// {form} {n}x{k} M={m}\n", globals_, functions)


def weight_arrays(form: str, n: int, k: int, count: int, seed: int = 0):
    """(name, array) pairs of `count` random weights in the form's archive layout; one
    quantized weight reused with its bytes shifted, so that making them is fast but every
    weight's bytes are distinct in memory."""
    bits, group = form_layout(form, k)
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.02
    if bits == 16:
        base = (w.view(np.uint32) >> 16).astype(np.uint16)
        return [(f"w{i}", np.roll(base, i)) for i in range(count)]
    if form in KERNEL_FORMS:
        q, scales = quant.block_weight(w, bits)
        packed, packed_scales = q8_matmul.pack_weight(q, bits), q8_matmul.pack_scales(scales)
        return [pair for i in range(count) for pair in ((f"w{i}", np.roll(packed, i)), (f"s{i}", packed_scales))]
    q, scales = quant.stored(w, quant.Layout(bits, group))
    biases = [(f"b{i}", scales * -8) for i in range(count)] if form == "mlx4" else []
    return [pair for i in range(count) for pair in ((f"q{i}", np.roll(q, i)), (f"s{i}", scales))] + biases


def compile_form(text: str, flags: list[str], dump: Path | None = None) -> bytes:
    import iree.compiler as ic
    extra = [*target_flags("llvm-cpu"), *flags]
    if dump:
        extra += [f"--iree-hal-dump-executable-files-to={dump}"]
    return ic.compile_str(text, extra_args=extra)


def asm_counts(dump: Path) -> dict:
    """Dot-product, FMA and convert instructions in the dumped executables' assembly."""
    text = "\n".join(p.read_text() for p in dump.rglob("*.s"))
    return {name: len(re.findall(rf"\b{name}\w*", text)) for name in ASM_COUNTS}


class Loaded:
    """A compiled form on the device with its weights resident (a parameter index)."""

    def __init__(self, config, vmfb: bytes, arrays, functions: int):
        import iree.runtime as rt
        self.arrays = arrays  # referenced by the index: keep alive
        self.ctx = rt.SystemContext(config=config)
        self.ctx.add_vm_module(parameters_module(config, arrays))
        self.ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
        self.functions = [self.ctx.modules.bench[f"f{f}"] for f in range(functions)]

    def sweep(self, x) -> float:
        start = time.perf_counter()
        for fn in self.functions:
            out = fn(x)
        _ = np.asarray((out[0] if isinstance(out, (list, tuple)) else out).to_host())  # wait for the last
        return time.perf_counter() - start


def quality(n: int = 1024, k: int = 2048, m: int = 8, outliers: int = 8, seed: int = 0) -> dict:
    """relL2 from f32 x @ w.T of the integer forms' math in numpy: weights N(0, 0.02), x N(0, 1)
    with `outliers` input channels x20."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.02
    x = rng.standard_normal((m, k), dtype=np.float32)
    x[:, rng.choice(k, outliers, replace=False)] *= 20
    y = x @ w.T
    q, s = quant.block_weight(w)
    xq, dx, _ = quant.block_activations(x)
    forms = {"q8k": q8_matmul.reference(xq, dx, q, s),
             "q4k": q8_matmul.reference(xq, dx, *quant.block_weight(w, 4)),
             "w8a8-row": quant.integer_matmul(x, *quant.quantize(w, quant.Layout(8, k))),
             "w8a8-g32": quant.integer_matmul(x, *quant.quantize(w, quant.Layout(8, 32))),
             "int8": x @ quant.dequantize(*quant.quantize(w, quant.Layout(8)), quant.GROUP).T,
             "q8_0 weights, f32 x": x @ (q * np.repeat(s.astype(np.float32), q8_matmul.BLOCK, axis=1)).T}
    return {form: float(np.linalg.norm(v - y) / np.linalg.norm(y)) for form, v in forms.items()}


def save(directory: Path, form: str, m: int, vmfb: bytes, arrays) -> None:
    import iree.runtime as rt
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{form}-m{m}.vmfb").write_bytes(vmfb)
    if not (directory / f"{form}.irpa").exists():
        rt.save_archive_file(dict(arrays), str(directory / f"{form}.irpa"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=6144)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 512])
    p.add_argument("--forms", nargs="+", default=list(FORMS))
    p.add_argument("--megabytes", type=float, default=400)
    p.add_argument("--per-call", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--flags", nargs="*", default=[], help="extra iree-compile flags")
    p.add_argument("--asm", metavar="DIR", help="dump each form's executables (M = 1) here and count instructions")
    p.add_argument("--objects", default="build/kernels", help="where the kernel forms' kernel objects are built")
    p.add_argument("--quality", action="store_true", help="print the integer forms' relL2 from f32 (numpy), no timing")
    p.add_argument("--save", metavar="DIR", help="write each form's vmfb, weights and x here")
    p.add_argument("--baseline", metavar="C_FILE", type=Path,
                   help="another version of kernels/q8_matmul.c (e.g. `git show main:kernels/q8_matmul.c`): each "
                        "kernel form also runs as FORM@base with it, alternating with the others")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.quality:
        out = quality()
        for form, rel in out.items():
            print(f"{form:<20} relL2 from f32 {rel:.3g}")
        return out
    set_thread_count(args.threads)
    config = device_config("llvm-cpu")
    out = {"n": args.n, "k": args.k, "threads": args.threads, "flags": args.flags,
           "bandwidth_before": memory_bandwidth_gbs(args.threads), "rows": {}, "asm": {}}
    rng = np.random.default_rng(1)
    runs = {form: (form, q8_matmul.SOURCE) for form in args.forms}  # name -> (form, kernel source)
    if args.baseline:
        runs.update({f"{form}@base": (form, args.baseline) for form in args.forms if form in KERNEL_FORMS})
    for m in args.rows:
        loaded = {}
        for name, (form, source) in runs.items():
            per = weight_bytes(form, args.n, args.k)
            count = math.ceil(args.megabytes * 1e6 / per / args.per_call) * args.per_call
            text = module_text(form, args.n, args.k, m, count, args.per_call, Path(args.objects), source)
            dump = None
            if args.asm and m == 1:
                dump = Path(args.asm) / name
                dump.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            vmfb = compile_form(text, args.flags, dump)
            compiled = time.perf_counter() - start
            if dump:
                out["asm"][name] = asm_counts(dump)
            arrays = weight_arrays(form, args.n, args.k, count)
            loaded[name] = (Loaded(config, vmfb, arrays, count // args.per_call), count, per)
            if args.save:
                save(Path(args.save), name, m, vmfb, arrays)
            print(f"M={m} {name}: {count} weights, {count * per / 1e6:.0f} MB, compiled in {compiled:.1f} s",
                  flush=True)
        x = rng.standard_normal((m, args.k), dtype=np.float32)
        if args.save:
            np.save(Path(args.save) / f"x-m{m}.npy", x)
        times = {form: [] for form in loaded}
        for form, (mod, _, _) in loaded.items():
            mod.sweep(x)  # warm-up: module initialization, packing
        for _ in range(args.rounds):
            for form, (mod, count, _) in loaded.items():
                times[form].append(mod.sweep(x) / count)
        out["rows"][m] = {}
        for form, (_, count, per) in loaded.items():
            s = statistics.median(times[form])
            out["rows"][m][form] = {"ms": s * 1e3, "gbs": per / s / 1e9, "min_ms": min(times[form]) * 1e3}
            print(f"M={m:<4} {form:<14} {s * 1e3:7.3f} ms/projection  {per / s / 1e9:6.1f} GB/s of weights "
                  f"(min {min(times[form]) * 1e3:.3f} ms)", flush=True)
        del loaded
    out["bandwidth_after"] = memory_bandwidth_gbs(args.threads)
    out["loadavg"] = os.getloadavg()
    for form, counts in out["asm"].items():
        print(f"asm {form:<10} " + " ".join(f"{k}={v}" for k, v in counts.items() if v))
    print(f"read bandwidth {out['bandwidth_before']['read_gbs']:.1f} / {out['bandwidth_after']['read_gbs']:.1f} "
          f"GB/s before/after; load average {out['loadavg'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
