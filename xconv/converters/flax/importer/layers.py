"""Flax module tree -> xconv layer marks: weight roles, layer kinds, recovered norms.

Classes are recognised by name for both linen and nnx (``Dense``/``Linear``, ``Conv``,
``BatchNorm``, ``LayerNorm``, ``Embed``, ``Dropout``, ``MultiHeadDotProductAttention`` /
``MultiHeadAttention``, ...), but only when they compute Flax's layer (:func:`layer_name`): a
Flax class, or a subclass that keeps its ``__call__``. A subclass overriding ``__call__`` (an
embedding that scales its output) or a user class that only shares a Flax name is emitted as
its traced body.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.ir.layers import mark_layer, mark_weight
from xconv.ir.metadata import SCOPE

KINDS = {
    "Dense": "dense",
    "Linear": "dense",
    "Conv": "conv",
    "ConvTranspose": "conv_transpose",
    "BatchNorm": "batch_norm",
    "LayerNorm": "layer_norm",
    "GroupNorm": "group_norm",
    "RMSNorm": "rms_norm",
    "Embed": "embedding",
    "Dropout": "dropout",
    "MultiHeadDotProductAttention": "attention",
    "MultiHeadAttention": "attention",
    "SelfAttention": "attention",
}
_DENSE_LIKE = {"Dense", "Linear", "DenseGeneral", "LinearGeneral", "Einsum"}
_ANCHORS = {
    "dense": ("MatMul", "Gemm", "Einsum"),
    "conv": ("Conv",),
    "conv_transpose": ("ConvTranspose",),
    "batch_norm": ("BatchNormalization",),
    "layer_norm": ("LayerNormalization",),
    "embedding": ("Gather",),
    "attention": ("MatMul", "Einsum"),
    "dropout": ("Dropout",),
}
_ATTN_ROLES = {"query": "q", "key": "k", "value": "v", "out": "out_proj"}
_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}


def _is_flax(cls: type) -> bool:
    mod = cls.__module__
    return any(mod == pkg or mod.startswith(pkg + ".") for pkg in ("flax.linen", "flax.nnx"))


def layer_name(cls: type | None) -> str | None:
    """The Flax layer class name (``Dense``, ``Conv``, ...) that ``cls`` computes, else None."""
    if cls is None:
        return None
    base = next(
        (
            c
            for c in cls.__mro__
            if _is_flax(c) and (c.__name__ in KINDS or c.__name__ in _DENSE_LIKE)
        ),
        None,
    )
    if base is None:
        return None
    owner = next((c for c in cls.__mro__ if "__call__" in c.__dict__), None)
    return base.__name__ if owner is not None and _is_flax(owner) else None


def layer_kind(cls: type | None) -> str | None:
    """The ``xconv.layer`` kind of a Flax module class that computes a standard layer."""
    return KINDS.get(layer_name(cls) or "")


def class_name(cls: type) -> str:
    """``flax.linen.Conv`` / ``flax.nnx.Linear`` for Flax's own classes, else module.qualname."""
    mod = cls.__module__
    for pkg in ("flax.linen", "flax.nnx"):
        if mod == pkg or mod.startswith(pkg + "."):
            return f"{pkg}.{cls.__name__}"
    return f"{mod}.{cls.__qualname__}"


def role_of(name: str, value: ir.Value, classes: dict[str, type]) -> tuple[str, str | None] | None:
    """(role, layout) of the weight ``name`` (``Block_0.Conv_0.kernel``) from its module."""
    parts = name.split(".")
    path, leaf = "/".join(parts[:-1]), parts[-1]
    kind = layer_name(classes.get(path))
    if kind is None:
        return None
    parent = classes.get("/".join(parts[:-2]))
    rank = len(value.shape) if value.shape is not None else 0
    if layer_kind(parent) == "attention" and parts[-2] in _ATTN_ROLES:
        prefix = _ATTN_ROLES[parts[-2]]
        if leaf in ("kernel", "bias"):
            return f"{prefix}_{leaf}", None
    if kind in _DENSE_LIKE and leaf in ("kernel", "bias"):
        return leaf, ("IO" if leaf == "kernel" and rank == 2 else "O" if leaf == "bias" else None)
    if kind in ("Conv", "ConvTranspose") and leaf in ("kernel", "bias"):
        if leaf == "bias":
            return "bias", "O"
        return "kernel", _SPATIAL.get(rank - 2, "") + "IO" if rank - 2 in _SPATIAL else None
    if kind == "BatchNorm" and leaf in ("scale", "bias", "mean", "var"):
        return leaf, None
    if kind in ("LayerNorm", "GroupNorm", "RMSNorm") and leaf in ("scale", "bias"):
        return leaf, None
    if kind == "Embed" and leaf == "embedding":
        return "embedding", None
    return None


