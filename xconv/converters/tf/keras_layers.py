"""Keras layer recognition: ``xconv.layer`` marks and weight roles for tf2onnx output.

Works on the IR after import: every node carries ``xconv.scope`` (the Keras layer path) and
weights are initializers named by their Keras variable paths. Keras objects are only read
(class name, config, variable shapes); tensorflow is never imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.ir.layers import mark_layer, mark_weight
from xconv.ir.metadata import MODULE, ROLE, SCOPE

logger = logging.getLogger(__name__)

_CONV = {"Conv1D": 1, "Conv2D": 2, "Conv3D": 3}
_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}
_POOL = {
    "MaxPooling1D": ("max_pool", 1),
    "MaxPooling2D": ("max_pool", 2),
    "MaxPooling3D": ("max_pool", 3),
    "AveragePooling1D": ("avg_pool", 1),
    "AveragePooling2D": ("avg_pool", 2),
    "AveragePooling3D": ("avg_pool", 3),
}

#: Keras weight leaf name -> (role, layout) per layer class; conv layouts get their rank.
_MHA_ROLES = {
    "query/kernel": ("q_kernel", "IHD"),
    "key/kernel": ("k_kernel", "IHD"),
    "value/kernel": ("v_kernel", "IHD"),
    "query/bias": ("q_bias", "HD"),
    "key/bias": ("k_bias", "HD"),
    "value/bias": ("v_bias", "HD"),
    "attention_output/kernel": ("out_proj_kernel", "HDO"),
    "attention_output/bias": ("out_proj_bias", "O"),
}


def _is_keras(cls: type) -> bool:
    mod = cls.__module__
    return mod == "keras" or mod.startswith(("keras.", "tf_keras.", "tensorflow."))


def class_name(layer: Any) -> str:
    """The Keras layer class ``layer`` computes (``Dense`` for a subclass that keeps Keras's
    ``call``), else its own qualified class name, which matches no Keras layer: a subclass
    overriding ``call``, or a user class that only shares a Keras name, is its traced body."""
    cls = type(layer)
    owner = next((c for c in cls.__mro__ if "call" in c.__dict__), None)
    if owner is not None and not _is_keras(owner):
        return f"{cls.__module__}.{cls.__qualname__}"
    base = next((c for c in cls.__mro__ if _is_keras(c)), cls)
    return base.__name__


def weight_spec(
    cls: str, leaf: str, rank: int, multiplier: int | None = None, channels: int | None = None
) -> tuple[str, str | None]:
    """``(role, layout)`` of the Keras variable ``leaf`` (path inside its layer) of ``cls``.

    ``multiplier`` and ``channels`` are a depthwise kernel's last two dimensions (its depth
    multiplier and input channels as Keras holds it; ``C*M`` and 1 flattened).
    """
    if cls == "Dense" or cls == "EinsumDense":
        return {"kernel": ("kernel", "IO"), "bias": ("bias", "O")}.get(leaf, (leaf, None))
    if cls in _CONV:
        layout = _SPATIAL.get(rank - 2, "") + "IO"
        return {"kernel": ("kernel", layout), "bias": ("bias", "O")}.get(leaf, (leaf, None))
    if cls in ("DepthwiseConv2D", "DepthwiseConv1D"):
        # (H, W, in, multiplier): channel c*M + m of the output reads input channel c. With
        # M == 1 that is (H, W, O, I=in/groups=1): a plain permutation of ONNX's OIHW; with
        # M > 1 it is stored (H, W, 1, in*M) (flatten_depthwise_kernels): (H, W, I=1, O).
        return {
            "kernel": ("kernel", _SPATIAL.get(rank - 2, "") + _depthwise_io(multiplier, channels)),
            "bias": ("bias", "O"),
        }.get(leaf, (leaf, None))
    if cls in ("SeparableConv1D", "SeparableConv2D"):
        spatial = _SPATIAL.get(rank - 2, "")
        return {
            "depthwise_kernel": ("kernel", spatial + _depthwise_io(multiplier, channels)),
            "pointwise_kernel": ("kernel", spatial + "IO"),
            "bias": ("bias", "O"),
        }.get(leaf, (leaf, None))
    if cls == "BatchNormalization":
        return {
            "gamma": ("scale", "C"),
            "beta": ("bias", "C"),
            "moving_mean": ("mean", "C"),
            "moving_variance": ("var", "C"),
        }.get(leaf, (leaf, None))
    if cls in ("LayerNormalization", "GroupNormalization", "RMSNormalization"):
        return {"gamma": ("scale", "C"), "beta": ("bias", "C")}.get(leaf, (leaf, None))
    if cls == "Embedding":
        return {"embeddings": ("embedding", "VD")}.get(leaf, (leaf, None))
    if cls == "MultiHeadAttention":
        return _MHA_ROLES.get(leaf, (leaf.replace("/", "_"), None))
    return leaf.replace("/", "_"), None


def _depthwise_io(multiplier: int | None, channels: int | None) -> str:
    """A depthwise kernel's last two axes: ``(C, 1)`` is ``OI``; flattened, ``(1, C*M)`` is
    ``IO``; ``(C, M)`` left as Keras holds it is ``IM``, which no target permutes."""
    return "OI" if multiplier == 1 else "IO" if channels == 1 else "IM"


_DEPTHWISE_KERNELS = {
    "DepthwiseConv1D": "kernel",
    "DepthwiseConv2D": "kernel",
    "SeparableConv1D": "depthwise_kernel",
    "SeparableConv2D": "depthwise_kernel",
}


def flatten_depthwise_kernels(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """Store each depthwise kernel ``(*k, C, M)`` with a depth multiplier ``M > 1`` as
    ``(*k, 1, C*M)``, the shape tf2onnx reshapes it to (output channel ``c*M + m`` reads input
    channel ``c``), dropping that Reshape: the kernel is then a plain ``(*k, I=1, O)`` one that
    every target permutes into its layout. Left as is where it is read otherwise."""
    from xconv.converters.tf.rewrite import _replace_value
    from xconv.ir.passes._utils import constant_of

    for name, (_scope, layer, leaf) in owners.items():
        value = graph.initializers.get(name)
        if _DEPTHWISE_KERNELS.get(class_name(layer)) != leaf or value is None:
            continue
        if value.const_value is None or value.shape is None or len(value.shape) < 3:
            continue
        arr = value.const_value.numpy()
        *k, c, m = arr.shape
        target = (*k, 1, c * m)
        uses = list(value.uses())
        if m == 1 or not uses or any(n.op_type != "Reshape" or i != 0 for n, i in uses):
            continue
        shapes = [constant_of(n.inputs[1], False) for n, _ in uses]
        if any(s is None or np.empty(arr.shape).reshape(s).shape != target for s in shapes):
            continue
        value.const_value = ir.tensor(arr.reshape(target), name=name)
        value.shape = ir.Shape(target)
        for node, _ in uses:
            _replace_value(graph, node.outputs[0], value)
            graph.remove(node, safe=True)


def sub_scope(cls: str, leaf: str) -> str | None:
    """The sub-scope a weight's nodes get (a SeparableConv is two conv layers)."""
    if cls in ("SeparableConv1D", "SeparableConv2D"):
        return "depthwise" if leaf == "depthwise_kernel" else "pointwise"
    return None


