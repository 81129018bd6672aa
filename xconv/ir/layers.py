"""Recognised layers: the schema of the ``xconv.layer`` metadata.

Importers mark each recognised source layer; emitters use the mark to write the target's
native layer (``nn.Conv``, ``torch.nn.Linear``) instead of raw ops.

The contract:

* Every node produced for one source layer carries the same ``xconv.scope`` (the module path,
  e.g. ``layer1.0.conv1``). Together they are the layer's *body*: the emitter may replace the
  whole body with one native layer call whose inputs and outputs are the body's inputs
  (excluding the layer's weights) and outputs.
* Exactly one node of the body, the *anchor* (the node that consumes the main weight: the
  ``Conv``, ``Gemm``/``MatMul``, ``BatchNormalization``, ``Gather`` for embeddings, ...),
  carries ``xconv.layer`` = JSON ``{"kind": KIND, ...hyper-parameters}`` as listed in
  ``LAYER_KINDS`` below (all keys required unless marked optional).
* The layer's weights are initializers named by their source path
  (``layer1.0.conv1.weight``), each with ``xconv.role`` (one of ``ROLES``) and
  ``xconv.layout``. Roles are framework-neutral: a torch ``Linear.weight`` and a Flax
  ``Dense.kernel`` are both role ``kernel``, with layouts ``OI`` and ``IO``.
* Conventions are the source framework's where they differ and are written explicitly:
  ``momentum`` of batch_norm is the weight of the *new* batch statistic (torch's
  convention; Flax's ``momentum`` is ``1 - momentum``).
"""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

from xconv.ir.metadata import LAYER, LAYOUT, ROLE

#: kind -> (required keys, optional keys)
LAYER_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # y = x @ kernel + bias over the last axis
    "dense": (("in_features", "out_features", "use_bias"), ()),
    # padding: [[lo, hi], ...] per spatial dim; ndim: number of spatial dims
    "conv": (
        (
            "ndim",
            "in_channels",
            "out_channels",
            "kernel_size",
            "strides",
            "padding",
            "dilations",
            "groups",
            "use_bias",
        ),
        ("padding_mode",),
    ),
    "conv_transpose": (
        (
            "ndim",
            "in_channels",
            "out_channels",
            "kernel_size",
            "strides",
            "padding",
            "dilations",
            "groups",
            "use_bias",
            "output_padding",
        ),
        (),
    ),
    "batch_norm": (("num_features", "epsilon", "momentum", "affine", "track_running_stats"), ()),
    "layer_norm": (("normalized_shape", "epsilon", "elementwise_affine", "use_bias"), ()),
    "group_norm": (("num_groups", "num_channels", "epsilon", "affine"), ()),
    "rms_norm": (("normalized_shape", "epsilon", "elementwise_affine"), ()),
    "embedding": (("num_embeddings", "features"), ("padding_idx",)),
    "dropout": (("rate",), ()),
    "attention": (
        ("embed_dim", "num_heads", "use_bias", "batch_first"),
        ("kdim", "vdim", "dropout", "causal"),
    ),
    "max_pool": (("ndim", "kernel_size", "strides", "padding", "dilations", "ceil_mode"), ()),
    "avg_pool": (
        ("ndim", "kernel_size", "strides", "padding", "ceil_mode", "count_include_pad"),
        (),
    ),
    "lstm": (
        ("input_size", "hidden_size", "num_layers", "bidirectional", "batch_first", "use_bias"),
        (),
    ),
    "gru": (
        ("input_size", "hidden_size", "num_layers", "bidirectional", "batch_first", "use_bias"),
        (),
    ),
}

#: Framework-neutral weight roles. Recurrent and attention layers use their own roles
#: (``in_proj_kernel``, ``weight_ih_l0``, ...) named after the source parameter.
ROLES = frozenset(
    {
        "kernel",
        "bias",
        "scale",
        "mean",
        "var",
        "num_batches",
        "embedding",
        "in_proj_kernel",
        "in_proj_bias",
        "out_proj_kernel",
        "out_proj_bias",
        "q_kernel",
        "k_kernel",
        "v_kernel",
        "q_bias",
        "k_bias",
        "v_bias",
        "weight_ih",
        "weight_hh",
        "bias_ih",
        "bias_hh",
    }
)


def layer_json(kind: str, **params: Any) -> str:
    """Validate ``params`` against ``LAYER_KINDS[kind]`` and return the metadata JSON."""
    if kind not in LAYER_KINDS:
        raise ValueError(f"unknown layer kind {kind!r}; known kinds: {sorted(LAYER_KINDS)}")
    required, optional = LAYER_KINDS[kind]
    missing = [k for k in required if k not in params]
    unknown = [k for k in params if k not in required and k not in optional]
    if missing or unknown:
        raise ValueError(f"layer {kind!r}: missing {missing}, unknown {unknown}")
    return json.dumps({"kind": kind, **params}, sort_keys=True)


def mark_layer(node: ir.Node, kind: str, **params: Any) -> None:
    node.metadata_props[LAYER] = layer_json(kind, **params)


def mark_weight(value: ir.Value, role: str, layout: str | None = None) -> None:
    value.metadata_props[ROLE] = role
    if layout:
        value.metadata_props[LAYOUT] = layout
