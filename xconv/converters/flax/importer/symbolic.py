"""Symbolic (shape-polymorphic) dimensions in the Flax / JAX frontend.

With ``dynamic_batch`` the importer traces with ``jax.export.symbolic_shape("batch")`` as the
leading dimension of every batched input (and ``seq`` as dim 1 of token-id inputs, when
``jax.export`` can trace the model so), so jaxpr shapes hold ``_DimExpr`` values (``batch``,
``2*batch``, …) instead of the example's integers. Handlers turn such shapes into IR values
computed at run time from the graph input's ``Shape``; fully static shapes stay literal
constants, exactly as before.

Every dimension value built here is a 1-D int64 tensor of one element, so shape vectors are
one ``Concat`` of constant runs and symbolic pieces.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.errors import ConversionError

#: The one symbol shared by the leading dimension of every batched input.
BATCH = "batch"
#: The symbol shared by dim 1 of every integer (token id) input of rank >= 2.
SEQ = "seq"


class SymbolicShapeError(ConversionError):
    """A handler met a symbolic dimension it can only take as a static integer."""


def static_dim(d: Any) -> int | None:
    """``d`` as an int when it is a constant dimension, else None."""
    try:
        return operator.index(d)
    except TypeError:
        return None


def is_static(dims: Sequence[Any]) -> bool:
    return all(static_dim(d) is not None for d in dims)


def dims(var: Any) -> tuple[Any, ...]:
    """A jaxpr variable's shape: ints where constant, the symbolic expression elsewhere."""
    return as_dims(var.aval.shape)


def as_dims(shape: Sequence[Any]) -> tuple[Any, ...]:
    """A shape parameter: ints where constant, the symbolic expression elsewhere."""
    return tuple(_norm(d) for d in shape)


def _norm(d: Any) -> Any:
    k = static_dim(d)
    return d if k is None else k


def require_static(dims_: Sequence[Any], what: str) -> list[int]:
    """``dims_`` as ints, or a ``SymbolicShapeError`` naming ``what``."""
    out = [static_dim(d) for d in dims_]
    if any(k is None for k in out):
        raise SymbolicShapeError(
            f"{what} needs static sizes, got {tuple(str(d) for d in dims_)}; convert with "
            "dynamic_batch=False to trace at the example's batch size"
        )
    return [int(k) for k in out]  # type: ignore[arg-type]


def ir_dim(d: Any) -> int | str:
    """A jaxpr dimension as an ``ir.Shape`` entry (an int or a symbol name)."""
    k = static_dim(d)
    return k if k is not None else str(d)


class _Dim:
    """A run-time dimension (1-D int64 IR value of one element) that ``_DimExpr`` evaluates with."""

    def __init__(self, ctx: Any, value: ir.Value):
        self.ctx = ctx
        self.value = value

    def _lift(self, other: Any) -> ir.Value:
        if isinstance(other, _Dim):
            return other.value
        return self.ctx.i64([int(other)])

    def _op(self, op: str, a: Any, b: Any, attrs: dict | None = None) -> _Dim:
        return _Dim(self.ctx, self.ctx.op(op, [self._lift(a), self._lift(b)], attrs))

    def __add__(self, other: Any) -> _Dim:
        return self._op("Add", self, other)

    __radd__ = __add__

    def __mul__(self, other: Any) -> _Dim:
        return self._op("Mul", self, other)

    __rmul__ = __mul__

    def __sub__(self, other: Any) -> _Dim:
        return self._op("Sub", self, other)

    def __rsub__(self, other: Any) -> _Dim:
        return self._op("Sub", other, self)

    def __mod__(self, other: Any) -> _Dim:
        return self._op("Mod", self, other)  # fmod=0: the divisor's sign, like Python

    def __rmod__(self, other: Any) -> _Dim:
        return self._op("Mod", other, self)

    def __floordiv__(self, other: Any) -> _Dim:
        # Exact floor division: (a - a mod b) / b, since Div truncates towards zero.
        diff = self - (self % other)
        return diff._op("Div", diff, other)

    def __rfloordiv__(self, other: Any) -> _Dim:
        num = _Dim(self.ctx, self._lift(other))
        return num // self

    def __divmod__(self, other: Any) -> tuple[_Dim, _Dim]:
        return self // other, self % other

    def __rdivmod__(self, other: Any) -> tuple[_Dim, _Dim]:
        num = _Dim(self.ctx, self._lift(other))
        return num // self, num % self


def dim_value(ctx: Any, d: Any) -> ir.Value:
    """A dimension (int or ``_DimExpr``) as a 1-D int64 IR value of one element."""
    k = static_dim(d)
    if k is not None:
        return ctx.i64([k])
    env = {name: _Dim(ctx, symbol_value(ctx, name)) for name in _vars(d)}
    try:
        out = d._evaluate(env)  # jax's own evaluator, run over IR values
    except Exception as e:
        raise SymbolicShapeError(f"cannot compute the dimension {d} at run time: {e}") from e
    if isinstance(out, _Dim):
        return out.value
    return ctx.i64([int(out)])


