"""Hand-written Q8_0 x Q8_0 and Q4_0 x Q8_0 projections (kernels/q8_matmul.c) in IREE-compiled graphs.

llama.cpp's Q8_0 math: weights and activations in blocks of 32 inputs, a scale per block
on both sides (the weights' f16), each block's int8 x int8 dot product summed exactly in int32
and scaled into an f32 accumulator (`reference`); Q4_0 x Q8_0 the same with the weights in
4 bits (-8..7, Q4_0's 18 bytes a block of 32 with its f16 scale), and 6 bits (-32..31, 26 bytes
a block: q4_0's lm_head table, where llama.cpp keeps Q6_K), one kernel per weight width
(`ENTRIES`) over the same loops and activations. IREE 3.13's own code for the grouped integer forms runs 3-10x
slower than one group (docs/performance.md, "Integer activations: w8a8"), so this module links
a C kernel into IREE's executables instead, through the embedded-ELF object mechanism:

- `build_object` compiles kernels/q8_matmul.c with the system C compiler (`$CC`, else cc, gcc
  or clang) into a bare-metal ELF object, once per source, ISA and compiler (cached on disk,
  named by their hash; `make install` builds every ISA's: `python -m kernels`);
  AVX-512 VNNI (vpdpbusd) or AVX2 (vpmaddubsw), as `target_isa` picks from what iree-compile
  resolves the target to;
- `executable` writes a `stream.executable` whose `hal.executable.objects` names that object
  (a graph names it by file name alone, found through `search_flags` at compile time, so that
  the graph, and so the artifact identity, is the same whatever folder holds it) and whose one export calls the C function once per workgroup of 128 outputs;
  iree-compile links the object into the executable's embedded ELF (iree-lld), so the vmfb
  is self-contained: the IREE runtime needs no plugin, flag or library to run it;
- `block_project` emits the projection into a `Builder` graph: x quantized per row and block
  of 32 in StableHLO (IREE's own code), then a `flow.dispatch` of the executable;
  `block_rows` gathers rows of such a weight out of its tiles (the embedding table, which
  a tied lm_head multiplies through the kernel), each row's blocks times their f16 scales.

Weights are stored packed in 16-output tiles (`pack_weight`, `pack_scales`): the kernel reads
64 bytes of 16 outputs x 4 inputs per step, one vpdpbusd against 4 broadcast bytes of x; at 4
bits one 64-byte load holds two steps (low nibbles, high nibbles), unpacked by an and and a shift.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from emitter import quant
from emitter.builder import Builder, TensorType, Value
from emitter.layers import quantize_groups

SOURCE = Path(__file__).with_name("q8_matmul.c")
BLOCK = quant.BLOCK  # inputs per scale, both sides (Q8_0)
TILE = quant.TILE  # outputs per packed weight tile
OBJECTS_ENV = "QWEN3VL_KERNEL_DIR"  # where `default_objects` keeps the built objects
OUTPUTS_PER_WORKGROUP = 128  # a multiple of 2 * TILE (the AVX-512 loop takes two tiles at once)
# weight bits -> the C function: Q8_0, Q4_0, and the 6-bit table of q4_0's lm_head (`pack_weight`)
ENTRIES = {8: "q8_matmul_workgroup", 6: "q6_matmul_workgroup", 4: "q4_matmul_workgroup"}
# Bare-metal object flags (IREE's embedded ELF: no libc, no TLS, position independent); no FMA
# contraction, so that the float math is the documented order (`reference`, bit for bit).
COMMON_FLAGS = ("-std=c17", "-O3", "-ffreestanding", "-fPIC", "-fvisibility=hidden", "-fno-plt",
                "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-exceptions",
                "-ffunction-sections", "-fdata-sections", "-ffp-contract=off")
ISA_FLAGS = {
    "avx512vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mbmi2"),
}
# LLVM target features each ISA's object needs, best first.
ISA_FEATURES = {"avx512vnni": ("+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni"), "avx2": ("+avx2",)}


class KernelError(ValueError):
    """A shape, weight or target the kernel cannot take, or an object that did not build."""


def check_shape(m: int, n: int, k: int) -> None:
    if m < 1:
        raise KernelError(f"q8_matmul: rows {m}: expected at least 1")
    if n % (2 * TILE) or n == 0:
        raise KernelError(f"q8_matmul: outputs {n}: expected a positive multiple of {2 * TILE}")
    if k % BLOCK or k == 0:
        raise KernelError(f"q8_matmul: inputs {k}: expected a positive multiple of {BLOCK}")


def isa_for_features(features: str) -> str:
    """The best ISA whose features an LLVM `cpu_features` string ("+avx2,+fma,...") has."""
    have = set(features.split(","))
    for isa, needed in ISA_FEATURES.items():
        if have.issuperset(needed):
            return isa
    raise KernelError(f"q8_matmul: target features {features[:80]!r}...: expected AVX2 or AVX-512 VNNI")


def target_isa(flags: tuple[str, ...]) -> str:
    """The ISA of the object to link for iree-compile `flags` (as they resolve on this machine)."""
    from emitter.identity import resolved_device_target
    device = resolved_device_target(tuple(flags))
    found = re.search(r'\bcpu_features = "([^"]*)"', device)
    if '"embedded-elf-x86_64"' not in device or not found:
        raise KernelError(f"q8_matmul: target {device[:120]!r}...: expected an x86-64 llvm-cpu embedded ELF target")
    return isa_for_features(found.group(1))


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


def build_object(isa: str, out_dir: str | os.PathLike, source: Path = SOURCE) -> Path:
    """`source` (kernels/q8_matmul.c, another kernel's C file, or a benchmark's baseline version
    of one) compiled for `isa` into `out_dir`, named by the source's stem and a hash of the
    source, flags and compiler (so a stale object is never reused); written whole or not at all."""
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


def object_name(isa: str, source: Path = SOURCE) -> str:
    """The file name of `source`'s object for `isa`, built into `default_objects()` if not
    there (by `make install`, else on first use); the name alone, so that a graph naming it does
    not depend on the folder (iree-compile finds it: `search_flags`)."""
    return build_object(isa, default_objects(), source).name


def object_executable(obj: str | os.PathLike, export: str, entry: str, bindings: dict[str, str],
                      sizes: dict[str, int], workgroups: str, dims: tuple[str, ...] = ()) -> str:
    """A `stream.executable` @`export` linking `obj` (a path, or a file name `search_flags`
    finds) whose function calls the C function `entry` once per workgroup with each binding
    (name -> memref type; a run-time dim written after it, `memref<?xi32>{%span}`), then the
    `sizes` (index constants) and the workgroup id. The last binding is the result; `dims`
    are the dispatch's index operands (after the others, as `Builder.dispatch` passes them).
    `workgroups`: the export's workgroup-count region over the workload `%n`, ending in
    `stream.return`."""
    path = str(obj).replace("\\", "\\\\").replace('"', '\\"')
    *operands, result = bindings
    decl = ", ".join([*(m.split("{")[0] for m in bindings.values()), *["index"] * (len(sizes) + 1)])
    args = ", ".join([*(f"%b{n}: !stream.binding" for n in operands), *(f"%{d}: index" for d in dims),
                      f"%b{result}: !stream.binding"])
    lines = [*(f"%{n} = arith.constant {v} : index" for n, v in sizes.items()),
             "%wg = hal.interface.workgroup.id[0] : index",
             *(f"%{n} = stream.binding.subspan %b{n}[%c0] : !stream.binding -> {m}" for n, m in bindings.items()),
             f"func.call @{entry}({', '.join(f'%{n}' for n in [*bindings, *sizes, 'wg'])}) : ({decl}) -> ()"]
    body = "\n          ".join(lines)
    return f"""stream.executable private @{export} attributes {{
    hal.executable.objects = #hal.executable.objects<{{
      #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{path}"}}>]
    }}>
  }} {{
    stream.executable.export public @{export} workgroups(%n: index) -> (index, index, index) {{
      {workgroups}
    }}
    builtin.module {{
      func.func private @{entry}({decl}) attributes {{hal.import.static}}
      func.func @{export}({args}) {{
          %c0 = arith.constant 0 : index
          {body}
          return
      }}
    }}
  }}"""


# -- weights -----------------------------------------------------------------
def quantize_weight(w: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, K] int8, scales [N, K / 32] f16) of an f32 weight [N, K], each block's f16 scale
    searched for the least squared error (`quant.searched`, as int4's). 8 bits: q in
    [-127, 127] (llama.cpp's Q8_0 bytes, 8.5 bits a weight; its rule is the search's max / 127
    candidate); 4 bits: q in [-8, 7] (Q4_0's bytes: 4.5 bits a weight); 6 bits the same in
    [-32, 31] (6.5 bits a weight, as llama.cpp's Q6_K's 6.56)."""
    return quant.quantize(w, quant.Layout(check_bits(bits), BLOCK, scales="f16", searched=True, packed=True))


