"""Which leaf of a Flax / JAX variable tree holds each torch ``state_dict`` entry.

``torch-to-flax`` names a layer's weights after the layer (``layer1.0.conv1.weight`` ->
``params/layer1_0_conv1/kernel``, transposed ``OIHW`` -> ``HWIO``; see
:mod:`xconv.weights.flax_names`), ``to_jax`` keeps the ``state_dict`` name
(``params["layer1"]["0"]["conv1"]["weight"]``). Optimizer state must follow the same path and
the same transpose. Where the conversion recorded its names (``SOURCE_SCOPES`` /
``SOURCE_NAMES`` in a generated ``model.py``, ``weight_names`` of a ``to_jax`` function),
:func:`match_recorded` takes each torch entry's leaf from that record and the transpose from
the values; a leaf whose values differ under every transpose is a stale conversion, reported
as such (:class:`StaleWeightsError`). Without a record, :func:`match_leaves` reads the
correspondence off the two trees themselves: each torch entry goes to the leaf that holds its
values, preferring the leaf its name predicts; a torch entry no leaf holds is a
:class:`WeightsError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from xconv.errors import WeightsError
from xconv.weights.flax_names import identifier

Path = tuple[str, ...]

#: torch name suffix -> the Flax variable names it usually becomes.
_ROLE_NAMES = {
    "weight": ("kernel", "scale", "embedding", "weight"),
    "bias": ("bias",),
    "running_mean": ("mean", "running_mean"),
    "running_var": ("var", "running_var"),
}


@dataclass(frozen=True)
class Leaf:
    """Where one torch tensor lives: the tree path and the axis permutation (or None)."""

    name: str
    path: Path
    perm: tuple[int, ...] | None

    def to_flax(self, array):
        return array if self.perm is None else array.transpose(self.perm)

    def to_torch(self, array):
        return array if self.perm is None else array.transpose(np.argsort(self.perm))


def flatten_tree(tree: Mapping[str, Any], prefix: Path = ()) -> dict[Path, Any]:
    """``{path: leaf}`` of a nested mapping (Flax variables, ``to_jax`` params, nnx state)."""
    out: dict[Path, Any] = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            out.update(flatten_tree(value, path))
        else:
            out[path] = value
    return out


def _perms(ndim: int) -> list[tuple[int, ...] | None]:
    """Identity, then torch's kernel layouts moved to Flax's (``O I ...`` / ``I O ...`` ->
    ``... I O``)."""
    out: list[tuple[int, ...] | None] = [None]
    if ndim >= 2:
        spatial = tuple(range(2, ndim))
        out += [(*spatial, 1, 0), (*spatial, 0, 1)]
    return [p for p in out if p is None or p != tuple(range(ndim))]


def _rank(name: str, path: Path) -> int:
    """Lower is a better name match for the torch entry ``name``."""
    if path[-len(name.split(".")) :] == tuple(name.split(".")):
        return 0
    scope, _, attr = name.rpartition(".")
    roles = _ROLE_NAMES.get(attr, (attr,))
    module = identifier(scope) if scope else ""
    # A flat tree names the module by one key (``layers_0_ln1``), a nested one by its path
    # (``layers_0/ln1``): either way the leaf's module path ends with the scope's identifier.
    holder = "_" + "_".join(path[:-1])
    here = bool(module) and (module in path or holder.endswith("_" + module))
    if here and path[-1] in roles:
        return 1
    if here:
        return 2
    if identifier(name) in path:
        return 3
    return 4


class StaleWeightsError(WeightsError):
    """The conversion's record names a leaf for each torch entry, but some leaves hold other
    values than the module's: the candidate was converted from older (or other) weights."""


def _array(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)


