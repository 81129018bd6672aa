"""PyTorch handlers for the random ops, drawn with a ``torch.Generator``.

A node with a ``seed`` attribute draws from a generator seeded with it (the same seed gives
the same numbers); otherwise from the module's generator (``ctx.generator``) or torch's
global one. Streams differ from numpy's (ONNX leaves them unspecified), so only
distributions, shapes and dtypes match other runtimes.
"""

from __future__ import annotations

import torch

from xconv.converters.ops.random import register_random_ops
from xconv.converters.torch.runtime.nn import seeded_generator
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import KERNEL


class _RandomKernel:
    """The torch side of :mod:`xconv.converters.ops.random`: generators from the seed."""

    dtype = staticmethod(KERNEL.dtype)

    @staticmethod
    def normal(ctx, shape, seed):
        return torch.randn(shape, generator=seeded_generator(ctx, seed), dtype=torch.float32)

    @staticmethod
    def uniform(ctx, shape, low, high, seed):
        sample = torch.rand(shape, generator=seeded_generator(ctx, seed), dtype=torch.float32)
        return sample * (high - low) + low

    @staticmethod
    def cast(x, dtype):
        return x.to(dtype)

    @staticmethod
    def is_float(dtype):
        return dtype.is_floating_point


register_random_ops(builtin, _RandomKernel(), REQUIRED)


@builtin("Bernoulli", since=15, attrs={"dtype": None, "seed": None})
def bernoulli(ctx, x, *, dtype, seed):
    """Bernoulli(input) -> 0/1 draws with probabilities ``input``, in ``dtype``."""
    out_dtype = KERNEL.dtype(ctx, dtype, x)
    p = x.to(torch.float32)
    return torch.bernoulli(p, generator=seeded_generator(ctx, seed)).to(out_dtype)


@builtin("Multinomial", since=7, attrs={"dtype": 6, "sample_size": 1, "seed": None})
def multinomial(ctx, x, *, dtype, sample_size, seed):
    """Multinomial(input [batch, classes] of log-probabilities) -> [batch, sample_size]."""
    out_dtype = KERNEL.dtype(ctx, dtype)
    if out_dtype not in (torch.int32, torch.int64):
        raise ctx.error(f"dtype must be int32 or int64, got {out_dtype}")
    if x.ndim != 2:
        raise ctx.error(f"input must be [batch_size, class_size], got shape {tuple(x.shape)}")
    probs = torch.softmax(x.to(torch.float32), dim=-1)
    draws = torch.multinomial(
        probs, int(sample_size), replacement=True, generator=seeded_generator(ctx, seed)
    )
    return draws.to(out_dtype)
