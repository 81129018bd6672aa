"""Tensors across PyTorch and JAX through the DLPack array protocol, without copies.

Both directions use the protocol form (``jax.dlpack.from_dlpack(tensor)``,
``torch.from_dlpack(array)``), not the deprecated capsule API. A copy happens only where the
memory cannot be shared as is: a non-contiguous tensor (made contiguous first), a tensor with
the conjugate or negative bit set, or a dtype JAX cannot hold with 64-bit types off
(``int64`` -> ``int32``, ``float64`` -> ``float32``, done by JAX).

A JAX array is immutable; a torch tensor that shares its buffer must not be written in place.
"""

from __future__ import annotations

from typing import Any


def torch_to_jax(tensor: Any) -> Any:
    """A torch tensor as a JAX array on the same device, sharing memory where possible."""
    import jax.dlpack

    t = tensor.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return jax.dlpack.from_dlpack(t)


def jax_to_torch(array: Any) -> Any:
    """A JAX array as a torch tensor on the same device, sharing its buffer."""
    import torch

    return torch.from_dlpack(array)