def mark_weights(graph: ir.Graph, classes: dict[str, type]) -> None:
    """Every variable is a weight: a recognised layer's gets its role and layout, any other
    (``self.param`` of a custom module) its leaf name as role, as the torch importer does."""
    for name, value in graph.initializers.items():
        role, layout = role_of(name, value, classes) or (name.rsplit(".", 1)[-1], None)
        mark_weight(value, role, layout)


def _attr(module: Any, name: str, default: Any = None) -> Any:
    return getattr(module, name, default)


def _weight(graph: ir.Graph, path: str, leaf: str) -> ir.Value | None:
    return graph.initializers.get(".".join([*path.split("/"), leaf]) if path else leaf)


def mark_layers(
    graph: ir.Graph,
    classes: dict[str, type],
    modules: dict[str, Any],
    node_info: dict[str, dict[str, Any]],
) -> None:
    """Put ``xconv.layer`` on the anchor node of each recognised layer."""
    by_scope: dict[str, list[ir.Node]] = {}
    for node in graph:
        scope = node.metadata_props.get(SCOPE)
        if scope is not None:
            by_scope.setdefault(scope, []).append(node)
    for path, cls in classes.items():
        kind = layer_kind(cls)
        if kind is None or kind not in _ANCHORS:
            continue
        candidates = [n for n in by_scope.get(path, []) if n.op_type in _ANCHORS[kind]]
        if not candidates:
            continue
        # The op reading the layer's own weight (an Embed's table Gather, not the Gather that
        # squeezes its ids), else the first.
        anchor = next(
            (n for n in candidates if any(v is not None and v.is_initializer() for v in n.inputs)),
            candidates[0],
        )
        params = _layer_params(kind, graph, path, modules.get(path), node_info.get(anchor.name))
        if params is not None and kind == "layer_norm" and not params["normalized_shape"]:
            features = _shape(anchor.inputs[0])[-1:]  # no scale or bias: the normalised axis
            params = {**params, "normalized_shape": features} if features else None
        if params is not None:
            mark_layer(anchor, kind, **params)


def _shape(value: ir.Value | None) -> list[int]:
    return [int(d) for d in value.shape] if value is not None and value.shape is not None else []


def _layer_params(kind, graph, path, module, info) -> dict[str, Any] | None:
    bias = _weight(graph, path, "bias")
    if kind == "dense":
        kernel = _shape(_weight(graph, path, "kernel"))
        if len(kernel) != 2:
            return None
        return {"in_features": kernel[0], "out_features": kernel[1], "use_bias": bias is not None}
    if kind in ("conv", "conv_transpose"):
        if info is None or info.get("kind") != kind:
            return None
        out = {
            "ndim": len(info["kernel_size"]),
            "in_channels": int(info["in_channels"]),
            "out_channels": int(info["out_channels"]),
            "kernel_size": info["kernel_size"],
            "strides": info["strides"],
            "padding": info["padding"],
            "dilations": info["dilations"],
            "groups": info["groups"],
            "use_bias": bias is not None,
        }
        if kind == "conv_transpose":
            out["output_padding"] = [0] * out["ndim"]
        return out
    if kind == "batch_norm":
        mean = _shape(_weight(graph, path, "mean"))
        return {
            "num_features": mean[0] if mean else 0,
            "epsilon": float(_attr(module, "epsilon", 1e-5)),
            "momentum": round(1.0 - float(_attr(module, "momentum", 0.99)), 8),
            "affine": _weight(graph, path, "scale") is not None,
            "track_running_stats": True,
        }
    if kind == "layer_norm":
        scale = _weight(graph, path, "scale")
        shape = _shape(scale) or _shape(bias)
        return {
            "normalized_shape": shape,
            "epsilon": float(_attr(module, "epsilon", 1e-6)),
            "elementwise_affine": scale is not None,
            "use_bias": bias is not None,
        }
    if kind == "dropout":
        return {"rate": float(_attr(module, "rate", 0.0))}
    if kind == "embedding":
        table = _shape(_weight(graph, path, "embedding"))
        return {"num_embeddings": table[0], "features": table[1]} if len(table) == 2 else None
    if kind == "attention":
        q = _shape(_weight(graph, f"{path}/query", "kernel"))
        if len(q) != 3:
            return None
        return {
            "embed_dim": q[0],
            "num_heads": q[1],
            "use_bias": _weight(graph, f"{path}/query", "bias") is not None,
            "batch_first": True,
        }
    return None


def ones_like_features(n: int, dtype: Any) -> np.ndarray:
    return np.ones((n,), dtype)
