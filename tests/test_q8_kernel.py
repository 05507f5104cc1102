"""The hand-written Q8_0 x Q8_0 and Q4_0 x Q8_0 kernels (kernels/q8_matmul.c, linked into IREE's
executables by emitter/kernel_calls.py): compiled by the real iree-compile, run by the IREE runtime
(python and iree-run-module), bit for bit against numpy's integer math of the same order
(`q8_matmul.reference`), at 8, 6 and 4 weight bits, for the host's best ISA (AVX-512 VNNI here) and
for x86-64-v3 code (AVX2), at 1 to 11 rows, and GGUF's Q6_K (its int8 scales per 16 and f16 d per
256) through the q6k entry, at 1, 3 and 6 rows; bad shapes and weights get a one-line error; a failed
object build leaves nothing behind. The install step (`python -m kernels`) builds every
kernel's object (this one's and kernels/decode_attention.c's) for every ISA once, and a
missing C compiler is one line; a graph naming the object by file name compiles from
whatever folder `$QWEN3VL_KERNEL_DIR` names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from emitter.builder import Builder, BuildError, TensorType
from emitter.targets import target_flags
from emitter.vision import render_module
from emitter import kernel_calls as calls
from emitter.layers import block_project, quantized_blocks
from emitter.quant import BlockWeight, block_activations, block_weight
from kernels import build
from kernels import q8_matmul as q8
from runtime.artifact.compiler import CompileError, compile_mlir
from runtime.artifact.iree_module import LoadedModule

K, N = 512, 224  # a last workgroup of 96 outputs


IREE_RUN_MODULE = Path(sys.executable).parent / "iree-run-module"
ROOT = Path(__file__).resolve().parent.parent


def graph_vmfb(m: int, target: str, objects, bits: int = 8, by_name: bool = False) -> bytes:
    """x [M, K] f32, the packed weight (`bits` wide) and scales in; the projection and x's
    quantized blocks out; `by_name`: the graph names the object by file name (as the text
    module does)."""
    obj = build.build_object(calls.target_isa(tuple(target_flags(target))), objects, q8.SOURCE)
    obj = obj.name if by_name else obj
    b = Builder()
    x = b.argument("x", (m, K))
    w, s = b.argument("w", (N * K * bits // 8,), "i8"), b.argument("s", (N * K // q8.BLOCK,), "f16")
    y = block_project(b, x, BlockWeight(b.reshape(w, (N, K * bits // 8)), b.reshape(s, (N, K // q8.BLOCK)), obj), "q8")
    xq, dx, xs = quantized_blocks(b, x, "check")
    text = render_module(b, [("y", y), ("xq", xq), ("dx", dx), ("xs", xs)], title="q8 kernel test")
    return compile_mlir(text, target)


def weights(seed: int, bits: int = 8):
    """(q, scales) of a random [N, K] weight, Q8_0's grid (8 bits), the 6-bit one or Q4_0's (4)."""
    return block_weight(np.random.default_rng(seed).standard_normal((N, K), dtype=np.float32), bits)


@pytest.mark.parametrize("bits", [8, 6, 4])
@pytest.mark.parametrize("target", ["llvm-cpu", "llvm-cpu-x86-64-v3"])
@pytest.mark.parametrize("m", [1, 4, 6, 11])
def test_projection_is_numpys_integer_math_bit_for_bit(tmp_path, target, m, bits):
    """Rows of 1 (the one-row loops), 4 (one pass of the 4-row loop; AVX2 at 6 bits takes 3 rows a
    pass: a pass and a remainder of 1), 6 (a pass and a remainder of 2, or two passes) and 11
    (passes and a remainder of 3, or of 2);
    a row of zeros and a row with one large value among them; at 4 bits every code, -8..7, occurs (at
    6 bits every one of -32..31: AVX2's one-row loop sums a half block's products in i16)."""
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, K), dtype=np.float32)
    x[-1, 7] = 40.0
    if m > 1:
        x[0] = 0
    q, scales = weights(m, bits)
    assert bits == 8 or set(np.unique(q)) == set(range(-(1 << bits - 1), 1 << bits - 1))
    module = LoadedModule(graph_vmfb(m, target, tmp_path, bits))
    y, xq, dx, xs = module(x, q8.pack_weight(q, bits), q8.pack_scales(scales))
    ref_xq, ref_dx, ref_xs = block_activations(x)
    assert np.array_equal(xq, ref_xq) and np.array_equal(dx, ref_dx) and np.array_equal(xs, ref_xs)
    assert np.array_equal(y, q8.reference(ref_xq, ref_dx, q, scales))
    if m > 1:
        assert not y[0].any()


@pytest.mark.parametrize("target", ["llvm-cpu", "llvm-cpu-x86-64-v3"])
@pytest.mark.parametrize("m", [1, 5])
def test_6_bit_sums_at_their_extremes_are_exact(tmp_path, target, m):
    """Every block's x at +-127 against weights all 31, all -32 or alternating: the sums' largest
    magnitudes (8 x 32 x 127 an i16 half of AVX2's one-row loop, products of 2 x 63 x 127 wrapping
    on their way there), bit for bit."""
    signs = np.array([1, -1, 1, 1, -1, -1, 1, -1] * (K // 8), np.float32)
    signs[32:64] = 1  # a whole block of one sign
    x = np.stack([signs * (-1) ** r for r in range(m)])  # row 1 the negation of row 0
    matched = np.where(signs > 0, np.int8(31), np.int8(-32))  # w x at its largest with row 0, least with row 1
    q = np.stack([np.full(K, 31, np.int8), np.full(K, -32, np.int8), matched, -1 - matched] * (N // 4))
    scales = np.full((N, K // q8.BLOCK), 0.5, np.float16)
    y = LoadedModule(graph_vmfb(m, target, tmp_path, 6))(x, q8.pack_weight(q, 6), q8.pack_scales(scales))[0]
    xq, dx, _ = block_activations(x)
    assert np.abs(xq).min() == 127
    assert np.array_equal(y, q8.reference(xq, dx, q, scales))


K6 = 768  # Q6_K: three super-blocks of 256


def q6_k_vmfb(m: int, target: str, objects) -> bytes:
    """`graph_vmfb` for a Q6_K weight [N, K6] (`q8.pack_q6_k`'s bytes and its d [N, K6/256] f16 in)."""
    obj = build.build_object(calls.target_isa(tuple(target_flags(target))), objects, q8.SOURCE)
    b = Builder()
    x = b.argument("x", (m, K6))
    row = K6 // q8.SUPER * q8.Q6_K_ROW_BYTES
    w, d = b.argument("w", (N * row,), "i8"), b.argument("d", (N * K6 // q8.SUPER,), "f16")
    y = block_project(b, x, BlockWeight(b.reshape(w, (N, row)), b.reshape(d, (N, K6 // q8.SUPER)), obj), "q6k")
    assert BlockWeight(b.reshape(w, (N, row)), b.reshape(d, (N, K6 // q8.SUPER)), obj).shape == (N, K6)
    return compile_mlir(render_module(b, [("y", y)], title="q6_k kernel test"), target)


def q6_k_weight(seed: int):
    """(codes q [N, K6] int8 -32..31, every one; sub-scales sc int8 [N, K6/16], -128 and 127 among
    them; d f16 [N, K6/256]) of a random Q6_K weight."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-32, 32, (N, K6), dtype=np.int8)
    sc = rng.integers(-128, 128, (N, K6 // q8.SUB), dtype=np.int8)
    sc[0, :2], q[0, :32] = (-128, 127), -32
    d = (rng.uniform(0.5, 2, (N, K6 // q8.SUPER)) * 2.0 ** -12).astype(np.float16)
    return q, sc, d


@pytest.mark.parametrize("target", ["llvm-cpu", "llvm-cpu-x86-64-v3"])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_q6_k_projection_is_numpys_integer_math_bit_for_bit(tmp_path, target, m):
    """GGUF's Q6_K through the q6k entry (`q8.reference_q6_k`: sub-scales per 16 combined in
    int32, d per 256), bit for bit: one row (the one-row loops, prefetched), 3 (AVX-512's
    remainder of 3, AVX2's pass of 2 and remainder of 1) and 6 (a pass of 4 and a remainder of 2
    on AVX-512, three passes of 2 on AVX2), 7 tiles in 2 workgroups, 3
    super-blocks; x at +-127 in one block against codes -32 and sub-scale -128 (the largest sum)."""
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, K6), dtype=np.float32)
    x[0, :32] = 1.0
    x[-1, 40] = 50.0
    q, sc, d = q6_k_weight(m)
    assert set(np.unique(q)) == set(range(-32, 32))
    y = LoadedModule(q6_k_vmfb(m, target, tmp_path))(x, q8.pack_q6_k(q, sc), q8.pack_scales(d))[0]
    xq, dx, _ = block_activations(x)
    assert np.abs(xq[0, :32]).min() == 127
    ref = q8.reference_q6_k(xq, dx, q, sc, d)
    assert np.array_equal(y, ref)
    w = d.astype(np.float32).repeat(q8.SUPER, 1) * sc.astype(np.float32).repeat(q8.SUB, 1) * q
    assert np.abs(ref - (xq * dx.repeat(q8.BLOCK, 1)) @ w.T).max() <= 1e-4 * np.abs(ref).max()  # the same numbers


def test_q6_k_bytes_are_its_codes_and_sub_scales():
    """A tile's super-block: its 8 blocks' codes in the 6-bit layout, then the int8 sub-scales
    [8 blocks, 2 halves, 16 outputs]; 208 bytes a row of 256 with Q6_K's d beside them (210)."""
    q, sc, d = q6_k_weight(2)
    packed = q8.pack_q6_k(q, sc).view(np.uint8).reshape(N // q8.TILE, K6 // q8.SUPER, -1)
    assert packed.shape[2] == 3328 and (packed.size + 2 * d.size) * 256 == 210 * q.size
    codes = packed[:, :, :3072].reshape(-1).view(np.int8)
    assert np.array_equal(codes, q8.pack_weight(q, 6).reshape(N // q8.TILE, K6 // q8.BLOCK, 384)
                          .reshape(N // q8.TILE, K6 // q8.SUPER, 3072).reshape(-1))
    scales = packed[:, :, 3072:].view(np.int8).reshape(N // q8.TILE, K6 // q8.SUPER, 16, q8.TILE)
    assert np.array_equal(scales.transpose(0, 3, 1, 2).reshape(N, -1), sc)
    with pytest.raises(build.KernelError, match=r"^q8_matmul q6_k: .*expected K a multiple of 256"):
        q8.pack_q6_k(q[:, :512 + 32], sc[:, :34])


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_iree_run_module_runs_the_linked_kernel(tmp_path, bits):
    """The vmfb carries the kernel: IREE's own iree-run-module runs it, no plugin or flag."""
    m = 2
    x = np.random.default_rng(7).standard_normal((m, K), dtype=np.float32)
    q, scales = weights(7, bits)
    (tmp_path / "q8.vmfb").write_bytes(graph_vmfb(m, "llvm-cpu", tmp_path / "objects", bits))
    for name, array in (("x", x), ("w", q8.pack_weight(q, bits)), ("s", q8.pack_scales(scales))):
        np.save(tmp_path / f"{name}.npy", array)
    subprocess.run([str(IREE_RUN_MODULE), "--device=local-task", f"--module={tmp_path / 'q8.vmfb'}", "--function=main",
                    *[f"--input=@{tmp_path / name}.npy" for name in "xws"],
                    *[f"--output=@{tmp_path / name}.npy" for name in ("y", "xq", "dx", "xs")]],
                   check=True, capture_output=True)
    xq, dx, _ = block_activations(x)
    assert np.array_equal(np.load(tmp_path / "y.npy"), q8.reference(xq, dx, q, scales))


def test_a_graph_naming_the_object_compiles_from_the_kernel_folder(tmp_path, monkeypatch):
    """The object by file name, in a folder of `$QWEN3VL_KERNEL_DIR`: compile_mlir finds it there
    (and only there: the graph holds no folder)."""
    monkeypatch.setenv(build.OBJECTS_ENV, str(tmp_path / "elsewhere"))
    m = 3
    x = np.random.default_rng(3).standard_normal((m, K), dtype=np.float32)
    q, scales = weights(3)
    y = LoadedModule(graph_vmfb(m, "llvm-cpu", tmp_path / "elsewhere", by_name=True))(
        x, q8.pack_weight(q), q8.pack_scales(scales))[0]
    assert np.array_equal(y, q8.reference(*block_activations(x)[:2], q, scales))
    monkeypatch.setenv(build.OBJECTS_ENV, str(tmp_path / "empty"))
    with pytest.raises(CompileError, match="referenced object file not found"):
        graph_vmfb(m, "llvm-cpu", tmp_path / "elsewhere", by_name=True)


def install_step(folder: Path, **env) -> subprocess.CompletedProcess:
    """`python -m kernels --dir folder` (the install step) in a child process."""
    return subprocess.run([sys.executable, "-m", "kernels", "--dir", str(folder)], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, **env))


def test_the_install_step_builds_every_isa_once(tmp_path):
    first = install_step(tmp_path)
    assert first.returncode == 0, first.stderr
    built = sorted(tmp_path.glob("*.o"))
    from kernels.__main__ import SOURCES
    assert sorted((p.name.split("-")[0], p.name.split("-")[1]) for p in built) == sorted(
        (source.stem, isa) for source in SOURCES for isa in build.ISA_FLAGS)
    assert first.stdout.split() == [str(build.build_object(isa, tmp_path, source)) for source in SOURCES
                                    for isa in build.ISA_FLAGS]
    stamps = [p.stat().st_mtime_ns for p in built]
    again = install_step(tmp_path)
    assert again.returncode == 0 and [p.stat().st_mtime_ns for p in built] == stamps  # nothing rebuilt


def test_the_install_step_without_a_c_compiler_is_one_line(tmp_path):
    """No $CC and nothing on PATH: one line naming what is missing, exit 1, nothing written."""
    done = install_step(tmp_path / "objects", PATH=str(tmp_path), CC="")
    assert done.returncode == 1
    assert done.stderr.strip() == ("error: q8_matmul: no C compiler: expected $CC, cc, gcc or clang on PATH "
                                   "(--precision q8_0's kernel is built from source; install gcc or clang)")
    assert not (tmp_path / "objects").exists()


def test_target_isa_follows_the_compile_target():
    assert calls.target_isa(tuple(target_flags("llvm-cpu-x86-64-v3"))) == "avx2"
    assert build.isa_for_features("+avx2,+avx512f,+avx512bw,+avx512vl,+avx512vnni") == "avx512vnni"
    with pytest.raises(build.KernelError, match="expected AVX2 or AVX-512 VNNI"):
        build.isa_for_features("+sse4.2")


@pytest.mark.parametrize("m, n, k, expected", [
    (1, 80, 512, "outputs 80: expected a positive multiple of 32"),
    (1, 128, 500, "inputs 500: expected a positive multiple of 32"),
    (0, 128, 512, "rows 0: expected at least 1"),
])
def test_bad_shapes_get_one_line(m, n, k, expected):
    with pytest.raises(build.KernelError, match=expected) as e:
        calls.matmul_executable("unused.o", m, n, k)
    assert "\n" not in str(e.value)


def test_a_weight_of_minus_128_is_refused():
    """The AVX2 path's sign trick cannot negate -128: the packer refuses it."""
    q = np.zeros((64, 32), np.int8)
    q[3, 5] = -128
    with pytest.raises(build.KernelError, match=r"weight: expected int8 values in \[-127, 127\]"):
        q8.pack_weight(q)


@pytest.mark.parametrize("bits, value, codes", [(4, 8, r"\[-8, 7\]"), (4, -9, r"\[-8, 7\]"),
                                                (6, 32, r"\[-32, 31\]"), (6, -33, r"\[-32, 31\]")])
def test_a_weight_outside_its_codes_is_refused(bits, value, codes):
    q = np.zeros((64, 32), np.int8)
    q[3, 5] = value
    with pytest.raises(build.KernelError, match=rf"weight: expected int8 values in {codes}$"):
        q8.pack_weight(q, bits)


def test_q4_weight_bytes_are_q4_0s_size_and_unpack_to_the_codes():
    """18 bytes a block of 32 with its f16 scale (Q4_0's); each byte two codes q + 8, inputs
    4s..4s+3 of a block low, 16+4s.. high (kernels/q8_matmul.c's layout)."""
    q, scales = weights(3, 4)
    packed = q8.pack_weight(q, 4).view(np.uint8)
    assert (packed.nbytes + q8.pack_scales(scales).nbytes) * 32 == 18 * q.size
    steps = packed.reshape(N // q8.TILE, K // q8.BLOCK, 4, q8.TILE, 4)
    halves = np.stack([steps & 15, steps >> 4], axis=2).astype(np.int8) - 8  # tile, block, half, step, out, in
    assert np.array_equal(halves.transpose(0, 4, 1, 2, 3, 5).reshape(N, K), q)


def test_q6_weight_bytes_are_6_5_bits_and_unpack_to_the_codes():
    """26 bytes a block of 32 with its f16 scale; each tile's block the codes q + 32 as 256 bytes of
    their low 4 bits (the 4-bit layout) and 128 of their top 2: step s's at byte row s % 2, bits
    2 (s // 2) (kernels/q8_matmul.c's layout)."""
    q, scales = weights(3, 6)
    packed = q8.pack_weight(q, 6).view(np.uint8)
    assert (packed.nbytes + q8.pack_scales(scales).nbytes) * 32 == 26 * q.size
    blocks = packed.reshape(N // q8.TILE, K // q8.BLOCK, 6, q8.TILE, 4)  # tile, block, load, output, input
    low = np.concatenate([blocks[:, :, :4] & 15, blocks[:, :, :4] >> 4], axis=2)  # step s at [s]
    top = np.stack([(blocks[:, :, 4 + s % 2] >> 2 * (s // 2)) & 3 for s in range(8)], axis=2)
    codes = (low | top << 4).astype(np.int8) - 32  # tile, block, step, output, input
    assert np.array_equal(codes.transpose(0, 3, 1, 2, 4).reshape(N, K), q)


def test_bad_bits_are_one_line():
    with pytest.raises(build.KernelError, match=r"^q8_matmul: weight bits 2: expected one of 8, 6, 4$"):
        calls.matmul_executable("unused.o", 1, 64, 64, bits=2)


def test_scales_must_be_f16():
    with pytest.raises(build.KernelError, match="scales of float32: expected float16"):
        q8.pack_scales(np.ones((64, 1), np.float32))


def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "broken-cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'broken-cc: no' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    out = tmp_path / "objects"
    with pytest.raises(build.KernelError, match="broken-cc failed for avx2"):
        build.build_object("avx2", out, q8.SOURCE)
    assert not any(out.rglob("*"))


def test_dispatch_adds_its_executable_once():
    b = Builder()
    x = b.argument("x", (4,))
    text = "stream.executable private @exe { }"
    for _ in range(2):
        b.dispatch("exe", text, "run", [x], TensorType((4,), "f32"), workload=4)
    assert b.globals.count(text) == 1
    with pytest.raises(BuildError, match="does not define @other"):
        b.dispatch("other", text, "run", [x], TensorType((4,), "f32"), workload=4)
