"""The JAX backend's handler registry.

Users register handlers for custom ops with :func:`register`; a user handler takes
precedence over the built-in one for the same op::

    from xconv.converters.jax.registry import register

    @register("MyOp", domain="my.domain", attrs={"alpha": 1.0})
    def my_op(ctx, x, *, alpha):
        return x * alpha

Importing this module imports the handler modules, which register the built-in handlers.
"""

from __future__ import annotations

from xconv.converters.ops import RUNTIME_FAMILIES
from xconv.converters.registry import REQUIRED, Registry, import_handler_modules

registry = Registry("jax", module=__name__)
register = registry.register
builtin = registry.builtin

#: Handler modules, one per op family; importing one registers its handlers.
HANDLER_MODULES = RUNTIME_FAMILIES

# After ``builtin`` exists: each handler module imports it from this (partly run) module.
import_handler_modules("xconv.converters.jax", HANDLER_MODULES)

__all__ = ["REQUIRED", "builtin", "register", "registry"]
