"""The JAX backend's handler registry.

Users register handlers for custom ops with :func:`register`; a user handler takes
precedence over the built-in one for the same op::

    from xconv.converters.jax.registry import register

    @register("MyOp", domain="my.domain", attrs={"alpha": 1.0})
    def my_op(ctx, x, *, alpha):
        return x * alpha
"""

from __future__ import annotations

from xconv.converters.registry import REQUIRED, Registry

registry = Registry("jax", module=__name__)
register = registry.register
builtin = registry.builtin

__all__ = ["REQUIRED", "builtin", "register", "registry"]
