"""Precisions: one table, each name one frozen `Precision` that says everything a graph, an
archive and a command need of it. Resolved once, where the command line or the API is read
(`precision`; emitter/cli.py's `PrecisionChoice`), and passed on as that object.

Accumulation, norms and softmax stay f32 under every precision. The rows:
- f32: exact.
- bf16: the matmul weights in bf16 (half the bytes), run on bf16 operands where the CPU's
  bf16 dot product runs at twice the f32 rate (AMD Zen 4/5, Arm bf16); elsewhere it is built
  as its target form bf16-f32, the weights widened to f32 inside each matmul (Intel's
  single-rate AVX-512 BF16, and AVX2, where IREE 3.13 lowers a bf16 x bf16 matmul to scalar
  code, ~50x slower than f32: docs/history/performance-notebook.md, "bf16 on every CPU").
- int8, int4 (the language model only): matmul weights in i8 / i4 with group scales, f32
  activations (emitter/quant.py's layouts).
- w8a8: int8 weights with a scale per output channel, activations quantized to int8 per row
  at run time, the projections in i32.
- q8_0, q4_0: llama.cpp's Q8_0 and Q4_0 x Q8_0 through a hand-written kernel
  (emitter/kernel_calls.py); each is built as the target form naming the kernel's ISA
  (q8_0-avx512vnni, q8_0-avx2, ...), so a module built for one ISA is never served to another.
- native (alias mlx): a quantized checkpoint in its own bits; not a graph precision of its
  own: the graph is f32 with the checkpoint's quantized weights named in the config's
  `native_weights`.
A new precision (another kernel ISA, MoE experts) is a new row of `_ROWS`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kernels.build import ISA_TITLES, KernelError

from .config import ConfigError
from .kernel_calls import target_isa
from .quant import BLOCK, KERNEL_LAYOUTS, Q6_HEAD, Q6_K_ROW, WEIGHT_ONLY_FLAGS, Layout
from .targets import DEFAULT_TARGET, host_cpu, resolved_device_target, target_flags

TEXT, VISION = "text", "vision"  # the models a precision builds graphs of


@dataclass(frozen=True)
class Precision:
    """One precision. `name` is what the artifact identity, module headers and outputs say;
    `weights` the matmul weights' dtype (and the archive's), `activations` the dtype the
    matmuls take their activations in; `layout` the quantized weights' (`head`: the table
    lm_head reads, where it differs); `isa` the kernel ISA of a target form and `family` the
    name it is a form of (bf16-f32 and the kernel ISAs' forms); `models` what it builds;
    `typed` whether a user may ask for it by name; `note` the module header's words."""
    name: str
    weights: str
    activations: str
    note: str = ""
    help: str = ""
    layout: Layout | None = None
    head: Layout | None = None
    per_channel: bool = False
    isa: str | None = None
    family: str | None = None
    models: tuple[str, ...] = (TEXT,)
    typed: bool = True
    native: bool = False

    def __str__(self) -> str:
        return self.name

    @property
    def activation_dtype(self) -> str | None:
        """A graph's `Builder(activations=...)`: None where the matmuls take each weight's own
        dtype (f32 and bf16), "f32" (bf16-f32, the weight-only and kernel forms), or "i8"
        (w8a8: quantized at run time, emitter/layers.py `integer_project`)."""
        return None if self.activations == self.weights != "i8" else self.activations

    @property
    def bits(self) -> int | None:
        """The quantized weights' bits, or None for a float precision."""
        return self.layout and self.layout.bits

    @property
    def kernel(self) -> bool:
        """Whether the projections run through the block kernel (q8_0, q4_0 and their forms)."""
        return bool(self.layout and self.layout.packed)

    @property
    def tower(self) -> "Precision":
        """The vision tower's precision beside this language model's: bf16 under the quantized
        ones (their layouts are the language model's), else this one."""
        return PRECISIONS["bf16"] if self.bits else self

    def compile_flags(self, native_weights=()) -> tuple[str, ...]:
        """The iree-compile flags a text module of this precision adds to its target's:
        `quant.WEIGHT_ONLY_FLAGS` for int8 and int4 and for a checkpoint run in its own bits
        (`native_weights` not empty); none for the rest (float, w8a8, q8_0, q4_0)."""
        weight_only = self.layout and not self.kernel and not self.per_channel
        return WEIGHT_ONLY_FLAGS if weight_only or native_weights else ()

    def layout_for(self, shape: tuple[int, ...], head: bool = False, gathered: bool = False) -> Layout:
        """The layout of a [N, K] weight quantized under this precision: `layout` (the `head`
        table, lm_head's: `head` where set), with one group of all K inputs (a scale per output
        channel) when `per_channel`. A `gathered` one (the embedding table, read by rows out of
        the kernel's tiles) of a kernel precision is the head's when it is the head (tied), else
        Q8_0's (an untied q4_0's table stays 8-bit: read a row a token, its bytes are not the
        decode's). q4_0's 6-bit head is Q8_0 at rows not a multiple of Q6_K_ROW inputs. The
        tables (head, gathered) of a kernel precision take a vocabulary of any size (`pad_rows`)."""
        layout = (self.head or self.layout) if head else self.layout
        if (gathered and layout.packed and not head) or (layout == Q6_HEAD and shape[-1] % Q6_K_ROW):
            layout = KERNEL_LAYOUTS["q8_0"]
        if layout.packed and (head or gathered):
            return replace(layout, pad_rows=True)
        return replace(layout, group=shape[-1]) if self.per_channel else layout

    def for_target(self, target: str | None = None, extra_flags=()) -> "Precision":
        """The form a graph is built in for this precision on `target`: bf16 as `bf16_form`
        says (bf16-f32: bf16 weights widened to f32 inside each matmul, never IREE's scalar bf16
        loop); q8_0 and q4_0 the form of the kernel object of the target's ISA; else itself."""
        if self.name == "bf16":
            return PRECISIONS[bf16_form(target or DEFAULT_TARGET, extra_flags)[0]]
        if self.kernel and self.isa is None:
            try:
                flags = tuple(target_flags(target or DEFAULT_TARGET)) + tuple(extra_flags)
                return PRECISIONS[f"{self.name}-{target_isa(flags)}"]
            except KernelError as e:
                raise ConfigError(f"--precision {self.name}: {e}") from None
        return self

    def target_note(self, used: "Precision", target: str | None = None) -> str | None:
        """One line for a user whose precision became `used`, the target's fast form, or None."""
        if used == self or self.name != "bf16":
            return None
        why = bf16_form(target or DEFAULT_TARGET)[1]
        return (f"note: --precision {self.name}: {why}; running {used.name} (bf16 weights, widened to f32 inside "
                f"each matmul: half the weight memory, about f32's matmul speed)")


def _kernel_rows(name: str, numbers: str, help: str) -> list[Precision]:
    """A block-kernel precision (built for the host's ISA) and its target form per ISA; q4_0's
    lm_head table in 6 bits (`quant.Q6_HEAD`)."""
    layout = KERNEL_LAYOUTS[name]
    base = Precision(name, layout.dtype, "f32", f", {numbers} (f16 scales per {BLOCK}), the host's kernel", help,
                     layout, Q6_HEAD if layout.bits == 4 else None)
    return [base, *(replace(base, name=f"{name}-{isa}", note=f", {numbers} (f16 scales per {BLOCK}), the {title} "
                            f"kernel", isa=isa, family=name, typed=False) for isa, title in ISA_TITLES.items())]


_BOTH = (TEXT, VISION)
_ROWS = [
    Precision("f32", "f32", "f32", "", "exact", models=_BOTH),
    Precision("bf16", "bf16", "bf16", ", bf16 matmuls", "matmul weights in bf16, the language model's embedding "
              "table in bf16 too", models=_BOTH),
    Precision("bf16-f32", "bf16", "f32", ", bf16 weights, f32 matmuls", family="bf16", models=_BOTH, typed=False),
    Precision("int8", "i8", "f32", ", int8 weights with f32 scales per 64, f32 matmuls",
              "int8 weights, a scale per 64", Layout(8)),
    Precision("int4", "i4", "f32", ", int4 weights with f32 scales per 64, f32 matmuls",
              "4-bit weights, a scale per 64", Layout(4, searched=True),
              head=Layout(8)),
    Precision("w8a8", "i8", "i8", ", int8 weights with an f32 scale per output, int8 activations per row, i32 matmuls",
              "int8 weights and activations", Layout(8), per_channel=True),
    *_kernel_rows("q8_0", "Q8_0 weights and activations", "llama.cpp's Q8_0, a hand-written kernel"),
    *_kernel_rows("q4_0", "Q4_0 weights and Q8_0 activations", "llama.cpp's Q4_0, the same kernel"),
    Precision("native", "f32", "f32", help="a quantized checkpoint's own bits; alias mlx",
              models=(), native=True),
]
PRECISIONS: dict[str, Precision] = {p.name: p for p in _ROWS}
ALIASES = {"mlx": "native"}  # mlx: native's first name, still accepted
GRAPH_PRECISIONS = tuple(p.name for p in _ROWS if p.models)  # what a graph is built in
VISION_PRECISIONS = tuple(p.name for p in _ROWS if VISION in p.models)  # emit-qwen3vl's
VISION_CHOICES = tuple(p.name for p in _ROWS if VISION in p.models and p.typed)  # run, build, export, bench
TEXT_CHOICES = (*(p.name for p in _ROWS if p.typed and (TEXT in p.models or p.native)), *ALIASES)  # generate, serve
NATIVE = PRECISIONS["native"]
HELP_DOC = "docs/precisions.md"


def precision(value: "Precision | str") -> Precision:
    """The `Precision` of a name (or the object itself): a graph precision, or native / mlx.
    An unknown name is a one-line ConfigError naming the graph precisions."""
    if isinstance(value, Precision):
        return value
    found = PRECISIONS.get(ALIASES.get(value, value))
    if found is None:
        raise ConfigError(f"--precision {value!r}: expected one of {', '.join(GRAPH_PRECISIONS)}")
    return found


def for_graph(value: "Precision | str") -> Precision:
    """`precision`, refusing one that is not a graph's own (native: resolved by the runtime
    into f32 and the checkpoint's `native_weights` first)."""
    p = precision(value)
    if not p.models:
        raise ConfigError(f"--precision {p.name!r}: expected one of {', '.join(GRAPH_PRECISIONS)}")
    return p


def help_text(choices) -> str:
    """--precision's help: each choice in a few words, and where the story is."""
    return ", ".join(f"{name} ({PRECISIONS[name].help})" for name in choices if name not in ALIASES) + f": {HELP_DOC}."


# bf16 x bf16 matmuls pay only where the bf16 dot product runs at twice the rate of f32
# FMAs: AMD Zen 4/5 (vdpbf16ps, measured 455-464 bf16 against 223 f32 GFLOP/s on 2 cores)
# and Arm's BF16 (BFMMLA). Intel's AVX-512 BF16 (Cooper Lake to Granite Rapids) runs it on one
# port, at f32's rate, so the activations' rounding and packing make a bf16 x bf16 graph
# slower than f32 (measured 1.3x on a 2B tower); without one (AVX2) IREE 3.13 lowers it to
# a scalar loop (~50x). There, bf16-f32 (docs/history/performance-notebook.md, "bf16 on every CPU").
_DOUBLE_RATE_BF16 = (("znver", "+avx512bf16"), ("", "+bf16"))  # (LLVM CPU name prefix, feature)


TEXT_HELP = help_text(TEXT_CHOICES) + " Default: native for a quantized checkpoint, else f32."  # generate, serve


def bf16_form(target: str, extra_flags=()) -> tuple[str, str]:
    """("bf16" or "bf16-f32", why) for `target` as LLVM resolves it here: "bf16" on GPU
    targets and CPUs with a double-rate bf16 dot product, else "bf16-f32"."""
    device = resolved_device_target(tuple([*target_flags(target), *extra_flags]))
    if '#hal.executable.target<"llvm-cpu"' not in device:
        return "bf16", "a GPU target"
    cpu, features = host_cpu(device)
    cpu, features = cpu or "", (features or "").split(",")
    if any(cpu.startswith(prefix) and feature in features for prefix, feature in _DOUBLE_RATE_BF16):
        return "bf16", f"{cpu} has a double-rate bf16 dot product"
    if "+avx512bf16" in features:
        return "bf16-f32", f"{cpu}'s bf16 dot product runs at the rate of f32 FMAs"
    return "bf16-f32", f"{cpu or target} has no bf16 dot product"
