"""JAX handlers: the Reduce* family and ArgMax / ArgMin.

Every Reduce* op takes its axes as an attribute in old opsets and as an (optional, static)
input in new ones (ReduceSum from 13, the others from 18); one handler per op declares the
union. Empty ``axes`` reduce over every axis, unless ``noop_with_empty_axes`` is set, in
which case only the op's elementwise part applies (``|x|`` for ReduceL1, ``x*x`` for
ReduceSumSquare, ...), as the ONNX reference does. Reductions over an empty set give the
identity element (0 for sums, 1 for products, -inf / the dtype minimum for ReduceMax, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xconv.converters.jax.linalg import index_dtype
from xconv.converters.jax.registry import builtin
from xconv.converters.ops.arrays import normalize_axis

_REDUCE_ATTRS = {"axes": None, "keepdims": 1, "noop_with_empty_axes": 0}


def _lowest(dtype: np.dtype):
    if dtype == np.bool_:
        return False
    if dtype.kind in "iu":
        return np.iinfo(dtype).min
    return -np.inf


def _highest(dtype: np.dtype):
    if dtype == np.bool_:
        return True
    if dtype.kind in "iu":
        return np.iinfo(dtype).max
    return np.inf


def _axes(ctx, x, axes_input, axes_attr, noop: int) -> tuple[int, ...] | None:
    """The normalised axes to reduce; ``()`` means no reduction, None means all axes."""
    if axes_input is not None:
        axes = [int(a) for a in ctx.static(axes_input, "axes").reshape(-1)]
    elif axes_attr is not None:
        axes = [int(a) for a in axes_attr]
    else:
        axes = []
    if not axes:
        return () if noop else None
    return tuple(sorted({normalize_axis(ctx, a, x.ndim) for a in axes}))


def _reduce(
    fn: Callable[[jax.Array, tuple[int, ...] | None, bool], jax.Array],
) -> Callable[..., jax.Array]:
    def handler(ctx, x, axes_input=None, **attrs):
        x = jnp.asarray(x)
        ax = _axes(ctx, x, axes_input, attrs["axes"], attrs["noop_with_empty_axes"])
        keepdims = bool(attrs["keepdims"])
        return fn(x, ax, keepdims).astype(x.dtype)

    return handler


def _max(x, ax, keepdims):
    return jnp.max(x, axis=ax, keepdims=keepdims, initial=_lowest(x.dtype))


def _min(x, ax, keepdims):
    return jnp.min(x, axis=ax, keepdims=keepdims, initial=_highest(x.dtype))


def _log_sum_exp(x, ax, keepdims):
    # Shift by the (finite) maximum for stability; an empty or all -inf set gives -inf.
    mx = jnp.max(x, axis=ax, keepdims=True, initial=-np.inf)
    mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, jnp.zeros((), x.dtype)))
    out = jnp.log(jnp.sum(jnp.exp(x - mx), axis=ax, keepdims=True)) + mx
    if not keepdims:
        out = jnp.squeeze(out, axis=tuple(range(x.ndim)) if ax is None else ax)
    return out


_REDUCERS: dict[str, tuple[int, Callable]] = {
    # op: (first opset taking axes as an input, fn(x, axes, keepdims))
    "ReduceSum": (13, lambda x, a, k: jnp.sum(x, axis=a, keepdims=k)),
    "ReduceMean": (18, lambda x, a, k: jnp.mean(x, axis=a, keepdims=k)),
    "ReduceMax": (18, _max),
    "ReduceMin": (18, _min),
    "ReduceProd": (18, lambda x, a, k: jnp.prod(x, axis=a, keepdims=k)),
    "ReduceL1": (18, lambda x, a, k: jnp.sum(jnp.abs(x), axis=a, keepdims=k)),
    "ReduceL2": (18, lambda x, a, k: jnp.sqrt(jnp.sum(x * x, axis=a, keepdims=k))),
    "ReduceLogSum": (18, lambda x, a, k: jnp.log(jnp.sum(x, axis=a, keepdims=k))),
    "ReduceLogSumExp": (18, _log_sum_exp),
    "ReduceSumSquare": (18, lambda x, a, k: jnp.sum(x * x, axis=a, keepdims=k)),
}

for _op, (_since_input, _fn) in _REDUCERS.items():
    _handler = _reduce(_fn)
    _handler.__name__ = f"{_op}_handler"
    _handler.__doc__ = (
        f"{_op}(data, axes?) -> reduced: axes as an attribute before opset {_since_input}, "
        "as an input from it; keepdims and noop_with_empty_axes as in the ONNX spec."
    )
    builtin(_op, since=1, attrs=_REDUCE_ATTRS)(_handler)


# --------------------------------------------------------------------------------------
# ArgMax / ArgMin


def _arg(ctx, x, axis, keepdims, select_last_index, fn):
    x = jnp.asarray(x)
    ax = normalize_axis(ctx, axis, x.ndim)
    if select_last_index:
        n = x.shape[ax]
        idx = (n - 1) - fn(jnp.flip(x, ax), axis=ax, keepdims=bool(keepdims))
    else:
        idx = fn(x, axis=ax, keepdims=bool(keepdims))
    return idx.astype(index_dtype())


_ARG_ATTRS = {"axis": 0, "keepdims": 1, "select_last_index": 0}


@builtin("ArgMax", since=1, attrs=_ARG_ATTRS)
def argmax(ctx, x, *, axis, keepdims, select_last_index):
    """ArgMax(data) -> reduced (int64): index of the first (or last) maximum along ``axis``."""
    return _arg(ctx, x, axis, keepdims, select_last_index, jnp.argmax)


@builtin("ArgMin", since=1, attrs=_ARG_ATTRS)
def argmin(ctx, x, *, axis, keepdims, select_last_index):
    """ArgMin(data) -> reduced (int64): index of the first (or last) minimum along ``axis``."""
    return _arg(ctx, x, axis, keepdims, select_last_index, jnp.argmin)
