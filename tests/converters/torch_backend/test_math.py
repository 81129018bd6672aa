"""Torch backend elementwise / math handlers against ONNX's reference evaluator.

Each table entry is one node built with ``onnx.helper``; ``xconv.to_torch``'s outputs must
match ``onnx.reference.ReferenceEvaluator`` on the same inputs (dtype and values).
Differentiable ops are also checked with ``torch.autograd.gradcheck`` in float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv
from xconv.converters.torch.runtime.dtypes import to_tensor
from xconv.errors import UnsupportedAttributeError

RNG = np.random.default_rng(0)


def f32(*shape: int, lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def ints(*shape: int, lo: int = -20, hi: int = 20, dtype=np.int32) -> np.ndarray:
    return RNG.integers(lo, hi, shape).astype(dtype)


@dataclass
class OpCase:
    """One node; ``data`` are run-time inputs (None: omitted), ``consts`` map an input
    position to an initializer (axes, k, ...)."""

    name: str
    op: str
    data: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    consts: dict[int, np.ndarray] = field(default_factory=dict)
    n_out: int = 1
    opset: int = 23
    rtol: float = 1e-5
    atol: float = 1e-6


def build_model(case: OpCase) -> onnx.ModelProto:
    inputs, names, inits = [], [], []
    n = len(case.data) + len(case.consts)
    data = iter(enumerate(case.data))
    for pos in range(n):
        if pos in case.consts:
            inits.append(numpy_helper.from_array(np.asarray(case.consts[pos]), f"c{pos}"))
            names.append(f"c{pos}")
            continue
        i, x = next(data)
        if x is None:
            names.append("")
            continue
        dtype = helper.np_dtype_to_tensor_dtype(x.dtype)
        inputs.append(helper.make_tensor_value_info(f"x{i}", dtype, x.shape))
        names.append(f"x{i}")
    outs = [f"y{i}" for i in range(case.n_out)]
    out_info = [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    node = helper.make_node(case.op, names, outs, **case.attrs)
    graph = helper.make_graph([node], case.name, inputs, out_info, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])


def feeds(case: OpCase) -> dict[str, np.ndarray]:
    return {f"x{i}": x for i, x in enumerate(case.data) if x is not None}


def run_case(case: OpCase) -> tuple[list[np.ndarray], list[Any]]:
    """(reference outputs, torch outputs) for one case."""
    model = build_model(case)
    expected = ReferenceEvaluator(model).run(None, feeds(case))
    module, _ = xconv.to_torch(xconv.load(model))
    args = [to_tensor(x) for x in feeds(case).values()]  # strings stay numpy
    with torch.no_grad():
        out = module(*args)
    got = list(out) if isinstance(out, tuple) else [out]
    return expected, got


def check_case(case: OpCase) -> None:
    expected, got = run_case(case)
    assert len(got) >= len(expected)
    for e, a in zip(expected, got, strict=False):
        e = np.asarray(e)
        a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
        assert a.shape == e.shape, (a.shape, e.shape)
        if e.dtype.kind in "OSU":
            assert a.astype(str).tolist() == e.astype(str).tolist()
        else:
            assert a.dtype == e.dtype, (a.dtype, e.dtype)
            np.testing.assert_allclose(a, e, rtol=case.rtol, atol=case.atol)


def grad_check(case: OpCase) -> None:
    """gradcheck of the converted module in float64 on the case's float inputs."""
    data = [None if x is None else x.astype(np.float64) for x in case.data]
    case = OpCase(case.name, case.op, data, case.attrs, case.consts, 1, case.opset)
    module, _ = xconv.to_torch(xconv.load(build_model(case)))
    args = tuple(
        torch.from_numpy(x).requires_grad_(True) for x in data if x is not None
    )  # every input differentiable
    assert torch.autograd.gradcheck(lambda *a: module(*a), args, eps=1e-6, atol=1e-5)


X = f32(3, 4)
POS = f32(3, 4, lo=0.1, hi=3.0)
UNIT = f32(3, 4, lo=-0.9, hi=0.9)
A, B = ints(3, 4), ints(3, 4, lo=1, hi=9)
BOOLS = RNG.integers(0, 2, (2, 5)).astype(bool), RNG.integers(0, 2, (2, 5)).astype(bool)

