"""ONNX <-> torch dtypes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch

#: Unsigned types torch stores but hardly computes with on CPU.
WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def is_numpy(x) -> bool:
    return isinstance(x, np.ndarray | np.generic)


def numpy_only(x) -> bool:
    """True for an array torch cannot compute with: numpy (strings) or wide unsigned."""
    return is_numpy(x) or (isinstance(x, torch.Tensor) and x.dtype in WIDE_UNSIGNED)


def needs_numpy(*xs) -> bool:
    """True when an input is numpy (strings) or a wide unsigned tensor."""
    return any(numpy_only(x) for x in xs if x is not None)


_BY_NAME = {
    "FLOAT": torch.float32, "DOUBLE": torch.float64, "FLOAT16": torch.float16,
    "BFLOAT16": torch.bfloat16, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32,
    "INT64": torch.int64, "UINT8": torch.uint8, "UINT16": torch.uint16, "UINT32": torch.uint32,
    "UINT64": torch.uint64, "BOOL": torch.bool, "COMPLEX64": torch.complex64,
    "COMPLEX128": torch.complex128, "FLOAT8E4M3FN": torch.float8_e4m3fn,
    "FLOAT8E4M3FNUZ": torch.float8_e4m3fnuz, "FLOAT8E5M2": torch.float8_e5m2,
    "FLOAT8E5M2FNUZ": torch.float8_e5m2fnuz, "FLOAT8E8M0": torch.float8_e8m0fnu,
    "INT4": torch.int4, "UINT4": torch.uint4, "INT2": torch.int2, "UINT2": torch.uint2,
    "FLOAT4E2M1": torch.float4_e2m1fn_x2,
}  # fmt: skip

#: float4e2m1 as torch holds it here: ``float4_e2m1fn_x2`` (torch's one float4 type, which
#: packs two values in a byte) with one value per byte, its code in the low four bits as
#: ml_dtypes' ``float4_e2m1fn`` stores it. torch computes nothing in it: data movement runs on
#: the codes (its byte type in :data:`SUB_BYTE`), casts and quantization on the values
#: (:func:`float4_values`, :func:`to_float4`).
FLOAT4 = torch.float4_e2m1fn_x2

#: The sub-byte types, which torch names but neither copies nor computes with (float4: see
#: :data:`FLOAT4`): a tensor of one holds each value in its byte as the byte type here does,
#: and ops compute on that view (:func:`widen`) and view the result back (:func:`narrow`).
SUB_BYTE = {
    torch.int4: torch.int8, torch.uint4: torch.uint8,
    torch.int2: torch.int8, torch.uint2: torch.uint8,
    FLOAT4: torch.uint8,
}  # fmt: skip

#: float4e2m1's magnitudes by code (the sign is bit 3), and the midpoints between neighbours.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def widen(x):
    """A sub-byte integer tensor as its byte type (a view); any other value as it is."""
    if isinstance(x, torch.Tensor) and x.dtype in SUB_BYTE:
        return x.view(SUB_BYTE[x.dtype])
    return x


def narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Integer values already in ``dtype``'s range as a tensor of that sub-byte type (float4:
    any values, rounded by :func:`to_float4`)."""
    if dtype == FLOAT4:
        return to_float4(x)
    return x.to(SUB_BYTE[dtype]).view(dtype)


def float4_values(x: torch.Tensor) -> torch.Tensor:
    """A :data:`FLOAT4` tensor's values in float32."""
    codes = x.view(torch.uint8).to(torch.int64)
    magnitude = torch.tensor(_E2M1, dtype=torch.float32, device=x.device)[codes & 7]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def to_float4(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float4e2m1 as ml_dtypes (and so ONNX's reference) rounds: to the
    nearest value, ties to the even code; magnitudes past 6 and infinities to ±6; NaN, which
    the type lacks, to a zero of the opposite sign (ml_dtypes' choice)."""
    # The sign first: torch's float16 -> float32 conversion drops some NaNs' sign bits.
    sign = torch.signbit(x) if x.dtype.is_floating_point else x < 0
    xf = x if x.dtype == torch.float64 else x.to(torch.float32)  # rounded once
    a = xf.abs().unsqueeze(-1)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=xf.dtype, device=x.device)
    odd = torch.arange(len(_E2M1_MIDPOINTS), device=x.device) % 2 == 1  # tie: the even code
    code = (a > mids).sum(-1) + ((a == mids) & odd).sum(-1)
    code = torch.where(xf.isnan(), 0, code.clamp(max=7))
    negative = sign ^ xf.isnan()
    return (code + torch.where(negative, 8, 0)).to(torch.uint8).view(FLOAT4)


def onnx_type_name(dtype: torch.dtype) -> str | None:
    """The ONNX name of a torch dtype, None for one ONNX lacks."""
    return next((name for name, held in _BY_NAME.items() if held == dtype), None)


def torch_dtype(dtype: ir.DataType) -> torch.dtype:
    """The torch dtype for an ONNX one; raises KeyError naming the supported ones."""
    try:
        return _BY_NAME[dtype.name]
    except KeyError:
        raise KeyError(
            f"ONNX dtype {dtype.name} has no torch equivalent; supported: {sorted(_BY_NAME)}"
        ) from None


def to_tensor(array: np.ndarray) -> torch.Tensor | np.ndarray:
    """numpy -> torch without a copy where torch has the dtype; strings stay numpy."""
    if array.dtype.kind in "OSU":
        return array
    try:
        # ascontiguousarray makes 0-d arrays 1-d: keep the shape.
        return torch.from_numpy(np.ascontiguousarray(array).reshape(array.shape))
    except TypeError:
        # ml_dtypes (bfloat16, float8, int4 ...) numpy arrays: go through the ONNX dtype.
        target = torch_dtype(ir.DataType.from_numpy(array.dtype))
        if target == FLOAT4:  # ml_dtypes holds the code in the low bits, as FLOAT4 does
            return torch.from_numpy(np.ascontiguousarray(array.view(np.uint8))).view(FLOAT4)
        if target in SUB_BYTE:
            # ml_dtypes keeps the low bits only: the values, sign included, as bytes.
            wide = np.dtype(str(SUB_BYTE[target]).removeprefix("torch."))
            return narrow(torch.from_numpy(np.ascontiguousarray(array.astype(wide))), target)
        bits = array.view(np.uint8 if array.dtype.itemsize == 1 else np.uint16)
        return torch.from_numpy(np.ascontiguousarray(bits).reshape(bits.shape)).view(target)


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """torch -> numpy; the types numpy lacks (bfloat16, float8, int4 ...) as ml_dtypes'."""
    x = x.detach().cpu()
    name = onnx_type_name(x.dtype)
    if x.dtype == FLOAT4:
        return widen(x).numpy().view(ir.DataType[name].numpy())
    if x.dtype in SUB_BYTE:
        return widen(x).numpy().astype(ir.DataType[name].numpy())
    try:
        return x.numpy()
    except TypeError:
        bits = x.view(torch.uint8 if x.element_size() == 1 else torch.int16).numpy()
        return bits.view(ir.DataType[name].numpy())
