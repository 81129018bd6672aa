"""PyTorch source templates, one table entry per op case, against the ONNX reference evaluator."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch")

from tests.converters.jax.test_flax_emitter_rnn import CASES as RNN_CASES  # noqa: E402
from xconv.converters.torch.source.emitter import to_torch_source  # noqa: E402
from xconv.errors import UnsupportedOpError  # noqa: E402
from xconv.ir import OPSET  # noqa: E402

R = np.random.default_rng(0)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


def i64(*values):
    return np.array(values, dtype=np.int64)


# (id, op, data inputs {name: array}, constants {name: array}, attrs, input order, n outputs)
CASES = [
    (  # a finfo.min fill (a decoder's mask): torch.full refuses -3.4028235e+38 (overflow)
        "constant_of_shape_finfo_min",
        "ConstantOfShape",
        {},
        {"s": i64(4, 32)},
        {"value": h.make_tensor("v", onnx.TensorProto.FLOAT, [1], [np.finfo(np.float32).min])},
        ["s"],
    ),
    (
        "reshape_to_scalar",
        "Reshape",
        {"x": f32(1)},
        {"s": np.zeros((0,), np.int64)},
        {},
        ["x", "s"],
    ),  # fmt: skip
    (  # a shape computed at run time: its 0 copies the input's dimension (allowzero=0)
        "reshape_runtime_shape_zero",
        "Reshape",
        {"x": f32(2, 3, 4), "s": i64(2, 0, -1, 1)},
        {},
        {},
        ["x", "s"],
    ),  # fmt: skip
    ("flatten_rank_1", "Flatten", {"x": f32(3)}, {}, {"axis": 1}, ["x"]),
    # uint16/32/64, for which torch has few kernels: computed in int64 (sub wraps around)
    *(
        (
            f"{op.lower()}_{np.dtype(dt).name}",
            op,
            {"a": np.array([3, 7, 2**bits - 1], dt), "b": np.array([5, 2, 1], dt)},
            {},
            {},
            ["a", "b"],
        )
        for op, types in (
            ("Sub", (np.uint16, np.uint32, np.uint64)),
            ("Add", (np.uint32, np.uint64)),
            ("Div", (np.uint32,)),
            ("Less", (np.uint16,)),
            ("Max", (np.uint32,)),
        )
        for dt in types
        for bits in (np.dtype(dt).itemsize * 8,)
    ),  # fmt: skip
    # reductions over axes the graph computes (dim=_dims(axes, x)), ReduceProd over several
    # axes (nested torch.prod), ReduceLogSum
    (
        "reduce_sum_runtime_axes",
        "ReduceSum",
        {"x": f32(2, 3, 4), "a": i64(0, -1)},
        {},
        {"keepdims": 0},
        ["x", "a"],
    ),
    (
        "reduce_max_runtime_empty_axes",
        "ReduceMax",
        {"x": f32(2, 3), "a": i64()},
        {},
        {},
        ["x", "a"],
    ),
    (
        "reduce_l2_runtime_noop",
        "ReduceL2",
        {"x": f32(2, 3), "a": i64()},
        {},
        {"noop_with_empty_axes": 1},
        ["x", "a"],
    ),
    (
        "reduce_log_sum_exp_noop",
        "ReduceLogSumExp",
        {"x": f32(2, 3)},
        {"a": i64()},
        {"noop_with_empty_axes": 1},
        ["x", "a"],
    ),
    (
        "reduce_prod_axes",
        "ReduceProd",
        {"x": f32(2, 3, 4)},
        {"a": i64(0, 2)},
        {"keepdims": 0},
        ["x", "a"],
    ),
    (
        "reduce_log_sum",
        "ReduceLogSum",
        {"x": np.abs(f32(2, 3)) + 0.1},
        {"a": i64(1)},
        {},
        ["x", "a"],
    ),
    # TopK's ties in index order (torch.topk leaves them unordered), k computed at run time
    *(
        (
            f"topk_ties_{'largest' if largest else 'smallest'}",
            "TopK",
            {"x": np.array([[1, 3, 3, 2, 3, 1]], np.float32)},
            {"k": i64(3)},
            {"largest": largest},
            ["x", "k"],
            2,
        )
        for largest in (1, 0)
    ),
    ("topk_runtime_k", "TopK", {"x": f32(2, 6), "k": i64(2)}, {}, {}, ["x", "k"], 2),
    # BitShift through int64: uint8's left shift wraps, uint64's right shift is logical from
    # 2**63 (int64's >> copies the sign bit)
    *(
        (
            f"bitshift_{d.lower()}_{np.dtype(dt).name}",
            "BitShift",
            {
                "a": np.array([1, 2**bits - 1, 2 ** (bits - 1) + 3, 5], dt),
                "b": np.array([1, 3, bits - 1, 0], dt),
            },
            {},
            {"direction": d},
            ["a", "b"],
        )
        for dt in (np.uint8, np.uint16, np.uint32, np.uint64)
        for d in ("LEFT", "RIGHT")
        for bits in (np.dtype(dt).itemsize * 8,)
    ),  # fmt: skip
    # pooling pads torch's padding argument cannot take: asymmetric (TensorFlow's SAME with
    # stride 2) or wider than half the window, written with F.pad
    *(
        (
            f"{op}_pads_{tag}{'_counted' if extra else ''}",
            op,
            {"x": f32(1, 2, 7, 7)},
            {},
            {"kernel_shape": [3, 3], "strides": [2, 2], "pads": pads, **extra},
            ["x"],
        )
        for tag, pads in (("asymmetric", [0, 0, 1, 1]), ("wide", [2, 2, 2, 2]))
        for op, extra in (
            ("MaxPool", {}),
            ("AveragePool", {}),
            ("AveragePool", {"count_include_pad": 1}),
        )
    ),  # fmt: skip
    ("flatten_at_rank", "Flatten", {"x": f32(2, 3)}, {}, {"axis": 2}, ["x"]),
    # Resize as F.interpolate (Keras UpSampling2D(interpolation="bilinear") exports the first)
    *(
        (
            f"resize_{tag}",
            "Resize",
            {"x": f32(*shape)},
            {key: value},
            attrs,
            ["x", "", "s"] if key == "s" else ["x", "", "", "z"],
        )
        for tag, shape, key, value, attrs in (
            (
                "linear_half_pixel",
                (1, 2, 4, 4),
                "s",
                np.array([1, 1, 2, 2], np.float32),
                {"mode": "linear"},
            ),
            (
                "linear_align_corners",
                (1, 2, 4, 3),
                "z",
                i64(1, 2, 7, 5),
                {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
            ),
            (
                "linear_pytorch_half_pixel",
                (1, 2, 4, 3),
                "z",
                i64(1, 2, 2, 5),
                {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
            ),
            ("linear_1d", (2, 3, 5), "s", np.array([1, 1, 2.5], np.float32), {"mode": "linear"}),
            (
                "trilinear",
                (1, 1, 2, 3, 4),
                "s",
                np.array([1, 1, 2, 2, 1.5], np.float32),
                {"mode": "linear"},
            ),
            (
                "nearest_floor",
                (1, 2, 3, 4),
                "s",
                np.array([1, 1, 2, 3], np.float32),
                {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
            ),
            (
                "nearest_floor_sizes",
                (1, 2, 3, 4),
                "z",
                i64(1, 2, 7, 9),
                {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
            ),
            (
                "cubic_half_pixel",
                (1, 2, 5, 4),
                "s",
                np.array([1, 1, 2, 1.5], np.float32),
                {"mode": "cubic"},
            ),
        )
    ),  # fmt: skip
    ("add_scalar", "Add", {"x": f32(2, 3)}, {"c": np.array(2.5, np.float32)}, {}, ["x", "c"]),
    ("sub_bcast", "Sub", {"x": f32(2, 3), "y": f32(3)}, {}, {}, ["x", "y"]),
    ("div_int", "Div", {"x": i64(7, -7, 9), "y": i64(2, 2, 4)}, {}, {}, ["x", "y"]),
    ("pow", "Pow", {"x": np.abs(f32(2, 3))}, {"p": np.array(1.5, np.float32)}, {}, ["x", "p"]),
    ("sqrt", "Sqrt", {"x": np.abs(f32(2, 3))}, {}, {}, ["x"]),
    ("erf", "Erf", {"x": f32(2, 3)}, {}, {}, ["x"]),
    ("gelu_exact", "Gelu", {"x": f32(2, 3)}, {}, {}, ["x"]),
    ("gelu_tanh", "Gelu", {"x": f32(2, 3)}, {}, {"approximate": "tanh"}, ["x"]),
    ("leaky_relu", "LeakyRelu", {"x": f32(2, 3)}, {}, {"alpha": 0.2}, ["x"]),
    ("hard_sigmoid", "HardSigmoid", {"x": f32(2, 3)}, {}, {}, ["x"]),
    (
        "clip",
        "Clip",
        {"x": f32(2, 3)},
        {"lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)},
        {},
        ["x", "lo", "hi"],
    ),
    ("cast", "Cast", {"x": f32(2, 3) * 3}, {}, {"to": onnx.TensorProto.INT64}, ["x"]),
    (
        "where",
        "Where",
        {"c": f32(2, 3) > 0, "x": f32(2, 3), "y": f32(2, 3)},
        {},
        {},
        ["c", "x", "y"],
    ),
    ("max3", "Max", {"x": f32(2, 3), "y": f32(2, 3), "z": f32(3)}, {}, {}, ["x", "y", "z"]),
    ("matmul_batched", "MatMul", {"x": f32(2, 3, 4), "y": f32(2, 4, 5)}, {}, {}, ["x", "y"]),
    (
        "gemm_alpha_beta",
        "Gemm",
        {"a": f32(4, 3), "b": f32(5, 4), "c": f32(5)},
        {},
        {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
        ["a", "b", "c"],
    ),
    (
        "einsum",
        "Einsum",
        {"x": f32(2, 3, 4), "y": f32(2, 4, 5)},
        {},
        {"equation": "bij,bjk->bik"},
        ["x", "y"],
    ),
    (
        "conv_grouped_dilated",
        "Conv",
        {"x": f32(1, 4, 9, 9), "w": f32(6, 2, 3, 3), "b": f32(6)},
        {},
        {"group": 2, "dilations": [2, 2], "strides": [2, 1], "pads": [1, 2, 1, 2]},
        ["x", "w", "b"],
    ),
    (
        "conv_transpose_s2",
        "ConvTranspose",
        {"x": f32(2, 4, 5, 5), "w": f32(4, 3, 3, 3)},
        {},
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
        ["x", "w"],
    ),
    (
        "maxpool_ceil",
        "MaxPool",
        {"x": f32(1, 2, 7, 7)},
        {},
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
        ["x"],
    ),
    (
        "avgpool_pad",
        "AveragePool",
        {"x": f32(1, 2, 6, 6)},
        {},
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        ["x"],
    ),
    ("global_avg_pool", "GlobalAveragePool", {"x": f32(2, 3, 4, 5)}, {}, {}, ["x"]),
    (
        "batch_norm",
        "BatchNormalization",
        {"x": f32(2, 3, 4, 4), "s": f32(3), "b": f32(3), "m": f32(3), "v": np.abs(f32(3)) + 0.5},
        {},
        {"epsilon": 1e-3},
        ["x", "s", "b", "m", "v"],
    ),
    (
        "layer_norm_2d",
        "LayerNormalization",
        {"x": f32(2, 3, 4), "s": f32(3, 4), "b": f32(3, 4)},
        {},
        {"axis": 1},
        ["x", "s", "b"],
    ),
    ("rms_norm", "RMSNormalization", {"x": f32(2, 3, 4), "s": f32(4)}, {}, {}, ["x", "s"]),
    (
        "group_norm",
        "GroupNormalization",
        {"x": f32(2, 4, 3, 3), "s": f32(4), "b": f32(4)},
        {},
        {"num_groups": 2},
        ["x", "s", "b"],
    ),
    ("softmax", "Softmax", {"x": f32(2, 3, 4)}, {}, {"axis": 1}, ["x"]),
    ("log_softmax", "LogSoftmax", {"x": f32(2, 3)}, {}, {}, ["x"]),
    (
        "reduce_mean",
        "ReduceMean",
        {"x": f32(2, 3, 4)},
        {"a": i64(1, -1)},
        {"keepdims": 0},
        ["x", "a"],
    ),
    ("reduce_sum_all", "ReduceSum", {"x": f32(2, 3)}, {}, {}, ["x"]),
    ("reduce_max", "ReduceMax", {"x": f32(2, 3, 4)}, {"a": i64(2)}, {}, ["x", "a"]),
    ("argmax", "ArgMax", {"x": f32(2, 3, 4)}, {}, {"axis": 1, "keepdims": 0}, ["x"]),
    ("reshape_zero", "Reshape", {"x": f32(2, 3, 4)}, {"s": i64(0, -1)}, {}, ["x", "s"]),
    ("flatten2", "Flatten", {"x": f32(2, 3, 4, 5)}, {}, {"axis": 2}, ["x"]),
    ("transpose", "Transpose", {"x": f32(2, 3, 4)}, {}, {"perm": [2, 0, 1]}, ["x"]),
    ("concat", "Concat", {"x": f32(2, 3), "y": f32(2, 2)}, {}, {"axis": -1}, ["x", "y"]),
    (
        "slice_steps",
        "Slice",
        {"x": f32(4, 6, 5)},
        {"s": i64(1, -4), "e": i64(9223372036854775807, -1), "a": i64(0, 1), "t": i64(1, 2)},
        {},
        ["x", "s", "e", "a", "t"],
    ),
    (
        "gather_scalar",
        "Gather",
        {"x": f32(3, 4)},
        {"i": np.array(-1, np.int64)},
        {"axis": 1},
        ["x", "i"],
    ),
    ("gather_2d", "Gather", {"x": f32(5, 4), "i": i64(0, 4, 2).reshape(3, 1)}, {}, {}, ["x", "i"]),
    ("split", "Split", {"x": f32(2, 6)}, {"s": i64(2, 4)}, {"axis": 1}, ["x", "s"], 2),
    ("split_even", "Split", {"x": f32(6, 2)}, {}, {"num_outputs": 3}, ["x"], 3),
    ("squeeze", "Squeeze", {"x": f32(2, 1, 3, 1)}, {"a": i64(1, -1)}, {}, ["x", "a"]),
    ("unsqueeze", "Unsqueeze", {"x": f32(2, 3)}, {"a": i64(0, -1)}, {}, ["x", "a"]),
    ("expand", "Expand", {"x": f32(3, 1)}, {"s": i64(2, 1, 4)}, {}, ["x", "s"]),
    ("tile", "Tile", {"x": f32(2, 3)}, {"r": i64(2, 1)}, {}, ["x", "r"]),
    (
        "pad_reflect",
        "Pad",
        {"x": f32(1, 2, 4, 4)},
        {"p": i64(0, 0, 1, 2, 0, 0, 2, 1)},
        {"mode": "reflect"},
        ["x", "p"],
    ),
    (
        "pad_const",
        "Pad",
        {"x": f32(2, 3)},
        {"p": i64(1, 0, 0, 2), "v": np.array(1.5, np.float32)},
        {},
        ["x", "p", "v"],
    ),
    (
        "range",
        "Range",
        {},
        {"a": np.array(1, np.int64), "b": np.array(9, np.int64), "d": np.array(3, np.int64)},
        {},
        ["a", "b", "d"],
    ),
    (
        "trilu_lower",
        "Trilu",
        {"x": f32(4, 4)},
        {"k": np.array(1, np.int64)},
        {"upper": 0},
        ["x", "k"],
    ),
    ("cumsum", "CumSum", {"x": f32(2, 3)}, {"a": np.array(1, np.int64)}, {}, ["x", "a"]),
    (
        "attention_causal",
        "Attention",
        {"q": f32(2, 4, 5, 8), "k": f32(2, 2, 5, 8), "v": f32(2, 2, 5, 8)},
        {},
        {"is_causal": 1},
        ["q", "k", "v"],
    ),
    (
        "attention_mask",
        "Attention",
        {"q": f32(1, 2, 3, 4), "k": f32(1, 2, 5, 4), "v": f32(1, 2, 5, 4), "m": f32(3, 5) > 0},
        {},
        {"scale": 0.3},
        ["q", "k", "v", "m"],
    ),
]


def _model(op, data, consts, attrs, order, n_out):
    dt = onnx.helper.np_dtype_to_tensor_dtype
    inputs = [h.make_tensor_value_info(k, dt(v.dtype), v.shape) for k, v in data.items()]
    inits = [onnx.numpy_helper.from_array(v, k) for k, v in consts.items()]
    outs = [f"y{i}" for i in range(n_out)]
    node = h.make_node(op, order, outs, **attrs)
    graph = h.make_graph(
        [node], "g", inputs, [h.make_tensor_value_info(o, 0, None) for o in outs], inits
    )
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)])
    proto = onnx.shape_inference.infer_shapes(proto)
    return proto


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op(case):
    _, op, data, consts, attrs, order, *rest = case
    n_out = rest[0] if rest else 1
    proto = _model(op, data, consts, attrs, order, n_out)
    want = ReferenceEvaluator(proto).run(None, data)
    source, state = to_torch_source(ir.from_proto(proto))
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    module = ns["Model"]()
    module.load_state_dict(state)
    # Float inputs that became weights are parameters; the rest are forward arguments.
    args = [torch.from_numpy(np.array(v)) for k, v in data.items() if f"{k}" not in state]
    with torch.no_grad():
        got = module(*args)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.numpy().dtype == w.dtype
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


def test_unsupported_ops_are_listed_together():
    TRAINING = "ai.onnx.preview.training"  # noqa: N806
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    nodes = [
        h.make_node("Momentum", ["x"], ["a"], domain=TRAINING),
        h.make_node("Relu", ["a"], ["b"]),
        h.make_node("GlobalLpPool", ["b"], ["c"]),
        h.make_node("Momentum", ["c"], ["y"], domain=TRAINING),
    ]
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    opsets = [h.make_opsetid("", OPSET), h.make_opsetid(TRAINING, 1)]
    proto = h.make_model(h.make_graph(nodes, "g", [x], [y]), opset_imports=opsets)
    with pytest.raises(UnsupportedOpError) as err:
        to_torch_source(ir.from_proto(proto))
    text = str(err.value)
    assert "Momentum x2" in text and "GlobalLpPool x1" in text and "Relu" not in text


def test_conv_with_asymmetric_pads_pads_explicitly():
    """TensorFlow's SAME padding with stride 2 gives pads [0, 0, 1, 1]: no conv argument."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper, numpy_helper

    import xconv
    from xconv.converters.torch.source.emitter import to_torch_source

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[0, 0, 1, 1], strides=[2, 2])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    source, state = to_torch_source(xconv.load(proto))
    assert "F.pad(" in source
    namespace: dict = {}
    exec(compile(source, "<generated>", "exec"), namespace)
    module = namespace["Model"]()
    module.load_state_dict(state)
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString()).run(None, {"x": x})[0]
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_resize_torch_cannot_match_is_the_generated_resize():
    """Resizes F.interpolate computes otherwise are written as the generated _resize (the
    runtimes' plan), not as F.interpolate, and match the ONNX reference: an output axis of one
    element with half-pixel coordinates (torch samples the middle), ONNX's default nearest
    rounding (round_prefer_floor), the channel axis."""
    for sizes, attrs in (
        ((1, 2, 1, 5), {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
        ((1, 2, 8, 6), {}),
        ((1, 4, 4, 3), {"mode": "linear"}),
    ):
        x = f32(1, 2, 4, 3)
        proto = _model("Resize", {"x": x}, {"z": i64(*sizes)}, attrs, ["x", "", "", "z"], 1)
        source, state = to_torch_source(ir.from_proto(proto))
        assert "_resize(" in source and "F.interpolate(" not in source
        ns: dict = {}
        exec(compile(source, "<generated>", "exec"), ns)
        module = ns["Model"]()
        module.load_state_dict(state)
        with torch.no_grad():
            got = module(torch.from_numpy(x)).numpy()
        (want,) = ReferenceEvaluator(proto).run(None, {"x": x})
        assert got.shape == sizes
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_resize_by_scales_of_a_dynamic_batch():
    """Keras UpSampling2D(interpolation="bilinear") through tf2onnx: a Resize by constant
    scales of an input whose batch is symbolic, written as F.interpolate(scale_factor=2.0)."""
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 2, 4, 3])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    scales = onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "s")
    node = h.make_node("Resize", ["x", "", "s"], ["y"], mode="linear")
    proto = h.make_model(h.make_graph([node], "g", [x], [y], [scales]),
                         opset_imports=[h.make_opsetid("", OPSET)])  # fmt: skip
    source, _ = to_torch_source(ir.from_proto(proto))
    assert 'F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)' in source
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    data = f32(3, 2, 4, 3)
    with torch.no_grad():
        got = ns["Model"]()(torch.from_numpy(data)).numpy()
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": data})[0], atol=1e-6)


