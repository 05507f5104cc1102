"""The builder's indexing ops: static and run-time slices, updates at run-time starts,
gathers of rows, slices and points, and the scatter of slices (a paged KV cache's block
reads and writes). A base of `Builder` (emitter/builder.py), whose naming, lines and shape
helpers (`_op`, `_fresh`, `_index`, `shape_tensor`, `reshape`) they use."""

from __future__ import annotations

from .dims import Dim, is_static
from .values import BuildError, TensorType, Value, array_attr, ints_attr


class IndexOps:
    def slice(self, x: Value, start, limit, hint=None) -> Value:
        """x[start:limit]; along a run-time dim only the whole of it (`limit` that Dim)."""
        def inside(s, e, d):
            return s == 0 and e == d if isinstance(d, Dim) else not isinstance(e, Dim) and 0 <= s < e <= d

        if len(start) != x.rank or len(limit) != x.rank or not all(map(inside, start, limit, x.shape)):
            raise BuildError(f"slice: [{start}, {limit}) out of {x.type}")
        t = TensorType([e if isinstance(e, Dim) else e - s for s, e in zip(start, limit)], x.dtype)
        if not is_static(x.shape):
            first, end, step = (self.shape_tensor(v) for v in (start, limit, [1] * x.rank))
            return self._op(hint or "slice", f"stablehlo.real_dynamic_slice {x}, {first}, {end}, {step} : "
                                             f"({x.type}, {first.type}, {end.type}, {step.type}) -> {t}", t)
        ranges = ", ".join(f"{s}:{e}" for s, e in zip(start, limit))
        return self._op(hint or "slice", f"stablehlo.slice {x} [{ranges}] : ({x.type}) -> {t}", t)

    def _check_starts(self, op: str, x: Value, starts) -> str:
        if len(starts) != x.rank or any(s.shape != () or s.dtype != "i32" for s in starts):
            raise BuildError(f"{op}: needs {x.rank} scalar i32 start indices for {x.type}")
        return ", ".join(str(s) for s in starts)

    def dynamic_slice(self, x: Value, starts: list[Value], sizes, hint=None) -> Value:
        """x[s0:s0+n0, ...] at run-time starts (scalar i32; clamped into range by StableHLO)."""
        operands = self._check_starts("dynamic_slice", x, starts)
        if len(sizes) != x.rank or any(isinstance(n, Dim) or not 0 < n or (not isinstance(d, Dim) and n > d)
                                       for n, d in zip(sizes, x.shape)):
            raise BuildError(f"dynamic_slice: sizes {list(sizes)} out of {x.type}")
        t = TensorType(sizes, x.dtype)
        types = ", ".join([str(x.type)] + [str(s.type) for s in starts])
        return self._op(hint or "dslice", f"stablehlo.dynamic_slice {x}, {operands}, sizes = [{ints_attr(sizes)}] : "
                                          f"({types}) -> {t}", t)

    def dynamic_update_slice(self, x: Value, update: Value, starts: list[Value], hint=None) -> Value:
        """x with `update` written at run-time starts (scalar i32; clamped into range, but
        for an x of run-time shape: there the update must fit where it is written)."""
        operands = self._check_starts("dynamic_update_slice", x, starts)
        def fits(u, d):
            return u == d if isinstance(u, Dim) else isinstance(d, Dim) or u <= d

        if update.dtype != x.dtype or update.rank != x.rank or not all(map(fits, update.shape, x.shape)):
            raise BuildError(f"dynamic_update_slice: {update.type} does not fit in {x.type}")
        if not is_static(x.shape):  # IREE 3.13 lowers no dynamic_update_slice of a run-time shape
            offsets = ", ".join(self._index(s, hint or "dupdate") for s in starts)
            sizes = ", ".join(str(d) if not isinstance(d, Dim) else self._index(self.size(d), hint or "dupdate")
                              for d in update.shape)
            return self._op(hint or "dupdate", f"tensor.insert_slice {update} into {x}[{offsets}] [{sizes}] "
                                               f"[{', '.join(['1'] * x.rank)}] : {update.type} into {x.type}", x.type)
        types = ", ".join([str(x.type), str(update.type)] + [str(s.type) for s in starts])
        return self._op(hint or "dupdate", f"stablehlo.dynamic_update_slice {x}, {update}, {operands} : "
                                           f"({types}) -> {x.type}", x.type)

    def gather_rows(self, table: Value, indices: Value, hint=None) -> Value:
        """table[indices]: rows of a [R, H] table for a 1-D i32 index vector."""
        if table.rank != 2 or indices.rank != 1 or indices.dtype != "i32":
            raise BuildError(f"gather_rows: needs [R, H] and [N] i32, got {table.type} and {indices.type}")
        (n,), (_, h) = indices.shape, table.shape
        idx = self.reshape(indices, (n, 1), hint=(hint or "gather") + "_idx")
        t = TensorType((n, h), table.dtype)
        attrs = ("dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], "
                 f"start_index_map = [0], index_vector_dim = 1>, slice_sizes = {array_attr((1, h))}, "
                 "indices_are_sorted = false")
        return self._op(hint or "gather", f'"stablehlo.gather"({table}, {idx}) {{{attrs}}} : '
                                          f"({table.type}, {idx.type}) -> {t}", t)

    def take_rows(self, table: Value, indices: Value, hint=None) -> Value:
        """table[indices]: rows of a [R, W] table for i32 indices of any shape, [*indices, W].
        IREE's own `iree_linalg_ext.gather` (IREE 3.13 lowers a `stablehlo.gather` of whole
        rows to a loop over elements, each computing its source index: about 3x slower for
        the KV cache's block reads)."""
        if table.rank != 2 or indices.dtype != "i32":
            raise BuildError(f"take_rows: needs [R, W] and i32 indices, got {table.type} and {indices.type}")
        t = TensorType((*indices.shape, table.shape[1]), table.dtype)
        sizes = [self._index(self.size(d), hint or "take") for d in indices.shape if isinstance(d, Dim)]
        empty = self._op((hint or "take") + "_init", f"tensor.empty({', '.join(sizes)}) : {t}", t)
        return self._op(hint or "take", f"iree_linalg_ext.gather dimension_map = [0] ins({table}, {indices} : "
                                        f"{table.type}, {indices.type}) outs({empty} : {t}) -> {t}", t)

    def gather_slices(self, x: Value, axis: int, indices: Value, hint=None) -> Value:
        """x's slices at `indices` [N] i32 along `axis`, in order: the same shape with that
        dim N (a block table read of a paged KV cache)."""
        if indices.rank != 1 or indices.dtype != "i32" or not 0 <= axis < x.rank:
            raise BuildError(f"gather_slices: needs [N] i32 indices and an axis of {x.type}, got {indices.type}")
        (n,) = indices.shape
        idx = self.reshape(indices, (n, 1), hint=(hint or "gather") + "_idx")
        shape = list(x.shape)
        shape[axis] = n
        t = TensorType(shape, x.dtype)
        sizes = list(x.shape)
        sizes[axis] = 1
        offsets = [d for d in range(x.rank) if d != axis]
        attrs = (f"dimension_numbers = #stablehlo.gather<offset_dims = [{ints_attr(offsets)}], collapsed_slice_dims = "
                 f"[{axis}], start_index_map = [{axis}], index_vector_dim = 1>, slice_sizes = {array_attr(sizes)}, "
                 "indices_are_sorted = false")
        return self._op(hint or "gather", f'"stablehlo.gather"({x}, {idx}) {{{attrs}}} : '
                                          f"({x.type}, {idx.type}) -> {t}", t)

    def gather_points(self, x: Value, axes: list[int], indices: Value, hint=None) -> Value:
        """x's sub-tensors at `indices` [N, len(axes)] i32, each a point in `axes` (collapsed),
        whole along the other dims: [N, *x's other dims] (rows of a tiled table)."""
        n, width = indices.shape if indices.rank == 2 else (None, None)
        if indices.dtype != "i32" or width != len(axes) or not all(0 <= a < x.rank for a in axes):
            raise BuildError(f"gather_points: needs [N, {len(axes)}] i32 indices and axes of {x.type}, "
                             f"got {indices.type}")
        kept = [d for d in range(x.rank) if d not in axes]
        t = TensorType((n, *[x.shape[d] for d in kept]), x.dtype)
        sizes = [1 if d in axes else x.shape[d] for d in range(x.rank)]
        attrs = (f"dimension_numbers = #stablehlo.gather<offset_dims = [{ints_attr(range(1, len(kept) + 1))}], "
                 f"collapsed_slice_dims = [{ints_attr(axes)}], start_index_map = [{ints_attr(axes)}], index_vector_dim = 1>, "
                 f"slice_sizes = {array_attr(sizes)}, indices_are_sorted = false")
        return self._op(hint or "gather", f'"stablehlo.gather"({x}, {indices}) {{{attrs}}} : '
                                          f"({x.type}, {indices.type}) -> {t}", t)

    def scatter_slices(self, x: Value, axis: int, indices: Value, updates: Value, hint=None) -> Value:
        """x with its slices at `indices` [N] i32 along `axis` replaced by `updates` (x's shape
        with that dim N); an index given twice keeps one of its updates."""
        (n,) = indices.shape
        shape = list(x.shape)
        shape[axis] = n
        if indices.dtype != "i32" or updates.type != TensorType(shape, x.dtype):
            raise BuildError(f"scatter_slices: {updates.type} at {indices.type} into {x.type} along {axis}")
        idx = self.reshape(indices, (n, 1), hint=(hint or "scatter") + "_idx")
        name = self._fresh(f"{self._stage}.{hint or 'scatter'}" if self._stage else hint or "scatter")
        scalar = TensorType((), x.dtype)
        windows = [d for d in range(x.rank) if d != axis]
        attrs = (f"scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [{ints_attr(windows)}], "
                 f"inserted_window_dims = [{axis}], scatter_dims_to_operand_dims = [{axis}], index_vector_dim = 1>, "
                 "indices_are_sorted = false, unique_indices = false")
        self.lines += [f'%{name} = "stablehlo.scatter"({x}, {idx}, {updates}) ({{',
                       f"  ^bb0(%{name}_old: {scalar}, %{name}_new: {scalar}):",
                       f"    stablehlo.return %{name}_new : {scalar}",
                       f'  }}) {{{attrs}}} : ({x.type}, {idx.type}, {updates.type}) -> {x.type} loc("{self._stage}")']
        return Value(name, x.type)
