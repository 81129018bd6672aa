"""The array namespace a handler computes with, and axis arithmetic: one definition each.

A handler's math is written once against ``xp``, chosen per call by :func:`namespace`: numpy
when every input is static (constants, shape arithmetic), so the result folds at trace time,
else the backend's namespace (``jax.numpy``, ``torch``). Framework-free: the backend passes
its namespace in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def is_static(value: Any) -> bool:
    """True for values held as numpy or Python scalars (folded at trace time).

    Backend arrays (JAX arrays, concrete or traced; torch tensors) are run-time data.
    """
    if value is None or isinstance(value, np.ndarray | np.generic | int | float | bool | str):
        return True
    if isinstance(value, list):
        return all(is_static(v) for v in value)
    return False


def namespace(backend: Any, *arrays: Any, numpy_for: Callable[[Any], bool] | None = None) -> Any:
    """numpy when every given array is static, else ``backend``.

    ``numpy_for`` names arrays the backend cannot compute with (torch's wide unsigned types,
    string tensors): any one of them selects numpy too.
    """
    present = [a for a in arrays if a is not None]
    if all(is_static(a) for a in present):
        return np
    if numpy_for is not None and any(numpy_for(a) for a in present):
        return np
    return backend


def normalize_axis(ctx: Any, axis: int, rank: int) -> int:
    """``axis`` in ``[-rank, rank)`` as a non-negative index; a rank-0 input takes only 0.

    ``ctx.error(message)`` builds the exception raised for an axis out of range.
    """
    if not -rank <= axis < max(rank, 1):
        raise ctx.error(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis % rank if rank else 0


def astype(xp: Any, x: Any, dtype: Any) -> Any:
    """``x`` as ``dtype`` in namespace ``xp`` (numpy before 2.0 has only the method)."""
    cast = getattr(xp, "astype", None)
    return cast(x, dtype) if cast is not None else x.astype(dtype)


def is_float(xp: Any, dtype: Any) -> bool:
    """Whether ``dtype`` (numpy's, JAX's or torch's) is a floating-point type."""
    flag = getattr(dtype, "is_floating_point", None)
    return bool(flag) if flag is not None else bool(xp.issubdtype(dtype, xp.floating))


def is_integer(dtype: Any) -> bool:
    """Whether ``dtype`` (numpy's, JAX's or torch's) is an integer type (bool is not)."""
    if getattr(dtype, "is_floating_point", None) is not None:  # a torch dtype
        return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")
    return bool(np.issubdtype(np.dtype(dtype), np.integer))


def onnx_dtype(ctx: Any, code: int | None, convert: Callable[[Any], Any], like: Any = None) -> Any:
    """The backend dtype of ONNX type ``code`` (``like``'s dtype when 0 or absent).

    ``convert`` maps an ``onnx_ir.DataType`` to the backend's dtype (raising ``KeyError``,
    ``ValueError`` or ``TypeError`` for one it lacks); the error names the node.
    """
    import onnx_ir as ir

    if code is None or code == 0:
        if like is None:
            raise ctx.error("dtype is required")
        return like.dtype
    try:
        return convert(ir.DataType(code))
    except (KeyError, ValueError, TypeError) as e:
        raise ctx.error(f"unsupported dtype {code}: {e}") from e