def test_resize_tf_half_pixel_for_nn_as_nearest_exact():
    """Keras' Resizing(interpolation="nearest") through tf2onnx: F.interpolate's
    "nearest-exact", and the torch runtime, against the definition."""
    import xconv
    from tests.converters.jax.test_shape import tf_half_pixel_resize

    proto, x, want = tf_half_pixel_resize()
    model = xconv.load(proto)
    runtime, _ = xconv.to_torch(model)
    source, _ = xconv.to_torch_source(model, example_inputs=(x,))
    assert 'mode="nearest-exact"' in source
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    with torch.no_grad():
        for module in (runtime, ns["Model"]()):
            got = module(torch.from_numpy(x))
            got = got[0] if isinstance(got, tuple | list) else got
            np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize(("op", "direction", "kw"), RNN_CASES)
def test_recurrent_ops_as_generated_helpers(op, direction, kw):
    """ONNX RNN / GRU / LSTM (peepholes, sequence lengths, reverse, both layouts) as calls of
    the generated _rnn / _gru / _lstm, against onnxruntime or the ONNX reference: the Flax
    emitter's cases, its call (expressions.recurrent_call), torch's helpers."""
    import xconv
    from tests.converters.jax.test_flax_emitter import ort_run
    from tests.converters.jax.test_flax_emitter_rnn import _rnn_model

    model, feeds = _rnn_model(op, direction, **kw)
    if kw.get("layout"):  # onnxruntime's CPU kernels refuse layout=1
        names = [v.name for v in model.graph.inputs]
        feed = dict(zip(names, feeds, strict=True))
        expected = ReferenceEvaluator(ir.to_proto(model)).run(None, feed)
    else:
        expected = ort_run(model, *feeds)
    source, state = xconv.to_torch_source(model, example_inputs=tuple(feeds))
    assert f"def _{op.lower()}(" in source and "def _rnn_scan(" in source
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    module = ns["Model"]().eval()
    module.load_state_dict(state)
    with torch.no_grad():
        got = module(*(torch.from_numpy(f) for f in feeds))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-5)