def _vars(d: Any) -> list[str]:
    get = getattr(d, "_get_vars", None)
    if get is None:
        raise SymbolicShapeError(f"unknown kind of symbolic dimension {d!r}")
    return sorted(get())


def symbol_value(ctx: Any, name: str) -> ir.Value:
    """The run-time value of symbol ``name``: ``Shape(input)[axis]``, built once per graph."""
    key = (id(ctx.graph), name)
    cached = ctx.dim_cache.get(key)
    if cached is not None:
        return cached
    source = ctx.dim_sources.get(name)
    if source is None:
        raise SymbolicShapeError(f"the symbolic dimension {name!r} appears in no graph input")
    value, axis = source
    out = ctx.op("Shape", [value], {"start": axis, "end": axis + 1})
    ctx.dim_cache[key] = out
    return out


def shape_value(ctx: Any, dims_: Sequence[Any]) -> ir.Value:
    """A shape vector: one int64 constant when static, else constant runs and symbolic dims."""
    if is_static(dims_):
        return ctx.i64([int(d) for d in dims_])
    pieces: list[ir.Value] = []
    run: list[int] = []
    for d in dims_:
        k = static_dim(d)
        if k is not None:
            run.append(k)
            continue
        if run:
            pieces.append(ctx.i64(run))
            run = []
        pieces.append(dim_value(ctx, d))
    if run:
        pieces.append(ctx.i64(run))
    return ctx.op("Concat", pieces, {"axis": 0}) if len(pieces) > 1 else pieces[0]


def reshape_target(ctx: Any, dims_: Sequence[Any]) -> ir.Value:
    """A ``Reshape`` shape: a single symbolic dim is written as ``-1`` (exact: ONNX infers it
    from the element count) unless a static dim is 0, where the count says nothing."""
    symbolic = [d for d in dims_ if static_dim(d) is None]
    if len(symbolic) == 1 and all(static_dim(d) != 0 for d in dims_ if d is not symbolic[0]):
        return ctx.i64([-1 if static_dim(d) is None else int(d) for d in dims_])
    return shape_value(ctx, dims_)


def expand_target(ctx: Any, in_dims: Sequence[Any], out_dims: Sequence[Any]) -> ir.Value:
    """An ``Expand`` shape for an input of ``in_dims`` (same rank). ONNX's Expand broadcasts
    both ways, so a symbolic dim the input already has is written as 1."""
    target = [
        1 if static_dim(o) is None and o == i else o for i, o in zip(in_dims, out_dims, strict=True)
    ]
    return shape_value(ctx, target)


def symbolic_specs(inputs: tuple, dynamic_batch: bool, seq: bool = False) -> tuple[tuple, bool]:
    """``inputs`` as ``jax.ShapeDtypeStruct`` with a symbolic ``batch`` leading dim.

    Every array input whose leading dim equals the first batched input's becomes batched;
    scalars and inputs with another leading size keep their example shape. With ``seq``,
    dim 1 of every integer input of rank >= 2 (token ids) whose size equals the first such
    input's becomes the symbol ``seq`` too. Returns the specs and whether any input was made
    symbolic (with ``seq``: whether any got ``seq``).
    """
    import jax
    from jax import export

    if not dynamic_batch:
        return inputs, False
    shapes = [np.shape(x) for x in inputs]
    lead = next((s[0] for s in shapes if len(s) >= 1), None)
    if lead is None:
        return inputs, False
    dtypes = [x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype for x in inputs]
    length = None
    if seq:
        length = next(
            (s[1] for s, t in zip(shapes, dtypes, strict=True) if _is_tokens(s, t, lead)), None
        )
        if length is None:
            return inputs, False
    batch, seq_dim = export.symbolic_shape(f"{BATCH}, {SEQ}")  # one scope for both
    specs = []
    any_symbolic = False
    for s, dtype in zip(shapes, dtypes, strict=True):
        if len(s) >= 1 and s[0] == lead:
            shape = [batch, *s[1:]]
            if length is not None and _is_tokens(s, dtype, lead) and s[1] == length:
                shape[1] = seq_dim
            specs.append(jax.ShapeDtypeStruct(tuple(shape), dtype))
            any_symbolic = True
        else:
            specs.append(jax.ShapeDtypeStruct(tuple(s), dtype))
    return tuple(specs), any_symbolic


def _is_tokens(shape: tuple, dtype: Any, lead: int) -> bool:
    """An integer array of rank >= 2 batched like the others: token ids, dim 1 a sequence."""
    return len(shape) >= 2 and shape[0] == lead and np.dtype(dtype).kind in "iu"


__all__ = [
    "BATCH",
    "SEQ",
    "as_dims",
    "SymbolicShapeError",
    "dim_value",
    "dims",
    "expand_target",
    "ir_dim",
    "is_static",
    "require_static",
    "reshape_target",
    "shape_value",
    "static_dim",
    "symbol_value",
    "symbolic_specs",
]