def check_bits(bits: int) -> int:
    if bits not in ENTRIES:
        raise KernelError(f"q8_matmul: weight bits {bits}: expected one of {', '.join(map(str, ENTRIES))}")
    return bits


def pack_weight(q: np.ndarray, bits: int = 8) -> np.ndarray:
    """q [N, K] int8 as the kernel reads it, flat: 8 bits [N/16, K/4, 16, 4]; 4 bits the codes
    q + 8 in bytes [N/16, K/32, 4, 16, 4], inputs 4s..4s+3 of a block in the low nibbles and
    16+4s..16+4s+3 in the high ones; 6 bits the codes q + 32, each tile's block 384 bytes: their
    low 4 bits as the 4-bit layout's 256, then their top 2 bits in [2, 16, 4] bytes, step s's
    (inputs 4s..4s+3) in byte row s % 2 at bits 2 (s // 2) (kernels/q8_matmul.c)."""
    n, k = q.shape
    check_shape(1, n, k)
    low = -(1 << (check_bits(bits) - 1)) + (bits == 8)  # -127 at 8 bits (the AVX2 sign trick), -8 at 4
    if q.dtype != np.int8 or (q < low).any() or (q > (1 << (bits - 1)) - 1).any():
        raise KernelError(f"q8_matmul: weight: expected int8 values in [{low}, {(1 << (bits - 1)) - 1}]")
    if bits == 8:
        return np.ascontiguousarray(q.reshape(n // TILE, TILE, k // 4, 4).transpose(0, 2, 1, 3)).reshape(-1)
    codes = (q + np.int8(1 << (bits - 1))).view(np.uint8).reshape(n // TILE, TILE, k // BLOCK, 8, 4)
    steps = codes.transpose(0, 2, 3, 1, 4)  # tile, block, step, output, input
    nibbles = steps & np.uint8(0xF)
    parts = [nibbles[:, :, :4] | (nibbles[:, :, 4:] << np.uint8(4))]  # [tiles, blocks, 4, 16, 4]
    if bits == 6:
        top = (steps >> np.uint8(4)).reshape(n // TILE, k // BLOCK, 4, 2, TILE, 4)  # step 2r + h at [r, h]
        parts.append(np.bitwise_or.reduce([top[:, :, r] << np.uint8(2 * r) for r in range(4)]))
    return np.concatenate(parts, axis=2).reshape(-1).view(np.int8)


def pack_scales(scales: np.ndarray) -> np.ndarray:
    """Weight scales [N, K/32] f16 as the kernel reads them: [N/16, K/32, 16], flat."""
    n, blocks = scales.shape
    if scales.dtype != np.float16:
        raise KernelError(f"q8_matmul: weight scales of {scales.dtype}: expected float16 (Q8_0's)")
    return np.ascontiguousarray(scales.reshape(n // TILE, TILE, blocks).transpose(0, 2, 1)).reshape(-1)


# -- the math, in numpy ------------------------------------------------------
def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xq [M, K] int8, scales [M, K/32] f32, block sums of xq [M, K/32] int32) of f32 x,
    as the graph computes them (`quant.quantize_activations` in blocks of 32)."""
    xq, dx = quant.quantize_activations(x, BLOCK)
    m, k = xq.shape
    return xq, dx, xq.reshape(m, k // BLOCK, BLOCK).astype(np.int32).sum(axis=2, dtype=np.int32)


def reference(xq: np.ndarray, dx: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """y [M, N] f32 as the kernel computes it at either width (q [N, K] int8, unpacked), bit for
    bit: per block b in order,
    acc += (f32(scales[:, b]) * dx[:, b]) * f32(i32 dot of the block), each op rounded to f32."""
    m, k = xq.shape
    blocks = k // BLOCK
    sums = np.einsum("mbj,nbj->mnb", xq.reshape(m, blocks, BLOCK).astype(np.int32),
                     q.reshape(-1, blocks, BLOCK).astype(np.int32), dtype=np.int32)
    acc, scales = np.zeros((m, q.shape[0]), np.float32), scales.astype(np.float32)
    for b in range(blocks):
        acc = acc + (scales[None, :, b] * dx[:, b:b + 1]) * sums[:, :, b].astype(np.float32)
    return acc


# -- MLIR --------------------------------------------------------------------
def executable_name(m: int, n: int, k: int, bits: int = 8) -> str:
    return f"q{bits}_matmul_{m}x{n}x{k}"


def executable(obj: str | os.PathLike, m: int, n: int, k: int, bits: int = 8) -> str:
    """A `stream.executable` linking `obj` (a path, or a file name `search_flags` finds) whose
    export (`executable_name`: unique in a module whose executables IREE links into one)
    computes y [M, N] from
    (xq [M, K] i8, dx [M, K/32] f32, xs [M, K/32] i32, packed w [N*K*bits/8] i8, packed scales
    [N*K/32] f16): one workgroup per 128 outputs (fewer in the last), each a call of the C
    function of the weights' `bits` (`ENTRIES`)."""
    check_shape(m, n, k)
    g, entry, export = k // BLOCK, ENTRIES[check_bits(bits)], executable_name(m, n, k, bits)
    shapes = {"x": (m * k, "i8"), "dx": (m * g, "f32"), "xs": (m * g, "i32"), "w": (n * k * bits // 8, "i8"),
              "dw": (n * g, "f16"), "y": (m * n, "f32")}
    workgroups = f"""%x = affine.apply affine_map<()[s0] -> (s0 ceildiv {OUTPUTS_PER_WORKGROUP})>()[%n]
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index"""
    return object_executable(obj, export, entry, {name: f"memref<{size}x{t}>" for name, (size, t) in shapes.items()},
                             {"m": m, "n": n, "k": k, "tiles": OUTPUTS_PER_WORKGROUP // TILE}, workgroups)


def quantized_blocks(b: Builder, x: Value, hint: str) -> tuple[Value, Value, Value]:
    """(xq [M, K] i8, scales [M, K/32] f32, block sums [M, K/32] i32) of f32 x [M, K] in the
    graph: `emitter.layers.quantize_groups` per row and block of 32 (`quantize_x`)."""
    m, k = x.shape
    xq3, dx = quantize_groups(b, b.reshape(x, (m, k // BLOCK, BLOCK), hint=hint + "_blocks"), hint)
    xs = b.reduce(b.convert(xq3, "i32", hint=hint + "_i32"), [2], "add", hint=hint + "_sums")
    return b.reshape(xq3, (m, k), hint=hint + "_i8"), dx, xs


def block_project(b: Builder, x: Value, w: Value, scales: Value, obj: str | os.PathLike, hint: str = "q8") -> Value:
    """x [M, K] f32 @ W.T -> [M, N] f32 through the kernel; `w` the packed weight [N*K*bits/8] i8
    (`pack_weight`: 8, 6 or 4 bits, told by its size), `scales` its packed scales [N*K/32] f16
    (`pack_scales`), `obj` the object `build_object` made for the graph's target."""
    m, k = x.shape
    n = scales.shape[0] * BLOCK // k
    bits = 8 * w.shape[0] // max(n * k, 1)
    if (bits not in ENTRIES or w.type != TensorType((n * k * bits // 8,), "i8")
            or scales.type != TensorType((n * k // BLOCK,), "f16")):
        sizes = " or ".join(str(TensorType((n * k * width // 8,), "i8")) for width in ENTRIES)
        raise KernelError(f"q8_matmul {hint}: weight {w.type} and scales {scales.type}: expected {sizes} and "
                          f"{TensorType((n * k // BLOCK,), 'f16')} for {k} inputs")
    xq, dx, xs = quantized_blocks(b, x, hint + "_x")
    name = executable_name(m, n, k, bits)
    return b.dispatch(name, executable(obj, m, n, k, bits), name, [xq, dx, xs, w, scales],
                      TensorType((m, n), "f32"), workload=n, hint=hint)


def block_rows(b: Builder, w: Value, scales: Value, rows: Value, hint: str = "q8_rows") -> Value:
    """Rows `rows` [T] i32 of a packed weight (w [N, K * bits / 8] i8 and scales [N, K/32] f16 in
    the tile order of `pack_weight`, `pack_scales`; 8, 6 or 4 bits) as f32 [T, K]: each block of
    32 times its scale (llama.cpp's `dequantize_row_q8_0`), gathered straight out of the tiles.
    A tile's block is `bits` loads of 64 bytes (16 outputs x 4 bytes), so one gather of (tile,
    output) points takes each row's [K/32, bits, 4] bytes; the codes are unpacked from them."""
    n, k = scales.shape[0], scales.shape[1] * BLOCK
    bits = check_bits(8 * w.shape[1] // k)
    tile = b.constant(TILE, rows.shape, "i32", hint=hint + "_tile")
    at = [b.reshape(op(rows, tile, hint=hint + "_at"), (rows.shape[0], 1), hint=hint + "_at")
          for op in (b.divide, b.remainder)]
    points = b.concatenate(at, 1, hint=hint + "_points")  # (tile, output within it) of each row
    t, blocks = rows.shape[0], k // BLOCK
    loads = b.gather_points(b.reshape(w, (n // TILE, blocks, bits, TILE, 4), hint=hint + "_tiles"), [0, 3], points,
                            hint=hint + "_q")  # [T, K/32, bits, 4]
    q = loads if bits == 8 else unpacked_codes(b, loads, bits, hint)  # [T, K/32, 8 steps, 4] i8
    d = b.gather_points(b.reshape(scales, (n // TILE, blocks, TILE), hint=hint + "_tile_scales"), [0, 2],
                        points, hint=hint + "_scales")  # [T, K/32]
    values = b.convert(b.reshape(q, (t, blocks, BLOCK), hint=hint + "_blocks"), "f32", hint=hint + "_wide")
    scaled = b.multiply(values, b.broadcast_in_dim(b.convert(d, "f32", hint=hint + "_scales_f32"), values.shape,
                                                   [0, 1], hint=hint + "_scales"), hint=hint)
    return b.reshape(scaled, (t, k), hint=hint)


def unpacked_codes(b: Builder, loads: Value, bits: int, hint: str) -> Value:
    """The signed values [T, B, 8 steps, 4] i8 of 4- or 6-bit rows' bytes [T, B, bits, 4] as
    `pack_weight` lays them out: loads 0-3 the codes' low nibbles (step l low, step l + 4 high),
    at 6 bits loads 4-5 their top 2 bits (step 2r + h in load 4 + h at bits 2r); minus the offset."""
    t, blocks = loads.shape[:2]

    def part(x, shift, mask, name):  # (x >> shift) & mask, bytewise (logical: codes are unsigned)
        at = b.shift_right_logical(x, b.constant(shift, x.shape, "i8", hint=hint + "_shift"), hint=hint + name)
        return b.bit_and(at, b.constant(mask, x.shape, "i8", hint=hint + "_mask"), hint=hint + name)

    low = b.slice(loads, (0, 0, 0, 0), (t, blocks, 4, 4), hint=hint + "_low_loads")
    codes = b.concatenate([part(low, 0, 0xF, "_low"), part(low, 4, 0xF, "_high")], 2, hint=hint + "_nibbles")
    if bits == 6:
        top = b.slice(loads, (0, 0, 4, 0), (t, blocks, 6, 4), hint=hint + "_top_loads")  # [T, B, 2, 4]
        pairs = [b.reshape(part(top, 2 * r, 3, "_top"), (t, blocks, 1, 2, 4), hint=hint + "_top")
                 for r in range(4)]
        top = b.reshape(b.concatenate(pairs, 2, hint=hint + "_tops"), (t, blocks, 8, 4), hint=hint + "_tops")
        codes = b.bit_or(codes, b.shift_left(top, b.constant(4, top.shape, "i8", hint=hint + "_shift"),
                                             hint=hint + "_top"), hint=hint + "_codes")
    offset = b.constant(1 << (bits - 1), codes.shape, "i8", hint=hint + "_offset")
    return b.subtract(codes, offset, hint=hint + "_values")