def test_uint64_ordering_is_refused():
    """uint64 values from 2**63 order otherwise in int64: refused by name, not written."""
    from xconv.errors import UnsupportedAttributeError

    data = {"a": np.array([1, 2**63], np.uint64), "b": np.array([2, 1], np.uint64)}
    proto = _model("Less", data, {}, {}, ["a", "b"], 1)
    with pytest.raises(UnsupportedAttributeError, match="Less of uint64"):
        to_torch_source(ir.from_proto(proto))


@pytest.mark.parametrize(
    ("kwargs", "helper"),
    [
        ({"scale_factor": 2, "mode": "bicubic", "align_corners": False}, False),
        ({"size": (5, 3), "mode": "bilinear", "antialias": True}, True),
        ({"size": (4, 3), "mode": "bicubic", "antialias": True}, True),
        ({"size": (1, 3), "mode": "bilinear", "align_corners": False}, True),
    ],
)
def test_torch_interpolate_round_trips_through_the_torch_source(tmp_path, kwargs, helper):
    """F.interpolate exported to ONNX's Resize comes back as F.interpolate where that is exact,
    else as the generated _resize (antialias, an output axis of one element), matching torch."""
    import xconv
    from tests.torch_source import load_generated

    class Interpolate(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, **kwargs)

    module, x = Interpolate().eval(), torch.randn(2, 3, 8, 9)
    generated, source = load_generated(xconv.from_torch(module, (x,)), tmp_path)
    assert ("_resize(" in source) == helper
    with torch.no_grad():
        np.testing.assert_allclose(generated(x).numpy(), module(x).numpy(), rtol=1e-5, atol=1e-5)


def test_unsqueeze_negative_axis_of_an_unknown_rank():
    """Unsqueeze by -2 of an input whose rank the graph does not give (a Scan body's values):
    torch's negative dim counts from the output's end, as ONNX's does."""
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    axes = onnx.numpy_helper.from_array(i64(-2), "axes")
    graph = h.make_graph([h.make_node("Unsqueeze", ["x", "axes"], ["y"])], "g", [x], [y], [axes])
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", OPSET)])
    data = f32(2, 3, 4)
    source, state = to_torch_source(ir.from_proto(proto))
    assert ".unsqueeze(-2)" in source
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    module = ns["Model"]()
    module.load_state_dict(state)
    (want,) = ReferenceEvaluator(proto).run(None, {"x": data})
    np.testing.assert_array_equal(module(torch.from_numpy(data)).numpy(), want)
