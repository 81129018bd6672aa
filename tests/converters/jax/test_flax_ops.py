"""Flax emitter op templates, one table entry per op case, against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import xconv
from tests.converters.jax.generated import run_generated
from tests.converters.jax.test_flax_emitter import ort_run

R = np.random.default_rng(0)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def i64(*values):
    return np.array(values, dtype=np.int64)


# (id, op, data inputs {name: array}, constants {name: array}, attrs, input order)
CASES = [
    # shapes computed at run time: 0 copies the input's dimension, or with allowzero is one
    (
        "reshape_runtime_zero",
        "Reshape",
        {"x": f32(2, 3, 4), "s": i64(2, 0, -1)},
        {},
        {},
        ["x", "s"],
    ),
    (
        "reshape_runtime_allowzero",
        "Reshape",
        {"x": np.zeros((0, 3, 4), np.float32), "s": i64(3, 4, 0)},
        {},
        {"allowzero": 1},
        ["x", "s"],
    ),
    (
        "conv_transpose_s2",
        "ConvTranspose",
        {"x": f32(2, 4, 5, 5)},
        {"w": f32(4, 3, 3, 3)},
        dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
        ["x", "w"],
    ),
    (
        "conv_grouped_dilated",
        "Conv",
        {"x": f32(1, 4, 9, 9)},
        {"w": f32(6, 2, 3, 3), "b": f32(6)},
        dict(group=2, dilations=[2, 2], strides=[2, 1], pads=[1, 2, 0, 1]),
        ["x", "w", "b"],
    ),
    (
        "maxpool_ceil",
        "MaxPool",
        {"x": f32(1, 2, 7, 7)},
        {},
        dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
        ["x"],
    ),
    (
        "avgpool_include_pad",
        "AveragePool",
        {"x": f32(1, 2, 6, 6)},
        {},
        dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1),
        ["x"],
    ),
    ("global_max_pool", "GlobalMaxPool", {"x": f32(2, 3, 4, 5)}, {}, {}, ["x"]),
    (
        "batch_norm_raw",
        "BatchNormalization",
        {"x": f32(2, 3, 4, 4)},
        {"s": f32(3), "b": f32(3), "m": f32(3), "v": np.abs(f32(3)) + 0.5},
        {},
        ["x", "s", "b", "m", "v"],
    ),
    (
        "layer_norm_raw",
        "LayerNormalization",
        {"x": f32(2, 3, 4)},
        {"s": f32(3, 4), "b": f32(3, 4)},
        dict(axis=-2),
        ["x", "s", "b"],
    ),
    (
        "group_norm_raw",
        "GroupNormalization",
        {"x": f32(2, 4, 3, 3)},
        {"s": f32(4), "b": f32(4)},
        dict(num_groups=2),
        ["x", "s", "b"],
    ),
    ("rms_norm_raw", "RMSNormalization", {"x": f32(2, 3, 4)}, {"s": f32(4)}, {}, ["x", "s"]),
    ("log_softmax", "LogSoftmax", {"x": f32(2, 3, 4)}, {}, dict(axis=1), ["x"]),
    (
        "reduce_sum",
        "ReduceSum",
        {"x": f32(2, 3, 4)},
        {"a": i64(0, 2)},
        dict(keepdims=0),
        ["x", "a"],
    ),
    ("reduce_max_all", "ReduceMax", {"x": f32(2, 3, 4)}, {}, {}, ["x"]),
    ("reduce_l2", "ReduceL2", {"x": f32(2, 3, 4)}, {"a": i64(-1)}, {}, ["x", "a"]),
    # noop_with_empty_axes keeps the elementwise part; logsumexp of values past exp's range
    *(
        (
            f"{op.lower()}_noop",
            op,
            {"x": f32(2, 3)},
            {"a": i64()},
            {"noop_with_empty_axes": 1},
            ["x", "a"],
        )
        for op in ("ReduceL2", "ReduceSumSquare", "ReduceLogSumExp")
    ),  # fmt: skip
    (
        "reduce_log_sum_exp_large",
        "ReduceLogSumExp",
        {"x": f32(2, 3) * 200},
        {"a": i64(1)},
        {},
        ["x", "a"],
    ),  # fmt: skip
    # OneHot (negative and out-of-range indices, an inner axis), CumSum's exclusive and
    # reverse
    (
        "one_hot",
        "OneHot",
        {"i": i64(0, -1, 5, 2, -7, 1).reshape(2, 3)},
        {"d": np.array(4, np.int64), "v": np.array([-1.0, 3.0], np.float32)},
        {"axis": 1},
        ["i", "d", "v"],
    ),
    (
        "cumsum_exclusive_reverse",
        "CumSum",
        {"x": f32(3, 4)},
        {"a": np.array(1, np.int64)},
        {"exclusive": 1, "reverse": 1},
        ["x", "a"],
    ),
    (
        "reduce_log_sum",
        "ReduceLogSum",
        {"x": np.abs(f32(2, 3)) + 0.1},
        {"a": i64(0)},
        {},
        ["x", "a"],
    ),  # fmt: skip
    (
        "slice_steps",
        "Slice",
        {"x": f32(4, 6, 5)},
        {"s": i64(-1, 1), "e": i64(-(2**63), 2**62), "a": i64(0, 2), "st": i64(-2, 2)},
        {},
        ["x", "s", "e", "a", "st"],
    ),
    (
        "gather_scalar",
        "Gather",
        {"x": f32(3, 4, 5)},
        {"i": np.array(2, np.int64)},
        dict(axis=1),
        ["x", "i"],
    ),
    ("gather_dynamic", "Gather", {"x": f32(5, 4), "i": i64(0, 4, 2, 2)}, {}, {}, ["x", "i"]),
    ("split_equal", "Split", {"x": f32(2, 6)}, {}, dict(axis=1, num_outputs=3), ["x"]),
    ("squeeze", "Squeeze", {"x": f32(2, 1, 3, 1)}, {"a": i64(1, -1)}, {}, ["x", "a"]),
    ("unsqueeze", "Unsqueeze", {"x": f32(2, 3)}, {"a": i64(0, 3)}, {}, ["x", "a"]),
    ("expand", "Expand", {"x": f32(3, 1)}, {"s": i64(2, 1, 4)}, {}, ["x", "s"]),
    ("tile", "Tile", {"x": f32(2, 3)}, {"r": i64(2, 1)}, {}, ["x", "r"]),
    (
        "pad_reflect",
        "Pad",
        {"x": f32(1, 2, 4, 4)},
        {"p": i64(0, 0, 1, 2, 0, 0, 2, 1)},
        dict(mode="reflect"),
        ["x", "p"],
    ),
    (
        "pad_constant",
        "Pad",
        {"x": f32(2, 3)},
        {"p": i64(1, 0, 0, 2), "v": np.array(1.5, np.float32)},
        {},
        ["x", "p", "v"],
    ),
    ("trilu_k", "Trilu", {"x": f32(4, 5)}, {"k": np.array(1, np.int64)}, dict(upper=1), ["x", "k"]),
    (
        "einsum",
        "Einsum",
        {"a": f32(2, 3, 4), "b": f32(2, 4, 5)},
        {},
        dict(equation="bij,bjk->bik"),
        ["a", "b"],
    ),
    ("argmax", "ArgMax", {"x": f32(3, 4)}, {}, dict(axis=1, keepdims=0), ["x"]),
    ("cumsum", "CumSum", {"x": f32(3, 4)}, {"a": np.array(1, np.int64)}, {}, ["x", "a"]),
    ("topk", "TopK", {"x": f32(3, 6)}, {"k": i64(2)}, {}, ["x", "k"]),
    (
        "clip",
        "Clip",
        {"x": f32(3, 4)},
        {"lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)},
        {},
        ["x", "lo", "hi"],
    ),
    ("hard_sigmoid", "HardSigmoid", {"x": f32(3, 4)}, {}, dict(alpha=0.3), ["x"]),
    ("leaky_relu", "LeakyRelu", {"x": f32(3, 4)}, {}, dict(alpha=0.2), ["x"]),
    ("elu", "Elu", {"x": f32(3, 4)}, {}, dict(alpha=0.7), ["x"]),
    ("selu", "Selu", {"x": f32(3, 4)}, {}, {}, ["x"]),
    ("mish", "Mish", {"x": f32(3, 4)}, {}, {}, ["x"]),
    ("hard_swish", "HardSwish", {"x": f32(3, 4)}, {}, {}, ["x"]),
    ("prelu", "PRelu", {"x": f32(2, 3, 4)}, {"s": f32(3, 1)}, {}, ["x", "s"]),
    ("mod_fmod", "Mod", {"a": f32(3, 4), "b": f32(3, 4) + 3}, {}, dict(fmod=1), ["a", "b"]),
    ("div_int", "Div", {"a": i64(7, -7, 9), "b": i64(2, 2, -4)}, {}, {}, ["a", "b"]),
    ("pow", "Pow", {"a": np.abs(f32(3, 4)), "b": f32(3, 4)}, {}, {}, ["a", "b"]),
    ("gelu_exact", "Gelu", {"x": f32(3, 4)}, {}, {}, ["x"]),
    ("gelu_tanh", "Gelu", {"x": f32(3, 4)}, {}, dict(approximate="tanh"), ["x"]),
    ("max_variadic", "Max", {"a": f32(3, 4), "b": f32(4), "c": f32(3, 1)}, {}, {}, ["a", "b", "c"]),
    ("mean_variadic", "Mean", {"a": f32(3, 4), "b": f32(3, 4)}, {}, {}, ["a", "b"]),
    ("flatten_axis2", "Flatten", {"x": f32(2, 3, 4, 5)}, {}, dict(axis=2), ["x"]),
    ("where", "Where", {"c": f32(3, 4) > 0, "a": f32(3, 4), "b": f32(4)}, {}, {}, ["c", "a", "b"]),
    ("isnan", "IsNaN", {"x": np.array([1.0, np.nan], np.float32)}, {}, {}, ["x"]),
    (
        "attention_3d_gqa",
        "Attention",
        {"q": f32(2, 4, 8), "k": f32(2, 5, 4), "v": f32(2, 5, 4)},
        {},
        dict(q_num_heads=4, kv_num_heads=2),
        ["q", "k", "v"],
    ),
    (
        "attention_mask",
        "Attention",
        {"q": f32(1, 2, 3, 4), "k": f32(1, 2, 5, 4), "v": f32(1, 2, 5, 4), "m": f32(3, 5)},
        {},
        dict(scale=0.3),
        ["q", "k", "v", "m"],
    ),
]


def test_split_to_sequence_and_sequence_at(tmp_path):
    """torch.split exports as SplitToSequence + SequenceAt."""
    nodes = [
        h.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=1),
        h.make_node("SequenceAt", ["seq", "one"], ["y"]),
        h.make_node("SequenceAt", ["seq", "minus1"], ["z"]),
    ]
    graph = h.make_graph(
        nodes,
        "seq",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 7])],
        [
            h.make_tensor_value_info("y", T.FLOAT, None),
            h.make_tensor_value_info("z", T.FLOAT, None),
        ],
        [
            h.make_tensor("split", T.INT64, [], [3]),
            h.make_tensor("one", T.INT64, [], [1]),
            h.make_tensor("minus1", T.INT64, [], [-1]),
        ],
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]))
    x = f32(2, 7)
    out = xconv.to_flax(model, tmp_path / "out")
    src = (out / "model.py").read_text()
    assert "jnp.split(x, [3, 6], axis=1)" in src
    (y, z), _ = run_generated(out, "linen", x, jit=False)
    np.testing.assert_array_equal(np.asarray(y), x[:, 3:6])
    np.testing.assert_array_equal(np.asarray(z), x[:, 6:])


def build(op, data, consts, attrs, order):
    from onnx import numpy_helper

    n_out = 3 if attrs.get("num_outputs") == 3 else 2 if op == "TopK" else 1
    outs = [f"y{i}" for i in range(n_out)]
    node = h.make_node(op, order, outs, **attrs)
    inputs = [
        h.make_tensor_value_info(k, h.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in data.items()
    ]
    outputs = [h.make_empty_tensor_value_info(o) for o in outs]
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = h.make_graph([node], "case", inputs, outputs, inits)
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)])
    return ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(proto))


@pytest.mark.parametrize(
    ("op", "data", "consts", "attrs", "order"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_op(tmp_path, op, data, consts, attrs, order):
    model = build(op, data, consts, attrs, order)
    expected = ort_run(model, *data.values())
    out = xconv.to_flax(model, tmp_path / "out")
    got, _ = run_generated(out, "linen", *data.values(), jit=False)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert np.asarray(g).shape == e.shape
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-4, atol=1e-5)


def test_max_pool_indices_as_a_graph_output(tmp_path):
    """A MaxPool whose Indices output the graph returns is the generated
    ``_max_pool_with_indices`` (ONNX's indices, flat over the NCHW input; it used to be
    refused); unused, the output is left out (``y, _ = ...``)."""
    for returned in (False, True):
        outs = [h.make_tensor_value_info("y", T.FLOAT, None)]
        outs += [h.make_tensor_value_info("i", T.INT64, None)] if returned else []
        node = h.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2])
        x = [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 4, 4])]
        proto = h.make_model(
            h.make_graph([node], "g", x, outs), opset_imports=[h.make_opsetid("", 23)]
        )
        model = ir.serde.deserialize_model(proto)
        data = f32(1, 2, 4, 4)
        out = xconv.to_flax(model, tmp_path / f"out{int(returned)}")
        got, _ = run_generated(out, "linen", data, jit=False)
        y = got[0] if returned else got
        np.testing.assert_array_equal(np.asarray(y), data.reshape(1, 2, 2, 2, 2, 2).max((3, 5)))
        if returned:
            windows = data.reshape(1, 2, 2, 2, 2, 2).transpose(0, 1, 2, 4, 3, 5)
            at = windows.reshape(1, 2, 2, 2, 4).argmax(-1)  # within each 2x2 window
            rows, cols = np.meshgrid(np.arange(2), np.arange(2), indexing="ij")
            flat = (2 * rows + at // 2) * 4 + 2 * cols + at % 2 + 16 * np.arange(2)[:, None, None]
            np.testing.assert_array_equal(np.asarray(got[1]), flat)


@pytest.mark.parametrize("attrs", [{}, {"exclusive": 1}, {"reverse": 1, "exclusive": 1}])
def test_cumprod_against_the_onnx_reference(tmp_path, attrs):
    """CumProd (opset 26, which onnxruntime lacks): jnp.cumprod, or the _cumulative helper."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    x = f32(3, 4)
    node = h.make_node("CumProd", ["x", "a"], ["y"], **attrs)
    graph = h.make_graph(
        [node], "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
        [h.make_empty_tensor_value_info("y")], [numpy_helper.from_array(i64(1).reshape(()), "a")],
    )  # fmt: skip
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 26)])
    want = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    out = xconv.to_flax(ir.serde.deserialize_model(proto), tmp_path / "out")
    got, _ = run_generated(out, "linen", x, jit=False)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
