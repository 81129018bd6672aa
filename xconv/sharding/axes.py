"""Logical axis names for every leaf of a variables tree.

Keyed off what a converter *emits* (the nested variables tree, its leaf names and shapes)
and the IR's metadata for the weight each leaf came from (``xconv.role``, ``xconv.layout``
and the consuming node's ``xconv.layer`` kind), never off an emitter's internals:

* a leaf is matched to its IR initializer by the name map the conversion recorded
  (``SOURCE_NAMES`` of generated Flax; ``to_jax`` trees are the initializer names nested);
* the IR gives axes in the IR layout (``OI`` dense, ``OIHW`` conv, ``VD`` embedding);
* they are permuted to the leaf's layout (Flax kernels are ``...IO``) and checked against its
  shape. A leaf with no IR record is named from its leaf name and shape (``kernel`` rank 2 is
  a Flax Dense kernel, rank >= 3 a Conv kernel, ``embedding`` an Embed table).

Anything that cannot be named is replicated (all ``None``): sharding never changes numbers,
only placement, so an unnamed or oddly named leaf costs memory, never correctness.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from xconv.ir.metadata import LAYER, LAYOUT, ROLE
from xconv.weights.flax_names import flax_kernel_layout, kernel_permutation

Axes = tuple[str | None, ...]
Path = tuple[str, ...]

_OUT_HINT = re.compile(r"(^|[._/])(out_proj|o_proj|c_proj|proj|wo|down_proj|dense_4h_to_h)$")
_NORM_KINDS = {"batch_norm", "layer_norm", "group_norm", "rms_norm"}


def leaves(tree: Any, prefix: Path = ()) -> dict[Path, Any]:
    """Flatten a nested dict to ``{path: leaf}``."""
    if isinstance(tree, Mapping):
        out: dict[Path, Any] = {}
        for k in tree:
            out.update(leaves(tree[k], (*prefix, str(k))))
        return out
    return {prefix: tree}


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(x, "shape", ()))


class _Info:
    """What the IR says about one initializer."""

    def __init__(self, value: Any) -> None:
        meta = value.metadata_props
        self.role = meta.get(ROLE)
        self.layout = meta.get(LAYOUT)
        self.shape = tuple(int(d) for d in value.shape) if value.shape is not None else None
        self.kind = None
        for node, _ in value.uses():
            raw = node.metadata_props.get(LAYER)
            if raw:
                self.kind = json.loads(raw).get("kind")
                break


def model_info(model: Any) -> dict[str, _Info]:
    return {name: _Info(v) for name, v in model.graph.initializers.items()}


def _widths(infos: Mapping[str, _Info]) -> tuple[int | None, set[int]]:
    """(model width, vocabulary sizes): the width is the most common size of embedding
    features and norm scales, else of dense kernel dimensions."""
    counts: Counter[int] = Counter()
    vocab: set[int] = set()
    for i in infos.values():
        if not i.shape:
            continue
        if i.role == "embedding" and len(i.shape) == 2:
            counts[i.shape[-1]] += 2
            vocab.add(i.shape[0])
        elif i.role == "scale" and i.kind in ("layer_norm", "rms_norm") and len(i.shape) == 1:
            counts[i.shape[0]] += 1
    if not counts:
        for i in infos.values():
            if i.role == "kernel" and i.shape and len(i.shape) == 2:
                counts.update(i.shape)
    width = counts.most_common(1)[0][0] if counts else None
    return width, vocab


def _dense(i_dim: int, o_dim: int, name: str, width: int | None, vocab: set[int]) -> Axes:
    """(in, out) logical names of a dense kernel."""
    if o_dim in vocab and i_dim == width:
        return ("embed", "vocab")
    if i_dim == width and o_dim != width:
        return ("embed", "mlp")
    if o_dim == width and i_dim != width:
        return ("mlp", "embed")
    if i_dim == width:  # square: attention projections; the output projection is row-parallel
        return ("heads", "embed") if _OUT_HINT.search(name) else ("embed", "heads")
    return ("embed", "mlp")


def _ir_axes(name: str, info: _Info, width: int | None, vocab: set[int]) -> Axes | None:
    """Axes of an initializer in its IR layout, or None when its role says nothing."""
    role, layout, shape = info.role, info.layout, info.shape
    if shape is None or not shape:
        return None
    rank = len(shape)
    if role == "embedding" and rank == 2:
        return ("vocab", "embed")
    if role in ("mean", "var") or (role in ("scale", "bias") and info.kind in _NORM_KINDS):
        return ("norm",) + (None,) * (rank - 1)
    if role in ("in_proj_kernel", "q_kernel", "k_kernel", "v_kernel") and layout == "OI":
        return ("heads", "embed")
    if role == "out_proj_kernel" and layout == "OI":
        return ("embed", "heads")
    if role in ("in_proj_bias", "q_bias", "k_bias", "v_bias"):
        return ("heads",)
    if role == "out_proj_bias":
        return ("embed",)
    if role == "kernel" and layout and len(layout) == rank and set("OI") <= set(layout):
        o, i = layout.index("O"), layout.index("I")
        axes: list[str | None] = [None] * rank
        if rank == 2 and info.kind not in ("conv", "conv_transpose"):
            axes[i], axes[o] = _dense(shape[i], shape[o], name, width, vocab)
        else:
            axes[i], axes[o] = "conv_in", "conv_out"
        return tuple(axes)
    return None


def _bias_axes(kernel_axes: Axes | None, is_conv: bool) -> Axes:
    if kernel_axes is None:
        return (None,)
    return (kernel_axes[-1],) if not is_conv else ("conv_out",)


def _permute(axes: Axes, info: _Info, shape: tuple[int, ...]) -> Axes | None:
    """IR-layout axes -> the leaf's layout, or None when the shapes cannot be matched."""
    if info.shape == shape:
        return axes
    layout = info.layout
    if layout and len(layout) == len(shape) and set("OI") <= set(layout):
        try:
            perm = kernel_permutation(layout, flax_kernel_layout(layout))
        except ValueError:
            return None
        if tuple(info.shape[p] for p in perm) == shape:  # type: ignore[index]
            return tuple(axes[p] for p in perm)
    return None


