"""The hand-written kernels (kernels/) called from a graph: each call a `flow.dispatch` of a
`stream.executable` that links the kernel's object, and the graph ops around it.

- `object_executable` writes a `stream.executable` whose `hal.executable.objects` names the
  object (by file name alone, found through kernels/build.py `search_flags` at compile time,
  so that the graph, and so the artifact identity, is the same whatever folder holds it) and
  whose one export calls the C function once per workgroup; iree-compile links the object
  into the executable's embedded ELF (iree-lld), so the vmfb is self-contained: the IREE
  runtime needs no plugin, flag or library to run it;
- `block_matmul` emits a Q8_0 / Q4_0 projection (kernels/q8_matmul.py) of x's blocks of 32,
  quantized in StableHLO (IREE's own code: emitter/layers.py `block_project`); `block_rows`
  gathers rows of such a weight out of its tiles (the embedding table, which a tied lm_head
  multiplies through the kernel), each row's blocks times their f16 scales;
- `token_attention` and `chunk_attention` emit the attention kernels (kernels/decode_attention.py)
  over the paged KV cache (emitter/kv_pages.py);
- `target_isa`: the ISA of the objects a graph links, from what iree-compile resolves its
  target to on this machine.
"""

from __future__ import annotations

import os

import numpy as np

from kernels.build import KernelError, isa_for_features
from kernels.decode_attention import (CHUNK_ENTRIES, ENTRIES as ATTENTION_ENTRIES, LANES, MAX_CHUNK_HEAD_DIM,
                                      MAX_GROUPS, MAX_HEAD_DIM, ROWS, chunk_fits, fits, scale_bits)
from kernels.q8_matmul import (BLOCK, ENTRIES, EXPERT_ENTRIES, OUTPUTS_PER_WORKGROUP, Q6_K_ENTRY, Q6_K_ROW_BYTES, SUB,
                               SUPER, TILE, check_bits, check_shape)

from .builder import Builder, TensorType, Value
from .kv_pages import BLOCK as KV_BLOCK
from .targets import host_cpu, resolved_device_target

assert KV_BLOCK == ROWS, "the attention kernels' ROWS is the KV cache's block"
# The attention exports' workgroup-count region: the workload `%n` workgroups along x.
WORKGROUPS = """%c1 = arith.constant 1 : index
      stream.return %n, %c1, %c1 : index, index, index"""


def target_isa(flags: tuple[str, ...]) -> str:
    """The ISA of the object to link for iree-compile `flags` (as they resolve on this machine)."""
    device = resolved_device_target(tuple(flags))
    features = host_cpu(device)[1]
    if '"embedded-elf-x86_64"' not in device or features is None:
        raise KernelError(f"q8_matmul: target {device[:120]!r}...: expected an x86-64 llvm-cpu embedded ELF target")
    return isa_for_features(features)


# -- linking an object ---------------------------------------------------------
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


# -- Q8_0 / Q4_0 projections ----------------------------------------------------
def matmul_executable_name(m: int, n: int, k: int, bits: int | str = 8) -> str:
    return f"q{bits}_matmul_{m}x{n}x{k}"


