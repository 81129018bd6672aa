"""The Reduce* family and ArgMax / ArgMin on JAX: written once in
:mod:`xconv.converters.ops.reduce`, run with :class:`~xconv.converters.jax.kernel.JaxKernel`."""

from __future__ import annotations

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import builtin
from xconv.converters.ops.reduce import register_reduce_ops

register_reduce_ops(builtin, KERNEL)