def _by_leaf_name(path: Path, shape: tuple[int, ...], width, vocab) -> Axes:
    """A leaf with no IR record, named from Flax's conventions."""
    leaf, rank = path[-1], len(shape)
    if leaf == "embedding" and rank == 2:
        return ("vocab", "embed")
    if leaf == "kernel" and rank == 2:
        return _dense(shape[0], shape[1], "/".join(path), width, vocab)
    if leaf == "kernel" and rank >= 3:
        return (None,) * (rank - 2) + ("conv_in", "conv_out")
    if path[0] == "batch_stats" or leaf in ("scale", "mean", "var"):
        return ("norm",) + (None,) * (rank - 1) if rank else ()
    return (None,) * rank


def logical_axes(
    tree: Any,
    *,
    model: Any = None,
    source_names: Mapping[str, str] | None = None,
    strip_collection: bool = False,
    perms: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[dict[Path, Axes], list[str]]:
    """Logical axis names for every leaf of ``tree``.

    Args:
        tree: Nested dict of arrays (or anything with ``.shape``).
        model: The IR model the tree was converted from (its metadata names the axes).
        source_names: Leaf path ("/"-joined, without the collection) -> IR initializer name,
            as generated Flax records it in ``SOURCE_NAMES``; else the path joined by ".".
        strip_collection: The tree's first level is a Flax collection (``params``...).
        perms: IR initializer name -> the permutation its leaf is stored in (``to_jax``'s
            ``kernel_perms``): known, so a square kernel is not taken for unpermuted.

    Returns:
        ``({path: axes}, notes)``.
    """
    infos = model_info(model) if model is not None else {}
    width, vocab = _widths(infos)
    flat = leaves(tree)
    names = source_names if source_names is not None else {}  # SourceNames predicts
    out: dict[Path, Axes] = {}
    notes: list[str] = []
    kernels: dict[Path, Axes] = {}
    for path, leaf in flat.items():
        shape = _shape(leaf)
        key = path[1:] if strip_collection and len(path) > 1 else path
        src = names.get("/".join(key), ".".join(key))
        info = infos.get(src)
        axes = ir_axes = None
        if info is not None and info.role == "bias" and info.kind not in _NORM_KINDS:
            axes = None  # named after its layer's kernel, below
        elif info is not None:
            ir_axes = _ir_axes(src, info, width, vocab)
            perm = (perms or {}).get(src)
            if ir_axes is not None and perm is not None and len(perm) == len(ir_axes):
                axes = tuple(ir_axes[p] for p in perm)
            elif ir_axes is not None:
                axes = _permute(ir_axes, info, shape)
                if axes is None:
                    notes.append(
                        f"{'/'.join(path)}: shape {shape} does not match {src} "
                        f"{info.shape} in any known layout: replicated"
                    )
                    axes = (None,) * len(shape)
        if axes is None:
            axes = _by_leaf_name(path, shape, width, vocab)
        out[path] = axes
        if info is not None and info.role == "kernel" and info.layout and "O" in info.layout:
            if len(info.layout) == len(shape) and ir_axes is not None:
                kernels[path[:-1]] = ir_axes[info.layout.index("O")]
        elif path[-1] == "kernel" and axes:
            kernels[path[:-1]] = axes[-1]  # Flax layout: output features last
    for path, axes in out.items():  # plain biases follow their layer's kernel
        if path[-1] == "bias" and path[:-1] in kernels and len(axes) == 1:
            name = kernels[path[:-1]]
            if name != "norm" and out[path] == (None,):
                out[path] = (name,)
    return out, notes
