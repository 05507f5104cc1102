"""Weight-only, group-wise quantization of the language model's matmul weights: the layout
in the archive and in the graph, and the numbers, in one place. A weight's `Layout` is its
bits (8 or 4), its group (inputs per scale: 32, 64, 128, ...) and whether it is affine.

A weight w [N, K] is cut along K into groups of `group` consecutive inputs, each with one
scale (f32, or bf16 where the layout says so: `Layout.scales`); its values are stored as
signed q in i8 (-128..127) or i4 (-8..7).
- Symmetric, the layouts of `--precision int8|int4` (emitter/precision.py), w ~ q * scale,
  exactly that product in f32 (`dequantize`): the quantized graph computes with these
  numbers and nothing else. int8: groups of 64, f32 scales, scale = max|w| / 127,
  q = clamp(round(w / scale), -127, 127). int4: groups of 64, f32 scales (4.5 bits a
  weight, as llama.cpp's Q4_0 with f16 scales per 32), all 16 levels -8..7, and each
  group's scale searched (`searched`): for candidate steps around the signed max / -8
  (Q4_0's rule), the values it rounds to, the least-squares step for those values (as
  llama.cpp's `make_qx_quants`), rounded to the scales' type; the candidate of least
  squared error is kept. The table lm_head reads (the embedding table when tied) stays in
  int8's layout under int4 (the precision's `head`), as llama.cpp's Q4_0 files keep theirs in Q6_K.
  Logit distance from f32 on the 2B random checkpoint (docs/history/performance-notebook.md): 0.395 before
  (max|w| / 7 per 64), 0.278 now; groups of 32 with bf16 scales (`Layout(4, 32, scales="bf16")`,
  the same bits) reach 0.251, under Q4_0's 0.264, but IREE 3.13's scale-and-sum over 64
  groups made the decode step 2.2x slower, so the default stays at 64.
- Affine (an MLX-quantized checkpoint run in its bits, `--precision native`: mlx's
  `mx.quantize` layout, w = s*u + b per group, u unsigned 0..2^bits-1): re-centred once, when
  the archive is written (`from_affine`), to q = u - 2^(bits-1) and bias = b + 2^(bits-1)*s,
  so w = s*q + bias with q in the same signed storage (`dequantize` with the biases).
- A checkpoint's own quantized weights (`--precision native`: MLX's, GGUF's block types,
  runtime/checkpoints/gguf_blocks.py) are named with their layout in the config's
  `native_weights` (`native_layouts`): affine, or symmetric in the checkpoint's own group
  (GGUF's Q8_0, Q4_0 per 32, Q6_K per 16), or packed in the block kernel's tiles as the file
  holds them (GGUF's Q8_0 and Q4_0 matrices and expert stacks; its Q6_K matrices as
  `Q6_K_TILES`: codes and int8 scales per 16 in the tiles, f16 d per 256 as the scales,
  through the kernel's q6k entry).

- Integer (`--precision w8a8`, vLLM's name: int8 weights, int8 activations): the symmetric
  int8 numbers with one group of all K inputs (a scale per output channel); at run time x is
  quantized per row the same way (scale = max|x| / 127, `quantize_activations`) and the
  contraction runs in i32 (emitter/layers.py `integer_project`; `integer_matmul` here).
- Q8_0 (`--precision q8_0`, llama.cpp's name): int8 weights (-127..127) in blocks of BLOCK = 32
  inputs with an f16 scale each, searched (`searched`, over `searched_range`; llama.cpp's
  max|w| / 127 is a candidate), activations quantized per row and block at run time, every block's
  int8 x int8 dot product in int32 through the hand-written kernel (kernels/q8_matmul.c:
  VNNI on AVX-512, vpmaddubsw on AVX2, linked into IREE's executables). Its graph forms name
  the kernel's ISA ("q8_0-avx512vnni", "q8_0-avx2"; emitter/precision.py's
  `Precision.for_target` picks one for the target), so a module built for one ISA is never
  served to another. Its weights are `packed` layouts: q [N, K] int8 and the scales [N, K/32]
  f16 in the kernel's tile order (`Layout.store`), the embedding table's too: its rows are
  gathered out of the tiles (emitter/kernel_calls.py `block_rows`), and a tied lm_head
  multiplies it through the kernel like any projection.
- Q4_0 (`--precision q4_0`, llama.cpp's name): the same with 4-bit weights, -8..7 in blocks of
  32 with an f16 scale each, the scale searched as int4's (`searched`, rounded to f16), stored
  two codes to a byte in the kernel's tiles (Q4_0's 18 bytes a block, 4.5 bits a weight), against
  the same Q8_0 activations (llama.cpp's Q4_0 x Q8_0 dot product); graph forms "q4_0-avx512vnni",
  "q4_0-avx2". The table lm_head reads is 6-bit (`Q6_HEAD`: -32..31, searched f16 scales per 32,
  6.5 bits a weight, as llama.cpp's Q4_0 files keep `output` in Q6_K's 6.56) through the kernel's
  6-bit entry, and a tied embedding table with it (its rows gathered out of the 6-bit tiles); an
  untied model's embedding table is Q8_0's. At widths that 256 does not divide the head is Q8_0,
  as llama-quantize falls back from Q6_K to Q8_0 there (`Q6_K_ROW`). (With lm_head in Q4_0 too,
  the logits on tests/test_gguf.py's checkpoint were 0.110 from f32, against 0.074 for
  llama.cpp's Q4_0 x Q8_0 math with its wider head; with an untied table in Q4_0, as llama.cpp's
  `token_embd`, its first greedy token flipped.)

In the archive the weight's checkpoint name holds q transposed, [K, N] (i8 or i4: `stored`), and
`scales_name` (the name with "weight" replaced by "scales") holds the scales [N, K / group]
(f32), an affine weight's `biases_name` its biases [N, K / group] (f32). The graph reads them
as they are (`QuantizedWeight`, emitter/layers.py's `quantized_project`). Transposed because
the one-row contraction runs over q as [G, g, N] (N contiguous: a vector of outputs per
input), which IREE 3.13 otherwise makes at load by a transposed copy that stays resident
beside the packed one (measured: 2.0x the i8 bytes resident, against 1.1x when stored so).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kernels.q8_matmul import BLOCK, Q6_K_ROW_BYTES, SUPER, TILE, pack_scales, pack_weight

from .config import ConfigError, WeightSpec

GROUP = 64  # inputs per scale of `--precision int8` (and the default of a `Layout`)
STORAGE_DTYPE = {8: "i8", 4: "i4"}  # bits -> the graph's element type of q
PACKED_ONLY_BITS = 6  # a width held only in the kernel's packed tiles (q4_0's lm_head table)
ACTIVATION_FLOOR = 1e-30  # the least max|x| of an activation group quantized at run time
# Outputs that a per-call dequantized i4 weight's N must be a multiple of: IREE's CPU codegen
# masks the last tile of any other N with a `vector.maskedload` of i4 it cannot lower (N = 4304,
# the 8B tower's fc1; 4320 fails too, 4352 compiles), so such a weight is held in i8 (`held_bits`).
I4_OUTPUTS = 64
BLOCK_ROWS = 4096  # rows of a weight rearranged at a time for the archive (even)
SYMMETRIC = "symmetric"  # the fourth item of a symmetric weight's `native_weights` entry
PACKED = "packed-"  # ... and of one in the block kernel's tiles: "packed-" + the kernel's ISA
SCALE_DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}  # a layout's scale type -> numpy's
CANDIDATES = (0.8, 0.85, 0.9, 0.95, 1.0)  # a searched group's trial steps, in units of its signed max / -2^(bits-1)


def levels(bits: int) -> int:
    """The largest magnitude a symmetric value takes: 127 at 8 bits, 7 at 4 (-127..127, -7..7)."""
    return (1 << (bits - 1)) - 1


def scales_name(weight_name: str) -> str:
    """`...proj.weight` -> `...proj.scales` (and `lm_head.weight` -> `lm_head.scales`); a
    name not ending in `weight` (an expert stack, `mlp.experts.gate_up_proj`) -> `..._scales`."""
    if not weight_name.endswith("weight"):
        return weight_name + "_scales"
    return weight_name[: -len("weight")] + "scales"


def biases_name(weight_name: str) -> str:
    """`...proj.weight` -> `...proj.biases` (an affine weight's); a name not ending in
    `weight` (an expert stack) -> `..._biases`, as `scales_name`."""
    if not weight_name.endswith("weight"):
        return weight_name + "_biases"
    return weight_name[: -len("weight")] + "biases"


def groups(name: str, shape: tuple[int, ...], group: int = GROUP) -> int:
    """Groups per row of a [N, K] weight; ConfigError naming the tensor where K is not a
    multiple of the group."""
    if len(shape) != 2 or shape[1] % group:
        raise ConfigError(f"{name}: shape {list(shape)}: expected [N, K] with K a multiple of the quantization "
                          f"group {group}")
    return shape[1] // group


@dataclass(frozen=True)
class Layout:
    """How one [N, K] weight is quantized: `bits` (8 or 4) per stored value, one scale per
    `group` inputs, and for an `affine` one a bias per group too (module docstring); the
    scales' element type (`scales`: f32 or bf16; biases are f32); whether each group's
    scale is `searched` over all 2^bits levels (else max|w| / levels), made by `quantize`;
    and a `packed` one (q8_0's, q4_0's) in the block kernel's tile order with f16 scales;
    `pad_rows`: a packed table whose N the kernel's tiles do not divide (a vocabulary of any
    size: the embedding table, lm_head's) takes zero rows up to the next multiple of them, as
    llama.cpp takes any row count (the graph's logits drop them: emitter/text.py `logits`)."""
    bits: int
    group: int = GROUP
    affine: bool = False
    scales: str = "f32"
    searched: bool = False
    packed: bool = False
    pad_rows: bool = False

    def __post_init__(self):
        if self.bits not in STORAGE_DTYPE and not (self.packed and self.bits == PACKED_ONLY_BITS):
            raise ConfigError(f"quantization bits {self.bits}: expected one of {', '.join(map(str, STORAGE_DTYPE))}")
        if self.scales not in SCALE_DTYPES:
            raise ConfigError(f"quantization scales {self.scales}: expected one of {', '.join(SCALE_DTYPES)}")

    @property
    def dtype(self) -> str:
        """The graph's element type of q."""
        return STORAGE_DTYPE[self.bits]

    @property
    def tag(self) -> str:
        """The layout in the names of the host transforms (the artifact identity): bits and
        group, then the scales' type and the search where they are not the default."""
        return (f"int{self.bits}_g{self.group}" + ("" if self.scales == "f32" else f"_{self.scales}")
                + ("_searched" if self.searched else ""))

    def specs(self, name: str, shape: tuple[int, ...]) -> list[WeightSpec]:
        """The graph weights of the [N, K] weight `name`: q [K, N], its scales [N, K / group]
        and an affine weight's biases; their host transforms name the layout (`tag`: so the
        artifact identity changes with the bits, the group, the scales and the form). Every
        layout also takes a stack of experts [E, N, K]: [E, ...] of each, every expert as one
        weight (q [E, K, N]; packed: each expert packed)."""
        tag = self.tag
        *stack, n, k = shape
        if len(stack) > 1:
            raise ConfigError(f"{name}: shape {list(shape)}: expected [N, K] or a stack of experts [E, N, K]")
        if self.packed:
            padded = self.padded(n)
            if n % (2 * TILE) and not (self.pad_rows and not stack):
                form = "[E, N, K]" if stack else "[N, K]"
                raise ConfigError(f"{name}: shape {list(shape)}: expected {form} with N a multiple of {2 * TILE} "
                                  f"(the q{self.bits}_0 kernel's tiles)")
            cut = (*stack, padded, groups(name, (n, k), self.group))
            suffix = ("_searched" if self.searched else "") + f"_g{self.group}" + (
                f"_rows{n}_padded{padded}" if padded != n else "")
            form = "q6_k" if self.q6_k else f"q{self.bits}_0"
            return [WeightSpec(name, (*stack, padded, self.row_bytes(k)), "i8", f"{form}_tiles{suffix}"),
                    WeightSpec(scales_name(name), cut, "f16", f"{form}_tile_scales{suffix}")]
        cut = (*stack, n, groups(name, (n, k), self.group))
        out = [WeightSpec(name, (*stack, k, n), self.dtype, f"{'affine' if self.affine else 'quantize'}_{tag}"),
               WeightSpec(scales_name(name), cut, self.scales, f"group_scales_{tag}")]
        if self.affine:
            out.append(WeightSpec(biases_name(name), cut, "f32", f"recentred_biases_{tag}"))
        return out

    @property
    def q6_k(self) -> bool:
        """GGUF's Q6_K in its bits (`Q6_K_TILES`): 6-bit codes with int8 scales per 16 inputs in the
        tiles, an f16 d per 256 its `scales` (kernels/q8_matmul.py `pack_q6_k`)."""
        return self.packed and self.bits == PACKED_ONLY_BITS and self.group == SUPER

    def row_bytes(self, k: int) -> int:
        """Bytes of a packed row of k inputs: k * bits / 8, Q6_K's 208 each 256 (codes and sub-scales)."""
        return k // SUPER * Q6_K_ROW_BYTES if self.q6_k else k * self.bits // 8

    def padded(self, n: int) -> int:
        """The rows a packed weight of n outputs holds: n, or with `pad_rows` the next multiple
        of the kernel's two tiles."""
        return -(-n // (2 * TILE)) * 2 * TILE if self.packed and self.pad_rows else n

    def source_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint's [N, K] (or [E, N, K]) of a weight whose graph spec has `shape` (q
        transposed, unless packed: [N, K * bits / 8] bytes)."""
        if self.packed:
            return (*shape[:-1], shape[-1] // Q6_K_ROW_BYTES * SUPER if self.q6_k else shape[-1] * 8 // self.bits)
        return (*shape[:-2], shape[-1], shape[-2])

    def store(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q, scales) of an f32 weight [N, K] as the archive holds them: `stored`, or packed
        for the kernel (`block_weight`, then kernels/q8_matmul.py's `pack_weight`, `pack_scales`:
        [N, K * bits / 8] bytes and [N, K/32] f16 in its tile order). A stack of experts
        [E, N, K]: each expert on its own, stacked."""
        if w.ndim == 3:
            parts = [self.store(expert) for expert in w]
            return np.stack([q for q, _ in parts]), np.stack([s for _, s in parts])
        if not self.packed:
            return stored(w, self)
        if self.q6_k:
            raise ConfigError("a Q6_K weight is read in its bits from its GGUF file (gguf_text.packed_blocks), "
                              "never made from f32")
        if self.padded(w.shape[0]) != w.shape[0]:
            w = np.concatenate([w, np.zeros((self.padded(w.shape[0]) - w.shape[0], w.shape[1]), w.dtype)])
        q, scales = block_weight(w, self.bits)
        return pack_weight(q, self.bits).reshape(q.shape[0], -1), pack_scales(scales).reshape(scales.shape)


# the kernel precisions' layouts (emitter/precision.py): Q8_0's also holds an untied q4_0's
# embedding table, and q4_0's head at widths Q6_K_ROW does not divide
KERNEL_LAYOUTS = {"q8_0": Layout(8, BLOCK, scales="f16", searched=True, packed=True),
                  "q4_0": Layout(4, BLOCK, scales="f16", searched=True, packed=True)}
# q4_0's lm_head table (the embedding table when tied): 6 bits, searched f16 scales per 32 (6.5
# bits a weight: llama.cpp's Q4_0 files keep it in Q6_K, 6.56), through the kernel's 6-bit entry;
# in Q8_0 where its rows are not a multiple of Q6_K_ROW inputs, as llama-quantize falls back
# from Q6_K (a super-block of 256) to Q8_0 there: the same bits as llama.cpp's file either way
Q6_HEAD = Layout(PACKED_ONLY_BITS, BLOCK, scales="f16", searched=True, packed=True)
Q6_K_ROW = SUPER
# GGUF's Q6_K matrices in their bits (runtime/checkpoints/gguf_text.py `on_kernel`): the 6-bit codes
# and int8 scales per 16 inputs in the kernel's tiles, an f16 d per 256 (`Layout.q6_k`), through
# its q6k entry against Q8_0 activations (the native entry (name, 6, 256, "packed-ISA"))
Q6_K_TILES = Layout(PACKED_ONLY_BITS, SUPER, scales="f16", packed=True)


# iree-compile flags of a module whose weights are weight-only quantized and dequantized per
# call (int8, int4, a checkpoint's own bits: MLX's, GGUF's): data tiling from global
# optimization instead of dispatch creation. Both pack prefill's dequantized weights for the
# tiled matmul per call; dispatch creation also encodes decode's split-K q at load, as the
# identity layout, a resident copy of every quantized weight beside the archive pages
# prefill reads (docs/history/performance-notebook.md, "One copy of the int8 weights"; at the 4-bit MLX 8B
# 5.0 GB, docs/text.md); global optimization resolves that encoding away.
WEIGHT_ONLY_FLAGS = ("--iree-opt-data-tiling=false", "--iree-global-opt-data-tiling")


def held_bits(bits: int, outputs: int) -> int:
    """The bits a `bits`-bit weight of `outputs` rows is held in when it is dequantized per call:
    its own, except 4-bit codes at an N that I4_OUTPUTS does not divide, held in 8 (exact)."""
    return 8 if bits == 4 and outputs % I4_OUTPUTS else bits


def native_layouts(entries) -> dict[str, Layout]:
    """{name: Layout} of a config's `native_weights` entries: (name, bits, group) for an affine
    weight (MLX's, GGUF's Q4_K / Q5_K), (name, bits, group, SYMMETRIC) for a symmetric one,
    (name, bits, 32, "packed-ISA") for one held in the block kernel's tiles as it is (a GGUF's
    Q8_0 / Q4_0 expert stack: its own codes and f16 scales), run by the kernel object of ISA."""
    out = {}
    for name, bits, group, *form in entries:
        if form and form[0].startswith(PACKED):
            out[name] = Layout(bits, group, scales="f16", packed=True)
            continue
        if form not in ([], [SYMMETRIC]):
            raise ConfigError(f"{name}: quantization form {form[0]!r}: expected {SYMMETRIC!r}, {PACKED}ISA or none "
                              "(affine)")
        out[name] = Layout(bits, group, affine=not form)
    return out


def with_kernel_isa(entries, isa: str) -> tuple[tuple, ...]:
    """`native_weights` entries with each packed one's form naming the kernel ISA `isa`."""
    return tuple((name, bits, group, PACKED + isa) if form == [PACKED] else (name, bits, group, *form)
                 for name, bits, group, *form in entries)


def native_kernel_isa(entries) -> str | None:
    """The ISA of the kernel object that a config's packed `native_weights` entries run on
    (None where it has none)."""
    isas = {form[0][len(PACKED):] for _, _, _, *form in entries if form and form[0].startswith(PACKED)}
    if len(isas) > 1:
        raise ConfigError(f"native weights packed for several kernel ISAs ({', '.join(sorted(isas))}): expected one")
    return isas.pop() if isas else None


def native_entry(name: str, layout: Layout) -> tuple:
    """`native_layouts`' entry of one weight."""
    return (name, layout.bits, layout.group) if layout.affine else (name, layout.bits, layout.group, SYMMETRIC)


def quantize(w: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, K] int8, scales [N, K / group] in the layout's scale type) of an f32 weight
    [N, K], symmetric: per group `searched` or scale = max|w| / levels with
    q = clamp(round-half-even(w / scale), -levels, levels). An all-zero group has scale 0
    and q 0. Made `BLOCK_ROWS` rows at a time."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    q = np.empty((n, k), np.int8)
    scales = np.empty((n, k // layout.group), SCALE_DTYPES[layout.scales])
    for r in range(0, n, BLOCK_ROWS):
        g = w[r:r + BLOCK_ROWS].reshape(-1, k // layout.group, layout.group)
        if layout.searched:
            step, (lo, hi) = searched(g, layout), searched_range(layout.bits)
        else:
            step = as_scales(np.abs(g).max(axis=2) / np.float32(levels(layout.bits)), layout)
            lo, hi = -levels(layout.bits), levels(layout.bits)
        q[r:r + BLOCK_ROWS] = rounded(g, step, lo, hi).reshape(-1, k)  # cast to int8 on assignment
        scales[r:r + BLOCK_ROWS] = step
    return q, scales


def as_scales(step: np.ndarray, layout: Layout) -> np.ndarray:
    """f32 steps rounded to the layout's scale type (to nearest even), as f32."""
    return step.astype(SCALE_DTYPES[layout.scales]).astype(np.float32)


def rounded(g: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The values (whole numbers in f32) of groups g [R, G, g] at steps [R, G]:
    clamp(round-half-even(w / step), lo, hi); 0 where the step is 0. In place, one array."""
    out = np.divide(g, np.where(step == 0, np.float32(1), step)[:, :, None])
    np.rint(out, out=out)
    return np.clip(out, lo, hi, out=out)


def searched_range(bits: int) -> tuple[int, int]:
    """The values a searched layout rounds to: all 2^bits levels, -2^(bits-1)..2^(bits-1)-1,
    except at 8 bits -127..127 (Q8_0's: the kernel's AVX2 sign trick cannot negate -128)."""
    return (-levels(8), levels(8)) if bits == 8 else (-(1 << (bits - 1)), levels(bits))


def searched(g: np.ndarray, layout: Layout) -> np.ndarray:
    """The f32 steps (each exact in the layout's scale type) of groups g [R, G, g] over the
    levels of `searched_range` (lo..hi): for each of CANDIDATES times the signed max / lo, the
    values it rounds to, the least-squares step for them (sum(q w) / sum(q q)), rounded to the
    scale type; per group the one whose values give the least squared error."""
    lo, hi = searched_range(layout.bits)
    top = np.take_along_axis(g, np.abs(g).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    best = least = None
    for c in CANDIDATES:
        q = rounded(g, top * np.float32(c / lo), lo, hi)
        norm = np.einsum("rgk,rgk->rg", q, q)
        step = as_scales(np.einsum("rgk,rgk->rg", q, g) / np.where(norm == 0, np.float32(1), norm), layout)
        miss = rounded(g, step, lo, hi)
        miss *= step[:, :, None]
        miss -= g
        error = np.einsum("rgk,rgk->rg", miss, miss)
        if best is None:
            best, least = step, error
        else:
            better = error < least
            best, least = np.where(better, step, best), np.where(better, error, least)
    return best


def stored(w: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(q transposed [K, N], scales [N, K / group]): an f32 weight [N, K] as the archive
    holds it (`quantize`, `arranged`)."""
    q, scales = quantize(w, layout)
    return arranged(row_blocks(q), q.shape, layout.bits), scales


def from_affine(code_blocks, shape: tuple[int, int], scales: np.ndarray, biases: np.ndarray,
                bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q transposed [K, N], scales, biases [N, K / group] f32): an affine-quantized [N, K]
    weight, w = scales*codes + biases with unsigned codes (0..2^bits-1; MLX's), as the
    archive holds it: q = codes - 2^(bits-1) (`arranged`), biases + 2^(bits-1)*scales, in f32.
    `code_blocks`: the codes as consecutive blocks of rows (uint8 [rows, K] each), so that
    no more than a block is ever held beside q unpacked; nothing of weight size in f32."""
    half = 1 << (bits - 1)
    recentred = ((np.asarray(c, np.uint8) - np.uint8(half)).view(np.int8) for c in code_blocks)  # modulo 256
    scales = np.asarray(scales, np.float32)
    return (arranged(recentred, shape, bits), scales,
            (np.asarray(biases, np.float32) + np.float32(half) * scales).astype(np.float32))


def row_blocks(q: np.ndarray, rows: int = BLOCK_ROWS):
    """q's consecutive blocks of `rows` rows (views)."""
    return (q[r:r + rows] for r in range(0, q.shape[0], rows))


def arranged(blocks, shape: tuple[int, int], bits: int) -> np.ndarray:
    """Signed values q [N, K] (int8, given as consecutive blocks of an even number of rows:
    `row_blocks`) as the archive holds them: transposed [K, N], int8, or at 4 bits its K*N/2
    bytes of nibbles (`nibbles`: pairs along N). Written block by block into the result."""
    n, k = shape
    out = np.empty((k, n // 2), np.uint8) if bits == 4 else np.empty((k, n), np.int8)
    start = 0
    for block in blocks:
        t = np.ascontiguousarray(np.asarray(block, np.int8).T)
        rows = t.shape[1]
        if bits == 4:
            out[:, start // 2:(start + rows) // 2] = nibbles(t).reshape(k, rows // 2)
        else:
            out[:, start:start + rows] = t
        start += rows
    assert start == n, (start, shape)
    return out.reshape(-1) if bits == 4 else out


def nibbles(q: np.ndarray) -> np.ndarray:
    """Values in -8..7 packed two to a byte, as IREE reads a tensor of i4: element 2i in the
    low nibble of byte i, element 2i+1 in the high one (two's complement)."""
    flat = q.reshape(-1).view(np.uint8) & np.uint8(0xF)
    return flat[0::2] | (flat[1::2] << np.uint8(4))


def dequantize(q: np.ndarray, scales: np.ndarray, group: int = GROUP, biases: np.ndarray | None = None) -> np.ndarray:
    """The f32 weight [N, K] the quantized graph computes with: q * scale of its group
    (+ the group's bias for an affine weight)."""
    n, k = q.shape
    g = q.reshape(n, k // group, group).astype(np.float32) * np.asarray(scales, np.float32)[:, :, None]
    if biases is not None:
        g += biases[:, :, None]
    return g.reshape(n, k)


def quantize_activations(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(xq [M, K] int8, scales [M, K / group] f32) of f32 x [M, K], as the graph computes them
    (emitter/layers.py `quantized_activations`): per row and group, scale = max|x| / 127 and
    xq = round-half-even(x * (127 / max|x|)), max|x| at least ACTIVATION_FLOOR."""
    x = np.asarray(x, np.float32)
    m, k = x.shape
    g = x.reshape(m, k // group, group)
    amax = np.maximum(np.abs(g).max(axis=2), np.float32(ACTIVATION_FLOOR))
    inverse = (np.float32(levels(8)) / amax).astype(np.float32)
    xq = np.rint(g * inverse[:, :, None]).astype(np.int8)
    return xq.reshape(m, k), (amax / np.float32(levels(8))).astype(np.float32)


def block_weight(w: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(q [N, K] int8, scales [N, K / 32] f16) of an f32 weight [N, K] for the block kernel, each
    block's f16 scale searched for the least squared error (`searched`). 8 bits: q in [-127, 127]
    (llama.cpp's Q8_0 bytes, 8.5 bits a weight; its rule is the search's max / 127 candidate);
    4 bits: q in [-8, 7] (Q4_0's bytes: 4.5 bits a weight); 6 bits the same in [-32, 31] (6.5
    bits a weight, as llama.cpp's Q6_K's 6.56). Unpacked: `Layout.store` packs them."""
    return quantize(w, Layout(bits, BLOCK, scales="f16", searched=True, packed=True))


def block_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(xq [M, K] int8, scales [M, K/32] f32, block sums of xq [M, K/32] int32) of f32 x, the
    block kernel's activations as the graph computes them (`quantize_activations` in blocks of
    32; emitter/layers.py `quantized_blocks`)."""
    xq, dx = quantize_activations(x, BLOCK)
    m, k = xq.shape
    return xq, dx, xq.reshape(m, k // BLOCK, BLOCK).astype(np.int32).sum(axis=2, dtype=np.int32)


def integer_sums(x: np.ndarray, q: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(the i32 sums [G, M, N] of each group of inputs, x's scales [M, G]) of x @ q.T in
    integers: x [M, K] quantized by `quantize_activations`, q [N, K] int8."""
    xq, x_scales = quantize_activations(x, group)
    (m, k), n = xq.shape, q.shape[0]
    xg = xq.reshape(m, k // group, group).transpose(1, 0, 2).astype(np.int32)
    qg = q.reshape(n, k // group, group).transpose(1, 2, 0).astype(np.int32)
    return np.matmul(xg, qg), x_scales


def integer_matmul(x: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x @ w.T, f32 [M, N], as `--precision w8a8` computes it for a weight quantized to q [N, K]
    int8 with scales [N, G] (`quantize`): `integer_sums`, each group's sum in f32 times its x
    scale and its weight scale, summed over the groups."""
    group = q.shape[1] // scales.shape[1]
    sums, x_scales = integer_sums(x, q, group)
    scaled = sums.astype(np.float32) * (x_scales.T[:, :, None] * scales.T[:, None, :])
    return scaled.sum(axis=0, dtype=np.float32)


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [N, K] weight in a graph: q transposed [K, N] (i8 or i4), its scales
    [N, K / group] (f32) and, affine, its biases (f32, like the scales; else None). A stack
    of experts [E, N, K]: q [E, K, N], scales and biases [E, N, K / group]."""
    q: object  # builder.Value
    scales: object  # builder.Value
    biases: object = None  # builder.Value

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's [N, K] (a stack's [E, N, K])."""
        return (*self.q.shape[:-2], self.q.shape[-1], self.q.shape[-2])

    @property
    def group(self) -> int:
        return self.q.shape[-2] // self.scales.shape[-1]

    @property
    def parts(self) -> list:
        """q, the scales and any biases."""
        return [v for v in (self.q, self.scales, self.biases) if v is not None]


@dataclass(frozen=True)
class BlockWeight:
    """A packed (q8_0, q4_0) [N, K] weight in a graph: q [N, K * bits / 8] i8 and its scales
    [N, K / 32] f16 in the kernel's tile order (a Q6_K one, `Layout.q6_k`: [N, K * 13 / 16] and
    its d [N, K / 256]), and the path of the kernel object its projections link
    (emitter/layers.py `block_project`)."""
    q: object  # builder.Value
    scales: object  # builder.Value
    kernel: str

    @property
    def shape(self) -> tuple[int, int]:
        q6_k = self.q.shape[1] == Q6_K_ROW_BYTES * self.scales.shape[1]  # d per 256 (Layout.q6_k)
        return self.q.shape[0], self.scales.shape[1] * (SUPER if q6_k else BLOCK)


def grouped(weights: dict, kernel: str | None = None) -> dict:
    """A graph's weights by name with each quantized weight's q, scales and any biases
    (`scales_name`, `biases_name`) bound as one `QuantizedWeight` under the weight's name; a
    packed one (f16 scales) as a `BlockWeight` over the `kernel` object."""
    out = dict(weights)
    for name in [n for n in out if scales_name(n) in out]:
        q, scales = out[name], out.pop(scales_name(name))
        if scales.dtype == "f16":
            out[name] = BlockWeight(q, scales, kernel)
        else:
            out[name] = QuantizedWeight(q, scales, out.pop(biases_name(name), None))
    return out
