"""Activation layouts for the Flax emitter, as axis permutations of the source layout.

A value's physical array is ``source.transpose(perm)``; ``None`` is the source (channels-first)
layout itself. Flax's conv, pooling and normalisation layers are channels-last, so the
emitter keeps NHWC through runs of such layers and elementwise ops and transposes only at
the boundaries of the run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Perm = tuple[int, ...] | None


def channels_last(rank: int) -> Perm:
    """``(0, 2, 3, 1)`` for rank 4; None (no change) below rank 3."""
    if rank < 3:
        return None
    return (0, *range(2, rank), 1)


def normalize(perm: Sequence[int] | None) -> Perm:
    if perm is None:
        return None
    perm = tuple(int(p) for p in perm)
    return None if perm == tuple(range(len(perm))) else perm


def conversion(src: Perm, dst: Perm, rank: int) -> tuple[int, ...]:
    """The transpose turning an array held in layout ``src`` into layout ``dst``."""
    s = src or tuple(range(rank))
    d = dst or tuple(range(rank))
    inv = [0] * rank
    for i, p in enumerate(s):
        inv[p] = i
    return tuple(inv[p] for p in d)


def after_reduce(perm: Perm, axes: Sequence[int], rank: int) -> Perm:
    """The layout of a reduction's output (axes in source numbering, keepdims=0)."""
    if perm is None:
        return None
    kept = [p for p in perm if p not in set(axes)]
    order = sorted(kept)
    return normalize([order.index(p) for p in kept])


def permute_constant(array: np.ndarray, perm: Perm, rank: int) -> np.ndarray:
    """A broadcastable constant for an op run in layout ``perm`` (padded to ``rank`` first)."""
    if perm is None or array.ndim == 0:
        return array
    full = array.reshape((1,) * (rank - array.ndim) + array.shape)
    return np.transpose(full, perm)


def moves_only_unit_axes(t: Sequence[int], src_shape: Sequence[int | None]) -> bool:
    """Whether transposing an array of ``src_shape`` by ``t`` keeps every axis that is not
    known to be 1 in its order, so the transpose is a reshape."""
    kept = [a for a in t if src_shape[a] != 1]
    return kept == sorted(kept)
