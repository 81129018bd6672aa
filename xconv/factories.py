"""``pkg.mod:factory`` strings that name a function building a model (framework-free)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from xconv.errors import ConversionError

Factory = str | Callable[[], Any]


def resolve_factory(factory: Factory) -> Callable[[], Any]:
    """``"pkg.mod:factory"`` -> the callable (callables pass through)."""
    if callable(factory):
        return factory
    module_name, sep, attr = str(factory).partition(":")
    if not sep or not module_name or not attr:
        raise ConversionError(
            f"module factory {factory!r} must look like 'package.module:function'"
        )
    try:
        mod = importlib.import_module(module_name)
    except ImportError as e:
        raise ConversionError(f"cannot import {module_name!r} for the module factory: {e}") from e
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConversionError(f"{module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ConversionError(f"module factory {factory!r} is not callable")
    return obj