def matmul_executable(obj: str | os.PathLike, m: int, n: int, k: int, bits: int = 8) -> str:
    """A `stream.executable` linking `obj` (a path, or a file name `search_flags` finds) whose
    export (`matmul_executable_name`: unique in a module whose executables IREE links into one)
    computes y [M, N] from
    (xq [M, K] i8, dx [M, K/32] f32, xs [M, K/32] i32, packed w [N*K*bits/8] i8, packed scales
    [N*K/32] f16): one workgroup per 128 outputs (fewer in the last), each a call of the C
    function of the weights' `bits` (`ENTRIES`)."""
    check_shape(m, n, k)
    g, entry, export = k // BLOCK, ENTRIES[check_bits(bits)], matmul_executable_name(m, n, k, bits)
    shapes = {"x": (m * k, "i8"), "dx": (m * g, "f32"), "xs": (m * g, "i32"), "w": (n * k * bits // 8, "i8"),
              "dw": (n * g, "f16"), "y": (m * n, "f32")}
    workgroups = f"""%x = affine.apply affine_map<()[s0] -> (s0 ceildiv {OUTPUTS_PER_WORKGROUP})>()[%n]
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index"""
    return object_executable(obj, export, entry, {name: f"memref<{size}x{t}>" for name, (size, t) in shapes.items()},
                             {"m": m, "n": n, "k": k, "tiles": OUTPUTS_PER_WORKGROUP // TILE}, workgroups)


def q6_k_executable(obj: str | os.PathLike, m: int, n: int, k: int) -> str:
    """`matmul_executable`'s form for GGUF's Q6_K in its bits (the q6k entry): xs the sums of x's
    halves of 16 [M, K/16] i32, w [N*K*13/16] i8 (kernels/q8_matmul.py `pack_q6_k`: codes and
    sub-scales), the scales its f16 d [N*K/256] (`pack_scales` of [N, K/256])."""
    check_shape(m, n, k)
    if k % SUPER:
        raise KernelError(f"q8_matmul q6_k: inputs {k}: expected a multiple of {SUPER}")
    export = matmul_executable_name(m, n, k, "6k")
    shapes = {"x": (m * k, "i8"), "dx": (m * k // BLOCK, "f32"), "xs": (m * k // SUB, "i32"),
              "w": (n * k // SUPER * Q6_K_ROW_BYTES, "i8"), "dw": (n * k // SUPER, "f16"), "y": (m * n, "f32")}
    workgroups = f"""%x = affine.apply affine_map<()[s0] -> (s0 ceildiv {OUTPUTS_PER_WORKGROUP})>()[%n]
      %c1 = arith.constant 1 : index
      stream.return %x, %c1, %c1 : index, index, index"""
    return object_executable(obj, export, Q6_K_ENTRY, {name: f"memref<{size}x{t}>" for name, (size, t) in shapes.items()},
                             {"m": m, "n": n, "k": k, "tiles": OUTPUTS_PER_WORKGROUP // TILE}, workgroups)


def is_q6_k(w: Value, scales: Value) -> bool:
    """Whether a packed weight's flat bytes and scales are Q6_K's form (`pack_q6_k`: 208 bytes
    a d) rather than the 8-, 6- or 4-bit one's (32, 24, 16 bytes a scale); flat, or [N, ...] both."""
    return w.shape[-1] == Q6_K_ROW_BYTES * scales.shape[-1]


def block_matmul(b: Builder, xq: Value, dx: Value, xs: Value, w: Value, scales: Value, obj: str | os.PathLike,
                 hint: str = "q8") -> Value:
    """x @ W.T -> [M, N] f32 through the kernel, from x's Q8_0 blocks (xq [M, K] i8, their scales
    [M, K/32] f32 and sums [M, K/32] i32: emitter/layers.py `quantized_blocks`); `w` the packed
    weight [N*K*bits/8] i8 (kernels/q8_matmul.py `pack_weight`: 8, 6 or 4 bits, told by its
    size), `scales` its packed scales [N*K/32] f16 (`pack_scales`), `obj` the object
    kernels/build.py made for the graph's target. A Q6_K weight (`is_q6_k`: `pack_q6_k`'s
    bytes, d [N*K/256] f16) takes xs as the sums of x's halves of 16, [M, K/16]."""
    m, k = xq.shape
    if is_q6_k(w, scales):
        n = scales.shape[0] * SUPER // k
        if xs.type != TensorType((m, k // SUB), "i32") or n * k != scales.shape[0] * SUPER:
            raise KernelError(f"q8_matmul {hint}: Q6_K weight {w.type}, d {scales.type}, x's sums {xs.type}: "
                              f"expected {k} inputs and the sums of {k // SUB} halves a row")
        name = matmul_executable_name(m, n, k, "6k")
        return b.dispatch(name, q6_k_executable(obj, m, n, k), name, [xq, dx, xs, w, scales],
                          TensorType((m, n), "f32"), workload=n, hint=hint)
    n = scales.shape[0] * BLOCK // k
    bits = 8 * w.shape[0] // max(n * k, 1)
    if (bits not in ENTRIES or w.type != TensorType((n * k * bits // 8,), "i8")
            or scales.type != TensorType((n * k // BLOCK,), "f16")):
        sizes = " or ".join(str(TensorType((n * k * width // 8,), "i8")) for width in ENTRIES)
        raise KernelError(f"q8_matmul {hint}: weight {w.type} and scales {scales.type}: expected {sizes} and "
                          f"{TensorType((n * k // BLOCK,), 'f16')} for {k} inputs")
    name = matmul_executable_name(m, n, k, bits)
    return b.dispatch(name, matmul_executable(obj, m, n, k, bits), name, [xq, dx, xs, w, scales],
                      TensorType((m, n), "f32"), workload=n, hint=hint)


def experts_executable_name(m: int, n: int, k: int, experts: int, bits: int) -> str:
    return f"q{bits}_experts_{m}x{n}x{k}x{experts}"


def chosen_count(m: int, experts: int) -> int:
    """How many distinct experts M sorted rows can name: the expert entry's list of them."""
    return min(m, experts)


def experts_executable(obj: str | os.PathLike, m: int, n: int, k: int, experts: int, bits: int) -> str:
    """`matmul_executable`'s mixture-of-experts form: y [M, N] from M rows sorted by expert
    (xq, dx, xs as there), offsets [E + 1] i32 (expert e's rows [offsets[e], offsets[e + 1])),
    the chosen experts [G] i32 (in order, then -1s; G = `chosen_count`), and stacks of E packed
    weights [E * N * K * bits / 8] i8 and scales [E * N * K / 32] f16; G x ceil(N / 128)
    workgroups, each one chosen expert's rows against 128 of its outputs (one past the chosen
    returns at once)."""
    check_shape(m, n, k)
    if bits not in EXPERT_ENTRIES:
        raise KernelError(f"q8_matmul experts: weight bits {bits}: expected one of {', '.join(map(str, EXPERT_ENTRIES))}")
    g, export = k // BLOCK, experts_executable_name(m, n, k, experts, bits)
    chunks = -(-n // OUTPUTS_PER_WORKGROUP)
    shapes = {"x": (m * k, "i8"), "dx": (m * g, "f32"), "xs": (m * g, "i32"), "offsets": (experts + 1, "i32"),
              "chosen": (chosen_count(m, experts), "i32"), "w": (experts * n * k * bits // 8, "i8"),
              "dw": (experts * n * g, "f16"), "y": (m * n, "f32")}
    return object_executable(obj, export, EXPERT_ENTRIES[bits],
                             {name: f"memref<{size}x{t}>" for name, (size, t) in shapes.items()},
                             {"n": n, "k": k, "tiles": OUTPUTS_PER_WORKGROUP // TILE, "chunks": chunks}, WORKGROUPS)


def expert_matmul(b: Builder, xq: Value, dx: Value, xs: Value, offsets: Value, chosen: Value, w: Value,
                  scales: Value, obj: str | os.PathLike, hint: str = "experts") -> Value:
    """Rows sorted by expert (xq [M, K] i8, dx, xs as `block_matmul` takes them; offsets
    [E + 1] i32; chosen [G] i32, the experts some row chose, in order, then -1s) against their
    experts' packed weights (w [E, N, K * bits / 8] i8, scales [E, N, K / 32] f16: quant.Layout's
    packed stacks) -> [M, N] f32, each row through the block kernel of `block_matmul`, each
    chosen expert's weights read once."""
    m, k = xq.shape
    experts, n = scales.shape[0], scales.shape[1]
    bits = 8 * w.shape[2] // k
    if (bits not in EXPERT_ENTRIES or w.shape[:2] != (experts, n) or offsets.type != TensorType((experts + 1,), "i32")
            or chosen.type != TensorType((chosen_count(m, experts),), "i32")):
        raise KernelError(f"q8_matmul {hint}: weights {w.type}, scales {scales.type}, offsets {offsets.type}, chosen "
                          f"{chosen.type}: expected stacks of {experts} experts in 8 or 4 bits, {experts + 1} offsets "
                          f"and {chosen_count(m, experts)} chosen")
    flat = [b.reshape(v, (int(np.prod(v.shape)),), hint=hint + "_flat") for v in (w, scales)]
    name = experts_executable_name(m, n, k, experts, bits)
    return b.dispatch(name, experts_executable(obj, m, n, k, experts, bits), name,
                      [xq, dx, xs, offsets, chosen, *flat], TensorType((m, n), "f32"),
                      workload=chosen_count(m, experts) * -(-n // OUTPUTS_PER_WORKGROUP), hint=hint)


def block_rows(b: Builder, w: Value, scales: Value, rows: Value, hint: str = "q8_rows") -> Value:
    """Rows `rows` [T] i32 of a packed weight (w [N, K * bits / 8] i8 and scales [N, K/32] f16 in
    the tile order of `pack_weight`, `pack_scales`; 8, 6 or 4 bits) as f32 [T, K]: each block of
    32 times its scale (llama.cpp's `dequantize_row_q8_0`), gathered straight out of the tiles.
    A tile's block is `bits` loads of 64 bytes (16 outputs x 4 bytes), so one gather of (tile,
    output) points takes each row's [K/32, bits, 4] bytes; the codes are unpacked from them."""
    if is_q6_k(w, scales):
        raise KernelError(f"q8_matmul {hint}: a Q6_K table's rows are not gathered out of its tiles (it stays on "
                          "the native path)")
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


# -- attention over the paged KV cache --------------------------------------------
def attention_executable_name(kv_heads: int, blocks: int, groups: int, head_dim: int, kv_dtype: str) -> str:
    return f"decode_attention_{kv_heads}x{blocks}x{groups}x{head_dim}_{kv_dtype}"


def attention_executable(obj: str | os.PathLike, kv_heads: int, blocks: int, groups: int, head_dim: int,
                         kv_dtype: str) -> str:
    """A `stream.executable` whose export computes one token's attention output [kv_heads x
    groups x head_dim] f32 from (q [the same] f32, own k and v [kv_heads x head_dim], the
    K and V pools [kv_heads x blocks x 16 x head_dim] of `kv_dtype`, the table [?] i32 and the
    slot [1] i32), then the table's length (an index): one workgroup per KV head."""
    if not fits(groups, head_dim, kv_dtype):
        raise KernelError(f"decode_attention: {groups} query heads a KV head, head_dim {head_dim}, KV {kv_dtype}: "
                          f"expected at most {MAX_GROUPS}, a multiple of {LANES} up to {MAX_HEAD_DIM}, f32 or bf16")
    export, entry = attention_executable_name(kv_heads, blocks, groups, head_dim, kv_dtype), ATTENTION_ENTRIES[kv_dtype]
    pool = f"memref<{kv_heads * blocks * ROWS * head_dim}x{kv_dtype}>"
    heads, own = f"memref<{kv_heads * groups * head_dim}xf32>", f"memref<{kv_heads * head_dim}x{kv_dtype}>"
    bindings = {"q": heads, "k": own, "v": own, "kp": pool, "vp": pool, "table": "memref<?xi32>{%span}",
                "slot": "memref<1xi32>", "out": heads}
    return object_executable(obj, export, entry, bindings,
                             {"blocks": blocks, "groups": groups, "d": head_dim, "scale": scale_bits(head_dim)},
                             WORKGROUPS, ("span",))


def token_attention(b: Builder, obj: str, q: Value, k_pool: Value, v_pool: Value, table: Value, slot: Value,
                    own_k: Value, own_v: Value) -> Value:
    """emitter/attention.py `token_attention`'s result [1, H*D] for q [1, H, D] over the
    slots 0..slot-1 of the blocks `table` [N] names in the pools [KVH, blocks, 16, D] and
    the token's own k, v [KVH, 1, D] (as the pools store them: their dtype), through the
    kernel object `obj`."""
    _, heads, d = q.shape
    kv_heads, blocks, _, _ = k_pool.shape
    groups = heads // kv_heads
    name = attention_executable_name(kv_heads, blocks, groups, d, k_pool.dtype)
    flat = lambda x, hint: b.reshape(x, (int(np.prod(x.shape)),), hint=hint)  # noqa: E731
    operands = [flat(q, "attn_q"), flat(own_k, "attn_own_k"), flat(own_v, "attn_own_v"),
                flat(k_pool, "attn_k_pool"), flat(v_pool, "attn_v_pool"), table,
                b.reshape(slot, (1,), hint="attn_slot")]
    out = b.dispatch(name, attention_executable(obj, kv_heads, blocks, groups, d, k_pool.dtype), name, operands,
                     TensorType((heads * d,), "f32"), workload=kv_heads, hint="decode_attention")
    return b.reshape(out, (1, heads * d), hint="context")


def chunk_executable_name(kv_heads: int, blocks: int, groups: int, head_dim: int, rows: int, kv_dtype: str) -> str:
    return f"chunk_attention_{rows}x{kv_heads}x{blocks}x{groups}x{head_dim}_{kv_dtype}"


def chunk_executable(obj: str | os.PathLike, kv_heads: int, blocks: int, groups: int, head_dim: int, rows: int,
                     kv_dtype: str) -> str:
    """A `stream.executable` whose export computes a chunk's attention output [rows x kv_heads x
    groups x head_dim] f32 from (q [the same] f32, the K and V pools [kv_heads x blocks x 16 x
    head_dim] of `kv_dtype` holding the chunk's own K/V, the table [?] i32 and the chunk's
    start [1] i32), then the table's length (an index): a workgroup per KV head and 16 rows."""
    if not chunk_fits(groups, head_dim, kv_dtype) or rows % ROWS:
        raise KernelError(f"chunk_attention: {groups} query heads a KV head, head_dim {head_dim}, KV {kv_dtype}, "
                          f"{rows} rows: expected at most {MAX_GROUPS}, a multiple of {LANES} up to "
                          f"{MAX_CHUNK_HEAD_DIM}, f32 or bf16, a multiple of {ROWS}")
    export = chunk_executable_name(kv_heads, blocks, groups, head_dim, rows, kv_dtype)
    pool = f"memref<{kv_heads * blocks * ROWS * head_dim}x{kv_dtype}>"
    heads = f"memref<{rows * kv_heads * groups * head_dim}xf32>"
    bindings = {"q": heads, "kp": pool, "vp": pool, "table": "memref<?xi32>{%span}", "start": "memref<1xi32>",
                "out": heads}
    sizes = {"blocks": blocks, "groups": groups, "d": head_dim, "kv_heads": kv_heads, "tiles": rows // ROWS,
             "scale": scale_bits(head_dim)}
    return object_executable(obj, export, CHUNK_ENTRIES[kv_dtype], bindings, sizes, WORKGROUPS, ("span",))


def chunk_attention(b: Builder, obj: str, q: Value, k_pool: Value, v_pool: Value, table: Value,
                    start: Value) -> Value:
    """The attention [S, H*D] of a chunk's queries q [S, H, D] at slots start.. over the
    sequence's slots up to each row's own, the blocks `table` [N] names in the pools [KVH,
    blocks, 16, D] (which hold the chunk's own K/V already), through the kernel object `obj`."""
    rows, heads, d = q.shape
    kv_heads, blocks, _, _ = k_pool.shape
    groups = heads // kv_heads
    name = chunk_executable_name(kv_heads, blocks, groups, d, rows, k_pool.dtype)
    flat = lambda x, hint: b.reshape(x, (int(np.prod(x.shape)),), hint=hint)  # noqa: E731
    operands = [flat(q, "attn_q"), flat(k_pool, "attn_k_pool"), flat(v_pool, "attn_v_pool"), table,
                b.reshape(start, (1,), hint="attn_start")]
    text = chunk_executable(obj, kv_heads, blocks, groups, d, rows, k_pool.dtype)
    out = b.dispatch(name, text, name, operands, TensorType((rows * heads * d,), "f32"),
                     workload=kv_heads * rows // ROWS, hint="chunk_attention")
    return b.reshape(out, (rows, heads * d), hint="context")
