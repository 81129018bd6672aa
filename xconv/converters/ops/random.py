"""RandomNormal, RandomUniform and their ``*Like`` forms written once; the draws (JAX keys,
torch generators) come from the backend's :class:`RandomKernel`. Streams differ between
backends and from numpy's (ONNX leaves them unspecified): only distributions, shapes and
dtypes match. Bernoulli and Multinomial stay per backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class RandomKernel(Protocol):
    """What a backend provides for the random ops."""

    def dtype(self, ctx, code: int | None, like: Any = None) -> Any:
        """The backend dtype of ONNX type ``code`` (``like``'s when 0 or absent)."""

    def normal(self, ctx, shape: tuple[int, ...], seed: float | None) -> Any:
        """float32 samples of N(0, 1)."""

    def uniform(self, ctx, shape: tuple[int, ...], low: float, high: float, seed) -> Any:
        """float32 samples of U[low, high)."""

    def cast(self, x: Any, dtype: Any) -> Any: ...

    def is_float(self, dtype: Any) -> bool:
        """Whether the backend dtype is a floating-point type (bfloat16 included)."""


def _shape(ctx, shape) -> tuple[int, ...]:
    if any(int(d) < 0 for d in shape):
        raise ctx.error(f"shape {tuple(shape)} has negative dimensions")
    return tuple(int(d) for d in shape)


def _check_float(ctx, k: RandomKernel, dtype: Any) -> Any:
    if not k.is_float(dtype):
        raise ctx.error(f"random values must be floating point (float16/32/64), got {dtype}")
    return dtype


def register_random_ops(builtin: Callable[..., Any], k: RandomKernel, required: Any) -> None:
    """Register the normal and uniform draws with a backend's ``builtin`` and kernel ``k``."""

    def normal(ctx, shape, dtype, mean, scale, seed):
        dtype = _check_float(ctx, k, dtype)
        return k.cast(k.normal(ctx, shape, seed) * scale + mean, dtype)

    def uniform(ctx, shape, dtype, low, high, seed):
        dtype = _check_float(ctx, k, dtype)
        return k.cast(k.uniform(ctx, shape, low, high, seed), dtype)

    @builtin(
        "RandomNormal",
        since=1,
        attrs={"dtype": 1, "mean": 0.0, "scale": 1.0, "seed": None, "shape": required},
    )
    def random_normal(ctx, *, dtype, mean, scale, seed, shape):
        """RandomNormal() -> samples of N(mean, scale^2) with the given shape and dtype."""
        return normal(ctx, _shape(ctx, shape), k.dtype(ctx, dtype), mean, scale, seed)

    @builtin(
        "RandomUniform",
        since=1,
        attrs={"dtype": 1, "high": 1.0, "low": 0.0, "seed": None, "shape": required},
    )
    def random_uniform(ctx, *, dtype, high, low, seed, shape):
        """RandomUniform() -> samples of U[low, high) with the given shape and dtype."""
        return uniform(ctx, _shape(ctx, shape), k.dtype(ctx, dtype), low, high, seed)

    @builtin(
        "RandomNormalLike",
        since=1,
        attrs={"dtype": None, "mean": 0.0, "scale": 1.0, "seed": None},
    )
    def random_normal_like(ctx, x, *, dtype, mean, scale, seed):
        """RandomNormalLike(input) -> N(mean, scale^2) samples shaped like input."""
        return normal(ctx, tuple(np.shape(x)), k.dtype(ctx, dtype, x), mean, scale, seed)

    @builtin(
        "RandomUniformLike",
        since=1,
        attrs={"dtype": None, "high": 1.0, "low": 0.0, "seed": None},
    )
    def random_uniform_like(ctx, x, *, dtype, high, low, seed):
        """RandomUniformLike(input) -> U[low, high) samples shaped like input."""
        return uniform(ctx, tuple(np.shape(x)), k.dtype(ctx, dtype, x), low, high, seed)
