"""JAX backend: IR -> jittable JAX function, and Flax linen / nnx source.

Importing this package imports no framework: the Flax source emitter (``flax_emitter``,
``flax_ops``) is plain Python, and the runtime's names below load jax on first use.
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
