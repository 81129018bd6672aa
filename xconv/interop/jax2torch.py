"""Call a JAX function from PyTorch as a differentiable op, with zero-copy tensors.

``jax2torch(jax_fn)`` returns ``f(*tensors)``. Tensors cross by DLPack on their own device
(no copy for contiguous tensors of a dtype JAX holds). When an input needs a gradient the
call goes through a ``torch.autograd.Function``: the forward runs ``jax.vjp`` (jitted) and
keeps the vjp function, the backward applies it (jitted) to the output cotangents. With no
input needing a gradient (``torch.no_grad()``, integer inputs, frozen tensors) the plain
jitted function runs and nothing is kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from xconv.errors import ConversionError
from xconv.interop.dlpack import jax_to_torch, torch_to_jax


def jax2torch(fn: Callable[..., Any], *, jit: bool = True) -> Callable[..., Any]:
    """Wrap a JAX function so PyTorch can call it and backpropagate through it.

    Args:
        fn: A JAX function of arrays, returning an array or a pytree (tuple, list, dict) of
            arrays. Parameters it needs are closed over or passed as further tensors.
        jit: Compile the forward (with its vjp) and the backward with ``jax.jit``.

    Returns:
        ``f(*tensors)``: takes torch tensors (one per positional argument of ``fn``) and
        returns torch tensors in ``fn``'s output structure, on the device JAX computed on.
        Gradients flow to every floating-point input that requires grad; integer and bool
        inputs and outputs are not differentiable. Dtypes are kept, except that with JAX's
        64-bit types off (its default) ``float64``/``int64`` inputs become 32-bit in JAX;
        gradients are returned in each input's own dtype. Double backward is not supported.

    Raises:
        ConversionError: An argument is not a torch tensor.
    """
    bridge = _Bridge(fn, jit)

    @functools.wraps(fn)
    def call(*tensors: Any) -> Any:
        return bridge(*tensors)

    return call


class _Bridge:
    """The compiled pieces of one wrapped function."""

    def __init__(self, fn: Callable[..., Any], jit: bool) -> None:
        import jax

        self.fn = fn
        vjp = functools.partial(_vjp, fn)
        if jit:
            self.forward = jax.jit(fn)
            self.vjp = jax.jit(vjp, static_argnums=0)
            self.backward = jax.jit(_apply_vjp)
        else:
            self.forward, self.vjp, self.backward = fn, vjp, _apply_vjp

    def __call__(self, *tensors: Any) -> Any:
        import jax
        import torch

        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ConversionError(
                    f"jax2torch: argument {i} is a {type(t).__name__}, not a torch.Tensor; "
                    "close over non-tensor values in the JAX function instead"
                )
        grad_on = torch.is_grad_enabled()
        mask = tuple(
            grad_on and t.requires_grad and (t.is_floating_point() or t.is_complex())
            for t in tensors
        )
        if not any(mask):
            out = self.forward(*(torch_to_jax(t) for t in tensors))
            return jax.tree_util.tree_map(jax_to_torch, out)
        box: dict[str, Any] = {}
        leaves = _JaxFunction.apply(self, mask, box, *tensors)
        return jax.tree_util.tree_unflatten(box["treedef"], list(leaves))


def _vjp(fn: Callable[..., Any], mask: tuple[bool, ...], *args: Any) -> tuple[Any, Any]:
    """``jax.vjp`` of ``fn`` with respect to the arguments selected by ``mask``."""
    import jax

    def partial_fn(*diff: Any) -> Any:
        it = iter(diff)
        return fn(*(next(it) if m else a for a, m in zip(args, mask, strict=True)))

    return jax.vjp(partial_fn, *(a for a, m in zip(args, mask, strict=True) if m))


def _apply_vjp(vjp_fn: Any, cotangent: Any) -> Any:
    return vjp_fn(cotangent)


def _is_inexact(dtype: Any) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _autograd_function() -> type:
    import jax
    import numpy as np
    import torch
    from torch.autograd.function import once_differentiable

    class JaxFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, bridge: _Bridge, mask, box, *tensors):
            out, vjp_fn = bridge.vjp(mask, *(torch_to_jax(t) for t in tensors))
            leaves, treedef = jax.tree_util.tree_flatten(out)
            box["treedef"] = treedef
            ctx.bridge, ctx.vjp_fn, ctx.treedef, ctx.mask = bridge, vjp_fn, treedef, mask
            ctx.out_avals = [(leaf.shape, leaf.dtype) for leaf in leaves]
            ctx.in_dtypes = [t.dtype for t in tensors]
            outs = tuple(jax_to_torch(leaf) for leaf in leaves)
            frozen = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
            if frozen:
                ctx.mark_non_differentiable(*frozen)
            return outs

        @staticmethod
        @once_differentiable
        def backward(ctx, *grads):
            import jax.numpy as jnp

            cts = []
            for g, (shape, dtype) in zip(grads, ctx.out_avals, strict=True):
                if not _is_inexact(dtype):
                    cts.append(np.zeros(shape, dtype=jax.dtypes.float0))
                elif g is None:
                    cts.append(jnp.zeros(shape, dtype))
                else:
                    ct = torch_to_jax(g)
                    cts.append(ct if ct.dtype == dtype else ct.astype(dtype))
            cotangent = jax.tree_util.tree_unflatten(ctx.treedef, cts)
            diff_grads = iter(ctx.bridge.backward(ctx.vjp_fn, cotangent))
            out = []
            for m, dtype in zip(ctx.mask, ctx.in_dtypes, strict=True):
                if not m:
                    out.append(None)
                    continue
                g = jax_to_torch(next(diff_grads))
                out.append(g if g.dtype == dtype else g.to(dtype))
            return (None, None, None, *out)

    return JaxFunction


class _LazyFunction:
    """Builds the ``torch.autograd.Function`` on first use, so importing needs no torch."""

    @functools.cached_property
    def cls(self) -> type:
        return _autograd_function()

    def apply(self, *args: Any) -> Any:
        return self.cls.apply(*args)


_JaxFunction = _LazyFunction()