def match_recorded(
    state: Mapping[str, Any],
    tree: Mapping[str, Any],
    sources: Mapping[Path, str],
    *,
    what: str = "the variables",
) -> dict[str, Leaf]:
    """Map each torch entry of ``state`` to the leaf ``sources`` (leaf path -> the source
    weight name the conversion recorded) names for it; the transpose is the one under which
    the leaf holds the entry's values. Entries the record does not name are matched by value
    (:func:`match_leaves`) among the leaves it does not claim.

    Raises:
        StaleWeightsError: a recorded leaf whose values differ from its torch entry under
            every transpose (the message lists them, with the largest difference).
    """
    flat = {p: np.asarray(v) for p, v in flatten_tree(tree).items()}
    by_name: dict[str, Path] = {}
    for path, source in sources.items():
        if path in flat:
            by_name.setdefault(source, path)
    out: dict[str, Leaf] = {}
    stale: list[str] = []
    unrecorded: dict[str, Any] = {}
    for name, tensor in state.items():
        path = by_name.get(name)
        if path is None:
            unrecorded[name] = tensor
            continue
        arr, got = _array(tensor), flat[path]
        perms = [p for p in _perms(arr.ndim) if _moved(arr, p).shape == got.shape]
        same = [p for p in perms if np.array_equal(got, _moved(arr, p).astype(got.dtype))]
        if same:
            out[name] = Leaf(name, path, same[0])
            continue
        if perms:
            diff = np.max(np.abs(got.astype(np.float64) - _moved(arr, perms[-1])), initial=0.0)
            stale.append(f"{name} (max difference {diff:.3g})")
        else:
            stale.append(f"{name} (shape {tuple(arr.shape)} against {tuple(got.shape)})")
    if stale:
        raise StaleWeightsError(
            f"{what} holds weights that differ from the module's: {len(stale)} of "
            f"{len(state)} tensor(s), "
            + ", ".join(stale[:5])
            + ("..." if len(stale) > 5 else "")
            + ". Re-run the conversion (xconv torch-to-flax / xconv.to_flax) on the module as it "
            "is now, or check the module whose weights it holds."
        )
    if unrecorded:
        claimed = {leaf.path for leaf in out.values()}
        rest = {p: v for p, v in flat.items() if p not in claimed}
        out.update(_match_values(unrecorded, rest, what))
    return out


def _moved(arr: np.ndarray, perm: tuple[int, ...] | None) -> np.ndarray:
    return arr if perm is None else arr.transpose(perm)


def match_leaves(
    state: Mapping[str, Any], tree: Mapping[str, Any], *, what: str = "the variables"
) -> dict[str, Leaf]:
    """Map each torch entry of ``state`` (``{name: tensor}``) to the leaf of ``tree`` holding
    its values, transposed as the converters transpose kernels.

    Raises:
        WeightsError: an entry no unclaimed leaf holds; the message lists them all.
    """
    return _match_values(state, {p: np.asarray(v) for p, v in flatten_tree(tree).items()}, what)


def _match_values(state: Mapping[str, Any], flat: dict[Path, Any], what: str) -> dict[str, Leaf]:
    """:func:`match_leaves` over a flattened tree."""
    claimed: set[Path] = set()
    out: dict[str, Leaf] = {}
    missing: list[str] = []
    for name, tensor in state.items():
        arr = _array(tensor)
        best: tuple[int, Leaf] | None = None
        for path in sorted(flat, key=lambda p: _rank(name, p)):
            rank = _rank(name, path)
            if best is not None and rank > best[0]:
                break
            if path in claimed:
                continue
            got = flat[path]
            for perm in _perms(arr.ndim):
                want = arr if perm is None else arr.transpose(perm)
                if got.shape == want.shape and np.array_equal(got, want.astype(got.dtype)):
                    best = best or (rank, Leaf(name, path, perm))
                    break
        if best is None:
            missing.append(name)
            continue
        claimed.add(best[1].path)
        out[name] = best[1]
    if missing:
        raise WeightsError(
            f"{len(missing)} torch tensor(s) are held by no leaf of {what}: "
            + ", ".join(missing[:10])
            + ("..." if len(missing) > 10 else "")
            + ". Pass the variables converted from this module's current weights "
            "(torch-to-flax / to_jax output), before any training step."
        )
    return out
