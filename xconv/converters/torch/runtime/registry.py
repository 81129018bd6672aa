"""The PyTorch backend's handler registry (user registrations win over built-ins)::

from xconv.converters.torch.runtime.registry import register

@register("MyOp", domain="my.domain", attrs={"alpha": 1.0})
def my_op(ctx, x, *, alpha):
    return x * alpha
"""

from __future__ import annotations

from xconv.converters.registry import REQUIRED, Registry

registry = Registry("torch", module=__name__)
register = registry.register
builtin = registry.builtin

__all__ = ["REQUIRED", "builtin", "register", "registry"]
