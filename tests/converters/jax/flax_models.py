"""Hand-built IR models with layer metadata, for the Flax emitter tests."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h

from xconv.ir.layers import mark_layer, mark_weight
from xconv.ir.metadata import SCOPE


def _init(rng, name, shape, scale=0.3, positive=False):
    a = rng.standard_normal(shape).astype(np.float32) * scale
    if positive:
        a = np.abs(a) + 0.5
    return h.make_tensor(name, T.FLOAT, shape, a.reshape(-1).tolist())


def resnet_block(batch: int | str = 2) -> ir.Model:
    """Conv-BN-ReLU x2 + 1x1 shortcut, residual add, max/avg pool, global pool, dense head."""
    rng = np.random.default_rng(0)
    inits = [
        _init(rng, "conv1.weight", [8, 3, 3, 3]),
        _init(rng, "bn1.weight", [8], positive=True),
        _init(rng, "bn1.bias", [8]),
        _init(rng, "bn1.running_mean", [8]),
        _init(rng, "bn1.running_var", [8], positive=True),
        _init(rng, "conv2.weight", [8, 8, 3, 3]),
        _init(rng, "bn2.weight", [8], positive=True),
        _init(rng, "bn2.bias", [8]),
        _init(rng, "bn2.running_mean", [8]),
        _init(rng, "bn2.running_var", [8], positive=True),
        _init(rng, "shortcut.weight", [8, 3, 1, 1]),
        _init(rng, "shortcut.bias", [8]),
        _init(rng, "fc.weight", [4, 8]),
        _init(rng, "fc.bias", [4]),
        h.make_tensor("idx0", T.INT64, [1], [0]),
        h.make_tensor("minus1", T.INT64, [1], [-1]),
    ]
    bn = dict(epsilon=1e-5, momentum=0.9)
    nodes = [
        h.make_node("Conv", ["x", "conv1.weight"], ["conv1"], pads=[1, 1, 1, 1], name="conv1"),
        h.make_node(
            "BatchNormalization",
            ["conv1", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var"],
            ["bn1"],
            name="bn1",
            **bn,
        ),
        h.make_node("Relu", ["bn1"], ["relu"], name="relu"),
        h.make_node("Conv", ["relu", "conv2.weight"], ["conv2"], pads=[1, 1, 1, 1], name="conv2"),
        h.make_node(
            "BatchNormalization",
            ["conv2", "bn2.weight", "bn2.bias", "bn2.running_mean", "bn2.running_var"],
            ["bn2"],
            name="bn2",
            **bn,
        ),
        h.make_node(
            "Conv", ["x", "shortcut.weight", "shortcut.bias"], ["shortcut"], name="shortcut"
        ),
        h.make_node("Add", ["bn2", "shortcut"], ["add"], name="add"),
        h.make_node("Relu", ["add"], ["relu_1"], name="relu_1"),
        h.make_node(
            "MaxPool", ["relu_1"], ["max_pool"], kernel_shape=[2, 2], strides=[2, 2], name="pool"
        ),
        h.make_node(
            "AveragePool",
            ["max_pool"],
            ["avg_pool"],
            kernel_shape=[3, 3],
            strides=[1, 1],
            pads=[1, 1, 1, 1],
            name="avgpool",
        ),
        h.make_node("GlobalAveragePool", ["avg_pool"], ["gap"], name="gap"),
        # Exporter-style flatten: Shape -> Gather -> Concat -> Reshape.
        h.make_node("Shape", ["gap"], ["shape"], name="shape"),
        h.make_node("Gather", ["shape", "idx0"], ["batch"], name="gather"),
        h.make_node("Concat", ["batch", "minus1"], ["flat_shape"], axis=0, name="concat"),
        h.make_node("Reshape", ["gap", "flat_shape"], ["flatten"], name="flatten"),
        h.make_node("Gemm", ["flatten", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc"),
    ]
    graph = h.make_graph(
        nodes,
        "resnet_block",
        [h.make_tensor_value_info("x", T.FLOAT, [batch, 3, 8, 8])],
        [h.make_tensor_value_info("logits", T.FLOAT, [batch, 4])],
        inits,
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]))
    g = model.graph
    nodes_by = {n.name: n for n in g}
    for n in g:
        n.metadata_props[SCOPE] = n.name
    conv = dict(ndim=2, strides=[1, 1], dilations=[1, 1], groups=1)
    mark_layer(
        nodes_by["conv1"],
        "conv",
        in_channels=3,
        out_channels=8,
        kernel_size=[3, 3],
        padding=[[1, 1], [1, 1]],
        use_bias=False,
        **conv,
    )
    mark_layer(
        nodes_by["conv2"],
        "conv",
        in_channels=8,
        out_channels=8,
        kernel_size=[3, 3],
        padding=[[1, 1], [1, 1]],
        use_bias=False,
        **conv,
    )
    mark_layer(
        nodes_by["shortcut"],
        "conv",
        in_channels=3,
        out_channels=8,
        kernel_size=[1, 1],
        padding=[[0, 0], [0, 0]],
        use_bias=True,
        **conv,
    )
    for b in ("bn1", "bn2"):
        mark_layer(
            nodes_by[b],
            "batch_norm",
            num_features=8,
            epsilon=1e-5,
            momentum=0.1,
            affine=True,
            track_running_stats=True,
        )
    mark_layer(nodes_by["fc"], "dense", in_features=8, out_features=4, use_bias=True)
    inits_by = g.initializers
    for name in ("conv1", "conv2", "shortcut"):
        mark_weight(inits_by[f"{name}.weight"], "kernel", "OIHW")
    mark_weight(inits_by["shortcut.bias"], "bias")
    for b in ("bn1", "bn2"):
        mark_weight(inits_by[f"{b}.weight"], "scale")
        mark_weight(inits_by[f"{b}.bias"], "bias")
        mark_weight(inits_by[f"{b}.running_mean"], "mean")
        mark_weight(inits_by[f"{b}.running_var"], "var")
    mark_weight(inits_by["fc.weight"], "kernel", "OI")
    mark_weight(inits_by["fc.bias"], "bias")
    return model
