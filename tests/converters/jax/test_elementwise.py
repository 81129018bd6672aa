"""JAX elementwise handlers (math, activations, casts, quantization) against ONNX's reference.

Each table entry is one node built with ``onnx.helper``; the converted function's outputs
must match ``onnx.reference.ReferenceEvaluator`` on the same inputs (dtype and values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv

RNG = np.random.default_rng(0)


def f32(*shape: int, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def i32(*shape: int, lo: int = -20, hi: int = 20) -> np.ndarray:
    return RNG.integers(lo, hi, shape).astype(np.int32)


@dataclass
class OpCase:
    """One node; ``data`` are run-time graph inputs, ``consts`` become initializers."""

    name: str
    op: str
    data: list[np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    consts: list[np.ndarray | None] = field(default_factory=list)
    n_out: int = 1
    opset: int = 23
    rtol: float = 1e-5
    atol: float = 1e-6


def build_model(case: OpCase, out_types: list[int] | None = None) -> onnx.ModelProto:
    inputs, names, inits = [], [], []
    for i, x in enumerate(case.data):
        dtype = helper.np_dtype_to_tensor_dtype(x.dtype)
        inputs.append(helper.make_tensor_value_info(f"x{i}", dtype, x.shape))
        names.append(f"x{i}")
    for i, c in enumerate(case.consts):
        if c is None:
            names.append("")
            continue
        inits.append(numpy_helper.from_array(np.asarray(c), f"c{i}"))
        names.append(f"c{i}")
    outs = [f"y{i}" for i in range(case.n_out)]
    if out_types is None:
        out_info = [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    else:
        out_info = [
            helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, out_types, strict=True)
        ]
    node = helper.make_node(case.op, names, outs, **case.attrs)
    graph = helper.make_graph([node], case.name, inputs, out_info, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])


def reference(case: OpCase) -> list[np.ndarray]:
    model = build_model(case)
    return ReferenceEvaluator(model).run(None, {f"x{i}": x for i, x in enumerate(case.data)})


def convert(case: OpCase, expected: list[np.ndarray]):
    types = [helper.np_dtype_to_tensor_dtype(np.asarray(e).dtype) for e in expected]
    return xconv.to_jax(xconv.load(build_model(case, types)))


def assert_close(actual: Any, expected: Any, rtol: float, atol: float) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    # JAX runs with 64-bit types off: int64 -> int32, float64 -> float32.
    narrow = {np.dtype(np.int64): np.int32, np.dtype(np.float64): np.float32}
    assert actual.dtype == narrow.get(expected.dtype, expected.dtype), (
        actual.dtype,
        expected.dtype,
    )
    assert actual.shape == expected.shape
    if expected.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected)
    else:
        np.testing.assert_allclose(
            actual.astype(np.float64), expected.astype(np.float64), rtol, atol, equal_nan=True
        )


SPECIAL = np.array([-np.inf, -2.5, -0.5, -0.0, 0.0, 0.5, 1.5, 2.5, np.inf, np.nan], np.float32)
UINT8 = RNG.integers(0, 255, (2, 3, 4)).astype(np.uint8)

CASES = [
    # Unary math.
    *[
        OpCase(op.lower(), op, [f32(2, 3, 4)])
        for op in ["Abs", "Neg", "Exp", "Ceil", "Floor", "Sign", "Erf", "Sin", "Cos", "Tan"]
        + ["Atan", "Sinh", "Cosh", "Asinh", "Tanh", "Sigmoid", "Relu", "Softplus", "Softsign"]
        + ["HardSwish", "Mish"]
    ],
    OpCase("sqrt", "Sqrt", [f32(3, 4, lo=0.1)]),
    OpCase("log", "Log", [f32(3, 4, lo=0.1)]),
    OpCase("reciprocal", "Reciprocal", [f32(3, 4, lo=0.5)]),
    OpCase("asin", "Asin", [f32(3, 4, lo=-0.9, hi=0.9)]),
    OpCase("acos", "Acos", [f32(3, 4, lo=-0.9, hi=0.9)]),
    OpCase("acosh", "Acosh", [f32(3, 4, lo=1.1)]),
    OpCase("atanh", "Atanh", [f32(3, 4, lo=-0.9, hi=0.9)]),
    OpCase("round_half_even", "Round", [SPECIAL]),
    OpCase("isnan", "IsNaN", [SPECIAL]),
    OpCase("isinf", "IsInf", [SPECIAL]),
    OpCase("isinf_neg", "IsInf", [SPECIAL], {"detect_positive": 0}),
    OpCase("isinf_pos", "IsInf", [SPECIAL], {"detect_negative": 0}),
    OpCase("not", "Not", [RNG.random((3, 4)) > 0.5]),
    OpCase("bitwise_not", "BitwiseNot", [UINT8]),
    OpCase("abs_int", "Abs", [i32(3, 4)]),
    OpCase("relu_int8", "Relu", [i32(3, 4).astype(np.int8)]),
    # Binary with broadcasting.
    OpCase("add_bcast", "Add", [f32(2, 3, 4), f32(4)]),
    OpCase("sub", "Sub", [f32(2, 3), f32(2, 3)]),
    OpCase("mul_bcast", "Mul", [f32(2, 1, 4), f32(3, 1)]),
    OpCase("div", "Div", [f32(3, 4), f32(3, 4, lo=0.5)]),
    OpCase(
        "div_int_trunc",
        "Div",
        [i32(5, 6), i32(5, 6, lo=1, hi=7) * RNG.choice(np.array([-1, 1], np.int32), (5, 6))],
    ),
    OpCase("div_uint8", "Div", [UINT8, np.full((4,), 7, np.uint8)]),
    OpCase("pow", "Pow", [f32(3, 4, lo=0.1), f32(3, 4)]),
    OpCase("pow_float_int", "Pow", [f32(3, 4), np.array([2, 3, 1, 0], np.int32)]),
    OpCase("pow_int_float", "Pow", [i32(3, 4, lo=0, hi=5), np.array([2.0], np.float32)]),
    OpCase("mod_int", "Mod", [i32(3, 4), np.array([3, -3, 5, -7], np.int32)]),
    OpCase("mod_float_fmod", "Mod", [f32(3, 4), f32(4, lo=0.5)], {"fmod": 1}),
    OpCase("mod_float", "Mod", [f32(3, 4), np.array([1.5, -1.5, 2.0, -0.7], np.float32)]),
    OpCase(
        "bitshift_left",
        "BitShift",
        [UINT8, np.array([1, 2, 9, 0], np.uint8)],
        {"direction": "LEFT"},
    ),
    OpCase(
        "bitshift_right",
        "BitShift",
        [i32(3, 4), np.array([1, 40, -1, 3], np.int32)],
        {"direction": "RIGHT"},
        opset=28,
    ),
    OpCase("bitwise_and", "BitwiseAnd", [UINT8, UINT8[::-1].copy()]),
    OpCase("bitwise_or", "BitwiseOr", [i32(3, 4), i32(4)]),
    OpCase("bitwise_xor", "BitwiseXor", [i32(3, 4), i32(3, 4)]),
    OpCase("and", "And", [RNG.random((3, 4)) > 0.5, RNG.random((4,)) > 0.5]),
    OpCase("or", "Or", [RNG.random((3, 4)) > 0.5, RNG.random((3, 4)) > 0.5]),
    OpCase("xor", "Xor", [RNG.random((3, 4)) > 0.5, RNG.random((3, 4)) > 0.5]),
    *[
        OpCase(op.lower(), op, [i32(3, 4, lo=0, hi=3), i32(4, lo=0, hi=3)])
        for op in ["Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"]
    ],
    OpCase("max", "Max", [f32(3, 4), f32(4), f32(3, 1)]),
    OpCase("min_int", "Min", [i32(3, 4), i32(4)]),
    OpCase("mean", "Mean", [f32(3, 4), f32(4), f32(3, 4)]),
    OpCase("sum_one", "Sum", [f32(3, 4)]),
    OpCase("where", "Where", [RNG.random((3, 4)) > 0.5, f32(3, 4), f32(4)]),
    OpCase("prelu", "PRelu", [f32(2, 3, 4), f32(3, 1)]),
    OpCase("clip", "Clip", [f32(3, 4)], consts=[np.float32(-1), np.float32(1)]),
    OpCase("clip_min_only", "Clip", [f32(3, 4)], consts=[np.float32(0.5)]),
    OpCase("clip_int8_max", "Clip", [i32(3, 4).astype(np.int8)], consts=[None, np.int8(3)]),
    # Activations with attributes.
    OpCase("leaky_relu", "LeakyRelu", [f32(3, 4)], {"alpha": 0.2}),
    OpCase("elu", "Elu", [f32(3, 4)], {"alpha": 0.7}),
    OpCase("selu", "Selu", [f32(3, 4)]),
    OpCase("celu", "Celu", [f32(3, 4)], {"alpha": 2.0}),
    OpCase("hard_sigmoid", "HardSigmoid", [f32(3, 4)], {"alpha": 0.3, "beta": 0.4}),
    OpCase("thresholded_relu", "ThresholdedRelu", [f32(3, 4)], {"alpha": 0.5}),
    OpCase("shrink", "Shrink", [f32(3, 4)], {"bias": 0.3, "lambd": 1.0}),
    OpCase("gelu_none", "Gelu", [f32(3, 4)]),
    OpCase("gelu_tanh", "Gelu", [f32(3, 4)], {"approximate": "tanh"}),
    OpCase("swish", "Swish", [f32(3, 4)], {"alpha": 1.5}, opset=24),
    OpCase("sigmoid_f16", "Sigmoid", [f32(3, 4).astype(np.float16)], rtol=1e-3, atol=1e-3),
    # Casts.
    OpCase("cast_f32_f16", "Cast", [f32(3, 4)], {"to": TensorProto.FLOAT16}, rtol=1e-3),
    OpCase("cast_f32_bf16", "Cast", [f32(3, 4)], {"to": TensorProto.BFLOAT16}),
    OpCase("cast_f32_i32", "Cast", [f32(3, 4)], {"to": TensorProto.INT32}),
    OpCase("cast_f32_bool", "Cast", [SPECIAL], {"to": TensorProto.BOOL}),
    OpCase(
        "cast_f32_e4m3fn", "Cast", [f32(3, 4, lo=-600, hi=600)], {"to": TensorProto.FLOAT8E4M3FN}
    ),
    OpCase(
        "cast_f32_e4m3fn_nosat",
        "Cast",
        [f32(3, 4, lo=-600, hi=600)],
        {"to": TensorProto.FLOAT8E4M3FN, "saturate": 0},
    ),
    OpCase("cast_f32_e5m2", "Cast", [SPECIAL * 30000], {"to": TensorProto.FLOAT8E5M2}),
    OpCase(
        "cast_f32_e8m0",
        "Cast",
        [f32(3, 4, lo=0.01, hi=100)],
        {"to": TensorProto.FLOAT8E8M0},
        opset=24,
    ),
    OpCase(
        "cast_f32_e8m0_nearest",
        "Cast",
        [f32(3, 4, lo=0.01, hi=100)],
        {"to": TensorProto.FLOAT8E8M0, "round_mode": "nearest"},
        opset=24,
    ),
    OpCase(
        "cast_f32_int4", "Cast", [np.arange(-9, 16, dtype=np.float32)], {"to": TensorProto.INT4}
    ),
    OpCase(
        "cast_f32_uint2", "Cast", [np.arange(-3, 4, dtype=np.float32)], {"to": TensorProto.UINT2}
    ),
    OpCase("cast_f32_fp4", "Cast", [f32(3, 4, lo=-8, hi=8)], {"to": TensorProto.FLOAT4E2M1}),
    OpCase(
        "cast_int4_f32",
        "Cast",
        [np.arange(-8, 8).astype(ml_dtypes.int4)],
        {"to": TensorProto.FLOAT},
    ),
    OpCase("castlike", "CastLike", [f32(3, 4)], consts=[np.zeros((1,), np.float16)], rtol=1e-3),
    OpCase("bitcast_f32_i32", "BitCast", [f32(3, 4)], {"to": TensorProto.INT32}, opset=26),
    OpCase(
        "bitcast_bool_u8", "BitCast", [RNG.random((5,)) > 0.5], {"to": TensorProto.UINT8}, opset=26
    ),
    # Quantization.
    OpCase(
        "quantize",
        "QuantizeLinear",
        [f32(2, 3, 4, lo=-20, hi=20)],
        consts=[np.float32(0.1), np.uint8(128)],
    ),
    OpCase(
        "quantize_axis",
        "QuantizeLinear",
        [f32(2, 3, 4)],
        consts=[np.array([0.1, 0.2, 0.05], np.float32), np.array([0, 5, -3], np.int8)],
    ),
    OpCase(
        "quantize_blocked",
        "QuantizeLinear",
        [f32(3, 4)],
        {"axis": 1, "block_size": 2},
        consts=[np.array([[0.1, 0.2]] * 3, np.float32), np.zeros((3, 2), np.int16)],
    ),
    OpCase(
        "quantize_int4",
        "QuantizeLinear",
        [f32(3, 4)],
        {"axis": 0},
        consts=[np.array([0.5, 0.25, 1.0], np.float32), np.zeros(3, ml_dtypes.int4)],
    ),
    OpCase(
        "quantize_e4m3fn",
        "QuantizeLinear",
        [f32(3, 4, lo=-1000, hi=1000)],
        consts=[np.float32(2.0), np.zeros(1, ml_dtypes.float8_e4m3fn)],
    ),
    OpCase(
        "quantize_output_dtype",
        "QuantizeLinear",
        [f32(3, 4)],
        {"output_dtype": TensorProto.INT8},
        consts=[np.float32(0.03)],
    ),
    OpCase(
        "dequantize_axis",
        "DequantizeLinear",
        [UINT8],
        consts=[np.array([0.1, 0.2, 0.3], np.float32), np.array([1, 128, 255], np.uint8)],
    ),
    OpCase(
        "dequantize_blocked",
        "DequantizeLinear",
        [UINT8],
        {"axis": 2, "block_size": 3},
        consts=[RNG.random((2, 3, 2)).astype(np.float32), np.full((2, 3, 2), 7, np.uint8)],
    ),
    OpCase("dynamic_quantize", "DynamicQuantizeLinear", [f32(3, 4)], n_out=3),
    OpCase(
        "matmul_integer",
        "MatMulInteger",
        [UINT8[0], UINT8[1].T.copy()],
        consts=[np.uint8(3), np.uint8(100)],
    ),
    OpCase(
        "qlinear_matmul",
        "QLinearMatMul",
        [
            UINT8[0],
            np.float32(0.02),
            np.uint8(100),
            UINT8[1].T.copy(),
            np.float32(0.01),
            np.uint8(120),
            np.float32(0.1),
            np.uint8(110),
        ],
    ),
    OpCase(
        "conv_integer",
        "ConvInteger",
        [
            RNG.integers(0, 9, (1, 2, 5, 5)).astype(np.uint8),
            RNG.integers(0, 9, (4, 2, 3, 3)).astype(np.uint8),
        ],
        {"pads": [1, 0, 1, 2], "strides": [2, 1]},
        consts=[np.uint8(2)],
    ),
    OpCase(
        "qlinear_conv",
        "QLinearConv",
        [
            RNG.integers(0, 255, (1, 2, 6, 6)).astype(np.uint8),
            np.float32(0.02),
            np.uint8(128),
            RNG.integers(0, 255, (3, 2, 3, 3)).astype(np.uint8),
            np.array([0.01, 0.02, 0.005], np.float32),
            np.array([120, 128, 130], np.uint8),
            np.float32(0.5),
            np.uint8(100),
            np.array([50, -20, 7], np.int32),
        ],
        {"auto_pad": "SAME_UPPER"},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    expected = reference(case)
    fn, params = convert(case, expected)
    actual = fn(params, *(jnp.asarray(x) for x in case.data))
    assert len(actual) == case.n_out
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, case.rtol, case.atol)


def test_string_equal_and_cast_from_string_are_static() -> None:
    words = np.array(["a", "bb", "a"], dtype=object)
    case = OpCase("eq_str", "Equal", [], consts=[words, np.array(["a"], dtype=object)])
    fn, params = convert(case, reference(case))
    (out,) = fn(params)
    np.testing.assert_array_equal(out, [True, False, True])
    nums = OpCase(
        "cast_str",
        "Cast",
        [],
        {"to": TensorProto.FLOAT},
        consts=[np.array(["1.5", "-2", "INF"], dtype=object)],
    )
    expected = reference(nums)
    fn, params = convert(nums, expected)
    np.testing.assert_array_equal(np.asarray(fn(params)[0]), expected[0])


def test_static_int64_shape_arithmetic_keeps_int64() -> None:
    # Constant int64 inputs fold with numpy: exact int64 values even with x64 off.
    big = np.array([2**40 + 7, -(2**40) - 7], np.int64)
    case = OpCase("div_static", "Div", [], consts=[big, np.array([2, -2], np.int64)])
    expected = reference(case)[0]
    fn, params = convert(case, [expected])
    folded = fn.intermediates(params)["y0"]
    assert isinstance(folded, np.ndarray) and folded.dtype == np.int64
    np.testing.assert_array_equal(folded, expected)
    np.testing.assert_array_equal(folded, [2**39 + 3, 2**39 + 3])


def test_jit_and_vmap() -> None:
    cases = [
        c for c in CASES if c.name in ("gelu_none", "mod_int", "quantize_axis", "cast_f32_e8m0")
    ]
    for case in cases:
        expected = reference(case)
        fn, params = convert(case, expected)
        data = [jnp.asarray(x) for x in case.data]
        actual = jax.jit(fn)(params, *data)
        assert_close(actual[0], expected[0], case.rtol, case.atol)
    # vmap over a leading batch axis of a binary op with broadcasting.
    case = CASES[[c.name for c in CASES].index("add_bcast")]
    fn, params = convert(case, reference(case))
    xs = jnp.stack([jnp.asarray(case.data[0])] * 3)
    out = jax.vmap(lambda x: fn(params, x, jnp.asarray(case.data[1]))[0])(xs)
    np.testing.assert_allclose(out[2], case.data[0] + case.data[1], rtol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_grad_matches_its_form(approximate: str) -> None:
    case = OpCase("gelu", "Gelu", [f32(16)], {"approximate": approximate})
    fn, params = convert(case, reference(case))
    x = jnp.asarray(case.data[0])
    grad = jax.grad(lambda v: fn(params, v)[0].sum())(x)
    want = jax.grad(lambda v: jax.nn.gelu(v, approximate=approximate == "tanh").sum())(x)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)
    other = jax.grad(lambda v: jax.nn.gelu(v, approximate=approximate != "tanh").sum())(x)
    # The two forms differ measurably: a mix-up would not pass the check above.
    assert float(jnp.max(jnp.abs(other - want))) > 1e-4


def test_softplus_grad_is_sigmoid() -> None:
    case = OpCase("softplus", "Softplus", [f32(10)])
    fn, params = convert(case, reference(case))
    x = jnp.asarray(case.data[0])
    grad = jax.grad(lambda v: fn(params, v)[0].sum())(x)
    np.testing.assert_allclose(grad, jax.nn.sigmoid(x), rtol=1e-5, atol=1e-6)


def test_unknown_gelu_mode_is_rejected() -> None:
    case = OpCase("gelu_bad", "Gelu", [f32(3)], {"approximate": "sigmoid"})
    model = xconv.load(build_model(case, [TensorProto.FLOAT]))
    fn, params = xconv.to_jax(model)
    with pytest.raises(xconv.ConversionError, match="approximate"):
        fn(params, jnp.asarray(case.data[0]))


def test_legacy_opset6_axis_broadcast() -> None:
    # Opset 6 Add with broadcast=1, axis=1 (B aligned at axis 1): kept at opset 6 because the
    # ONNX version converter rejects it, so the legacy handler runs.
    node = helper.make_node("Add", ["a", "b"], ["c"], broadcast=1, axis=1)
    graph = helper.make_graph(
        [node],
        "legacy",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, 4]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)])
    fn, params = xconv.to_jax(xconv.load(model))
    a, b = f32(2, 3, 4), f32(3)
    np.testing.assert_allclose(fn(params, a, b)[0], a + b[:, None], rtol=1e-6)


def test_exact_gelu_is_the_erf_form() -> None:
    """Exact Gelu as ONNX and torch write it (erf, not jax.nn.gelu's erfc, which XLA:CPU runs
    about 3x slower): within 1e-6 of torch's F.gelu from -12 to 12 (in the negative tail
    1 + erf cancels, in torch's form as in this one; the values there are below 1e-6)."""
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.linspace(-12, 12, 481), [-0.0, 1e-8, -3e-5]]).astype(np.float32)
    case = OpCase("gelu", "Gelu", [x])
    fn, params = convert(case, reference(case))
    jaxpr = str(jax.make_jaxpr(lambda v: fn(params, v))(jnp.asarray(x)))
    assert "erf " in jaxpr and "erfc" not in jaxpr
    got = np.asarray(jax.jit(lambda v: fn(params, v)[0])(jnp.asarray(x)))
    want = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _cast_model(source: int, to: int, n: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=to)],
        "cast",
        [helper.make_tensor_value_info("x", source, [n])],
        [helper.make_tensor_value_info("y", to, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


@pytest.mark.parametrize(
    "to",
    [TensorProto.INT8, TensorProto.INT4, TensorProto.UINT8, TensorProto.INT64, TensorProto.BOOL],
)
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_float4_to_integers_under_jit(to: int) -> None:
    """Each of the 16 float4 codes cast to an integer type as the reference casts it; XLA
    alone turns float4's largest value (±6) into the integer type's extremes."""
    codes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn)
    model = _cast_model(TensorProto.FLOAT4E2M1, to, 16)
    want = ReferenceEvaluator(model).run(None, {"x": codes})[0]
    fn, params = xconv.to_jax(xconv.load(model))
    got = np.asarray(jax.jit(fn)(params, jnp.asarray(codes))[0])
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("source", [np.float32, np.float16])
def test_nan_to_float4_is_the_zero_of_the_opposite_sign(source) -> None:
    """float4 has no NaN: ml_dtypes (the reference) gives +NaN -0 and -NaN +0; XLA gives -0
    to both."""
    bits = {
        np.float32: ([0x7FC00000, 0xFFC00000], np.uint32),
        np.float16: ([0x7E00, 0xFE00], np.uint16),
    }
    x = np.array(bits[source][0], bits[source][1]).view(source)
    model = _cast_model(
        helper.np_dtype_to_tensor_dtype(np.dtype(source)), TensorProto.FLOAT4E2M1, 2
    )
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    fn, params = xconv.to_jax(xconv.load(model))
    got = np.asarray(jax.jit(fn)(params, jnp.asarray(x))[0])
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert got.view(np.uint8).tolist() == [8, 0]
