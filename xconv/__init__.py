"""xconv: translate models between PyTorch, JAX/Flax, TensorFlow and ONNX, with proof.

The public API is imported lazily: ``import xconv`` loads no framework; each function pulls
in the framework it needs when called.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from xconv.errors import (
    ConversionError,
    InvalidModelError,
    MissingFrameworkError,
    ParityError,
    StaticValueError,
    UnsupportedAttributeError,
    UnsupportedOpError,
    UsageError,
    WeightsError,
)
from xconv.errors import missing_framework as _missing_framework

__version__ = "0.1.0"

# name -> (module, attribute)
_LAZY = {
    "convert": ("xconv.pipeline", "convert"),
    "ConvertOptions": ("xconv.pipeline", "ConvertOptions"),
    "load": ("xconv.converters.onnx.io", "load"),
    "save": ("xconv.converters.onnx.io", "save"),
    "to_jax": ("xconv.converters.jax.interpreter", "to_jax"),
    "to_flax": ("xconv.pipeline", "to_flax"),
    "from_torch": ("xconv.converters.torch.importer.trace", "from_torch"),
    "from_checkpoint": ("xconv.checkpoint", "from_checkpoint"),
    "convert_checkpoint": ("xconv.checkpoint", "convert_checkpoint"),
    "to_torch": ("xconv.converters.torch.emitter", "to_torch"),
    "to_torch_source": ("xconv.pipeline", "to_torch_source"),
    "from_flax": ("xconv.converters.flax.importer.trace", "from_flax"),
    "from_jax": ("xconv.converters.flax.importer.trace", "from_jax"),
    "from_tf": ("xconv.converters.tf.importer", "from_tf"),
    "check_parity": ("xconv.parity.checker", "check_parity"),
    "torch2jax": ("xconv.interop.torch2jax", "torch2jax"),
    "jax2torch": ("xconv.interop.jax2torch", "jax2torch"),
    "from_torch_optimizer": ("xconv.training.optimizers", "from_torch_optimizer"),
    "check_training": ("xconv.training.check", "check_training"),
}

#: The conversion entry points: a framework found missing while one runs (they import their
#: framework lazily, inside the call) raises MissingFrameworkError naming the extra, as the CLI does.
_CALLS_MAP_MISSING = (
    frozenset(_LAZY)
    - {"ConvertOptions", "load", "save"}
    - {
        "check_training",  # xconv.training's own exports (identity pinned by tests/training)
        "from_torch_optimizer",
    }
)

#: Subpackages reachable as attributes after ``import xconv`` (``xconv.training.X``), imported
#: on first use like the functions above.
_SUBPACKAGES = frozenset(
    {"checkpoint", "converters", "interop", "ir", "parity", "sharding", "testing", "training"}
)

if TYPE_CHECKING:
    from xconv.converters.jax.interpreter import to_jax  # noqa: F401
    from xconv.converters.onnx.io import load, save  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        try:
            return importlib.import_module(f"xconv.{name}")
        except ImportError as e:
            raise _missing_framework(e) or e from e
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'xconv' has no attribute {name!r}") from None
    try:
        value = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise _missing_framework(e) or e from e
    if name in _CALLS_MAP_MISSING:
        value = _mapping_missing_framework(value)
    globals()[name] = value
    return value


def _mapping_missing_framework(fn: Any) -> Any:
    """``fn`` whose ImportError of a known optional framework becomes MissingFrameworkError."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ImportError as e:
            error = _missing_framework(e)
            if error is None:
                raise
            raise error from e

    return call


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, *_SUBPACKAGES])


__all__ = [
    "ConversionError",
    "InvalidModelError",
    "MissingFrameworkError",
    "ParityError",
    "StaticValueError",
    "UnsupportedAttributeError",
    "UnsupportedOpError",
    "UsageError",
    "WeightsError",
    "__version__",
    *_LAZY,
]
