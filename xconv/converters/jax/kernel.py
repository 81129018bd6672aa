"""The JAX side of the shared op semantics (:mod:`xconv.converters.ops`): which namespace a
handler computes with, and the few primitives the array API lacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xconv.converters.ops.arrays import namespace, onnx_dtype

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


class JaxKernel:
    """numpy when every input is static (folded at trace time), else ``jax.numpy``."""

    overrides: dict = {}

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
