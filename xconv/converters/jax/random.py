"""Random ops with explicit keys.

Each node draws from ``ctx.key(seed)``: its ``seed`` attribute when present, else the
``rng`` key passed to the converted function folded with the node's index. The same key
gives the same numbers; the streams differ from numpy's (ONNX leaves them unspecified), so
only distributions, shapes and dtypes match other runtimes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.random import register_random_ops


class _RandomKernel:
    """The JAX side of :mod:`xconv.converters.ops.random`: keys from ``ctx.key(seed)``."""

    dtype = staticmethod(KERNEL.dtype)

    @staticmethod
    def normal(ctx, shape, seed):
        return jax.random.normal(ctx.key(seed), shape, dtype=jnp.float32)

    @staticmethod
    def uniform(ctx, shape, low, high, seed):
        return jax.random.uniform(ctx.key(seed), shape, jnp.float32, minval=low, maxval=high)

    @staticmethod
    def cast(x, dtype):
        return x.astype(dtype)

    @staticmethod
    def is_float(dtype):
        return jnp.issubdtype(dtype, jnp.floating)


register_random_ops(builtin, _RandomKernel(), REQUIRED)


@builtin("Bernoulli", since=15, attrs={"dtype": None, "seed": None})
def bernoulli(ctx, x, *, dtype, seed):
    """Bernoulli(input) -> 0/1 draws with probabilities ``input``, in ``dtype``."""
    out_dtype = KERNEL.dtype(ctx, dtype, x)
    p = jnp.asarray(x).astype(jnp.float32)
    return jax.random.bernoulli(ctx.key(seed), p).astype(out_dtype)


@builtin("Multinomial", since=7, attrs={"dtype": 6, "sample_size": 1, "seed": None})
def multinomial(ctx, x, *, dtype, sample_size, seed):
    """Multinomial(input [batch, classes] of log-probabilities) -> [batch, sample_size]."""
    out_dtype = KERNEL.dtype(ctx, dtype)
    if out_dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise ctx.error(f"dtype must be int32 or int64, got {out_dtype}")
    logits = jnp.asarray(x).astype(jnp.float32)
    if logits.ndim != 2:
        raise ctx.error(f"input must be [batch_size, class_size], got shape {logits.shape}")
    draws = jax.random.categorical(
        ctx.key(seed), logits, axis=-1, shape=(int(sample_size), logits.shape[0])
    )
    return draws.T.astype(out_dtype)
