"""The builder's values: a tensor type (shape and dtype), an SSA value of one, and how
numbers and integer lists are written into MLIR text (exact literals, `array<i64: ...>`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dims import Dim

DTYPES = ("f32", "bf16", "f16", "i32", "i64", "i8", "i4", "i1")
# dot_general operand dtypes that may differ
MIXED_DOTS = ({"f32", "bf16"}, {"f32", "i8"}, {"f32", "i4"}, {"i8", "i4"})
COMPARE_DIRECTIONS = ("EQ", "NE", "GE", "GT", "LE", "LT")
REDUCE_INIT = {  # (kind, dtype) -> identity element
    ("add", "f32"): 0.0, ("maximum", "f32"): float("-inf"),
    ("add", "i32"): 0, ("maximum", "i32"): -2**31, ("add", "i64"): 0, ("maximum", "i64"): -2**63,
}


class BuildError(ValueError):
    """An op was given operands it cannot take (a bug in the graph code)."""


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise BuildError(f"unknown dtype {self.dtype!r}")
        object.__setattr__(self, "shape", tuple(d if isinstance(d, Dim) else int(d) for d in self.shape))

    def __str__(self) -> str:
        return "tensor<" + "".join(f"{d}x" for d in self.shape) + self.dtype + ">"


@dataclass(frozen=True)
class Value:
    name: str
    type: TensorType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> str:
        return self.type.dtype

    @property
    def rank(self) -> int:
        return len(self.type.shape)

    def __str__(self) -> str:
        return "%" + self.name


def float_literal(x: float, dtype: str = "f32") -> str:
    """An f32 or bf16 literal MLIR parses back to the same bits (infinities and NaN as hex,
    of the type's width); a bf16 literal must be exact in bf16."""
    with np.errstate(over="ignore"):
        x32 = np.float32(x)
    if np.isfinite(x) and not np.isfinite(x32):
        raise BuildError(f"{x!r} does not fit in f32")
    bits = int(x32.view(np.uint32))
    if dtype == "bf16" and bits & 0xFFFF:
        raise BuildError(f"{x!r} is not exact in bf16")
    if not np.isfinite(x32):
        return "0x%08X" % bits if dtype == "f32" else "0x%04X" % (bits >> 16)
    text = np.format_float_scientific(x32, unique=True, exp_digits=2)
    return text.replace(".e", ".0e")


def ints_attr(values) -> str:
    return ", ".join(str(int(v)) for v in values)


def array_attr(values) -> str:
    return f"array<i64: {ints_attr(values)}>" if len(values) else "array<i64>"
