"""JAX backend: IR -> jittable JAX function, and Flax linen / nnx source."""

from __future__ import annotations

import importlib

from xconv.converters.jax.interpreter import JaxFunction, to_jax
from xconv.converters.jax.registry import register, registry

#: Handler modules, one per op family; importing one registers its handlers.
HANDLER_MODULES = (
    "elementwise",
    "math",
    "nn",
    "rnn",
    "linalg",
    "reduce",
    "attention",
    "shape",
    "indexing",
    "control",
    "sequence",
    "random",
    "misc",
    "signal",
    "text",
    "ml",
)

for _name in HANDLER_MODULES:
    try:
        importlib.import_module(f"xconv.converters.jax.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"xconv.converters.jax.{_name}":
            raise

__all__ = ["JaxFunction", "register", "registry", "to_jax"]
