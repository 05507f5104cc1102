"""A small StableHLO builder that writes MLIR text.

Values know their shape and dtype; each op is one method that checks its operands,
infers the result type and appends one line. SSA names come from the current stage
and a hint (`%blocks.3.attn.scores`), and every line carries `loc("<stage>")`.

A shape may hold run-time dimensions (`emitter/dims.py`, sizes bound by `bind`): the
ops then take their dynamic forms (`dynamic_broadcast_in_dim`, `dynamic_iota`,
`real_dynamic_slice`; reshapes as `tensor.expand_shape` / `collapse_shape`).

The values and types are emitter/values.py's; the slices, gathers and scatters are
emitter/indexing.py's (`IndexOps`, a base of `Builder`).
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import numpy as np

from .dims import Dim, count, grouping, is_static, same_count
from .indexing import IndexOps
from .values import (COMPARE_DIRECTIONS, MIXED_DOTS, REDUCE_INIT, BuildError, TensorType, Value, array_attr,
                     float_literal, ints_attr)


class Builder(IndexOps):
    def __init__(self, activations: str | None = None):
        """`activations`: the dtype every matmul's activations take ("f32": a bf16 weight is
        widened inside the matmul), or None: each matmul's weight dtype (`layers.linear`)."""
        self.activations = activations
        self.arguments: list[tuple[Value, str]] = []
        self.globals: list[str] = []  # module-level declarations (parameter-backed weights)
        self.lines: list[str] = []
        self._names: set[str] = set()
        self._stage = "input"
        self.extents: dict[str, Value] = {}  # a Dim's base -> its size, scalar i32 (`bind`)
        self._call_zero: Value | None = None

    # -- naming and stages -------------------------------------------------
    @contextmanager
    def stage(self, name: str):
        """Ops built inside carry `loc("name")` and SSA names prefixed by it."""
        if '"' in name or "\\" in name:
            raise BuildError(f"stage name {name!r}: no quotes or backslashes")
        outer, self._stage = self._stage, name
        try:
            yield
        finally:
            self._stage = outer

    def _fresh(self, hint: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.$-]", "_", hint)
        if not (base[:1].isalpha() or base[:1] == "_"):
            base = "v" + base
        name, n = base, 0
        while name in self._names:
            n += 1
            name = f"{base}.{n}"
        self._names.add(name)
        return name

    def _op(self, hint: str, text: str, result: TensorType) -> Value:
        value = Value(self._fresh(f"{self._stage}.{hint}" if self._stage else hint), result)
        self.lines.append(f'{value} = {text} loc("{self._stage}")')
        return value

    def argument(self, name: str, shape, dtype: str = "f32", abi_name: str | None = None) -> Value:
        value = Value(self._fresh(name), TensorType(shape, dtype))
        self.arguments.append((value, abi_name or name))
        return value

    def call_zero(self) -> Value | None:
        """0.0, an f32 scalar computed from the function's first integer argument of static
        shape (its first element times 0): a value no compiler can fold or move out of the
        call, to make what is added to it a per-call computation; None when no argument
        serves. Built once per function, at its first use."""
        if self._call_zero is None:
            arg = next((a for a, _ in self.arguments if a.dtype in ("i32", "i64") and is_static(a.shape)), None)
            if arg is None:
                return None
            first = self.reshape(self.slice(arg, [0] * arg.rank, [1] * arg.rank, hint="call_first"), (),
                                 hint="call_first") if arg.rank else arg
            self._call_zero = self.multiply(self.convert(first, "f32", hint="call_zero"),
                                            self.constant(0.0, ()), hint="call_zero")
        return self._call_zero

    def parameter(self, name: str, shape, dtype: str, key: str, scope: str = "model") -> Value:
        """An immutable module global read from a parameter archive (`scope::key`), loaded
        here. IREE hoists work that depends only on such globals (e.g. packing a weight into
        the data-tiled layout) out of the function, into module initialization."""
        t = TensorType(shape, dtype)
        symbol = self._fresh("global." + name)
        self.globals.append(f'util.global private @{symbol} = #stream.parameter.named<"{scope}"::"{key}"> : {t}')
        value = Value(self._fresh(name), t)
        self.lines.append(f'{value} = util.global.load @{symbol} : {t} loc("{key}")')
        return value

    def state(self, name: str, shape, dtype: str = "f32") -> tuple[str, TensorType]:
        """A mutable module global, zero at module load (e.g. a KV cache that stays on the
        device between calls); returns (symbol, type) for `load_state` / `store_state`."""
        t = TensorType(shape, dtype)
        symbol = self._fresh("state." + name)
        zero = float_literal(0.0, dtype) if dtype in ("f32", "bf16") else "0"
        self.globals.append(f"util.global private mutable @{symbol} = dense<{zero}> : {t}")
        return symbol, t

    def load_state(self, state: tuple[str, TensorType], hint: str | None = None) -> Value:
        symbol, t = state
        return self._op(hint or symbol, f"util.global.load @{symbol} : {t}", t)

    def store_state(self, value: Value, state: tuple[str, TensorType]) -> None:
        symbol, t = state
        if value.type != t:
            raise BuildError(f"store_state: {value.type} into @{symbol} of {t}")
        self.lines.append(f'util.global.store {value}, @{symbol} : {t} loc("{self._stage}")')

    # -- run-time dimensions -----------------------------------------------------
    def bind(self, base: str, size: Value) -> None:
        """Dims of `base` are `scale` times `size` (a scalar i32) in what is built from here."""
        self.extents[base] = size

    def dimension_size(self, x: Value, axis: int, hint=None) -> Value:
        """x's size along `axis`, scalar i32."""
        t = TensorType((), "i32")
        return self._op(hint or "dim", f"stablehlo.get_dimension_size {x}, dim = {axis} : ({x.type}) -> {t}", t)

    def size(self, d) -> Value:
        """A dimension's size (an int or a bound Dim), scalar i32."""
        if not isinstance(d, Dim):
            return self.constant(d, (), "i32", hint="size")
        if d.base not in self.extents:
            raise BuildError(f"run-time dimension {d.base!r} used before it is bound")
        base = self.extents[d.base]
        return base if d.scale == 1 else self.multiply(base, self.constant(d.scale, (), "i32", hint="scale"),
                                                       hint="size")

    def shape_tensor(self, shape) -> Value:
        """A shape (ints and bound Dims) as a [rank] i32 value, the operand of a dynamic op."""
        parts = [self.reshape(self.size(d), (1,), hint="shape") for d in shape]
        return parts[0] if len(parts) == 1 else self.concatenate(parts, 0, hint="shape")

    def dispatch(self, executable: str, text: str, export: str, operands: list[Value], result: TensorType,
                 workload: int, hint: str = "dispatch") -> Value:
        """A `flow.dispatch` of export `@export` of a hand-written `stream.executable`
        `@executable` (its MLIR `text`, added to the module once) on `operands`, with
        `workload` passed to the export's workgroup-count region (e.g. emitter/kernel_calls.py).
        An operand of run-time shape carries its dims (`{%d}`), and each such dim is passed
        after the operands too, an `index` argument of the export's function, in order."""
        if f"@{executable} " not in text:
            raise BuildError(f"dispatch: the executable text does not define @{executable}")
        if text not in self.globals:
            self.globals.append(text)
        count = self._fresh(f"{self._stage}.{hint}.workload" if self._stage else f"{hint}.workload")
        self.lines.append(f'%{count} = arith.constant {int(workload)} : index loc("{self._stage}")')
        types, dims = [], []
        for v in operands:
            mine = [self._index(self.size(d), hint) for d in v.shape if isinstance(d, Dim)]
            types.append(f"{v.type}{{{', '.join(mine)}}}" if mine else str(v.type))
            dims += mine
        return self._op(hint, f"flow.dispatch @{executable}::@{export}[%{count}]"
                              f"({', '.join([*map(str, operands), *dims])}) : "
                              f"({', '.join([*types, *['index'] * len(dims)])}) -> {result}", result)

    # -- checks ------------------------------------------------------------
    @staticmethod
    def _same(op: str, *values: Value) -> TensorType:
        first = values[0].type
        for v in values[1:]:
            if v.type != first:
                raise BuildError(f"{op}: operand types differ: {first} vs {v.type}")
        return first

    # -- constants and iota ------------------------------------------------
    def constant(self, value: float | int, shape=(), dtype: str = "f32", hint: str = "const") -> Value:
        """A splat constant (of a shape with run-time dims: a scalar one broadcast)."""
        if not is_static(shape):
            return self.broadcast_in_dim(self.constant(value, (), dtype, hint), shape, [], hint=hint)
        literal = float_literal(value, dtype) if dtype in ("f32", "bf16") else str(int(value))
        t = TensorType(shape, dtype)
        return self._op(hint, f"stablehlo.constant dense<{literal}> : {t}", t)

    def constant_array(self, values: np.ndarray, hint: str = "const") -> Value:
        """A dense 1-D f32 constant (exact: each element printed to round-trip)."""
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        t = TensorType((values.size,), "f32")
        body = ", ".join(float_literal(v) for v in values)
        return self._op(hint, f"stablehlo.constant dense<[{body}]> : {t}", t)

    def iota(self, shape, dim: int, dtype: str = "i32", hint: str = "iota") -> Value:
        t = TensorType(shape, dtype)
        if not 0 <= dim < len(t.shape):
            raise BuildError(f"iota: dim {dim} out of {t}")
        if not is_static(t.shape):
            s = self.shape_tensor(t.shape)
            return self._op(hint, f"stablehlo.dynamic_iota {s}, dim = {dim} : ({s.type}) -> {t}", t)
        return self._op(hint, f"stablehlo.iota dim = {dim} : {t}", t)

    # -- elementwise ------------------------------------------------------
    def _binary(self, op: str, a: Value, b: Value, hint: str | None) -> Value:
        t = self._same(op, a, b)
        return self._op(hint or op, f"stablehlo.{op} {a}, {b} : {t}", t)

    def add(self, a, b, hint=None): return self._binary("add", a, b, hint)
    def subtract(self, a, b, hint=None): return self._binary("subtract", a, b, hint)
    def multiply(self, a, b, hint=None): return self._binary("multiply", a, b, hint)
    def divide(self, a, b, hint=None): return self._binary("divide", a, b, hint)
    def remainder(self, a, b, hint=None): return self._binary("remainder", a, b, hint)
    def maximum(self, a, b, hint=None): return self._binary("maximum", a, b, hint)
    # integers' bits (packed codes): and, or, shifts by a tensor of counts
    def bit_and(self, a, b, hint=None): return self._binary("and", a, b, hint)
    def bit_or(self, a, b, hint=None): return self._binary("or", a, b, hint)
    def shift_left(self, a, b, hint=None): return self._binary("shift_left", a, b, hint)
    def shift_right_logical(self, a, b, hint=None): return self._binary("shift_right_logical", a, b, hint)

    def _unary(self, op: str, x: Value, hint: str | None) -> Value:
        return self._op(hint or op.split(".")[-1], f"{op} {x} : {x.type}", x.type)

    def negate(self, x, hint=None): return self._unary("stablehlo.negate", x, hint)
    def abs(self, x, hint=None): return self._unary("stablehlo.abs", x, hint)
    def exponential(self, x, hint=None): return self._unary("stablehlo.exponential", x, hint)
    def tanh(self, x, hint=None): return self._unary("stablehlo.tanh", x, hint)
    def rsqrt(self, x, hint=None): return self._unary("stablehlo.rsqrt", x, hint)
    def cosine(self, x, hint=None): return self._unary("stablehlo.cosine", x, hint)
    def sine(self, x, hint=None): return self._unary("stablehlo.sine", x, hint)
    def round_even(self, x, hint=None): return self._unary("stablehlo.round_nearest_even", x, hint)

    def erf(self, x: Value, hint=None) -> Value:
        """chlo.erf: StableHLO has no erf of its own."""
        return self._op(hint or "erf", f"chlo.erf {x} : {x.type} -> {x.type}", x.type)

    def convert(self, x: Value, dtype: str, hint=None) -> Value:
        t = TensorType(x.shape, dtype)
        return self._op(hint or "convert", f"stablehlo.convert {x} : ({x.type}) -> {t}", t)

    def compare(self, direction: str, a: Value, b: Value, hint=None) -> Value:
        t = self._same("compare", a, b)
        if direction not in COMPARE_DIRECTIONS:
            raise BuildError(f"compare: direction {direction!r}, expected one of {COMPARE_DIRECTIONS}")
        kind = {"f32": "FLOAT", "i1": "UNSIGNED"}.get(t.dtype, "SIGNED")  # booleans compare unsigned
        result = TensorType(t.shape, "i1")
        return self._op(hint or "cmp", f"stablehlo.compare {direction}, {a}, {b}, {kind} : ({t}, {t}) -> {result}",
                        result)

    def select(self, pred: Value, on_true: Value, on_false: Value, hint=None) -> Value:
        t = self._same("select", on_true, on_false)
        if pred.shape != t.shape or pred.dtype != "i1":
            raise BuildError(f"select: predicate {pred.type} does not match {t}")
        return self._op(hint or "select", f"stablehlo.select {pred}, {on_true}, {on_false} : {pred.type}, {t}", t)

    # -- shape ops ------------------------------------------------------------
    def broadcast_in_dim(self, x: Value, shape, dims, hint=None) -> Value:
        shape, dims = tuple(shape), tuple(dims)
        if (len(dims) != x.rank or len(set(dims)) != len(dims) or any(not 0 <= d < len(shape) for d in dims)
                or any(x.shape[i] not in (1, shape[d]) for i, d in enumerate(dims))):
            raise BuildError(f"broadcast_in_dim: {x.type} cannot map to {shape} by dims {dims}")
        t = TensorType(shape, x.dtype)
        if not is_static(shape):
            s = self.shape_tensor(shape)
            expanding = [i for i, d in enumerate(dims) if x.shape[i] != shape[d]]
            same = [i for i, d in enumerate(dims) if x.shape[i] == shape[d]]
            attrs = (f"broadcast_dimensions = {array_attr(dims)}, known_expanding_dimensions = {array_attr(expanding)}, "
                     f"known_nonexpanding_dimensions = {array_attr(same)}")
            return self._op(hint or "bcast", f'"stablehlo.dynamic_broadcast_in_dim"({x}, {s}) {{{attrs}}} : '
                                             f"({x.type}, {s.type}) -> {t}", t)
        return self._op(hint or "bcast", f"stablehlo.broadcast_in_dim {x}, dims = [{ints_attr(dims)}] : ({x.type}) -> {t}", t)

    def reshape(self, x: Value, shape, hint=None) -> Value:
        t = TensorType(shape, x.dtype)
        if not same_count(t.shape, x.shape):
            raise BuildError(f"reshape: {x.type} has a different element count than {t}")
        if not (is_static(t.shape) and is_static(x.shape)):
            return self._dynamic_reshape(x, t, hint or "reshape")
        return self._op(hint or "reshape", f"stablehlo.reshape {x} : ({x.type}) -> {t}", t)

    def _dynamic_reshape(self, x: Value, t: TensorType, hint: str) -> Value:
        """A reshape with run-time dims: a collapse or an expansion of dims as tensor's
        own ops, which IREE fuses like static reshapes (any other of one base: a collapse to
        one dim, then an expansion); else `dynamic_reshape`."""
        collapse, expand = grouping(x.shape, t.shape), grouping(t.shape, x.shape)
        if collapse and len(t.shape) < x.rank:
            return self._op(hint, f"tensor.collapse_shape {x} {collapse} : {x.type} into {t}", t)
        if expand and len(t.shape) > x.rank:
            sizes = [str(d) if not isinstance(d, Dim) else self._index(self.size(d), hint) for d in t.shape]
            return self._op(hint, f"tensor.expand_shape {x} {expand} output_shape [{', '.join(sizes)}] : "
                                  f"{x.type} into {t}", t)
        factor, bases = count(x.shape)
        if len(bases) == 1 and x.rank > 1 and len(t.shape) > 1:
            flat = self._dynamic_reshape(x, TensorType((Dim(bases[0], factor),), x.dtype), hint)
            return self._dynamic_reshape(flat, t, hint)
        s = self.shape_tensor(t.shape)
        return self._op(hint, f"stablehlo.dynamic_reshape {x}, {s} : ({x.type}, {s.type}) -> {t}", t)

    def _index(self, size: Value, hint: str) -> str:
        """A scalar i32 value as an `index` SSA name (for tensor ops' sizes)."""
        element, index = (self._fresh(f"{self._stage}.{hint}_{n}") for n in ("i32", "index"))
        self.lines += [f'%{element} = tensor.extract {size}[] : {size.type} loc("{self._stage}")',
                       f'%{index} = arith.index_cast %{element} : i32 to index loc("{self._stage}")']
        return f"%{index}"

    def transpose(self, x: Value, perm, hint=None) -> Value:
        if sorted(perm) != list(range(x.rank)):
            raise BuildError(f"transpose: {list(perm)} is not a permutation of {x.rank} dims")
        t = TensorType([x.shape[p] for p in perm], x.dtype)
        return self._op(hint or "transpose", f"stablehlo.transpose {x}, dims = [{ints_attr(perm)}] : ({x.type}) -> {t}", t)

    def optimization_barrier(self, x: Value, hint=None) -> Value:
        """x unchanged, but the compiler fuses nothing across it: x is written out as it is,
        and what reads the result starts a new dispatch."""
        return self.tie_shape(self._op(hint or "barrier", f"stablehlo.optimization_barrier {x} : {x.type}", x.type),
                              hint or "barrier")

    def optimization_barriers(self, values: list[Value], hint=None) -> list[Value]:
        """`values` unchanged, through one barrier: whatever reads any result waits for all
        of them to be computed (an order the data alone does not impose)."""
        name = self._fresh(f"{self._stage}.{hint or 'barrier'}" if self._stage else hint or "barrier")
        operands, types = ", ".join(map(str, values)), ", ".join(str(v.type) for v in values)
        self.lines.append(f'%{name}:{len(values)} = stablehlo.optimization_barrier {operands} : {types} '
                          f'loc("{self._stage}")')
        return [self.tie_shape(Value(f"{name}#{i}", v.type), hint or "barrier") for i, v in enumerate(values)]

    def tie_shape(self, x: Value, hint: str = "tied") -> Value:
        """x with its run-time dims stated (`flow.tensor.tie_shape`), for a value whose op
        cannot tell IREE its shape (a barrier's result); x itself when its shape is static."""
        if is_static(x.shape):
            return x
        dims = [self._index(self.size(d), hint) for d in x.shape if isinstance(d, Dim)]
        return self._op(hint, f"flow.tensor.tie_shape {x} : {x.type}{{{', '.join(dims)}}}", x.type)

    def concatenate(self, values: list[Value], dim: int, hint=None) -> Value:
        if not values or not 0 <= dim < values[0].rank:
            raise BuildError(f"concatenate: dim {dim} of {[str(v.type) for v in values]}")
        first = values[0]
        for v in values[1:]:
            if v.dtype != first.dtype or v.rank != first.rank or any(
                    a != b for i, (a, b) in enumerate(zip(v.shape, first.shape)) if i != dim):
                raise BuildError(f"concatenate: {v.type} does not stack with {first.type} on dim {dim}")
        if not is_static([v.shape[dim] for v in values]):
            raise BuildError(f"concatenate: along run-time dim {dim} of {[str(v.type) for v in values]}")
        shape = list(first.shape)
        shape[dim] = sum(v.shape[dim] for v in values)
        t = TensorType(shape, first.dtype)
        operands = ", ".join(str(v) for v in values)
        types = ", ".join(str(v.type) for v in values)
        return self._op(hint or "concat", f"stablehlo.concatenate {operands}, dim = {dim} : ({types}) -> {t}", t)

    # -- control flow ------------------------------------------------------------
    def while_loop(self, init: list[Value], cond, body, hint: str = "loop") -> list[Value]:
        """stablehlo.while over the carried values `init`: `cond(*carried)` returns a scalar
        i1, `body(*carried)` the next carried values (same types). The regions may read any
        value built before the loop. Returns the final carried values."""
        name = self._fresh(f"{self._stage}.{hint}" if self._stage else hint)
        args = [Value(self._fresh(f"{name}.arg{i}"), v.type) for i, v in enumerate(init)]
        types = ", ".join(str(v.type) for v in init)

        def region(fn) -> tuple[list[str], list[Value]]:
            outer, self.lines = self.lines, []
            try:
                out = fn(*args)
            finally:
                lines, self.lines = self.lines, outer
            return lines, list(out) if isinstance(out, (list, tuple)) else [out]

        cond_lines, (pred,) = region(cond)
        body_lines, nexts = region(body)
        if pred.type != TensorType((), "i1") or [v.type for v in nexts] != [v.type for v in init]:
            raise BuildError(f"while_loop: cond gave {pred.type}, body {[str(v.type) for v in nexts]} for {types}")
        carried = ", ".join(f"{a} = {v}" for a, v in zip(args, init))
        self.lines.append(f"%{name}:{len(init)} = stablehlo.while({carried}) : {types}")
        self.lines += [" cond {", *("  " + line for line in cond_lines), f"  stablehlo.return {pred} : {pred.type}",
                       " } do {", *("  " + line for line in body_lines),
                       f"  stablehlo.return {', '.join(map(str, nexts))} : {types}", f' }} loc("{self._stage}")']
        return [Value(f"{name}#{i}", v.type) for i, v in enumerate(init)]

    def for_loop(self, count: Value, init: list[Value], body, hint: str = "loop") -> list[Value]:
        """`scf.for` i in [0, count) over the carried values `init` (any shapes, run-time dims
        included: IREE 3.13 carries a run-time shape through an scf.for, not a
        stablehlo.while): `body(i, *carried)`, i a scalar i32, returns the next carried
        values (same types). Returns the final carried values."""
        name = self._fresh(f"{self._stage}.{hint}" if self._stage else hint)
        bound = self._index(count, hint)
        iv = f"%{name}.iv"
        args = [Value(self._fresh(f"{name}.arg{i}"), v.type) for i, v in enumerate(init)]
        outer, self.lines = self.lines, []
        try:
            i32 = TensorType((), "i32")
            self.lines.append(f'%{name}.i32 = arith.index_cast {iv} : index to i32 loc("{self._stage}")')
            i = self._op("i", f"tensor.from_elements %{name}.i32 : {i32}", i32)
            out = body(i, *args)
        finally:
            lines, self.lines = self.lines, outer
        nexts = list(out) if isinstance(out, (list, tuple)) else [out]
        if [v.type for v in nexts] != [v.type for v in init]:
            raise BuildError(f"for_loop: body gave {[str(v.type) for v in nexts]} for {[str(v.type) for v in init]}")
        types = ", ".join(str(v.type) for v in init)
        carried = ", ".join(f"{a} = {v}" for a, v in zip(args, init))
        self.lines += [f'%{name}.zero = arith.constant 0 : index loc("{self._stage}")',
                       f'%{name}.one = arith.constant 1 : index loc("{self._stage}")',
                       f"%{name}:{len(init)} = scf.for {iv} = %{name}.zero to {bound} step %{name}.one "
                       f"iter_args({carried}) -> ({types}) {{",
                       *("  " + line for line in lines),
                       f"  scf.yield {', '.join(map(str, nexts))} : {types}", f'}} loc("{self._stage}")']
        return [Value(f"{name}#{i}", v.type) for i, v in enumerate(init)]

    # -- contractions and reductions --------------------------------------------
    def dot_general(self, a: Value, b: Value, contract: tuple[list, list], batch: tuple[list, list] = ([], []),
                    hint=None, result_dtype: str | None = None) -> Value:
        """Result dims: batch dims, then a's free dims, then b's free dims; the result
        dtype may be wider than the operands' (bf16 x bf16 -> f32 accumulates in f32), and
        one operand may be f32 beside a bf16, i8 or i4 one, or i8 beside i4 (`MIXED_DOTS`: widened
        inside the matmul)."""
        (ca, cb), (ba, bb) = contract, batch
        for dims, v in ((list(ca) + list(ba), a), (list(cb) + list(bb), b)):
            if len(set(dims)) != len(dims) or any(not 0 <= d < v.rank for d in dims):
                raise BuildError(f"dot_general: dims {dims} do not name distinct dims of {v.type}")
        if (a.dtype != b.dtype and {a.dtype, b.dtype} not in MIXED_DOTS) or [a.shape[i] for i in ca] != [b.shape[i] for i in cb] or \
                [a.shape[i] for i in ba] != [b.shape[i] for i in bb]:
            raise BuildError(f"dot_general: {a.type} x {b.type} cannot contract {contract} batch {batch}")
        free_a = [d for i, d in enumerate(a.shape) if i not in ca and i not in ba]
        free_b = [d for i, d in enumerate(b.shape) if i not in cb and i not in bb]
        t = TensorType([a.shape[i] for i in ba] + free_a + free_b, result_dtype or (a.dtype if a.dtype == b.dtype else "f32"))
        dims = f"contracting_dims = [{ints_attr(ca)}] x [{ints_attr(cb)}]"
        if ba:
            dims = f"batching_dims = [{ints_attr(ba)}] x [{ints_attr(bb)}], " + dims
        return self._op(hint or "dot", f"stablehlo.dot_general {a}, {b}, {dims} : ({a.type}, {b.type}) -> {t}", t)

    def reduce(self, x: Value, dims, kind: str = "add", hint=None) -> Value:
        """Sum (`add`) or max (`maximum`) over `dims`."""
        if (kind, x.dtype) not in REDUCE_INIT:
            raise BuildError(f"reduce: no {kind!r} reduction for {x.dtype}")
        if len(set(dims)) != len(dims) or any(not 0 <= d < x.rank for d in dims):
            raise BuildError(f"reduce: dims {list(dims)} do not name distinct dims of {x.type}")
        zero = self.constant(REDUCE_INIT[kind, x.dtype], (), x.dtype, hint=f"{kind}_init")
        t = TensorType([d for i, d in enumerate(x.shape) if i not in dims], x.dtype)
        return self._op(hint or f"reduce_{kind}",
                        f"stablehlo.reduce({x} init: {zero}) applies stablehlo.{kind} across dimensions = "
                        f"[{ints_attr(dims)}] : ({x.type}, {zero.type}) -> {t}", t)

    # -- conveniences built on the ops above ------------------------------------
    def broadcast_to(self, x: Value, shape, dims, hint=None) -> Value:
        return x if tuple(shape) == x.shape else self.broadcast_in_dim(x, shape, dims, hint)

    def scalar(self, value: float, like: Value, hint: str = "const") -> Value:
        """A constant splatted to the shape of `like` (StableHLO has no implicit broadcast)."""
        return self.constant(value, like.shape, like.dtype, hint=hint)
