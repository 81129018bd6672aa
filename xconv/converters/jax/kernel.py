"""The JAX side of the shared op semantics (:mod:`xconv.converters.ops`): which namespace a
handler computes with, and the few primitives the array API lacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xconv.converters.ops.arrays import namespace, onnx_dtype
from xconv.converters.ops.indexing import SELECT_ROWS

# This module imports no handler module (they import it): importing any one handler module
# on its own then works (the registry imports the rest).


def index_dtype() -> np.dtype:
    """int64 when JAX runs with 64-bit types, else int32 (ONNX index outputs are int64)."""
    return jax.dtypes.canonicalize_dtype(np.int64)


def reference_sum(x, axis: int):
    """Sum along ``axis`` keeping the dimension, accumulating as the ONNX reference does.

    bfloat16 accumulates in bfloat16 (numpy's ml_dtypes loop rounds after every add), where
    ``jnp.sum`` would accumulate in float32 and round differently; other types use jnp.sum.
    """
    if x.dtype == jnp.bfloat16:
        out = lax.reduce(x, jnp.zeros((), x.dtype), lax.add, (axis % x.ndim,))
        return jnp.expand_dims(out, axis)
    return jnp.sum(x, axis=axis, keepdims=True)


def take(x, idx, axis: int):
    """Gather (on wrapped indices) for the shared op: ``jnp.take``, except from a float table
    of at most ``indexing.SELECT_ROWS`` rows along ``axis`` (a token-type embedding), which
    is a chain of ``jnp.where`` over its rows.

    Both give the table's values exactly. Their gradients differ: a take's is a scatter-add
    into the table, and on a GPU a bfloat16 scatter-add of many positions into few rows
    contends on the same addresses (BERT-base's 2-row token-type table, 16,384 positions at
    batch 128: 200 ms of a 243 ms bfloat16 training step on an H200, the step 30 ms without
    it); the selects' gradient is one masked sum per row. Indices outside the table (an
    error in ONNX) give its first row. A symbolic axis (``jax.export``'s shape polymorphism)
    is taken.
    """
    n = x.shape[axis]
    if not isinstance(n, int) or n > SELECT_ROWS or not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.take(x, idx, axis=axis)
    before, after = axis, x.ndim - axis - 1
    mask = jnp.reshape(idx, (1,) * before + tuple(idx.shape) + (1,) * after)

    def row(r):
        at = (slice(None),) * axis + (r,)
        return jnp.reshape(x[at], x.shape[:axis] + (1,) * idx.ndim + x.shape[axis + 1 :])

    shape = x.shape[:axis] + tuple(idx.shape) + x.shape[axis + 1 :]
    out = jnp.broadcast_to(row(0), shape)
    for r in range(1, n):
        out = jnp.where(mask == r, row(r), out)
    return out


class JaxKernel:
    """numpy when every input is static (folded at trace time), else ``jax.numpy``."""

    overrides: dict = {"Gather": take}

    @staticmethod
    def run(fn, *arrays):
        xp = namespace(jnp, *arrays)
        if xp is np:
            with np.errstate(all="ignore"):
                return fn(np, *(None if a is None else np.asarray(a) for a in arrays))
        return fn(jnp, *(None if a is None else jnp.asarray(a) for a in arrays))

    @staticmethod
    def index_dtype(xp):
        return index_dtype()

    @staticmethod
    def arange(xp, n, like):
        return xp.arange(n)

    @staticmethod
    def rsqrt(xp, x):
        return lax.rsqrt(x) if xp is jnp else 1 / np.sqrt(x)

    @staticmethod
    def constant(a, like=None):
        return a  # numpy: folded at trace time

    @staticmethod
    def pad(y, widths, mode, fill):
        """``y`` padded by non-negative widths (``fill``: a number or a 0-d array)."""
        scalar = isinstance(fill, float | int)
        xp = namespace(jnp, y, None if scalar else fill)
        if mode != "constant":
            return xp.pad(y, widths, mode=mode)
        if not scalar and np.ndim(fill):
            fill = fill.reshape(())
        if xp is np:
            return np.pad(y, widths, mode="constant", constant_values=np.asarray(fill))
        return jnp.pad(y, widths, mode="constant", constant_values=jnp.asarray(fill, y.dtype))

    @staticmethod
    def dtype(ctx, code, like=None):
        """The numpy dtype of ONNX type ``code`` (``like``'s when 0 or absent)."""
        if like is not None and not hasattr(like, "dtype"):
            like = np.asarray(like)
        return onnx_dtype(ctx, code, lambda t: np.dtype(t.numpy()), like)

    @staticmethod
    def materialize(xp, x):
        return x


KERNEL = JaxKernel()
