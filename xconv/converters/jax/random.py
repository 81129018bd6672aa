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
import onnx_ir as ir

from xconv.converters.jax.registry import REQUIRED, builtin


def _dtype(ctx, dtype: int | None, like=None) -> np.dtype:
    if dtype is None or dtype == 0:
        if like is None:
            raise ctx.error("dtype is required")
        return jnp.asarray(like).dtype
    try:
        return ir.DataType(dtype).numpy()
    except (ValueError, TypeError) as e:
        raise ctx.error(f"unsupported dtype {dtype}") from e


def _check_float(ctx, dtype: np.dtype) -> np.dtype:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ctx.error(f"random values must be floating point (float16/32/64), got {dtype}")
    return dtype


def _shape(ctx, shape) -> tuple[int, ...]:
    if any(int(d) < 0 for d in shape):
        raise ctx.error(f"shape {tuple(shape)} has negative dimensions")
    return tuple(int(d) for d in shape)


def _normal(ctx, shape, dtype, mean, scale, seed):
    dtype = _check_float(ctx, dtype)
    sample = jax.random.normal(ctx.key(seed), shape, dtype=jnp.float32)
    return (sample * scale + mean).astype(dtype)


def _uniform(ctx, shape, dtype, low, high, seed):
    dtype = _check_float(ctx, dtype)
    sample = jax.random.uniform(ctx.key(seed), shape, jnp.float32, minval=low, maxval=high)
    return sample.astype(dtype)


@builtin(
    "RandomNormal",
    since=1,
    attrs={"dtype": 1, "mean": 0.0, "scale": 1.0, "seed": None, "shape": REQUIRED},
)
def random_normal(ctx, *, dtype, mean, scale, seed, shape):
    """RandomNormal() -> samples of N(mean, scale^2) with the given shape and dtype."""
    return _normal(ctx, _shape(ctx, shape), _dtype(ctx, dtype), mean, scale, seed)


@builtin(
    "RandomUniform",
    since=1,
    attrs={"dtype": 1, "high": 1.0, "low": 0.0, "seed": None, "shape": REQUIRED},
)
def random_uniform(ctx, *, dtype, high, low, seed, shape):
    """RandomUniform() -> samples of U[low, high) with the given shape and dtype."""
    return _uniform(ctx, _shape(ctx, shape), _dtype(ctx, dtype), low, high, seed)


@builtin(
    "RandomNormalLike",
    since=1,
    attrs={"dtype": None, "mean": 0.0, "scale": 1.0, "seed": None},
)
def random_normal_like(ctx, x, *, dtype, mean, scale, seed):
    """RandomNormalLike(input) -> N(mean, scale^2) samples shaped like input."""
    return _normal(ctx, np.shape(x), _dtype(ctx, dtype, x), mean, scale, seed)


@builtin(
    "RandomUniformLike",
    since=1,
    attrs={"dtype": None, "high": 1.0, "low": 0.0, "seed": None},
)
def random_uniform_like(ctx, x, *, dtype, high, low, seed):
    """RandomUniformLike(input) -> U[low, high) samples shaped like input."""
    return _uniform(ctx, np.shape(x), _dtype(ctx, dtype, x), low, high, seed)


@builtin("Bernoulli", since=15, attrs={"dtype": None, "seed": None})
def bernoulli(ctx, x, *, dtype, seed):
    """Bernoulli(input) -> 0/1 draws with probabilities ``input``, in ``dtype``."""
    out_dtype = _dtype(ctx, dtype, x)
    p = jnp.asarray(x).astype(jnp.float32)
    return jax.random.bernoulli(ctx.key(seed), p).astype(out_dtype)


@builtin("Multinomial", since=7, attrs={"dtype": 6, "sample_size": 1, "seed": None})
def multinomial(ctx, x, *, dtype, sample_size, seed):
    """Multinomial(input [batch, classes] of log-probabilities) -> [batch, sample_size]."""
    out_dtype = _dtype(ctx, dtype)
    if out_dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise ctx.error(f"dtype must be int32 or int64, got {out_dtype}")
    logits = jnp.asarray(x).astype(jnp.float32)
    if logits.ndim != 2:
        raise ctx.error(f"input must be [batch_size, class_size], got shape {logits.shape}")
    draws = jax.random.categorical(
        ctx.key(seed), logits, axis=-1, shape=(int(sample_size), logits.shape[0])
    )
    return draws.T.astype(out_dtype)
