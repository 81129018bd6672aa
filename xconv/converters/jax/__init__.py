"""JAX runtime: the IR as a jittable JAX function (``xconv.to_jax``).

Importing this package imports no framework; the names below load jax on first use.
Importing :mod:`xconv.converters.jax.registry` registers the built-in handlers.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "JaxFunction": "xconv.converters.jax.interpreter",
    "to_jax": "xconv.converters.jax.interpreter",
    "register": "xconv.converters.jax.registry",
    "registry": "xconv.converters.jax.registry",
}


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), name)


__all__ = ["JaxFunction", "register", "registry", "to_jax"]