UNARY = [
    ("Abs", X),
    ("Neg", A),
    ("Reciprocal", POS),
    ("Sqrt", POS),
    ("Exp", X),
    ("Log", POS),
    ("Ceil", X),
    ("Floor", X),
    ("Round", np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4], np.float32)),
    ("Sign", X),
    ("Erf", X),
    ("Sin", X),
    ("Cos", X),
    ("Tan", UNIT),
    ("Asin", UNIT),
    ("Acos", UNIT),
    ("Atan", X),
    ("Sinh", X),
    ("Cosh", X),
    ("Asinh", X),
    ("Acosh", POS + 1),
    ("Atanh", UNIT),
    ("IsNaN", np.array([1.0, np.nan, np.inf], np.float32)),
    ("Not", BOOLS[0]),
    ("BitwiseNot", ints(3, 4, lo=0, hi=200, dtype=np.uint8)),
    ("BitwiseNot", ints(3, 4, lo=0, hi=10**6, dtype=np.uint32)),
    ("Relu", X),
    ("Sigmoid", X),
    ("Tanh", X),
    ("Softplus", X),
    ("Softsign", X),
    ("HardSwish", X),
    ("Mish", X),
]

CASES = [OpCase(f"{op}_{x.dtype}", op, [x]) for op, x in UNARY] + [
    OpCase("add_f32", "Add", [X, f32(4)]),
    OpCase("add_u32", "Add", [ints(5, lo=0, hi=10**9, dtype=np.uint32)] * 2),
    OpCase("add_u64", "Add", [ints(5, lo=0, hi=10**9, dtype=np.uint64)] * 2),
    OpCase("sub_i64", "Sub", [A.astype(np.int64), B.astype(np.int64)]),
    OpCase("mul_f16", "Mul", [X.astype(np.float16), X.astype(np.float16)], rtol=1e-3),
    OpCase("div_f32", "Div", [X, POS]),
    OpCase("div_int_trunc", "Div", [A, B]),
    OpCase("div_int_negative", "Div", [A, -B]),
    OpCase("pow_f32", "Pow", [POS, X]),
    OpCase("pow_int_float_exp", "Pow", [B, np.full((3, 4), 2.0, np.float32)]),
    OpCase("pow_int", "Pow", [B.astype(np.int64), np.full((3, 4), 3, np.int64)]),
    OpCase("and", "And", list(BOOLS)),
    OpCase("or", "Or", list(BOOLS)),
    OpCase("xor", "Xor", list(BOOLS)),
    OpCase("equal", "Equal", [A, A[::-1].copy()]),
    OpCase("equal_strings", "Equal", [np.array(["a", "b"]), np.array(["a", "c"])]),
    OpCase("greater", "Greater", [X, X.T[:3, :3].mean() * np.ones((3, 4), np.float32)]),
    OpCase("less_or_equal", "LessOrEqual", [A, B]),
    OpCase("bitwise_and_u16", "BitwiseAnd", [ints(6, lo=0, hi=60000, dtype=np.uint16)] * 2),
    OpCase("bitwise_xor", "BitwiseXor", [A, B]),
    OpCase("mod", "Mod", [A, B]),
    OpCase("mod_negative_divisor", "Mod", [A, -B]),
    OpCase("fmod_float", "Mod", [X, POS], attrs={"fmod": 1}),
    OpCase("fmod_int", "Mod", [A, -B], attrs={"fmod": 1}),
    OpCase("mod_inf", "Mod", [np.array([3.0, -3.0], np.float32), np.full(2, np.inf, np.float32)]),
    *[
        OpCase(
            f"bitshift_{d}_{t.__name__}",
            "BitShift",
            [ints(6, lo=0, hi=100, dtype=t), ints(6, lo=0, hi=3, dtype=t)],
            attrs={"direction": d},
        )
        for d in ("LEFT", "RIGHT")
        for t in (np.uint8, np.uint16, np.uint32, np.uint64)
    ],
    OpCase("max", "Max", [X, f32(4), f32(1, 4)]),
    OpCase("min_u32", "Min", [ints(4, lo=0, hi=99, dtype=np.uint32)] * 2),
    OpCase("sum", "Sum", [X, X, f32(4)]),
    OpCase("mean", "Mean", [X, f32(4)]),
    OpCase("where", "Where", [BOOLS[0], f32(2, 5), f32(1, 5)]),
    OpCase("where_strings", "Where", [BOOLS[0][0], np.array(["a"] * 5), np.array(["b"] * 5)]),
    OpCase(
        "isinf_neg",
        "IsInf",
        [np.array([1, -np.inf, np.inf], np.float32)],
        attrs={"detect_positive": 0},
    ),  # fmt: skip
    OpCase("leaky_relu", "LeakyRelu", [X], attrs={"alpha": 0.2}),
    OpCase("elu", "Elu", [X], attrs={"alpha": 0.5}),
    OpCase("selu", "Selu", [X]),
    OpCase("celu", "Celu", [X], attrs={"alpha": 2.0}),
    OpCase("hard_sigmoid", "HardSigmoid", [X], attrs={"alpha": 0.3, "beta": 0.4}),
    OpCase("thresholded_relu", "ThresholdedRelu", [X], attrs={"alpha": 0.5}),
    OpCase("shrink_int", "Shrink", [ints(6, dtype=np.int8)], attrs={"lambd": 1.5, "bias": 1.0}),
    OpCase("swish", "Swish", [X], attrs={"alpha": 0.7}, opset=24),
    OpCase("gelu_exact", "Gelu", [X]),
    OpCase("gelu_tanh", "Gelu", [X], attrs={"approximate": "tanh"}),
    OpCase("prelu", "PRelu", [f32(2, 3, 4), f32(3, 1)]),
    OpCase("prelu_legacy_channel", "PRelu", [f32(2, 3, 4), f32(3)], opset=6),
    OpCase("clip", "Clip", [X], consts={1: np.float32(-1.0), 2: np.float32(1.0)}),
    OpCase("clip_int_max_only", "Clip", [A, None], consts={2: np.int32(5)}),
    OpCase("clip_legacy", "Clip", [X], attrs={"min": -0.5, "max": 0.5}, opset=6),
    OpCase("cast_f32_f16", "Cast", [X], attrs={"to": TensorProto.FLOAT16}, rtol=1e-3),
    OpCase("cast_f32_i8", "Cast", [X * 10], attrs={"to": TensorProto.INT8}),
    OpCase(
        "cast_i64_u32",
        "Cast",
        [ints(5, lo=0, hi=99, dtype=np.int64)],
        attrs={"to": TensorProto.UINT32},
    ),  # fmt: skip
    OpCase(
        "cast_f32_str",
        "Cast",
        [np.array([1.5, -2.0], np.float32)],
        attrs={"to": TensorProto.STRING},
    ),  # fmt: skip
    OpCase(
        "cast_str_f32", "Cast", [np.array(["1.5", "-2", "1e-3"])], attrs={"to": TensorProto.FLOAT}
    ),  # fmt: skip
    OpCase("cast_like", "CastLike", [X, np.zeros(1, np.float64)]),
    OpCase("bitcast_f32_i32", "BitCast", [X], attrs={"to": TensorProto.INT32}, opset=26),
    OpCase("quantize_u8", "QuantizeLinear", [X, np.float32(0.05), np.uint8(128)]),
    OpCase(
        "quantize_per_axis_i8",
        "QuantizeLinear",
        [f32(2, 3), f32(3, lo=0.1, hi=1), None],
        attrs={"axis": 1},
    ),  # fmt: skip
    OpCase(
        "dequantize_u8",
        "DequantizeLinear",
        [ints(3, 4, lo=0, hi=255, dtype=np.uint8), np.float32(0.1), np.uint8(100)],
    ),  # fmt: skip
    OpCase("dynamic_quantize", "DynamicQuantizeLinear", [X], n_out=3),
    OpCase(
        "matmul_integer",
        "MatMulInteger",
        [
            ints(3, 4, lo=0, hi=255, dtype=np.uint8),
            ints(4, 2, lo=0, hi=255, dtype=np.uint8),
            np.uint8(12),
            np.uint8(7),
        ],
    ),  # fmt: skip
    OpCase(
        "qlinear_matmul",
        "QLinearMatMul",
        [
            ints(2, 4, lo=0, hi=255, dtype=np.uint8),
            np.float32(0.02),
            np.uint8(113),
            ints(4, 3, lo=0, hi=255, dtype=np.uint8),
            np.float32(0.003),
            np.uint8(114),
            np.float32(0.1),
            np.uint8(118),
        ],
    ),  # fmt: skip
    OpCase(
        "conv_integer_pads",
        "ConvInteger",
        [
            ints(1, 1, 4, 4, lo=0, hi=20, dtype=np.uint8),
            ints(1, 1, 2, 2, lo=0, hi=5, dtype=np.uint8),
            np.uint8(1),
        ],
        attrs={"pads": [1, 0, 0, 1]},
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    check_case(case)


@pytest.mark.parametrize(
    "op,attrs",
    [("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("Elu", {}), ("Mish", {}), ("Erf", {})],
)
def test_gradients(op: str, attrs: dict[str, Any]) -> None:
    grad_check(OpCase(op, op, [f32(2, 3)], attrs=attrs))


def test_binary_gradients() -> None:
    grad_check(OpCase("pow", "Pow", [f32(2, 3, lo=0.5, hi=2), f32(3)]))
    grad_check(OpCase("div", "Div", [f32(2, 3), f32(2, 3, lo=0.5, hi=2)]))


def test_gelu_unknown_approximation_rejected() -> None:
    case = OpCase("gelu_bad", "Gelu", [X], attrs={"approximate": "sigmoid"})
    with pytest.raises(UnsupportedAttributeError, match="approximate"):
        run_case(case)
