"""PyTorch handlers: the dtype conversions Cast, CastLike, BitCast, and the torch kernel of
the activations, Gelu, PRelu and Clip (written once in :mod:`xconv.converters.ops.elementwise`),
which uses ``torch.nn.functional`` where its definition is ONNX's (``F.elu``, ``F.mish``, ...).

Cast covers every ONNX type torch holds: the float8 family and float8e8m0, and int4, uint4,
int2, uint2 and float4e2m1, which torch names but does not compute with (held one value per
byte: :data:`~xconv.converters.torch.runtime.dtypes.SUB_BYTE`). Strings are numpy arrays.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F

from xconv.converters.ops.elementwise import (
    FLOAT8,
    SUB_BYTE_INTS,
    data_type,
    register_cast_ops,
    register_elementwise_ops,
    sub_byte_values,
    to_e8m0,
)
from xconv.converters.torch.runtime import xp as torch_xp
from xconv.converters.torch.runtime.dtypes import (
    _BY_NAME,
    FLOAT4,
    SUB_BYTE,
    WIDE_UNSIGNED,
    float4_values,
    narrow,
    to_float4,
    widen,
)
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import as_numpy, from_numpy


def _relu(x):
    if x.dtype.is_floating_point:
        return torch.relu(x)
    return torch.maximum(x, torch.zeros((), dtype=x.dtype, device=x.device))


class _Kernel:
    """The torch side of :mod:`xconv.converters.ops.elementwise`: torch under numpy's names,
    ``torch.nn.functional`` where its definition is ONNX's."""

    overrides = {
        "Relu": _relu,
        "Elu": lambda x, *, alpha: F.elu(x, alpha),
        "Celu": lambda x, *, alpha: F.celu(x, alpha),
        "HardSwish": F.hardswish,
        "Softplus": F.softplus,
        "Softsign": F.softsign,
        "Mish": F.mish,
        "Sigmoid": torch.sigmoid,
        "Tanh": torch.tanh,
    }
    run = staticmethod(torch_xp.run)
    sigmoid = staticmethod(torch.sigmoid)

    @staticmethod
    def gelu(x, tanh):
        return F.gelu(x, approximate="tanh" if tanh else "none")

    @staticmethod
    def float32_bits(x):
        return x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF

    @staticmethod
    def e8m0(exponent):
        return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


_KERNEL = _Kernel()
register_elementwise_ops(builtin, _KERNEL)


# ------------------------------------------------------------------------- dtype casts

#: ONNX types torch holds, beyond the interpreter's table.
_EXTRA = {"FLOAT8E8M0": torch.float8_e8m0fnu}


def _torch_type(ctx, dtype: ir.DataType) -> torch.dtype:
    found = _BY_NAME.get(dtype.name) or _EXTRA.get(dtype.name)
    if found is None:
        supported = sorted([*_BY_NAME, *_EXTRA, "STRING"])
        raise ctx.error(f"ONNX type {dtype.name} has no torch equivalent; supported: {supported}")
    return found


def _from_strings(ctx, x, target: torch.dtype):
    """String tensor -> numbers, parsed by numpy (``"1e-3"``, ``"NaN"``, ``"-INF"``...)."""
    x = np.asarray(x)
    if target.is_floating_point or target == torch.bool:
        parsed = x.astype(np.float64)
        if target == torch.bool:
            return torch.from_numpy(parsed != 0)
        return torch.from_numpy(parsed).to(target)
    return torch.from_numpy(x.astype(np.int64)).to(target)


def _to_strings(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.str_).astype(object)
    if x.dtype == torch.bfloat16 or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x.to(torch.float32)
    return as_numpy(x).astype(np.str_).astype(object)


def cast_tensor(ctx, x, to: ir.DataType, saturate: int, round_mode: str):
    """Cast ``x`` to ONNX type ``to`` (torch tensors; strings are numpy arrays)."""
    if isinstance(x, torch.Tensor) and x.dtype == FLOAT4:
        x = float4_values(x)
    if to == ir.DataType.STRING:
        return _to_strings(widen(x))
    target = _torch_type(ctx, to)
    if isinstance(x, np.ndarray):
        x = _from_strings(ctx, x, torch.float64 if target in SUB_BYTE else target)
        if target not in SUB_BYTE:
            return x
    x = widen(x)
    if target == FLOAT4:
        return to_float4(x)
    if to in SUB_BYTE_INTS:
        return narrow(sub_byte_values(torch_xp, x, to), target)
    if to == ir.DataType.FLOAT8E8M0:
        return to_e8m0(torch_xp, _KERNEL, x, bool(saturate), round_mode)
    if to in FLOAT8 and x.dtype.is_floating_point:
        if saturate:
            info = torch.finfo(target)
            x = torch.clamp(x.to(torch.float32), info.min, info.max)
        elif to in (
            ir.DataType.FLOAT8E4M3FN,
            ir.DataType.FLOAT8E4M3FNUZ,
            ir.DataType.FLOAT8E5M2FNUZ,
        ):
            # Types without infinities: overflow (and infinities) become NaN.
            info = torch.finfo(target)
            xf = x.to(torch.float32)
            overflow = xf.abs() > info.max
            nan = torch.full_like(xf, float("nan"))
            rounded = xf.to(target).to(torch.float32)
            x = torch.where(overflow | rounded.isnan(), nan, xf)
    if (x.dtype in WIDE_UNSIGNED) != (target in WIDE_UNSIGNED) and not x.dtype.is_floating_point:
        # Conversions between the wide unsigned types and others wrap like numpy's.
        y = as_numpy(x).astype(as_numpy(torch.zeros((), dtype=target)).dtype)
        return from_numpy(y, x)
    return x.to(target)


def _type_of(a) -> ir.DataType:
    if isinstance(a, np.ndarray):
        return ir.DataType.STRING
    names = {v: k for k, v in {**_BY_NAME, **_EXTRA}.items()}
    return ir.DataType[names[a.dtype]]


register_cast_ops(builtin, REQUIRED, cast_tensor, _type_of)


@builtin("BitCast", since=26, attrs={"to": REQUIRED})
def bit_cast(ctx, x, *, to):
    """BitCast(input) -> output: the same bits reinterpreted as type ``to`` (same width)."""
    target = data_type(ctx, to)
    if target == ir.DataType.STRING or isinstance(x, np.ndarray):
        raise ctx.error("BitCast supports numeric and bool types, not strings")
    dtype = _torch_type(ctx, target)
    source_bits = x.element_size() * 8
    target_bits = torch.empty((), dtype=dtype).element_size() * 8
    if source_bits != target_bits:
        raise ctx.error(
            f"BitCast needs types of one width; {x.dtype} is {source_bits} bits, "
            f"{dtype} is {target_bits}"
        )
    if x.dtype == torch.bool:
        return x.to(dtype)
    if dtype == torch.bool:
        return x.view(torch.uint8) != 0
    return x.view(dtype)
