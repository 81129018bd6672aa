"""Recognise standard ``torch.nn`` layers in an exported graph and annotate them.

After export every node carries ``xconv.scope`` (its module path). For each module of a known
class this module:

* marks the layer's *anchor* node with ``xconv.layer`` (kind and hyper-parameters read from
  the module instance, schema in :mod:`xconv.ir.layers`), and
* gives every weight (initializer named by its ``state_dict`` key) an ``xconv.role`` and
  ``xconv.layout``.

Roles and layouts (torch's own layouts; biases and norm vectors are 1-D):

=====================  =========================================  ==========================
layer                  parameter -> role                          layout
=====================  =========================================  ==========================
Linear                 weight -> kernel, bias -> bias             OI, O
transformers Conv1D    weight -> kernel, bias -> bias             IO, O (a dense layer)
ConvNd                 weight -> kernel, bias -> bias             OIW / OIHW / OIDHW, O
ConvTransposeNd        weight -> kernel, bias -> bias             IOW / IOHW / IODHW, O
BatchNormNd            weight/bias/running_mean/running_var ->    C
                       scale/bias/mean/var; num_batches_tracked
                       -> num_batches
LayerNorm/GroupNorm/   weight -> scale, bias -> bias              C (normalized dims for LN)
RMSNorm
Embedding              weight -> embedding                        VD (vocabulary, features)
MultiheadAttention     in_proj_weight/bias -> in_proj_kernel/bias  OI, O
                       q/k/v_proj_weight -> q/k/v_kernel, out_proj
                       .weight/.bias -> out_proj_kernel/bias
LSTM / GRU             the parameter's own name (weight_ih_l0,    OI (gates stacked in torch
                       bias_hh_l1_reverse, ...) so (scope, role)  order: LSTM i,f,g,o; GRU
                       stays unique per layer and direction       r,z,n), O
anything else          the parameter's own name                   none
=====================  =========================================  ==========================
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from xconv.ir.layers import mark_layer, mark_weight
from xconv.ir.metadata import LAYER, SCOPE

logger = logging.getLogger(__name__)

#: The op types that can anchor each layer kind, in order of preference.
ANCHOR_OPS: dict[str, tuple[str, ...]] = {
    "dense": ("Gemm", "MatMul"),
    "conv": ("Conv",),
    "conv_transpose": ("ConvTranspose",),
    "batch_norm": ("BatchNormalization",),
    "layer_norm": ("LayerNormalization",),
    "group_norm": ("GroupNormalization", "InstanceNormalization"),
    "rms_norm": ("RMSNormalization",),
    "embedding": ("Gather",),
    "dropout": ("Dropout", "Identity"),
    # The input projection: the node that consumes the layer's main weight.
    "attention": ("MatMul", "Gemm"),
    "lstm": ("LSTM",),
    "gru": ("GRU",),
    "max_pool": ("MaxPool",),
    "avg_pool": ("AveragePool",),
}


#: transformers' GPT-style ``Conv1D``: a dense layer whose weight is stored (in, out).
HF_CONV1D = "transformers.pytorch_utils.Conv1D"


def _class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


#: Methods whose torch.nn definition a layer's computation depends on (besides ``forward``).
_COMPUTE_METHODS = ("forward", "_conv_forward")


def computes_standard_layer(module: nn.Module) -> bool:
    """True when ``module`` computes what its torch.nn base class computes.

    A subclass that overrides ``forward`` (an embedding that scales its output, a layer norm
    over channels-first data) or ``_conv_forward`` (a weight-standardised conv) computes
    something else: its traced body must be emitted as is.
    """
    cls = type(module)
    for name in _COMPUTE_METHODS:
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is not None and not _is_torch_class(owner):
            return False
    return True


def _is_torch_class(cls: type) -> bool:
    name = f"{cls.__module__}.{cls.__qualname__}"
    return name.startswith("torch.nn.") or name == HF_CONV1D


def layer_kind(module: nn.Module) -> str | None:
    """The ``xconv.layer`` kind of a torch module, or None for modules that are not layers
    (including subclasses of a layer that compute something else)."""
    kind = _layer_kind(module)
    return kind if kind is None or computes_standard_layer(module) else None


def _layer_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear) or _class_name(module) == HF_CONV1D:
        return "dense"
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return "conv_transpose"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batch_norm"
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if isinstance(module, nn.GroupNorm):
        return "group_norm"
    if isinstance(module, nn.RMSNorm):
        return "rms_norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return "dropout"
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    if isinstance(module, nn.LSTM):
        return "lstm"
    if isinstance(module, nn.GRU):
        return "gru"
    if isinstance(module, nn.MaxPool1d | nn.MaxPool2d | nn.MaxPool3d):
        return "max_pool"
    if isinstance(module, nn.AvgPool1d | nn.AvgPool2d | nn.AvgPool3d):
        return "avg_pool"
    return None


#: Standard torch.nn classes by name -> layer kind, for modules known only by class name
#: (an ExportedProgram's module stack, TorchScript's ``original_name``).
_KIND_BY_CLASS: dict[str, str] = {
    "Linear": "dense",
    "NonDynamicallyQuantizableLinear": "dense",
    **{f"Conv{n}d": "conv" for n in (1, 2, 3)},
    **{f"ConvTranspose{n}d": "conv_transpose" for n in (1, 2, 3)},
    **{f"BatchNorm{n}d": "batch_norm" for n in (1, 2, 3)},
    "SyncBatchNorm": "batch_norm",
    "LayerNorm": "layer_norm",
    "GroupNorm": "group_norm",
    "RMSNorm": "rms_norm",
    "Embedding": "embedding",
    "Dropout": "dropout",
    **{f"Dropout{n}d": "dropout" for n in (1, 2, 3)},
    "MultiheadAttention": "attention",
    "LSTM": "lstm",
    "GRU": "gru",
    **{f"MaxPool{n}d": "max_pool" for n in (1, 2, 3)},
    **{f"AvgPool{n}d": "avg_pool" for n in (1, 2, 3)},
}


def kind_from_class(qualname: str | None) -> str | None:
    """Layer kind of a standard ``torch.nn`` class given by (qualified) name."""
    if not qualname:
        return None
    if qualname == HF_CONV1D:
        return "dense"
    if "." in qualname and not qualname.startswith("torch.nn."):
        return None  # a user class that happens to share a torch.nn name
    return _KIND_BY_CLASS.get(qualname.rsplit(".", 1)[-1])


def _tuple(value: Any, n: int) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    return [int(v) for v in value]


def _conv_ndim(module: nn.Module) -> int:
    return module.weight.dim() - 2


def _conv_padding(module: nn.Module, anchor: ir.Node | None, ndim: int) -> list[list[int]]:
    if isinstance(module.padding, str):
        # 'same' / 'valid': the exporter wrote the resolved pads on the Conv node.
        pads = _node_ints(anchor, "pads") if anchor is not None else None
        if pads is None:
            pads = [0] * (2 * ndim)
        return [[pads[i], pads[i + ndim]] for i in range(ndim)]
    pad = _tuple(module.padding, ndim)
    return [[p, p] for p in pad]


def _node_ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return [int(v) for v in attr.value] if attr is not None else None


def _node_float(node: ir.Node | None, name: str) -> float | None:
    if node is None:
        return None
    attr = node.attributes.get(name)
    return float(attr.value) if attr is not None else None


def _dense_params(kind, module, anchor):
    if _class_name(module) == HF_CONV1D:
        return {"in_features": module.nx, "out_features": module.nf, "use_bias": True}
    return {
        "in_features": module.in_features,
        "out_features": module.out_features,
        "use_bias": module.bias is not None,
    }


def _conv_params(kind, module, anchor):
    ndim = _conv_ndim(module)
    params = {
        "ndim": ndim,
        "in_channels": module.in_channels,
        "out_channels": module.out_channels,
        "kernel_size": _tuple(module.kernel_size, ndim),
        "strides": _tuple(module.stride, ndim),
        "padding": _conv_padding(module, anchor, ndim),
        "dilations": _tuple(module.dilation, ndim),
        "groups": module.groups,
        "use_bias": module.bias is not None,
    }
    if kind == "conv_transpose":
        params["output_padding"] = _tuple(module.output_padding, ndim)
    elif module.padding_mode != "zeros":
        params["padding_mode"] = module.padding_mode
    return params


def _batch_norm_params(kind, module, anchor):
    return {
        "num_features": module.num_features,
        "epsilon": float(module.eps),
        "momentum": None if module.momentum is None else float(module.momentum),
        "affine": module.affine,
        "track_running_stats": module.track_running_stats,
    }


def _layer_norm_params(kind, module, anchor):
    return {
        "normalized_shape": list(module.normalized_shape),
        "epsilon": float(module.eps),
        "elementwise_affine": module.elementwise_affine,
        "use_bias": module.bias is not None,
    }


def _group_norm_params(kind, module, anchor):
    return {
        "num_groups": module.num_groups,
        "num_channels": module.num_channels,
        "epsilon": float(module.eps),
        "affine": module.affine,
    }


def _rms_norm_params(kind, module, anchor):
    eps = module.eps
    if eps is None:  # torch uses the input dtype's machine epsilon; the node has it
        eps = _node_float(anchor, "epsilon")
        if eps is None:
            eps = float(torch.finfo(torch.float32).eps)
    return {
        "normalized_shape": list(module.normalized_shape),
        "epsilon": float(eps),
        "elementwise_affine": module.elementwise_affine,
    }


def _embedding_params(kind, module, anchor):
    params = {"num_embeddings": module.num_embeddings, "features": module.embedding_dim}
    if module.padding_idx is not None:
        params["padding_idx"] = module.padding_idx
    return params


def _attention_params(kind, module, anchor):
    return {
        "embed_dim": module.embed_dim,
        "num_heads": module.num_heads,
        "use_bias": module.in_proj_bias is not None,
        "batch_first": module.batch_first,
        "kdim": module.kdim,
        "vdim": module.vdim,
        "dropout": float(module.dropout),
    }


def _recurrent_params(kind, module, anchor):
    return {
        "input_size": module.input_size,
        "hidden_size": module.hidden_size,
        "num_layers": module.num_layers,
        "bidirectional": module.bidirectional,
        "batch_first": module.batch_first,
        "use_bias": module.bias,
    }


_POOL_NDIM = {
    nn.MaxPool1d: 1,
    nn.MaxPool2d: 2,
    nn.MaxPool3d: 3,
    nn.AvgPool1d: 1,
    nn.AvgPool2d: 2,
    nn.AvgPool3d: 3,
}


def _pool_params(kind, module, anchor):
    ndim = _POOL_NDIM[type(module)]
    kernel = _tuple(module.kernel_size, ndim)
    stride = module.stride if module.stride not in (None, (), []) else kernel
    params = {
        "ndim": ndim,
        "kernel_size": kernel,
        "strides": _tuple(stride, ndim),
        "padding": [[p, p] for p in _tuple(module.padding, ndim)],
        "ceil_mode": bool(module.ceil_mode),
    }
    if kind == "max_pool":
        params["dilations"] = _tuple(module.dilation, ndim)
    else:
        params["count_include_pad"] = bool(module.count_include_pad)
    return params


#: Layer kind (``xconv/ir/layers.py``) -> reader of a module's hyper-parameters.
_PARAM_READERS: dict[str, Callable[[str, nn.Module, ir.Node | None], dict[str, Any]]] = {
    "dense": _dense_params,
    "conv": _conv_params,
    "conv_transpose": _conv_params,
    "batch_norm": _batch_norm_params,
    "layer_norm": _layer_norm_params,
    "group_norm": _group_norm_params,
    "rms_norm": _rms_norm_params,
    "embedding": _embedding_params,
    "dropout": lambda kind, module, anchor: {"rate": float(module.p)},
    "attention": _attention_params,
    "lstm": _recurrent_params,
    "gru": _recurrent_params,
    "max_pool": _pool_params,
    "avg_pool": _pool_params,
}


def layer_params(kind: str, module: nn.Module, anchor: ir.Node | None) -> dict[str, Any]:
    """Hyper-parameters of ``module`` for ``xconv.layer`` (schema: ``xconv.ir.layers``)."""
    reader = _PARAM_READERS.get(kind)
    if reader is None:
        raise ValueError(f"no hyper-parameter reader for layer kind {kind!r}")
    return reader(kind, module, anchor)


def weight_spec(kind: str | None, leaf: str, rank: int | None) -> tuple[str, str | None]:
    """``(role, layout)`` of the parameter or buffer ``leaf`` (of ``rank``) of a ``kind`` layer."""
    if kind == "dense":
        return {"weight": ("kernel", "OI"), "bias": ("bias", "O")}.get(leaf, (leaf, None))
    if kind in ("conv", "conv_transpose"):
        spatial = {1: "W", 2: "HW", 3: "DHW"}.get((rank or 4) - 2, "")
        kernel = ("OI" if kind == "conv" else "IO") + spatial
        return {"weight": ("kernel", kernel), "bias": ("bias", "O")}.get(leaf, (leaf, None))
    if kind == "batch_norm":
        return {
            "weight": ("scale", "C"),
            "bias": ("bias", "C"),
            "running_mean": ("mean", "C"),
            "running_var": ("var", "C"),
            "num_batches_tracked": ("num_batches", None),
        }.get(leaf, (leaf, None))
    if kind in ("layer_norm", "group_norm", "rms_norm"):
        return {"weight": ("scale", "C"), "bias": ("bias", "C")}.get(leaf, (leaf, None))
    if kind == "embedding":
        return {"weight": ("embedding", "VD")}.get(leaf, (leaf, None))
    if kind == "attention":
        return {
            "in_proj_weight": ("in_proj_kernel", "OI"),
            "in_proj_bias": ("in_proj_bias", "O"),
            "q_proj_weight": ("q_kernel", "OI"),
            "k_proj_weight": ("k_kernel", "OI"),
            "v_proj_weight": ("v_kernel", "OI"),
            "out_proj.weight": ("out_proj_kernel", "OI"),
            "out_proj.bias": ("out_proj_bias", "O"),
        }.get(leaf, (leaf, None))
    if kind in ("lstm", "gru"):
        return leaf, ("OI" if leaf.startswith("weight_") else "O")
    return leaf, None


def _owner(
    name: str, modules: Mapping[str, nn.Module], classes: Mapping[str, str]
) -> tuple[str, str]:
    """Split a state_dict key into (owning layer path, leaf) — MHA owns its ``out_proj``."""
    path, _, leaf = name.rpartition(".")
    parent, _, child = path.rpartition(".")
    if child == "out_proj" and (
        isinstance(modules.get(parent), nn.MultiheadAttention)
        or kind_from_class(classes.get(parent)) == "attention"
    ):
        return parent, f"out_proj.{leaf}"
    return path, leaf


def annotate_weights(
    graph: ir.Graph,
    names: Iterable[str],
    modules: Mapping[str, nn.Module],
    classes: Mapping[str, str] | None = None,
) -> None:
    """Give each initializer named in ``names`` (state_dict keys) its role and layout.

    A layer's kind comes from its module instance when there is one, else from its class name
    in ``classes`` (``{module path: class}``, e.g. from an ExportedProgram's module stack).
    """
    classes = classes or {}
    for name in names:
        value = graph.initializers.get(name)
        if value is None:
            continue
        path, leaf = _owner(name, modules, classes)
        module = modules.get(path)
        kind = layer_kind(module) if isinstance(module, nn.Module) else None
        if kind is None:
            kind = kind_from_class(classes.get(path))
        rank = len(value.shape) if value.shape is not None else None
        role, layout = weight_spec(kind, leaf, rank)
        cls = _class_name(module) if isinstance(module, nn.Module) else classes.get(path)
        if cls == HF_CONV1D and leaf == "weight":
            layout = "IO"
        mark_weight(value, role, layout)


def annotate_layers(graph: ir.Graph, modules: Mapping[str, nn.Module]) -> dict[str, int]:
    """Mark the anchor node of every recognised layer; returns a count per kind."""
    bodies: dict[str, list[ir.Node]] = {}
    for node in graph:
        scope = node.metadata_props.get(SCOPE)
        if scope:
            bodies.setdefault(scope, []).append(node)
    counts: dict[str, int] = {}
    for path, module in modules.items():
        kind = layer_kind(module)
        body = bodies.get(path)
        if kind is None or not body:
            continue
        anchor = find_anchor(kind, body)
        if anchor is None:
            logger.debug("no %s anchor among the %d nodes of %r", kind, len(body), path)
            continue
        mark_layer(anchor, kind, **layer_params(kind, module, anchor))
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def find_anchor(kind: str, body: list[ir.Node]) -> ir.Node | None:
    """The first body node (graph order) of the most preferred anchor op for ``kind``."""
    for op_type in ANCHOR_OPS.get(kind, ()):
        for node in body:
            if (
                node.op_type == op_type
                and node.domain in ("", "ai.onnx")
                and LAYER not in node.metadata_props
            ):
                return node
    return None


def drop_zero_conv_bias(
    graph: ir.Graph,
    modules: Mapping[str, nn.Module],
    classes: Mapping[str, str],
    state_names: Iterable[str],
) -> int:
    """Remove the zero bias the exporter builds for bias-free convolutions.

    For ``bias=None`` the exporter materialises a zero bias from the weight's shape
    (``Shape -> Expand -> CastLike -> Expand``) and feeds it to ``Conv``; ONNX's bias input is
    optional, so the node loses it and the bookkeeping becomes dead code. Only standard
    ``torch.nn`` conv layers without a bias (per instance, or per state_dict when known only
    by class name) are touched.
    """
    names = set(state_names)
    dropped = 0
    for node in graph:
        if node.op_type not in ("Conv", "ConvTranspose") or len(node.inputs) < 3:
            continue
        scope = node.metadata_props.get(SCOPE, "")
        bias = node.inputs[2]
        if not scope or bias is None or bias.is_initializer():
            continue
        module = modules.get(scope)
        kind = layer_kind(module) if isinstance(module, nn.Module) else None
        if kind in ("conv", "conv_transpose"):
            bias_free = module.bias is None
        else:
            kind = kind_from_class(classes.get(scope))
            bias_free = f"{scope}.bias" not in names
        if kind in ("conv", "conv_transpose") and bias_free:
            node.resize_inputs(2)
            dropped += 1
    return dropped


# -- layers known only by class name: hyper-parameters from the graph --------------------------

#: Kinds whose hyper-parameters the graph fully determines (dropout rates, recurrent and
#: attention options do not survive export, so those need the module instance).
GRAPH_KINDS = frozenset(
    {"dense", "conv", "conv_transpose", "batch_norm", "layer_norm", "group_norm", "rms_norm",
     "embedding", "max_pool", "avg_pool"}
)  # fmt: skip


def _f32(value: float) -> float:
    """A float32 attribute as the decimal the user wrote (``1e-05``, not ``9.99999e-06``)."""
    return float(str(np.float32(value)))


def _attr(node: ir.Node, name: str, default: Any = None) -> Any:
    attr = node.attributes.get(name)
    if attr is None:
        return default
    value = attr.value
    return (
        [int(v) for v in value]
        if isinstance(value, Sequence) and not isinstance(value, str)
        else value
    )


def _shape(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None or not value.shape.is_static():
        return None
    return [int(d) for d in value.shape]


def _pairs(pads: list[int] | None, ndim: int) -> list[list[int]]:
    pads = pads or [0] * (2 * ndim)
    return [[pads[i], pads[i + ndim]] for i in range(ndim)]


def _pad_of_body(body: list[ir.Node], ndim: int) -> tuple[list[list[int]], str] | None:
    """Explicit padding a non-zeros ``padding_mode`` conv does with a ``Pad`` node."""
    modes = {"wrap": "circular", "reflect": "reflect", "edge": "replicate"}
    for node in body:
        if node.op_type != "Pad":
            continue
        mode = _attr(node, "mode", "constant")
        pads = node.inputs[1].const_value if len(node.inputs) > 1 and node.inputs[1] else None
        if pads is None and node.inputs[1] is not None and node.inputs[1].producer() is not None:
            producer = node.inputs[1].producer()
            if producer.op_type == "Constant":
                pads = producer.attributes["value"].value
        if mode not in modes or pads is None:
            return None
        flat = [int(p) for p in np.asarray(pads.numpy()).reshape(-1)]
        rank = len(flat) // 2
        if rank < ndim:
            return None
        begin, end = flat[rank - ndim : rank], flat[2 * rank - ndim :]
        return [[b, e] for b, e in zip(begin, end, strict=True)], modes[mode]
    return None


class _GraphLayer(NamedTuple):
    """What the graph readers see of one layer: its anchor and body, its weights."""

    kind: str
    path: str
    anchor: ir.Node
    body: list[ir.Node]
    inits: Mapping[str, ir.Value]
    weight: ir.Value | None
    bias: ir.Value | None
    w_shape: list[int] | None


def _dense_from_graph(g: _GraphLayer, weight_is_in_out: bool) -> dict[str, Any] | None:
    w_shape = g.w_shape
    if not (w_shape and len(w_shape) == 2):
        return None
    if weight_is_in_out:
        w_shape = w_shape[::-1]  # stored (in, out)
    return {"in_features": w_shape[1], "out_features": w_shape[0], "use_bias": g.bias is not None}


def _conv_from_graph(g: _GraphLayer, weight_is_in_out: bool) -> dict[str, Any] | None:
    w_shape, anchor = g.w_shape, g.anchor
    if not (w_shape and len(w_shape) >= 3):
        return None
    ndim = len(w_shape) - 2
    groups = int(_attr(anchor, "group", 1))
    if g.kind == "conv":
        in_ch, out_ch = w_shape[1] * groups, w_shape[0]
    else:
        in_ch, out_ch = w_shape[0], w_shape[1] * groups
    params = {
        "ndim": ndim,
        "in_channels": in_ch,
        "out_channels": out_ch,
        "kernel_size": w_shape[2:],
        "strides": _attr(anchor, "strides", [1] * ndim),
        "padding": _pairs(_attr(anchor, "pads"), ndim),
        "dilations": _attr(anchor, "dilations", [1] * ndim),
        "groups": groups,
        "use_bias": g.bias is not None,
    }
    if g.kind == "conv_transpose":
        params["output_padding"] = _attr(anchor, "output_padding", [0] * ndim)
    else:
        explicit = _pad_of_body(g.body, ndim)
        if explicit is not None:
            params["padding"], params["padding_mode"] = explicit
    return params


def _batch_norm_from_graph(g: _GraphLayer, weight_is_in_out: bool) -> dict[str, Any] | None:
    mean = g.inits.get(f"{g.path}.running_mean")
    features = _shape(mean) or g.w_shape or _shape(g.anchor.inputs[1])
    if not features:
        return None
    return {
        "num_features": features[0],
        # ONNX's momentum weighs the running statistic; torch's weighs the new one.
        "momentum": round(1.0 - float(_attr(g.anchor, "momentum", 0.9)), 6),
        "epsilon": _f32(_attr(g.anchor, "epsilon", 1e-5)),
        "affine": g.weight is not None,
        "track_running_stats": mean is not None,
    }


def _norm_from_graph(g: _GraphLayer, weight_is_in_out: bool) -> dict[str, Any] | None:
    shape = g.w_shape
    if shape is None:
        x = _shape(g.anchor.inputs[0])
        axis = int(_attr(g.anchor, "axis", -1))
        shape = x[axis:] if x else None
    if shape is None:
        return None
    params = {
        "normalized_shape": shape,
        "epsilon": _f32(_attr(g.anchor, "epsilon", 1e-5)),
        "elementwise_affine": g.weight is not None,
    }
    if g.kind == "layer_norm":
        params["use_bias"] = g.bias is not None
    return params


def _group_norm_from_graph(g: _GraphLayer, weight_is_in_out: bool) -> dict[str, Any] | None:
    x = _shape(g.anchor.inputs[0])
    channels = g.w_shape[0] if g.w_shape else (x[1] if x else None)
    if channels is None or "num_groups" not in g.anchor.attributes:
        return None
    return {
        "num_groups": int(_attr(g.anchor, "num_groups")),
        "num_channels": channels,
        "epsilon": _f32(_attr(g.anchor, "epsilon", 1e-5)),
        "affine": g.weight is not None,
    }


def _embedding_from_graph(g: _GraphLayer, weight_is_in_out: bool) -> dict[str, Any] | None:
    if not (g.w_shape and len(g.w_shape) == 2):
        return None
    return {"num_embeddings": g.w_shape[0], "features": g.w_shape[1]}


def _pool_from_graph(g: _GraphLayer, weight_is_in_out: bool) -> dict[str, Any] | None:
    anchor = g.anchor
    kernel = _attr(anchor, "kernel_shape")
    if not kernel:
        return None
    ndim = len(kernel)
    params = {
        "ndim": ndim,
        "kernel_size": kernel,
        "strides": _attr(anchor, "strides", [1] * ndim),
        "padding": _pairs(_attr(anchor, "pads"), ndim),
        "ceil_mode": bool(_attr(anchor, "ceil_mode", 0)),
    }
    if g.kind == "max_pool":
        params["dilations"] = _attr(anchor, "dilations", [1] * ndim)
    else:
        params["count_include_pad"] = bool(_attr(anchor, "count_include_pad", 0))
    return params


#: Layer kind (``xconv/ir/layers.py``) -> reader of its hyper-parameters from the graph.
_GRAPH_READERS = {
    "dense": _dense_from_graph,
    "conv": _conv_from_graph,
    "conv_transpose": _conv_from_graph,
    "batch_norm": _batch_norm_from_graph,
    "layer_norm": _norm_from_graph,
    "rms_norm": _norm_from_graph,
    "group_norm": _group_norm_from_graph,
    "embedding": _embedding_from_graph,
    "max_pool": _pool_from_graph,
    "avg_pool": _pool_from_graph,
}


def graph_params(
    kind: str,
    path: str,
    anchor: ir.Node,
    body: list[ir.Node],
    graph: ir.Graph,
    weight_is_in_out: bool = False,
) -> dict[str, Any] | None:
    """Hyper-parameters read from the exported graph, or None when it does not determine them."""
    reader = _GRAPH_READERS.get(kind)
    if reader is None:
        return None
    inits = graph.initializers
    weight = inits.get(f"{path}.weight")
    bias = inits.get(f"{path}.bias")
    layer = _GraphLayer(kind, path, anchor, body, inits, weight, bias, _shape(weight))
    return reader(layer, weight_is_in_out)


def annotate_layers_from_graph(graph: ir.Graph, classes: Mapping[str, str]) -> dict[str, int]:
    """Mark layers known only by class name (no module instance), reading the graph.

    Scopes that already carry an anchor are left alone.
    """
    bodies: dict[str, list[ir.Node]] = {}
    for node in graph:
        scope = node.metadata_props.get(SCOPE)
        if scope:
            bodies.setdefault(scope, []).append(node)
    counts: dict[str, int] = {}
    for path, body in bodies.items():
        kind = kind_from_class(classes.get(path))
        if kind not in GRAPH_KINDS or any(LAYER in n.metadata_props for n in body):
            continue
        anchor = find_anchor(kind, body)
        conv1d = classes.get(path) == HF_CONV1D
        params = graph_params(kind, path, anchor, body, graph, conv1d) if anchor else None
        if params is None:
            logger.debug("cannot read the %s hyper-parameters of %r from the graph", kind, path)
            continue
        mark_layer(anchor, kind, **params)
        counts[kind] = counts.get(kind, 0) + 1
    return counts
