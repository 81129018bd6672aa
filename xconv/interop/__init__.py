"""Zero-copy calls across frameworks (DLPack), with autograd.

- :func:`xconv.interop.jax2torch.jax2torch`: call a JAX function from PyTorch as a
  differentiable op (``torch.autograd.Function`` over ``jax.vjp``).
- :func:`xconv.interop.torch2jax.torch2jax`: turn a PyTorch module or function into a pure
  JAX function through the IR (``xconv.from_torch`` then ``xconv.to_jax``).

Both are reachable lazily as ``xconv.jax2torch`` and ``xconv.torch2jax``; this package imports
no framework itself.
"""

from __future__ import annotations
