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
}  # fmt: skip


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
        # ml_dtypes (bfloat16, float8) numpy arrays: go through the ONNX dtype.
        dtype = ir.DataType.from_numpy(array.dtype)
        bits = array.view(np.uint8 if array.dtype.itemsize == 1 else np.uint16)
        return torch.from_numpy(np.ascontiguousarray(bits).reshape(bits.shape)).view(
            torch_dtype(dtype)
        )
