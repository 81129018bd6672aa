"""``pkg.mod:factory`` strings that name a function building a model (framework-free)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xconv.errors import ConversionError, UsageError

Factory = str | Callable[[], Any]


def resolve_factory(factory: Factory) -> Callable[[], Any]:
    """``"pkg.mod:factory"`` or ``"path/to/file.py:factory"`` -> the callable (callables pass
    through)."""
    if callable(factory):
        return factory
    obj = resolve_attr(str(factory), "module factory")
    if not callable(obj):
        raise UsageError(f"module factory {factory!r} is not callable")
    return obj


def resolve_attr(spec: str, what: str = "module factory", name: str = "function") -> Any:
    """``"pkg.mod:ATTR"`` or ``"path/to/file.py:ATTR"`` (``ATTR`` may be dotted) -> the object
    it names. A malformed spec, a module that does not import and a missing attribute are
    :class:`UsageError` s (exit 2) naming ``what`` the spec was for (``name``: what ``ATTR`` is
    called in the expected form)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"{what} {spec!r} must look like 'package.module:{name}' or 'path/to/file.py:{name}'"
        )
    if module_name.endswith(".py"):
        mod = _import_file(Path(module_name), what)
    else:
        try:
            mod = importlib.import_module(module_name)
        except Exception as e:  # ImportError, or the user's module failing as it imports
            detail = str(e) if isinstance(e, ImportError) else f"{type(e).__name__}: {e}"
            # A module that is not there is a wrong argument; one that fails as it imports
            # is the user's code failing.
            error = UsageError if isinstance(e, ModuleNotFoundError) else ConversionError
            raise error(f"cannot import {module_name!r} for the {what}: {detail}") from e
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UsageError(f"{module_name!r} has no attribute {attr!r}")
    return obj


def _import_file(path: Path, what: str = "module factory") -> Any:
    """Import a Python file as a module (an ``xconv``-generated ``model.py``, a script)."""
    if not path.is_file():
        raise UsageError(f"{what} file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"xconv_factory_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConversionError(f"cannot import {str(path)!r} for the {what}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        del sys.modules[name]
        raise ConversionError(f"importing {str(path)!r} failed: {e}") from e
    return mod
