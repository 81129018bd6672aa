"""torch under numpy's names: the array namespace ``xp`` that shared op semantics
(:mod:`xconv.converters.ops`) compute with on the torch backend.

Only what the shared ops use; each function takes numpy's arguments (``axis``, ``keepdims``,
tuples of axes, an empty tuple meaning no reduction) and returns torch tensors.
:func:`run` picks numpy instead for arrays torch cannot compute with (wide unsigned types,
numpy strings).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from xconv.converters.ops.arrays import namespace, onnx_dtype
from xconv.converters.torch.runtime.dtypes import (
    FLOAT4,
    SUB_BYTE,
    float4_values,
    narrow,
    numpy_only,
    to_numpy,
    to_tensor,
    torch_dtype,
    widen,
)


def as_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return to_numpy(x)
    return np.asarray(x)


def from_numpy(y: Any, like: Any = None) -> Any:
    """A numpy result back to a tensor (on ``like``'s device); strings stay numpy."""
    y = np.asarray(y)
    out = to_tensor(y)
    if isinstance(out, torch.Tensor) and isinstance(like, torch.Tensor):
        out = out.to(like.device)
    return out


bool_ = torch.bool
float16 = torch.float16
bfloat16 = torch.bfloat16
float32 = torch.float32
float64 = torch.float64
int32 = torch.int32
uint8 = torch.uint8
triu = torch.triu
tril = torch.tril
int64 = torch.int64
iinfo = torch.iinfo
abs = torch.abs  # noqa: A001 - numpy's name
sqrt = torch.sqrt
log = torch.log
exp = torch.exp
expm1 = torch.expm1
tanh = torch.tanh
logaddexp = torch.logaddexp
isfinite = torch.isfinite
where = torch.where
zeros_like = torch.zeros_like
full_like = torch.full_like
clip = torch.clamp
reshape = torch.reshape
negative = torch.negative
reciprocal = torch.reciprocal
ceil = torch.ceil
trunc = torch.trunc
floor = torch.floor
sign = torch.sign
sin = torch.sin
cos = torch.cos
tan = torch.tan
arcsin = torch.arcsin
arccos = torch.arccos
arctan = torch.arctan
sinh = torch.sinh
cosh = torch.cosh
arcsinh = torch.arcsinh
arccosh = torch.arccosh
arctanh = torch.arctanh
isnan = torch.isnan
isinf = torch.isinf
isneginf = torch.isneginf
isposinf = torch.isposinf
logical_not = torch.logical_not
logical_and = torch.logical_and
logical_or = torch.logical_or
logical_xor = torch.logical_xor
bitwise_not = torch.bitwise_not
bitwise_and = torch.bitwise_and
bitwise_or = torch.bitwise_or
bitwise_xor = torch.bitwise_xor
add = torch.add
subtract = torch.subtract
multiply = torch.multiply
divide = torch.divide
greater = torch.greater
less = torch.less
greater_equal = torch.greater_equal
less_equal = torch.less_equal
remainder = torch.remainder
fmod = torch.fmod
asarray = torch.asarray
equal = torch.eq  # elementwise; torch.equal compares whole tensors
rint = torch.round  # both round half to even
power = torch.pow
matmul = torch.matmul
swapaxes = torch.swapaxes
moveaxis = torch.movedim
einsum = torch.einsum


def stack(arrays, axis=0):
    return torch.stack(list(arrays), dim=axis)


def _tensor(b: Any, like: Any) -> Any:
    return b if isinstance(b, torch.Tensor) else torch.as_tensor(b, device=like.device)


def maximum(a, b):
    return torch.maximum(a, _tensor(b, a))


def minimum(a, b):
    return torch.minimum(a, _tensor(b, a))


def _dims(axis: Any) -> tuple[int, ...]:
    return tuple(axis) if isinstance(axis, tuple | list) else (axis,)


def _reduce(fn: Callable[..., Any]) -> Callable[..., Any]:
    def reduce(x, axis=None, keepdims=False):
        if axis is None:
            axis = tuple(range(x.ndim))
        axis = _dims(axis)
        return fn(x, axis, keepdims) if axis else x

    reduce.__name__ = fn.__name__
    return reduce


@_reduce
def sum(x, axis, keepdims):  # noqa: A001 - numpy's name
    return torch.sum(x, dim=axis, keepdim=keepdims)


@_reduce
def max(x, axis, keepdims):  # noqa: A001 - numpy's name
    return torch.amax(x, dim=axis, keepdim=keepdims)


@_reduce
def min(x, axis, keepdims):  # noqa: A001 - numpy's name
    return torch.amin(x, dim=axis, keepdim=keepdims)


@_reduce
def mean(x, axis, keepdims):
    if not x.dtype.is_floating_point and not x.dtype.is_complex:
        x = x.to(torch.float64)
    return torch.mean(x, dim=axis, keepdim=keepdims)


@_reduce
def prod(x, axis, keepdims):
    for a in sorted(axis, reverse=True):
        x = torch.prod(x, dim=a, keepdim=keepdims)
    return x


@_reduce
def var(x, axis, keepdims):
    return torch.var(x, dim=axis, keepdim=keepdims, correction=0)


promote_types = torch.promote_types
ones_like = torch.ones_like
repeat = torch.repeat_interleave


def transpose(x, perm):
    return x.permute(tuple(perm))


def concatenate(arrays, axis=0):
    return torch.cat(list(arrays), dim=axis)


def tile(x, reps):
    return x.repeat(tuple(reps)) if x.ndim else x.clone()


def squeeze(x, axis):
    return torch.squeeze(x, _dims(axis))


moveaxis = torch.movedim


def cumsum(x, axis, dtype=None):
    return torch.cumsum(x, dim=axis, dtype=dtype)


def cumprod(x, axis, dtype=None):
    return torch.cumprod(x, dim=axis, dtype=dtype)


def flip(x, axis):
    return torch.flip(x, _dims(axis))


def _arg(fn: Callable[..., Any]) -> Callable[..., Any]:
    def arg(x, axis, keepdims=False):
        if x.dtype == torch.bool:
            x = x.to(torch.int64)
        return fn(x, dim=axis, keepdim=keepdims)

    return arg


argmax = _arg(torch.argmax)
argmin = _arg(torch.argmin)


def astype(x, dtype):
    if isinstance(x, torch.Tensor) and x.dtype == FLOAT4:
        x = float4_values(x)
    if dtype in SUB_BYTE:  # the values must be in the type's range (float4: rounded)
        return narrow(x, dtype)
    return widen(x).to(dtype)


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(xp, *args)`` with this namespace, or with numpy (results back as tensors) for
    arrays torch cannot compute with."""
    if namespace(torch, *args, numpy_for=numpy_only) is np:
        like = next((a for a in args if isinstance(a, torch.Tensor)), None)
        with np.errstate(all="ignore"):
            return from_numpy(fn(np, *(None if a is None else as_numpy(a) for a in args)), like)
    return fn(sys.modules[__name__], *args)


def take(x, indices, axis=None):
    """``np.take``, for numpy or tensor ``indices``."""
    from xconv.converters.torch.runtime.shape import take as take_static

    if isinstance(indices, torch.Tensor):
        if axis is None:
            x, axis = x.reshape(-1), 0
        y = torch.index_select(x, axis, indices.reshape(-1))
        return y.reshape((*x.shape[:axis], *indices.shape, *x.shape[axis + 1 :]))

    if axis is None:
        return take_static(x.reshape(-1), indices, 0)
    return take_static(x, indices, axis)


def expand_dims(x, axis):
    return torch.unsqueeze(x, axis)


def broadcast_to(x, shape):
    return torch.broadcast_to(x, shape)


def take_along_axis(x, indices, axis):
    return torch.gather(x, axis, indices)


class TensorConstructors:
    """The tensor constructors every torch kernel shares (a kernel class derives from this
    one): an input as a tensor, and new tensors in a dtype on ``like``'s device."""

    @staticmethod
    def asarray(x):
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)

    @staticmethod
    def constant(a, dtype, like):
        return torch.as_tensor(a, dtype=dtype, device=like.device)

    @staticmethod
    def scalar(value, dtype, like):
        return torch.tensor(value, dtype=dtype, device=like.device)

    @staticmethod
    def zeros(shape, dtype, like):
        return torch.zeros(shape, dtype=dtype, device=like.device)


class TorchKernel:
    """The torch side of the shared op semantics: this namespace, numpy for what torch cannot
    hold."""

    overrides: dict = {"GatherElements": lambda x, idx, axis: torch.gather(x, axis, idx)}
    run = staticmethod(run)

    @staticmethod
    def index_dtype(xp):
        return np.int64 if xp is np else torch.int64

    @staticmethod
    def arange(xp, n, like):
        if xp is np:
            return np.arange(n)
        return torch.arange(n, device=like.device)

    @staticmethod
    def rsqrt(xp, x):
        return 1 / np.sqrt(x) if xp is np else torch.rsqrt(x)

    constant = staticmethod(from_numpy)

    @staticmethod
    def pad(y, widths, mode, fill):
        from xconv.converters.torch.runtime.shape import pad

        return pad(y, widths, mode, fill)

    @staticmethod
    def dtype(ctx, code, like=None):
        """The torch dtype of ONNX type ``code`` (``like``'s when 0 or absent)."""
        return onnx_dtype(ctx, code, torch_dtype, like)

    @staticmethod
    def materialize(xp, x):
        return x.copy() if xp is np else x.clone()


KERNEL = TorchKernel()