def annotate_weights(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> None:
    """Give every Keras weight ``xconv.role`` / ``xconv.layout``.

    Args:
        graph: The IR graph (weights are initializers named by Keras variable path).
        owners: ``{variable path: (layer scope, layer, leaf)}``.
    """
    for name, value in graph.initializers.items():
        if name not in owners:
            continue
        _scope, layer, leaf = owners[name]
        shape = list(value.shape) if value.shape is not None else []
        multiplier = int(shape[-1]) if shape and isinstance(shape[-1], int) else None
        channels = int(shape[-2]) if len(shape) > 1 and isinstance(shape[-2], int) else None
        role, layout = weight_spec(class_name(layer), leaf, len(shape), multiplier, channels)
        mark_weight(value, role, layout)


def _producers_chain(value: ir.Value | None, limit: int = 4) -> set[str]:
    """Names of the initializers reached from ``value`` through up to ``limit`` unary nodes."""
    names: set[str] = set()
    frontier = [value]
    for _ in range(limit + 1):
        nxt = []
        for v in frontier:
            if v is None:
                continue
            if v.is_initializer() and v.name:
                names.add(v.name)
                continue
            node = v.producer()
            if node is not None and node.op_type in ("Transpose", "Reshape", "Squeeze", "Cast"):
                nxt.append(node.inputs[0])
        frontier = nxt
    return names


def _find(body: list[ir.Node], op: str, weight: str | None) -> ir.Node | None:
    for node in body:
        if node.op_type != op:
            continue
        if weight is None:
            return node
        for x in node.inputs:
            if weight in _producers_chain(x):
                return node
    return None


def _ints(node: ir.Node, name: str, default: Any = None) -> Any:
    attr = node.attributes.get(name)
    return list(attr.value) if attr is not None else default


def _pads(node: ir.Node, ndim: int) -> list[list[int]] | str:
    auto = node.attributes.get("auto_pad")
    if auto is not None and auto.value not in ("NOTSET", b"NOTSET"):
        value = auto.value.decode() if isinstance(auto.value, bytes) else auto.value
        return "same" if value.startswith("SAME") else [[0, 0]] * ndim
    pads = _ints(node, "pads", [0] * (2 * ndim))
    return [[int(pads[i]), int(pads[i + ndim])] for i in range(ndim)]


def _conv_params(node: ir.Node, layer: Any, in_ch: int, out_ch: int, groups: int, bias: bool):
    kernel = _ints(node, "kernel_shape")
    ndim = len(kernel)
    padding = _pads(node, ndim)
    if padding == "same":
        # tf2onnx keeps auto_pad when the spatial size is unknown: no literal pads to record.
        raise ValueError(f"{layer.name}: auto_pad SAME (spatial size unknown)")
    return {
        "ndim": ndim,
        "in_channels": in_ch,
        "out_channels": out_ch,
        "kernel_size": kernel,
        "strides": _ints(node, "strides", [1] * ndim),
        "padding": padding,
        "dilations": _ints(node, "dilations", [1] * ndim),
        "groups": groups,
        "use_bias": bias,
    }


def annotate_layers(
    graph: ir.Graph, layers: Mapping[str, Any], weights: Mapping[str, Mapping[str, str]]
) -> dict[str, int]:
    """Mark the anchor node of each recognised Keras layer with ``xconv.layer``.

    Args:
        graph: The IR graph, nodes scoped by Keras layer path.
        layers: ``{scope: keras layer}`` for every scope in the graph.
        weights: ``{scope: {leaf: variable path}}`` of each layer's weights (leaf: the path
            inside the layer, ``kernel``, ``query/kernel``).

    Returns:
        ``{kind: count}`` of the layers marked.
    """
    bodies: dict[str, list[ir.Node]] = {}
    for node in graph.all_nodes():
        scope = node.metadata_props.get(SCOPE)
        if scope:
            bodies.setdefault(scope, []).append(node)
    counts: dict[str, int] = {}
    for scope, layer in layers.items():
        cls = class_name(layer)
        cfg = layer.get_config()
        leaf = dict(weights.get(scope, {}))
        for node in bodies.get(scope, []):
            node.metadata_props.setdefault(MODULE, cls if "." in cls else f"keras.layers.{cls}")
        try:
            kind = _mark(graph, bodies, scope, layer, cls, cfg, leaf)
        except Exception as e:  # recognition is best effort: the graph stays correct
            logger.debug("%s (%s) not recognised: %s", scope, cls, e)
            kind = None
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _mark_dense(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    kernel = graph.initializers[leaf["kernel"]]
    anchor = _find(body, "MatMul", leaf["kernel"]) or _find(body, "Gemm", leaf["kernel"])
    if anchor is None:
        return None
    mark_layer(
        anchor,
        "dense",
        in_features=int(kernel.shape[0]),
        out_features=int(cfg["units"]),
        use_bias=bool(cfg["use_bias"]),
    )
    return "dense"


def _mark_conv(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    kernel = graph.initializers[leaf["kernel"]]
    anchor = _find(body, "Conv", leaf["kernel"])
    if anchor is None:
        return None
    groups = int(cfg.get("groups", 1))
    shape = list(kernel.shape)
    params = _conv_params(
        anchor, layer, shape[-2] * groups, int(cfg["filters"]), groups, cfg["use_bias"]
    )
    mark_layer(anchor, "conv", **params)
    return "conv"


def _mark_depthwise(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    kernel = graph.initializers[leaf["kernel"]]
    anchor = _find(body, "Conv", leaf["kernel"])
    if anchor is None:
        return None
    c, out = _depthwise_channels(anchor, kernel)
    params = _conv_params(anchor, layer, c, out, c, cfg["use_bias"])
    mark_layer(anchor, "conv", **params)
    return "conv"


def _depthwise_channels(conv: ir.Node, kernel: ir.Value) -> tuple[int, int]:
    """A depthwise convolution's ``(input channels, output channels)``: its ``group`` and the
    kernel's last two axes' product (``(C, M)`` as Keras holds it, or ``(1, C*M)`` flattened)."""
    group = conv.attributes.get("group")
    out = int(kernel.shape[-2]) * int(kernel.shape[-1])
    return (int(group.value) if group is not None else int(kernel.shape[-2])), out


def _mark_separable(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    dw = graph.initializers[leaf["depthwise_kernel"]]
    pw = graph.initializers[leaf["pointwise_kernel"]]
    marked = None
    for sub, w, bias in (("depthwise", dw, False), ("pointwise", pw, cfg["use_bias"])):
        sub_body = bodies.get(f"{scope}/{sub}", [])
        anchor = _find(sub_body, "Conv", w.name)
        if anchor is None:
            continue
        if sub == "depthwise":
            c, out = _depthwise_channels(anchor, w)
            groups = c
        else:
            c, out, groups = int(w.shape[-2]), int(w.shape[-1]), 1
        mark_layer(anchor, "conv", **_conv_params(anchor, layer, c, out, groups, bias))
        marked = "conv"
    return marked


def _mark_batch_norm(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    anchor = _find(body, "BatchNormalization", None)
    if anchor is None:
        return None
    mark_layer(
        anchor,
        "batch_norm",
        num_features=int(_num_features(graph, leaf, ("moving_mean", "gamma"))),
        epsilon=float(cfg["epsilon"]),
        # Keras's momentum weighs the old statistic; the schema's the new one (torch).
        momentum=round(1.0 - float(cfg["momentum"]), 12),
        affine=bool(cfg["scale"] and cfg["center"]),
        track_running_stats=True,
    )
    return "batch_norm"


def _mark_layer_norm(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    anchor = _find(body, "LayerNormalization", None)
    if anchor is None:
        return None
    n = _num_features(graph, leaf, ("gamma", "beta"))
    mark_layer(
        anchor,
        "layer_norm",
        normalized_shape=[int(n)],
        epsilon=float(cfg["epsilon"]),
        elementwise_affine=bool(cfg["scale"]),
        use_bias=bool(cfg["center"]),
    )
    return "layer_norm"


def _mark_embedding(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    table = graph.initializers[leaf["embeddings"]]
    anchor = _find(body, "Gather", leaf["embeddings"])
    if anchor is None:
        return None
    mark_layer(
        anchor,
        "embedding",
        num_embeddings=int(table.shape[0]),
        features=int(table.shape[1]),
    )
    return "embedding"


def _mark_attention(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    q = leaf.get("query/kernel")
    if q is None:
        return None
    anchor = _find(body, "Einsum", q) or _find(body, "MatMul", q)
    if anchor is None:
        return None
    shape = list(graph.initializers[q].shape)
    mark_layer(
        anchor,
        "attention",
        embed_dim=int(shape[0]),
        num_heads=int(cfg["num_heads"]),
        use_bias=bool(cfg["use_bias"]),
        batch_first=True,
        dropout=float(cfg.get("dropout", 0.0)),
    )
    return "attention"


def _mark_pool(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    body = bodies.get(scope, [])
    kind, ndim = _POOL[cls]
    op = "MaxPool" if kind == "max_pool" else "AveragePool"
    anchor = _find(body, op, None)
    if anchor is None:
        return None
    padding = _pads(anchor, ndim)
    if padding == "same":
        return None
    params = {
        "ndim": ndim,
        "kernel_size": _ints(anchor, "kernel_shape"),
        "strides": _ints(anchor, "strides", [1] * ndim),
        "padding": padding,
        "ceil_mode": bool(anchor.attributes.get("ceil_mode", ir.AttrInt64("c", 0)).value),
    }
    if kind == "max_pool":
        params["dilations"] = _ints(anchor, "dilations", [1] * ndim)
    else:
        params["count_include_pad"] = bool(
            anchor.attributes.get("count_include_pad", ir.AttrInt64("c", 0)).value
        )
    mark_layer(anchor, kind, **params)
    return kind


#: Keras layer class -> marker of its anchor node (returns the layer kind of
#: ``xconv/ir/layers.py`` it marked, or None).
_MARKERS: dict[str, Callable[..., str | None]] = {
    "Dense": _mark_dense,
    **dict.fromkeys(_CONV, _mark_conv),
    "DepthwiseConv2D": _mark_depthwise,
    "SeparableConv2D": _mark_separable,
    "BatchNormalization": _mark_batch_norm,
    "LayerNormalization": _mark_layer_norm,
    "Embedding": _mark_embedding,
    "MultiHeadAttention": _mark_attention,
    **dict.fromkeys(_POOL, _mark_pool),
}


def _mark(graph, bodies, scope, layer, cls, cfg, leaf) -> str | None:
    marker = _MARKERS.get(cls)
    return None if marker is None else marker(graph, bodies, scope, layer, cls, cfg, leaf)


def _num_features(graph: ir.Graph, leaf: Mapping[str, str], keys: tuple[str, ...]) -> int:
    for key in keys:
        if key in leaf and leaf[key] in graph.initializers:
            return int(graph.initializers[leaf[key]].shape[0])
    raise KeyError(f"none of {keys}")


# ---------------------------------------------------------------- recurrent layers as ONNX ops

#: Keras cells tf2onnx writes as a Loop (its LSTM rewriter alone matches Keras 3's graph):
#: the ONNX op (its W's gate blocks are Keras' kernel column blocks), default activations.
_LOOP_CELLS = {
    "GRUCell": ("GRU", ("sigmoid", "tanh")),
    "SimpleRNNCell": ("RNN", ("tanh",)),
}


def _activation_name(fn: Any) -> str:
    return str(getattr(fn, "__name__", fn)).lower()


def recurrent_loops_as_ops(
    graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]], layers: Mapping[str, Any]
) -> int:
    """Replace each Loop tf2onnx wrote for a Keras GRU or SimpleRNN layer by ONNX's GRU or
    RNN over the same time-major input, with W / R / B from the cell's kernel, recurrent
    kernel and bias (Keras' gate blocks z, r, h are ONNX's; ``reset_after`` is
    ``linear_before_reset``): the Loop's final state and stacked outputs become the op's,
    so the nodes around it (the last step's slice, the batch-major transpose) stay; Keras
    reverses a ``go_backwards`` layer's input before its loop. A layer the op does not
    compute (other activations, a stateful layer, a mask) keeps its Loop.
    Returns the number replaced."""
    replaced = 0
    for loop in [n for n in graph if n.op_type == "Loop"]:
        plan = _loop_plan(graph, loop, owners, layers)
        if plan is None:
            continue
        _replace_loop(graph, loop, *plan)
        replaced += 1
    return replaced


def _loop_plan(graph, loop, owners, layers):
    """(op, cell scope, cell, weights {leaf: value}, h0 index, time-major input) for a Loop
    :func:`recurrent_loops_as_ops` replaces; else None."""
    carried = list(loop.inputs[2:])
    found = {
        owners[v.name][2]: (i, v)
        for i, v in enumerate(carried)
        if v is not None and v.name in owners
    }
    cells = {id(owners[v.name][1]) for _, v in found.values()}
    if "kernel" not in found or "recurrent_kernel" not in found or len(cells) != 1:
        return None
    scope, cell, _ = owners[found["kernel"][1].name]
    spec = _LOOP_CELLS.get(class_name(cell))
    rnn = layers.get(scope.rsplit("/", 1)[0]) if "/" in scope else None
    if spec is None or rnn is None:
        return None
    op, defaults = spec
    if getattr(cell, "use_bias", False) and "bias" not in found:
        # a bias equal to another layer's (zeros as initialised) was not named by value
        bias = np.asarray(cell.bias.numpy())
        same = [
            (i, v)
            for i, v in enumerate(carried)
            if v is not None and v.const_value is not None and v.shape is not None
            and tuple(v.shape) == bias.shape and np.array_equal(v.const_value.numpy(), bias)
        ]  # fmt: skip
        if len(same) != 1:
            return None
        found["bias"] = same[0]
    acts = (cell.recurrent_activation, cell.activation) if op == "GRU" else (cell.activation,)
    if tuple(_activation_name(a) for a in acts) != defaults:
        return None
    if getattr(rnn, "stateful", False):
        return None
    states = [
        i
        for i, v in enumerate(carried)
        if i not in {j for j, _ in found.values()} and v is not None and v.shape is not None
        and len(v.shape) == 2
    ]  # fmt: skip
    n_scan = len(loop.outputs) - len(carried)
    if len(states) != 1 or n_scan != 1:
        return None
    body = loop.attributes["body"].value
    inner = {v for n in body for v in n.outputs} | set(body.inputs)
    gathered = [
        n.inputs[0] for n in body if n.op_type == "Gather" and n.inputs[0] not in inner
    ]  # the time-major input the body reads step by step
    if len(gathered) != 1 or gathered[0].shape is None or len(gathered[0].shape) != 3:
        return None  # (a masked layer's body gathers its mask too)
    if gathered[0].dtype != found["kernel"][1].dtype:
        return None  # mixed precision: the op takes one type
    # every other carried output must be unused: the op gives only the state and the outputs
    for i, out in enumerate(loop.outputs[: len(carried)]):
        if i != states[0] and (out.uses() or out.is_graph_output()):
            return None
    return op, scope, cell, {k: v for k, (_, v) in found.items()}, states[0], gathered[0]


def _replace_loop(graph, loop, op, scope, cell, weights, h_index, x_tm) -> None:
    from xconv.converters.tf.rewrite import _replace_value

    units = int(cell.units)
    kernel = weights["kernel"].const_value.numpy()
    recurrent = weights["recurrent_kernel"].const_value.numpy()
    prefix = f"{scope}/"  # the cell's (the Loop's scope may be a sibling layer's)

    def init(name: str, arr: np.ndarray) -> ir.Value:
        value = ir.Value(name=prefix + name, shape=ir.Shape(arr.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)))  # fmt: skip
        value.const_value = ir.tensor(arr, name=prefix + name)
        graph.register_initializer(value)
        mark_weight(value, name)  # a trainable weight, zero or not
        return value

    w = init("W", np.ascontiguousarray(kernel.T[None]))
    r = init("R", np.ascontiguousarray(recurrent.T[None]))
    ins: list[ir.Value | None] = [x_tm, w, r]
    if "bias" in weights:
        bias = weights["bias"].const_value.numpy()
        bias = bias.reshape(-1) if bias.ndim == 2 else np.concatenate([bias, np.zeros_like(bias)])
        ins.append(init("B", bias[None]))
    else:
        ins.append(None)
    h0 = loop.inputs[2 + h_index]
    axes = ir.Value(name=f"{prefix}{op.lower()}_axes0")
    axes.const_value = ir.tensor(np.array([0], np.int64), name=axes.name)
    graph.register_initializer(axes)
    first = ir.node("Unsqueeze", [h0, axes])
    ins += [None, first.outputs[0]]
    attrs = {"hidden_size": units}
    if op == "GRU":
        attrs["linear_before_reset"] = int(bool(cell.reset_after))
    rec = ir.node(op, ins, attributes=attrs, num_outputs=2)
    axes1 = ir.Value(name=f"{prefix}{op.lower()}_axes1")
    axes1.const_value = ir.tensor(np.array([1], np.int64), name=axes1.name)
    graph.register_initializer(axes1)
    ys = ir.node("Squeeze", [rec.outputs[0], axes1])  # (T, 1, B, H) -> (T, B, H)
    h_last = ir.node("Squeeze", [rec.outputs[1], axes])  # (1, B, H) -> (B, H)
    new = [first, rec, ys, h_last]
    for n in new:
        n.metadata_props[SCOPE] = scope
    graph.insert_before(loop, new)
    _replace_value(graph, loop.outputs[-1], ys.outputs[0])
    _replace_value(graph, loop.outputs[h_index], h_last.outputs[0])
    graph.remove(loop, safe=True)


#: ONNX LSTM's gate blocks (i, o, f, c) in a Keras LSTM kernel's column order (i, f, c, o).
_LSTM_GATES = [0, 3, 1, 2]


def name_lstm_weights(graph: ir.Graph, owners: Mapping[str, tuple[str, Any, str]]) -> int:
    """Give the W / R / B that tf2onnx wrote for each Keras LSTM (``W0__72``: it rearranges
    the kernels into ONNX's gate order) the layer's name, ``<cell scope>/W`` (a Bidirectional
    layer's scope for both directions), and mark them trainable weights, as
    :func:`recurrent_loops_as_ops` names a GRU's: each direction of W is matched by value to
    the cell whose kernel it rearranges. Returns the number of LSTM nodes named."""
    kernels = [
        (scope, layer, np.asarray(layer.kernel.numpy()))
        for scope, layer, leaf in owners.values()
        if leaf == "kernel" and class_name(layer) == "LSTMCell"
    ]  # the layers' own values: tf2onnx folded their initializers into W
    named = 0
    for node in [n for n in graph if n.op_type == "LSTM"]:
        w = node.inputs[1]
        if w is None or not w.is_initializer() or w.const_value is None or ROLE in w.metadata_props:
            continue
        arr = w.const_value.numpy()
        scopes = []
        for d in range(arr.shape[0]):
            hits = [
                scope
                for scope, layer, k in kernels
                if k.T.shape == arr[d].shape
                and np.array_equal(_lstm_rows(k.T, int(layer.units)), arr[d])
            ]
            scopes.append(hits[0] if len(hits) == 1 else None)
        if None in scopes:
            continue
        scope = scopes[0] if len(scopes) == 1 else _common_layer(scopes)
        if not scope or any(f"{scope}/{r}" in graph.initializers for r in "WRB"):
            continue
        for role, value in zip("WRB", node.inputs[1:4], strict=False):
            if value is None or not value.is_initializer():
                continue
            graph.initializers.pop(value.name)
            value.name = f"{scope}/{role}"
            if value.const_value is not None:
                value.const_value.name = value.name
            graph.register_initializer(value)
            mark_weight(value, role)
        node.metadata_props[SCOPE] = scope
        named += 1
    return named


def _lstm_rows(kernel_t: np.ndarray, units: int) -> np.ndarray:
    """A Keras LSTM kernel (transposed, gates i, f, c, o) in ONNX's gate order i, o, f, c."""
    blocks = kernel_t.reshape(4, units, -1)[_LSTM_GATES]
    return blocks.reshape(kernel_t.shape)


def _common_layer(scopes: list[str]) -> str | None:
    """The layer path the cells' scopes share (a Bidirectional layer's), or None."""
    parts = [s.split("/") for s in scopes]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return "/".join(common) or None
