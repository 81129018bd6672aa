"""The ONNX types numpy lacks on the torch runtime: int4, uint4, int2 and uint2, held one value
per byte in torch's own sub-byte dtypes (``torch.int4`` ...) and computed in the byte type,
float4e2m1 (one code per byte in ``torch.float4_e2m1fn_x2``), and bfloat16 weights; every case compared with the ONNX reference (and onnxruntime for a
block-quantized int4 MatMul)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import xconv

torch = pytest.importorskip("torch")

from xconv.converters.torch.runtime.dtypes import to_numpy, to_tensor  # noqa: E402

SUB_BYTE = {
    TensorProto.INT4: (ml_dtypes.int4, torch.int4),
    TensorProto.UINT4: (ml_dtypes.uint4, torch.uint4),
    TensorProto.INT2: (ml_dtypes.int2, torch.int2),
    TensorProto.UINT2: (ml_dtypes.uint2, torch.uint2),
}


def _model(nodes, inputs, outputs, initializers=(), opset=23) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, *xs: np.ndarray) -> list[np.ndarray]:
    module, _ = xconv.to_torch(xconv.load(model))
    out = module(*(to_tensor(x) for x in xs))
    return [to_numpy(o) for o in (out if isinstance(out, tuple) else (out,))]


def _reference(model: onnx.ModelProto, *xs: np.ndarray) -> list[np.ndarray]:
    names = [i.name for i in model.graph.input]
    return ReferenceEvaluator(model).run(None, dict(zip(names, xs, strict=True)))


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


@pytest.mark.parametrize("to", sorted(SUB_BYTE))
@pytest.mark.parametrize("source", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32])
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_cast_to_and_from_sub_byte_types_is_the_reference(to, source):
    rng = np.random.default_rng(to * 7 + source)
    values = rng.uniform(-12, 12, size=(3, 5, 4))
    if source == TensorProto.INT32:
        x = np.rint(values * 20).astype(np.int32)  # far out of range: the cast wraps
    else:
        x = values.astype(helper.tensor_dtype_to_np_dtype(source))
        x.reshape(-1)[:3] = [np.nan, 0.99, -0.99]
    there = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=to), helper.make_node("Cast", ["y"], ["z"], to=source)],
        [helper.make_tensor_value_info("x", source, x.shape)],
        [helper.make_tensor_value_info("y", to, x.shape), helper.make_tensor_value_info("z", source, x.shape)],
    )  # fmt: skip
    got, want = _run(there, x), _reference(there, x)
    assert got[0].dtype == SUB_BYTE[to][0]
    for g, w in zip(got, want, strict=True):
        _same(g, w)


@pytest.mark.parametrize("to", sorted(SUB_BYTE))
def test_castlike_takes_the_sub_byte_type_of_its_target(to):
    x = np.linspace(-9, 9, 24, dtype=np.float32).reshape(4, 6)
    like = np.zeros((1,), SUB_BYTE[to][0])
    model = _model(
        [helper.make_node("CastLike", ["x", "like"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
         helper.make_tensor_value_info("like", to, like.shape)],
        [helper.make_tensor_value_info("y", to, x.shape)],
    )  # fmt: skip
    _same(_run(model, x, like)[0], _reference(model, x, like)[0])


def test_sub_byte_tensors_pass_through_layout_ops():
    """Reshape, Transpose, Gather, Concat and Slice move int4 values without computing."""
    x = np.arange(-6, 6).reshape(3, 4).astype(ml_dtypes.int4)
    init = [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 6]),
            helper.make_tensor("idx", TensorProto.INT64, [2], [2, 0]),
            helper.make_tensor("start", TensorProto.INT64, [1], [1]),
            helper.make_tensor("end", TensorProto.INT64, [1], [5])]  # fmt: skip
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
        helper.make_node("Reshape", ["t"], ["r"]),
        helper.make_node("Gather", ["x", "idx"], ["g"], axis=0),
        helper.make_node("Concat", ["g", "x"], ["c"], axis=0),
        helper.make_node("Slice", ["c", "start", "end"], ["y"]),
    ]
    nodes[1].input.append("shape")
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.INT4, x.shape)],
        [helper.make_tensor_value_info("r", TensorProto.INT4, None),
         helper.make_tensor_value_info("y", TensorProto.INT4, None)],
        init,
    )  # fmt: skip
    for got, want in zip(_run(model, x), _reference(model, x), strict=True):
        _same(got, want)


@pytest.mark.parametrize("to", sorted(SUB_BYTE))
def test_quantize_and_dequantize_sub_byte_types_per_block(to):
    """QuantizeLinear into int4/int2 with a block scale and zero point, and back."""
    rng = np.random.default_rng(to)
    x = rng.normal(size=(4, 8)).astype(np.float32) * 3
    scale = rng.uniform(0.2, 0.8, size=(4, 2)).astype(np.float32)
    np_type = SUB_BYTE[to][0]
    lo = int(ml_dtypes.iinfo(np_type).min)
    zp = np.full((4, 2), lo + 1, np_type)
    model = _model(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=1, block_size=4),
         helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=1, block_size=4)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("q", to, x.shape),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)],
        [onnx.numpy_helper.from_array(scale, "s"), onnx.numpy_helper.from_array(zp, "zp")],
    )  # fmt: skip
    got, want = _run(model, x), _reference(model, x)
    _same(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_int4_weight_only_matmul_is_onnxruntime():
    """A block-quantized int4 weight (the weight-only quantization of language models),
    dequantized and multiplied: torch's output and its gradient through x."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    w = rng.integers(-8, 8, size=(32, 16)).astype(ml_dtypes.int4)
    scale = rng.uniform(0.01, 0.1, size=(2, 16)).astype(np.float32)
    zp = rng.integers(-2, 3, size=(2, 16)).astype(ml_dtypes.int4)
    model = _model(
        [helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["wf"], axis=0, block_size=16),
         helper.make_node("MatMul", ["x", "wf"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])],
        [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(scale, "s"),
         onnx.numpy_helper.from_array(zp, "zp")],
        opset=21,
    )  # fmt: skip
    x = rng.normal(size=(3, 32)).astype(np.float32)
    # Without its optimizations: onnxruntime fuses the pair into MatMulNBits, which may
    # quantize x too.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model.SerializeToString(), options).run(None, {"x": x})[0]
    module, _ = xconv.to_torch(xconv.load(model))
    xt = torch.from_numpy(x).requires_grad_()
    y = module(xt)
    np.testing.assert_allclose(y.detach().numpy(), want, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    dense = (w.astype(np.float32) - np.repeat(zp, 16, 0).astype(np.float32)) * np.repeat(
        scale, 16, 0
    )
    np.testing.assert_allclose(xt.grad.numpy(), np.tile(dense.sum(1), (3, 1)), rtol=1e-5)


#: float4e2m1's edge values: NaN of each sign, infinities, ties between neighbours (to the
#: even code), past the largest value (6), the smallest magnitudes and -0.
FLOAT4_EDGES = [np.nan, -np.nan, np.inf, -np.inf, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0,
                5.01, 6.0, 6.5, 1e30, 1e-9, -0.0, -0.26, 2.4999]  # fmt: skip


@pytest.mark.parametrize("source", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_cast_to_and_from_float4_is_the_reference(source):
    """float4e2m1 held one value per byte in torch's float4_e2m1fn_x2: the codes ml_dtypes
    (and the ONNX reference) round to, and their values back."""
    rng = np.random.default_rng(source)
    values = np.concatenate([FLOAT4_EDGES, rng.uniform(-8, 8, size=40)])
    x = values.astype(helper.tensor_dtype_to_np_dtype(source))
    model = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT4E2M1),
         helper.make_node("Cast", ["y"], ["z"], to=source)],
        [helper.make_tensor_value_info("x", source, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT4E2M1, x.shape),
         helper.make_tensor_value_info("z", source, x.shape)],
    )  # fmt: skip
    got, want = _run(model, x), _reference(model, x)
    assert got[0].dtype == ml_dtypes.float4_e2m1fn
    np.testing.assert_array_equal(got[0].view(np.uint8), want[0].view(np.uint8))  # -0 too
    _same(got[1], want[1])


