"""Hand-built IR models with layer metadata, for the Flax emitter tests."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h

from xconv.ir.layers import mark_layer, mark_weight
from xconv.ir.metadata import LAYER, MODULE, SCOPE


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


def tiny_transformer(
    batch: int | str = "B", seq: int = 5, dim: int = 8, heads: int = 2, attention_module=False
):
    """Embedding + positions, pre-LN attention (manual and ONNX Attention), GELU MLP, head."""
    rng = np.random.default_rng(0)
    dh = dim // heads
    inits = [
        _init(rng, "embed.weight", [11, dim]),
        _init(rng, "pos", [seq, dim]),
        _init(rng, "ln1.weight", [dim], positive=True),
        _init(rng, "ln1.bias", [dim]),
        _init(rng, "qkv.weight", [dim, 3 * dim]),
        _init(rng, "qkv.bias", [3 * dim]),
        _init(rng, "proj.weight", [dim, dim]),
        _init(rng, "proj.bias", [dim]),
        _init(rng, "ln2.weight", [dim], positive=True),
        _init(rng, "fc1.weight", [dim, 2 * dim]),
        _init(rng, "fc1.bias", [2 * dim]),
        _init(rng, "fc2.weight", [2 * dim, dim]),
        _init(rng, "fc2.bias", [dim]),
        _init(rng, "head.weight", [3, dim]),
        _init(rng, "head.bias", [3]),
        h.make_tensor("split", T.INT64, [3], [dim] * 3),
        h.make_tensor("heads_shape", T.INT64, [4], [0, seq, heads, dh]),
        h.make_tensor("merge_shape", T.INT64, [3], [0, seq, dim]),
        h.make_tensor("dh", T.FLOAT, [], [float(dh)]),
        h.make_tensor("ones", T.FLOAT, [seq, seq], [1.0] * seq * seq),
        h.make_tensor("neg_inf", T.FLOAT, [], [float("-inf")]),
        h.make_tensor("half", T.FLOAT, [], [0.5]),
        h.make_tensor("two", T.FLOAT, [], [2.0]),
        h.make_tensor("sqrt2", T.FLOAT, [], [float(np.sqrt(2.0))]),
        h.make_tensor("one", T.FLOAT, [], [1.0]),
        h.make_tensor("axes1", T.INT64, [1], [1]),
    ]
    n = h.make_node
    nodes = [
        n("Gather", ["embed.weight", "ids"], ["tok"], name="embed"),
        n("Add", ["tok", "pos"], ["x0"], name="add_pos"),
        n(
            "LayerNormalization",
            ["x0", "ln1.weight", "ln1.bias"],
            ["ln1"],
            axis=-1,
            epsilon=1e-5,
            name="ln1",
        ),
        n("MatMul", ["ln1", "qkv.weight"], ["qkv_mm"], name="qkv_mm"),
        n("Add", ["qkv_mm", "qkv.bias"], ["qkv"], name="qkv_add"),
        n("Split", ["qkv", "split"], ["q", "k", "v"], axis=-1, name="split"),
        n("Reshape", ["q", "heads_shape"], ["q4"], name="q4"),
        n("Reshape", ["k", "heads_shape"], ["k4"], name="k4"),
        n("Reshape", ["v", "heads_shape"], ["v4"], name="v4"),
        n("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3], name="qh"),
        n("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3], name="kh"),
        n("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3], name="vh"),
        # manual causal attention
        n("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2], name="kt"),
        n("MatMul", ["qh", "kt"], ["scores"], name="scores"),
        n("Sqrt", ["dh"], ["sqrt_dh"], name="sqrt_dh"),
        n("Div", ["scores", "sqrt_dh"], ["scaled"], name="scaled"),
        n("Trilu", ["ones"], ["tril"], upper=0, name="tril"),
        n("Cast", ["tril"], ["causal"], to=T.BOOL, name="causal"),
        n("Where", ["causal", "scaled", "neg_inf"], ["masked"], name="masked"),
        n("Softmax", ["masked"], ["probs"], axis=-1, name="probs"),
        n("MatMul", ["probs", "vh"], ["ctx_manual"], name="ctx_manual"),
        # the same with the ONNX Attention op
        n("Attention", ["qh", "kh", "vh"], ["ctx_op"], is_causal=1, name="attention_op"),
        n("Add", ["ctx_manual", "ctx_op"], ["ctx_sum"], name="ctx_sum"),
        n("Mul", ["ctx_sum", "half"], ["ctx"], name="ctx"),
        n("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3], name="ctx_t"),
        n("Reshape", ["ctx_t", "merge_shape"], ["merged"], name="merged"),
        n("MatMul", ["merged", "proj.weight"], ["proj_mm"], name="proj_mm"),
        n("Add", ["proj_mm", "proj.bias"], ["proj"], name="proj_add"),
        n("Dropout", ["proj"], ["proj_drop"], name="drop"),
        n("Add", ["x0", "proj_drop"], ["x1"], name="res1"),
        n("RMSNormalization", ["x1", "ln2.weight"], ["ln2"], axis=-1, epsilon=1e-6, name="ln2"),
        n("MatMul", ["ln2", "fc1.weight"], ["fc1_mm"], name="fc1_mm"),
        n("Add", ["fc1_mm", "fc1.bias"], ["fc1"], name="fc1_add"),
        n("Gelu", ["fc1"], ["gelu"], approximate="tanh", name="gelu"),
        # exact GELU written out with Erf and Pow
        n("Div", ["gelu", "sqrt2"], ["g_div"], name="g_div"),
        n("Erf", ["g_div"], ["g_erf"], name="g_erf"),
        n("Add", ["g_erf", "one"], ["g_add"], name="g_add"),
        n("Mul", ["gelu", "g_add"], ["g_mul"], name="g_mul"),
        n("Mul", ["g_mul", "half"], ["g_out"], name="g_out"),
        n("Pow", ["g_out", "two"], ["g_sq"], name="g_sq"),
        n("Gelu", ["g_sq"], ["gelu2"], name="gelu2"),
        n("MatMul", ["gelu2", "fc2.weight"], ["fc2_mm"], name="fc2_mm"),
        n("Add", ["fc2_mm", "fc2.bias"], ["fc2"], name="fc2_add"),
        n("Add", ["x1", "fc2"], ["x2"], name="res2"),
        n("ReduceMean", ["x2", "axes1"], ["pooled"], keepdims=0, name="pool"),
        n("Gemm", ["pooled", "head.weight", "head.bias"], ["logits"], transB=1, name="head"),
    ]
    graph = h.make_graph(
        nodes,
        "tiny_transformer",
        [h.make_tensor_value_info("ids", T.INT64, [batch, seq])],
        [h.make_tensor_value_info("logits", T.FLOAT, [batch, 3])],
        inits,
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]))
    g = model.graph
    by = {nd.name: nd for nd in g}
    scopes = {
        "embed": ["embed"],
        "ln1": ["ln1"],
        "attn.qkv": ["qkv_mm", "qkv_add"],
        "attn.proj": ["proj_mm", "proj_add"],
        "drop": ["drop"],
        "ln2": ["ln2"],
        "mlp.fc1": ["fc1_mm", "fc1_add"],
        "mlp.fc2": ["fc2_mm", "fc2_add"],
        "head": ["head"],
    }
    for nd in g:
        nd.metadata_props[SCOPE] = "attn" if nd.name in ("scores", "probs") else nd.name
    for scope, names in scopes.items():
        for name in names:
            by[name].metadata_props[SCOPE] = scope
    mark_layer(by["embed"], "embedding", num_embeddings=11, features=dim)
    mark_layer(
        by["ln1"],
        "layer_norm",
        normalized_shape=[dim],
        epsilon=1e-5,
        elementwise_affine=True,
        use_bias=True,
    )
    mark_layer(by["ln2"], "rms_norm", normalized_shape=[dim], epsilon=1e-6, elementwise_affine=True)
    mark_layer(by["drop"], "dropout", rate=0.25)
    for name, fin, fout in (
        ("qkv_mm", dim, 3 * dim),
        ("proj_mm", dim, dim),
        ("fc1_mm", dim, 2 * dim),
        ("fc2_mm", 2 * dim, dim),
    ):
        mark_layer(by[name], "dense", in_features=fin, out_features=fout, use_bias=True)
    if attention_module:
        # The attention body (heads split, both attention paths, output projection) as one
        # recognised layer with no native Flax counterpart: a generated submodule.
        attn = [
            "split",
            "q4",
            "k4",
            "v4",
            "qh",
            "kh",
            "vh",
            "kt",
            "scores",
            "sqrt_dh",
            "scaled",
            "tril",
            "causal",
            "masked",
            "probs",
            "ctx_manual",
            "attention_op",
            "ctx_sum",
            "ctx",
            "ctx_t",
            "merged",
            "proj_mm",
            "proj_add",
        ]
        for name in attn:
            by[name].metadata_props[SCOPE] = "attn"
            by[name].metadata_props.pop(LAYER, None)
        mark_layer(
            by["attention_op"],
            "attention",
            embed_dim=dim,
            num_heads=heads,
            use_bias=True,
            batch_first=True,
        )
        by["attention_op"].metadata_props[MODULE] = "torch.nn.MultiheadAttention"
    mark_layer(by["head"], "dense", in_features=dim, out_features=3, use_bias=True)
    inits_by = g.initializers
    mark_weight(inits_by["embed.weight"], "embedding")
    mark_weight(inits_by["pos"], "embedding")
    mark_weight(inits_by["ln1.weight"], "scale")
    mark_weight(inits_by["ln1.bias"], "bias")
    mark_weight(inits_by["ln2.weight"], "scale")
    for name in ("qkv", "proj", "fc1", "fc2"):
        mark_weight(inits_by[f"{name}.weight"], "kernel", "IO")
        mark_weight(inits_by[f"{name}.bias"], "bias")
    mark_weight(inits_by["head.weight"], "kernel", "OI")
    mark_weight(inits_by["head.bias"], "bias")
    if attention_module:
        mark_weight(inits_by["proj.weight"], "out_proj_kernel", "IO")
        mark_weight(inits_by["proj.bias"], "out_proj_bias")
    return model


def conv1d_norms() -> ir.Model:
    """Conv1d (grouped, strided) -> GroupNorm -> BatchNorm1d -> mean -> BatchNorm1d on (N, C)."""
    rng = np.random.default_rng(3)
    inits = [
        _init(rng, "conv.weight", [6, 2, 3]),
        _init(rng, "conv.bias", [6]),
        _init(rng, "gn.weight", [6], positive=True),
        _init(rng, "gn.bias", [6]),
        _init(rng, "bn.weight", [6], positive=True),
        _init(rng, "bn.bias", [6]),
        _init(rng, "bn.running_mean", [6]),
        _init(rng, "bn.running_var", [6], positive=True),
        _init(rng, "bn2.weight", [6], positive=True),
        _init(rng, "bn2.bias", [6]),
        _init(rng, "bn2.running_mean", [6]),
        _init(rng, "bn2.running_var", [6], positive=True),
        h.make_tensor("axes", T.INT64, [1], [2]),
    ]
    n = h.make_node
    bn_in = ["bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"]
    bn2_in = ["bn2.weight", "bn2.bias", "bn2.running_mean", "bn2.running_var"]
    nodes = [
        n(
            "Conv",
            ["x", "conv.weight", "conv.bias"],
            ["conv"],
            group=2,
            strides=[2],
            pads=[1, 1],
            name="conv",
        ),
        n(
            "GroupNormalization",
            ["conv", "gn.weight", "gn.bias"],
            ["gn"],
            num_groups=3,
            epsilon=1e-5,
            name="gn",
        ),
        n("BatchNormalization", ["gn", *bn_in], ["bn"], epsilon=1e-5, name="bn"),
        n("Sigmoid", ["bn"], ["sig"], name="sig"),
        n("ReduceMean", ["sig", "axes"], ["pooled"], keepdims=0, name="pool"),
        n("BatchNormalization", ["pooled", *bn2_in], ["y"], epsilon=1e-3, name="bn2"),
    ]
    graph = h.make_graph(
        nodes,
        "conv1d_norms",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 4, 9])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 6])],
        inits,
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]))
    by = {nd.name: nd for nd in model.graph}
    for nd in model.graph:
        nd.metadata_props[SCOPE] = nd.name
    mark_layer(
        by["conv"],
        "conv",
        ndim=1,
        in_channels=4,
        out_channels=6,
        kernel_size=[3],
        strides=[2],
        padding=[[1, 1]],
        dilations=[1],
        groups=2,
        use_bias=True,
    )
    mark_layer(by["gn"], "group_norm", num_groups=3, num_channels=6, epsilon=1e-5, affine=True)
    mark_layer(
        by["bn"],
        "batch_norm",
        num_features=6,
        epsilon=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
    )
    mark_layer(
        by["bn2"],
        "batch_norm",
        num_features=6,
        epsilon=1e-3,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
    )
    inits_by = model.graph.initializers
    mark_weight(inits_by["conv.weight"], "kernel", "OIW")
    mark_weight(inits_by["conv.bias"], "bias")
    mark_weight(inits_by["gn.weight"], "scale")
    mark_weight(inits_by["gn.bias"], "bias")
    for b in ("bn", "bn2"):
        mark_weight(inits_by[f"{b}.weight"], "scale")
        mark_weight(inits_by[f"{b}.bias"], "bias")
        mark_weight(inits_by[f"{b}.running_mean"], "mean")
        mark_weight(inits_by[f"{b}.running_var"], "var")
    return model
