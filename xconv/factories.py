"""``pkg.mod:factory`` strings that name a function building a model (framework-free)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xconv.errors import ConversionError

Factory = str | Callable[[], Any]


def resolve_factory(factory: Factory) -> Callable[[], Any]:
    """``"pkg.mod:factory"`` or ``"path/to/file.py:factory"`` -> the callable (callables pass
    through)."""
    if callable(factory):
        return factory
    module_name, sep, attr = str(factory).rpartition(":")
    if not sep or not module_name or not attr:
        raise ConversionError(
            f"module factory {factory!r} must look like 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    if module_name.endswith(".py"):
        mod = _import_file(Path(module_name))
    else:
        try:
            mod = importlib.import_module(module_name)
        except ImportError as e:
            raise ConversionError(
                f"cannot import {module_name!r} for the module factory: {e}"
            ) from e
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConversionError(f"{module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ConversionError(f"module factory {factory!r} is not callable")
    return obj


def _import_file(path: Path) -> Any:
    """Import a Python file as a module (an ``xconv``-generated ``model.py``, a script)."""
    if not path.is_file():
        raise ConversionError(f"module factory file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"xconv_factory_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConversionError(f"cannot import {str(path)!r} for the module factory")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        del sys.modules[name]
        raise ConversionError(f"importing {str(path)!r} failed: {e}") from e
    return mod
