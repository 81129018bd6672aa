"""PyTorch handlers for the random ops, drawn with a ``torch.Generator``.

A node with a ``seed`` attribute draws from a generator seeded with it (the same seed gives
the same numbers); otherwise from the module's generator (``ctx.generator``) or torch's
global one. Streams differ from numpy's (ONNX leaves them unspecified), so only
distributions, shapes and dtypes match other runtimes.
"""

from __future__ import annotations

import onnx_ir as ir
import torch

from xconv.converters.torch.backend.dtypes import torch_dtype
from xconv.converters.torch.backend.nn import seeded_generator
from xconv.converters.torch.backend.registry import REQUIRED, builtin


def _dtype(ctx, dtype: int | None, like=None) -> torch.dtype:
    if dtype is None or dtype == 0:
        if like is None:
            raise ctx.error("dtype is required")
        return like.dtype
    try:
        return torch_dtype(ir.DataType(dtype))
    except (ValueError, KeyError) as e:
        raise ctx.error(f"unsupported dtype {dtype}: {e}") from e


def _check_float(ctx, dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point:
        raise ctx.error(f"random values must be floating point (float16/32/64), got {dtype}")
    return dtype


def _shape(ctx, shape) -> tuple[int, ...]:
    if any(int(d) < 0 for d in shape):
        raise ctx.error(f"shape {tuple(shape)} has negative dimensions")
    return tuple(int(d) for d in shape)


def _normal(ctx, shape, dtype, mean, scale, seed):
    dtype = _check_float(ctx, dtype)
    sample = torch.randn(shape, generator=seeded_generator(ctx, seed), dtype=torch.float32)
    return (sample * scale + mean).to(dtype)


def _uniform(ctx, shape, dtype, low, high, seed):
    dtype = _check_float(ctx, dtype)
    sample = torch.rand(shape, generator=seeded_generator(ctx, seed), dtype=torch.float32)
    return (sample * (high - low) + low).to(dtype)


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
    "RandomNormalLike", since=1, attrs={"dtype": None, "mean": 0.0, "scale": 1.0, "seed": None}
)
def random_normal_like(ctx, x, *, dtype, mean, scale, seed):
    """RandomNormalLike(input) -> N(mean, scale^2) samples shaped like input."""
    return _normal(ctx, tuple(x.shape), _dtype(ctx, dtype, x), mean, scale, seed)


@builtin("RandomUniformLike", since=1, attrs={"dtype": None, "high": 1.0, "low": 0.0, "seed": None})
def random_uniform_like(ctx, x, *, dtype, high, low, seed):
    """RandomUniformLike(input) -> U[low, high) samples shaped like input."""
    return _uniform(ctx, tuple(x.shape), _dtype(ctx, dtype, x), low, high, seed)


@builtin("Bernoulli", since=15, attrs={"dtype": None, "seed": None})
def bernoulli(ctx, x, *, dtype, seed):
    """Bernoulli(input) -> 0/1 draws with probabilities ``input``, in ``dtype``."""
    out_dtype = _dtype(ctx, dtype, x)
    p = x.to(torch.float32)
    return torch.bernoulli(p, generator=seeded_generator(ctx, seed)).to(out_dtype)


@builtin("Multinomial", since=7, attrs={"dtype": 6, "sample_size": 1, "seed": None})
def multinomial(ctx, x, *, dtype, sample_size, seed):
    """Multinomial(input [batch, classes] of log-probabilities) -> [batch, sample_size]."""
    out_dtype = _dtype(ctx, dtype)
    if out_dtype not in (torch.int32, torch.int64):
        raise ctx.error(f"dtype must be int32 or int64, got {out_dtype}")
    if x.ndim != 2:
        raise ctx.error(f"input must be [batch_size, class_size], got shape {tuple(x.shape)}")
    probs = torch.softmax(x.to(torch.float32), dim=-1)
    draws = torch.multinomial(
        probs, int(sample_size), replacement=True, generator=seeded_generator(ctx, seed)
    )
    return draws.to(out_dtype)
