"""PyTorch handlers: matrix products, cumulative ops, TopK, the softmax family and losses."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from xconv.converters.ops.linalg import (
    register_cumulative_ops,
    register_loss_ops,
    register_softmax_ops,
    register_topk,
)
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import KERNEL, as_numpy, from_numpy

#: Types whose products accumulate in float32 (as the ONNX reference does for Einsum).
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


# --------------------------------------------------------------------------------------
# Matrix products


def _matmul(a, b):
    """torch.matmul, also for the integer cases torch lacks kernels for."""
    if not (_is_int(a.dtype) and _is_int(b.dtype)):
        return torch.matmul(a, b)
    if a.device.type != "cpu":
        # Accelerators have no integer matmul: float64 is exact for sums below 2**53.
        return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(a.dtype)
    if a.dtype in (torch.uint16, torch.uint32, torch.uint64) or a.dtype != b.dtype:
        return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(a.dtype)
    return torch.matmul(a, b)


@builtin("MatMul", since=1)
def matmul(ctx, a, b):
    """MatMul(A, B) -> Y: numpy.matmul semantics (1-D operands promoted, batch broadcast)."""
    return _matmul(a, b)


@builtin(
    "Gemm", since=1, attrs={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0, "broadcast": 0}
)
def gemm(ctx, a, b, c=None, *, alpha, beta, transA, transB, broadcast):
    """Gemm(A, B, C?) -> Y = alpha * A' @ B' + beta * C, C unidirectionally broadcast.

    ``broadcast`` (opset < 7) is accepted: later opsets always broadcast C.
    """
    dtype = a.dtype
    a = a.T if transA else a
    b = b.T if transB else b
    y = _matmul(a, b)
    if _is_int(dtype) and (alpha != 1.0 or (c is not None and beta != 1.0)):
        # Integer Gemm with fractional alpha / beta: scale in floating point, then truncate
        # back to the integer type (as the reference's numpy arithmetic does).
        y = y.to(torch.float64) * alpha
        if c is not None and beta != 0.0:
            y = y + c.to(torch.float64) * beta
        return y.to(dtype)
    if alpha != 1.0:
        y = y * alpha
    if c is not None and beta != 0.0:
        c = c.to(dtype)
        y = y + (c if beta == 1.0 else c * beta)
    return y.to(dtype)


@builtin("Einsum", since=12, attrs={"equation": REQUIRED})
def einsum(ctx, *inputs, equation):
    """Einsum(Inputs...) -> Output, by Einstein summation over ``equation``."""
    eq = equation.decode() if isinstance(equation, bytes) else equation
    eq = eq.replace(" ", "")
    dtype = inputs[0].dtype
    if dtype in _LOW_PRECISION:
        return torch.einsum(eq, *(x.to(torch.float32) for x in inputs)).to(dtype)
    return torch.einsum(eq, *inputs)


@builtin("Det", since=11)
def det(ctx, x):
    """Det(X) -> Y: determinant of the square matrices in the last two dimensions."""
    if x.dtype in _LOW_PRECISION:
        return torch.linalg.det(x.to(torch.float32)).to(x.dtype)
    return torch.linalg.det(x)


# --------------------------------------------------------------------------------------
# Cumulative ops


# CumSum, CumProd: converters/ops/linalg.py.
register_cumulative_ops(builtin, KERNEL)


# --------------------------------------------------------------------------------------
# TopK


def _top_k(x, k: int, ax: int, largest: bool):
    """TopK along ``ax`` by a stable sort (lower index first among equal values)."""
    if x.dtype in (torch.uint16, torch.uint32, torch.uint64):
        # torch has no wide unsigned sort/gather kernels: numpy's stable argsort does the same.
        a = as_numpy(x)
        order = np.argsort(~a if largest else a, axis=ax, kind="stable")
        order = np.take(order, np.arange(k), axis=ax)
        values = np.take_along_axis(a, order, axis=ax)
        return from_numpy(values, x), from_numpy(order.astype(np.int64), x)
    _, idx = torch.sort(x, dim=ax, descending=largest, stable=True)
    idx = idx.narrow(ax, 0, k)
    return torch.gather(x, ax, idx), idx


# TopK-1, -10, -11: converters/ops/linalg.py.
register_topk(builtin, _top_k, REQUIRED)


# --------------------------------------------------------------------------------------
# Softmax family


def reference_sum(x):
    """Sum over the last axis keeping it, accumulating as the ONNX reference does.

    bfloat16 accumulates in bfloat16 (numpy's ml_dtypes loop rounds after every add), where
    ``torch.sum`` would accumulate in float32 and round once.
    """
    if x.dtype != torch.bfloat16:
        return x.sum(dim=-1, keepdim=True)
    total = x[..., :1]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j : j + 1]
    return total


def _softmax(x, axis: int):
    # Low-precision inputs round exp() before summing, as the reference does.
    if x.dtype not in _LOW_PRECISION:
        return torch.softmax(x, axis)
    x = x.movedim(axis, -1)
    e = torch.exp(x - x.amax(dim=-1, keepdim=True).detach())
    return (e / reference_sum(e)).movedim(-1, axis)


def _hardmax(x, axis: int):
    idx = torch.argmax(x, dim=axis, keepdim=True)
    return torch.zeros_like(x).scatter_(axis, idx, 1)


register_softmax_ops(
    builtin,
    {
        "Softmax": _softmax,
        "LogSoftmax": lambda v, ax: torch.log_softmax(v, ax),
        "Hardmax": _hardmax,
    },
    lambda x: x,
)


# --------------------------------------------------------------------------------------
# Losses

# NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss: converters/ops/linalg.py.
register_loss_ops(builtin, KERNEL, lambda x, axis: F.log_softmax(x, dim=axis))
