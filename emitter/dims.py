"""Dimensions known only at run time, as the builder's shapes hold them.

A function's shapes may hold `Dim`s beside ints: `scale` times one of its run-time
extents, `base` (the language model's: "blocks", the block-table entries a call reads;
its slots are `Dim("blocks", 16)`). The builder binds each base to a scalar i32 value
(`Builder.bind`) and prints a Dim as `?`; shapes with Dims compare equal when their Dims
do, and one reshapes into another when their static sizes and their Dims multiply to the
same count (`same_count`)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class Dim:
    base: str
    scale: int = 1

    def __mul__(self, k: int) -> "Dim":
        return Dim(self.base, self.scale * k)

    __rmul__ = __mul__

    def __floordiv__(self, k: int) -> "Dim":
        if self.scale % k:
            raise ValueError(f"{self} is not a multiple of {k}")
        return Dim(self.base, self.scale // k)

    def __str__(self) -> str:
        return "?"


def is_static(shape) -> bool:
    return not any(isinstance(d, Dim) for d in shape)


def count(shape) -> tuple[int, list[str]]:
    """A shape's element count as (static factor, the bases it multiplies, sorted)."""
    ints = [d for d in shape if not isinstance(d, Dim)]
    dims = [d for d in shape if isinstance(d, Dim)]
    return prod(ints) * prod(d.scale for d in dims), sorted(d.base for d in dims)


def same_count(a, b) -> bool:
    """Whether shapes `a` and `b` hold as many elements for every value of their extents."""
    return count(a) == count(b)


def grouping(wide, narrow) -> list[list[int]] | None:
    """The dims of `wide` that make each dim of `narrow`, in order (`narrow` a collapse of
    `wide`: consecutive groups, unit dims joining a neighbour), or None if it is none."""
    groups, i = [], 0
    for d in narrow:
        group = []
        while i < len(wide) and (not group or count([wide[k] for k in group]) != count([d])):
            group.append(i)
            i += 1
        if count([wide[k] for k in group]) != count([d]):
            return None
        groups.append(group)
    if not groups or any(wide[k] != 1 for k in range(i, len(wide))):
        return None
    groups[-1] += list(range(i, len(wide)))
    return groups