def test_float16_nans_round_to_float4_by_their_sign():
    """A NaN becomes the zero of the opposite sign; float16 NaNs keep their sign bit here
    (torch's float16 -> float32 conversion drops it for some)."""
    x = np.array([0xFE00, 0x7E00, 0xFC01, 0x7C01, 0xFFFF], np.uint16).view(np.float16)
    model = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT4E2M1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT4E2M1, x.shape)],
    )
    got, want = _run(model, x)[0], _reference(model, x)[0]
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_float4_tensors_pass_through_layout_ops():
    """Transpose, Concat and Slice move float4 codes; Cast and DequantizeLinear read their
    values; the graph output keeps the type."""
    x = np.array([-6, -3, -1, -0.5, 0, 0.5, 1.5, 2, 3, 4, 6, -0.0]).reshape(3, 4)
    x = x.astype(ml_dtypes.float4_e2m1fn)
    init = [helper.make_tensor("start", TensorProto.INT64, [1], [1]),
            helper.make_tensor("end", TensorProto.INT64, [1], [6]),
            onnx.numpy_helper.from_array(np.array([0.5, 2.0, -1.0], np.float32), "s")]  # fmt: skip
    model = _model(
        [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
         helper.make_node("Concat", ["t", "t"], ["c"], axis=0),
         helper.make_node("Slice", ["c", "start", "end"], ["y"]),
         helper.make_node("Cast", ["y"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("DequantizeLinear", ["y", "s"], ["d"], axis=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT4E2M1, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT4E2M1, None),
         helper.make_tensor_value_info("f", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("d", TensorProto.FLOAT, None)],
        init,
    )  # fmt: skip
    got, want = _run(model, x), _reference(model, x)
    np.testing.assert_array_equal(got[0].view(np.uint8), want[0].view(np.uint8))
    for g, w in zip(got, want, strict=True):
        _same(g, w)


def test_quantize_to_float4_per_axis_is_the_reference():
    """QuantizeLinear into float4e2m1 with a per-channel scale rounds x / scale as a cast
    does (saturating at 6), and DequantizeLinear multiplies back."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 16)).astype(np.float32) * 5
    x[2, 0] = 100.0
    scale = np.array([0.5, 1.0, 2.0], np.float32)
    zp = np.zeros(3, ml_dtypes.float4_e2m1fn)
    model = _model(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=0),
         helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=0)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, x.shape),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)],
        [onnx.numpy_helper.from_array(scale, "s"), onnx.numpy_helper.from_array(zp, "zp")],
    )  # fmt: skip
    got, want = _run(model, x), _reference(model, x)
    np.testing.assert_array_equal(got[0].view(np.uint8), want[0].view(np.uint8))
    np.testing.assert_array_equal(got[1], want[1])
    assert got[1][2, 0] == 12.0  # 100 / 2 saturates at 6


def test_float4_weight_only_matmul_is_the_reference():
    """A block-scaled float4 weight (FP4 weight-only quantization) stays float4 in the
    state_dict (one code per byte) and multiplies as the reference dequantizes it; the
    gradient reaches x."""
    rng = np.random.default_rng(1)
    w = rng.uniform(-6, 6, size=(32, 16)).astype(ml_dtypes.float4_e2m1fn)
    scale = rng.uniform(0.01, 0.1, size=(2, 16)).astype(np.float32)
    model = _model(
        [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], axis=0, block_size=16),
         helper.make_node("MatMul", ["x", "wf"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])],
        [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(scale, "s")],
    )  # fmt: skip
    x = rng.normal(size=(3, 32)).astype(np.float32)
    module, state = xconv.to_torch(xconv.load(model))
    assert state["w"].dtype == torch.float4_e2m1fn_x2 and tuple(state["w"].shape) == (32, 16)
    np.testing.assert_array_equal(to_numpy(state["w"]).view(np.uint8), w.view(np.uint8))
    xt = torch.from_numpy(x).requires_grad_()
    y = module(xt)
    np.testing.assert_allclose(y.detach().numpy(), _reference(model, x)[0], rtol=1e-6, atol=1e-6)
    y.sum().backward()
    dense = w.astype(np.float32) * np.repeat(scale, 16, 0)
    np.testing.assert_allclose(xt.grad.numpy(), np.tile(dense.sum(1), (3, 1)), rtol=1e-5)


def test_bfloat16_weights_are_parameters():
    """A bfloat16 initializer becomes a bfloat16 parameter (numpy has no bfloat16)."""
    w = (np.arange(12).reshape(4, 3) / 7).astype(ml_dtypes.bfloat16)
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 3])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    module, state = xconv.to_torch(xconv.load(model))
    assert state["w"].dtype == torch.bfloat16
    x = np.linspace(-1, 1, 8).reshape(2, 4).astype(ml_dtypes.bfloat16)
    got = to_numpy(module(to_tensor(x)))
    want = _reference(model, x)[0]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2)
