"""JAX handlers for shape ops: parity with the ONNX reference evaluator, jit and grad."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv
from xconv.errors import StaticValueError

RNG = np.random.default_rng(0)
I64_MAX = np.iinfo(np.int64).max


@dataclass
class OpCase:
    """One node: ``data`` are run-time graph inputs, ``consts`` become Constant nodes."""

    name: str
    op: str
    data: list[np.ndarray]
    consts: list[np.ndarray | None] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    n_out: int = 1
    opset: int = 23
    rtol: float = 1e-5
    atol: float = 1e-6
    # "onnxruntime" where the reference evaluator lacks a feature, or a numpy function.
    oracle: Any = "reference"


def build_model(case: OpCase) -> onnx.ModelProto:
    nodes, inputs, names = [], [], []
    for i, x in enumerate(case.data):
        name = f"x{i}"
        inputs.append(
            helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
        )
        names.append(name)
    for i, c in enumerate(case.consts):
        if c is None:
            names.append("")
            continue
        name = f"c{i}"
        nodes.append(
            helper.make_node(
                "Constant", [], [name], value=numpy_helper.from_array(np.asarray(c), name)
            )
        )
        names.append(name)
    outs = [f"y{i}" for i in range(case.n_out)]
    nodes.append(helper.make_node(case.op, names, outs, **case.attrs))
    graph = helper.make_graph(
        nodes, case.name, inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])


def reference(
    model: onnx.ModelProto, data: list[np.ndarray], oracle: str = "reference"
) -> list[np.ndarray]:
    if callable(oracle):
        return oracle(*data)
    feeds = {value.name: x for value, x in zip(model.graph.input, data, strict=True)}
    if oracle == "onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)
    return ReferenceEvaluator(model).run(None, feeds)


def assert_close(actual: Any, expected: np.ndarray, rtol: float, atol: float) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    # JAX runs with 64-bit types off: int64 -> int32, float64 -> float32.
    canonical = jax.dtypes.canonicalize_dtype(expected.dtype)
    assert actual.dtype == canonical, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol
    )


def run_case(case: OpCase) -> None:
    model = build_model(case)
    expected = reference(model, case.data, case.oracle)
    ir_models = [xconv.load(model)]
    if case.opset < 23:
        # Also at the node's own opset, as when the ONNX version converter cannot upgrade it.
        native = ir.from_proto(model)
        assert native.opset_imports[""] == case.opset
        ir_models.append(native)
    for ir_model in ir_models:
        fn, params = xconv.to_jax(ir_model)
        actual = fn(params, *(jnp.asarray(x) for x in case.data))
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_close(a, e, case.rtol, case.atol)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


X234 = f32(2, 3, 4)
IMG = f32(1, 2, 4, 5)

CASES = [
    OpCase("identity", "Identity", [X234]),
    OpCase(
        "constant_of_shape",
        "ConstantOfShape",
        [],
        [i64(2, 3)],
        {"value": numpy_helper.from_array(np.array([7], np.int32))},
    ),
    OpCase("shape", "Shape", [X234]),
    OpCase("shape_start_end", "Shape", [X234], attrs={"start": -2, "end": 10}),
    OpCase("size", "Size", [X234]),
    OpCase("reshape_zero_minus_one", "Reshape", [X234], [i64(0, -1)]),
    OpCase("reshape_allowzero", "Reshape", [f32(0, 3)], [i64(3, 0)], {"allowzero": 1}),
    OpCase("flatten_axis0", "Flatten", [X234], attrs={"axis": 0}),
    OpCase("flatten_neg", "Flatten", [X234], attrs={"axis": -1}),
    OpCase("squeeze_all", "Squeeze", [f32(1, 3, 1)]),
    OpCase("squeeze_axes_input", "Squeeze", [f32(1, 3, 1)], [i64(-1)]),
    OpCase("squeeze_axes_attr_opset11", "Squeeze", [f32(1, 3, 1)], attrs={"axes": [0]}, opset=11),
    OpCase("unsqueeze_neg", "Unsqueeze", [X234], [i64(-1, 0)]),
    OpCase("unsqueeze_attr_opset11", "Unsqueeze", [X234], attrs={"axes": [1, 4]}, opset=11),
    OpCase("transpose_default", "Transpose", [X234]),
    OpCase("transpose_perm", "Transpose", [X234], attrs={"perm": [1, 2, 0]}),
    # Concat-1's axis defaults to 1; neither oracle runs it.
    OpCase(
        "concat_default_axis_opset1",
        "Concat",
        [X234, f32(2, 3, 4)],
        opset=1,
        oracle=lambda a, b: [np.concatenate([a, b], axis=1)],
    ),
    OpCase("concat_neg_axis", "Concat", [X234, f32(2, 3, 2)], attrs={"axis": -1}),
    OpCase("split_input", "Split", [f32(7, 2)], [i64(3, 4)], n_out=2),
    OpCase("split_num_outputs_uneven", "Split", [f32(7, 2)], attrs={"num_outputs": 3}, n_out=3),
    OpCase("split_attr_opset11", "Split", [f32(6, 2)], attrs={"split": [2, 4]}, n_out=2, opset=11),
    OpCase("split_equal", "Split", [f32(2, 6)], attrs={"axis": 1}, n_out=3),
    OpCase("expand_bidirectional", "Expand", [f32(3, 1)], [i64(2, 1, 4)]),
    OpCase("tile", "Tile", [X234], [i64(2, 1, 3)]),
    # Tile-1: float `tiles` and `axis` inputs; neither oracle runs it.
    OpCase(
        "tile_axis_opset1",
        "Tile",
        [X234],
        [np.float32(3), np.float32(-1)],
        opset=1,
        oracle=lambda x: [np.tile(x, (1, 1, 3))],
    ),
    OpCase("pad_constant_value", "Pad", [X234], [i64(1, 0, 2, 0, 3, 1), np.float32(1.5)]),
    # The reference evaluator rejects negative pads; onnxruntime crops.
    OpCase("pad_negative_crops", "Pad", [X234], [i64(0, -1, 1, 0, 0, -2)], oracle="onnxruntime"),
    OpCase("pad_reflect_axes", "Pad", [X234], [i64(2, 1), None, i64(-1)], {"mode": "reflect"}),
    OpCase("pad_edge", "Pad", [X234], [i64(1, 1, 1, 1, 1, 1)], {"mode": "edge"}),
    OpCase("pad_wrap", "Pad", [X234], [i64(0, 2, 1, 0, 1, 3)], {"mode": "wrap"}),
    OpCase(
        "pad_attr_opset2", "Pad", [X234], attrs={"pads": [0, 1, 0, 0, 1, 0], "value": 2.0}, opset=2
    ),
    OpCase("range_float", "Range", [], [np.float32(1), np.float32(3.1), np.float32(0.3)]),
    OpCase(
        "range_float16_stash_opset27",
        "Range",
        [],
        [np.float16(1000), np.float16(1100), np.float16(7.3)],
        opset=27,
    ),
    OpCase("range_negative_delta", "Range", [], [np.int32(10), np.int32(1), np.int32(-3)]),
    OpCase("eye_like_k", "EyeLike", [f32(3, 5)], attrs={"k": 2}),
    OpCase("eye_like_dtype", "EyeLike", [f32(4, 3)], attrs={"k": -1, "dtype": TensorProto.INT32}),
    OpCase("trilu_upper_k", "Trilu", [X234], [np.int64(1)]),
    OpCase("trilu_lower_neg_k", "Trilu", [X234], [np.int64(-1)], {"upper": 0}),
    OpCase("depth_to_space_dcr", "DepthToSpace", [f32(1, 8, 2, 3)], attrs={"blocksize": 2}),
    OpCase(
        "depth_to_space_crd",
        "DepthToSpace",
        [f32(1, 8, 2, 3)],
        attrs={"blocksize": 2, "mode": "CRD"},
    ),
    OpCase("space_to_depth", "SpaceToDepth", [f32(1, 2, 4, 6)], attrs={"blocksize": 2}),
    OpCase("center_crop_pad", "CenterCropPad", [f32(5, 4, 3)], [i64(3, 7)], {"axes": [0, 1]}),
    OpCase(
        "resize_nearest_scales", "Resize", [IMG], [None, np.array([1, 1, 1.5, 2.0], np.float32)]
    ),
    OpCase(
        "resize_nearest_sizes_ceil_align",
        "Resize",
        [IMG],
        [None, None, i64(1, 2, 7, 3)],
        {"nearest_mode": "ceil", "coordinate_transformation_mode": "align_corners"},
    ),
    OpCase(
        "resize_linear_half_pixel",
        "Resize",
        [IMG],
        [None, np.array([1, 1, 0.6, 1.7], np.float32)],
        {"mode": "linear"},
    ),
    OpCase(
        "resize_linear_antialias_down",
        "Resize",
        [f32(1, 1, 8, 9)],
        [None, np.array([1, 1, 0.5, 0.4], np.float32)],
        {"mode": "linear", "antialias": 1},
    ),
    OpCase(
        "resize_cubic_exclude_outside",
        "Resize",
        [IMG],
        [None, None, i64(1, 2, 9, 3)],
        {"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5},
    ),
    OpCase(
        "resize_cubic_antialias",
        "Resize",
        [f32(1, 1, 9, 8)],
        [None, np.array([1, 1, 0.6, 0.5], np.float32)],
        {"mode": "cubic", "antialias": 1},
    ),
    OpCase(
        "resize_tf_crop_and_resize",
        "Resize",
        [IMG],
        [np.array([0, 0, 0.2, -0.3, 1, 1, 0.9, 1.2], np.float32), None, i64(1, 2, 3, 6)],
        {
            "mode": "linear",
            "coordinate_transformation_mode": "tf_crop_and_resize",
            "extrapolation_value": 9.0,
        },
    ),
    OpCase(
        "resize_axes_not_larger",
        "Resize",
        [IMG],
        [None, None, i64(7, 7)],
        {
            "mode": "linear",
            "axes": [2, 3],
            "keep_aspect_ratio_policy": "not_larger",
            "coordinate_transformation_mode": "pytorch_half_pixel",
        },
    ),
    OpCase(
        "resize_half_pixel_symmetric",
        "Resize",
        [IMG],
        [None, None, i64(1, 2, 3, 8)],
        {"mode": "linear", "coordinate_transformation_mode": "half_pixel_symmetric"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    run_case(case)


def _jitted(model: onnx.ModelProto):
    fn, params = xconv.to_jax(xconv.load(model))
    return jax.jit(lambda *xs: fn(params, *xs)[0])


JIT_CASES = [
    c
    for c in CASES
    if c.op
    in {"Reshape", "Concat", "Transpose", "Pad", "Resize", "Split", "Expand", "Tile", "Unsqueeze"}
]


@pytest.mark.parametrize("case", JIT_CASES, ids=lambda c: c.name)
def test_under_jit(case: OpCase) -> None:
    model = build_model(case)
    expected = reference(model, case.data, case.oracle)[0]
    assert_close(
        _jitted(model)(*(jnp.asarray(x) for x in case.data)), expected, case.rtol, case.atol
    )


def test_shape_arithmetic_stays_static_under_jit() -> None:
    # Shape -> Gather -> Concat -> Reshape, as exporters write a flatten.
    x = f32(2, 3, 4)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Constant", [], ["i0"], value=numpy_helper.from_array(i64(0))),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Constant", [], ["m1"], value=numpy_helper.from_array(i64(-1))),
        helper.make_node("Concat", ["n", "m1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "flatten",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_value_info("y", onnx.TypeProto())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    y = _jitted(model)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), x.reshape(2, 12))


def test_runtime_shape_under_jit_is_a_clear_error() -> None:
    case = OpCase("reshape_runtime_shape", "Reshape", [X234, i64(4, 6)])
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    with pytest.raises(StaticValueError, match="shape"):
        jax.jit(lambda x, s: fn(params, x, s))(jnp.asarray(X234), jnp.asarray([4, 6]))


def jacobian_from_reference(case: OpCase) -> np.ndarray:
    """The op is affine in its first input: column i of its Jacobian is f(e_i) - f(0)."""
    model = build_model(case)
    x, rest = case.data[0], case.data[1:]

    def f(v: np.ndarray) -> np.ndarray:
        out = reference(model, [v.reshape(x.shape), *rest], case.oracle)[0]
        return np.asarray(out, np.float64).ravel()

    base = f(np.zeros(x.size, x.dtype))
    return np.stack([f(np.eye(1, x.size, i, dtype=x.dtype)[0]) - base for i in range(x.size)], 1)


GRAD_CASES = [
    c
    for c in CASES
    if c.name
    in {
        "reshape_zero_minus_one",
        "concat_neg_axis",
        "transpose_perm",
        "pad_constant_value",
        "pad_reflect_axes",
        "pad_wrap",
        "resize_linear_half_pixel",
        "resize_cubic_exclude_outside",
        "resize_nearest_scales",
        "resize_tf_crop_and_resize",
        "depth_to_space_crd",
        "resize_linear_antialias_down",
        "split_input",
        "tile",
    }
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
def test_grad_matches_reference_jacobian(case: OpCase) -> None:
    model = build_model(case)
    fn, params = xconv.to_jax(xconv.load(model))
    jac = jacobian_from_reference(case)
    cot = RNG.standard_normal(jac.shape[0]).astype(np.float32)
    rest = [jnp.asarray(v) for v in case.data[1:]]

    def loss(x):
        return jnp.sum(fn(params, x, *rest)[0].ravel() * cot)

    g = jax.jit(jax.grad(loss))(jnp.asarray(case.data[0]))
    np.testing.assert_allclose(np.asarray(g).ravel(), jac.T @ cot, rtol=1e-4, atol=1e-5)


def test_constant_attribute_kinds() -> None:
    for attrs, expected in [
        ({"value_float": 2.5}, np.float32(2.5)),
        ({"value_ints": [1, 2]}, i64(1, 2)),
        ({"value_int": -3}, np.int64(-3)),
        ({"value_floats": [1.0, 0.5]}, np.array([1.0, 0.5], np.float32)),
    ]:
        graph = helper.make_graph(
            [helper.make_node("Constant", [], ["y"], **attrs)],
            "c",
            [],
            [helper.make_value_info("y", onnx.TypeProto())],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
        fn, params = xconv.to_jax(xconv.load(model))
        assert_close(fn(params)[0], expected, 0, 0)


def test_resize_scales_initializer_under_jit_with_traced_params() -> None:
    # A float initializer used only as Resize's scales is a constant, not a weight, so it
    # stays static under jit.
    x = f32(1, 1, 3, 4)
    scales = numpy_helper.from_array(np.array([1, 1, 2, 0.5], np.float32), "scales")
    graph = helper.make_graph(
        [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")],
        "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_value_info("y", onnx.TypeProto())],
        [scales],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    fn, params = xconv.to_jax(xconv.load(model))
    assert "scales" not in params
    y = jax.jit(fn)(params, jnp.asarray(x))[0]
    assert_close(y, reference(model, [x])[0], 1e-5, 1e-6)


@pytest.mark.parametrize(
    "name", ["resize_cubic_exclude_outside", "pad_reflect_axes", "depth_to_space_crd", "tile"]
)
def test_vmap_matches_per_example(name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    batch = np.stack([case.data[0], 2 * case.data[0] + 1])
    y = jax.vmap(lambda x: fn(params, x)[0])(jnp.asarray(batch))
    model = build_model(case)
    for i in range(2):
        assert_close(y[i], reference(model, [batch[i]], case.oracle)[0], 1e-5, 1e-5)


def tf_half_pixel_resize(opset: int = 19) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """Resize nearest with opset 11's ``tf_half_pixel_for_nn`` coordinates (tf2onnx writes
    them for Keras' ``Resizing(interpolation="nearest")``; the reference evaluator refuses
    them, onnxruntime reads them): ``(model, x, expected)``, ``expected[i] = x[floor((i +
    0.5) / scale)]`` per axis."""
    from onnx import TensorProto as T
    from onnx import helper as h

    node = h.make_node(
        "Resize", ["x", "", "", "sizes"], ["y"], mode="nearest",
        coordinate_transformation_mode="tf_half_pixel_for_nn", nearest_mode="floor",
    )  # fmt: skip
    graph = h.make_graph(
        [node], "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 3, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [h.make_tensor("sizes", T.INT64, [4], [1, 2, 7, 9])],
    )  # fmt: skip
    x = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    rows = np.floor((np.arange(7) + 0.5) / (7 / 3)).astype(int)
    cols = np.floor((np.arange(9) + 0.5) / (9 / 4)).astype(int)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    return model, x, x[:, :, rows][:, :, :, cols]


def test_resize_tf_half_pixel_for_nn(tmp_path):
    from tests.converters.jax.generated import run_generated

    proto, x, want = tf_half_pixel_resize()
    model = xconv.load(proto)
    fn, params = xconv.to_jax(model)
    np.testing.assert_array_equal(np.asarray(fn(params, x)[0]), want)
    out = xconv.to_flax(model, tmp_path / "flax", example_inputs=x)
    got, _ = run_generated(out, "linen", x)
    np.testing.assert_array_equal(np.asarray(got), want)
