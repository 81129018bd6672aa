"""float8e8m0 and float4e2m1 in both source emitters: each form written with the public writers
(``xconv.to_flax``, linen and nnx; ``write_torch``), run, and compared bit for bit with the
ONNX reference and the emitter's runtime (``to_jax`` / ``to_torch``); a torch source's
state_dict is to_torch's (a float4 or e8m0 weight of one loads into the other)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.converters.torch.source.write import write_torch  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _model(nodes, inputs, outputs, inits=(), opset=24) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _reference(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return [np.asarray(o) for o in ReferenceEvaluator(proto).run(None, feeds)]


def _flax_outputs(model, inputs, tmp_path, api: str) -> tuple[list[np.ndarray], str]:
    """``xconv.to_flax`` of ``model`` (checked against ``to_jax`` on ``inputs``), loaded and
    run: its outputs and its source."""
    out = xconv.to_flax(model, tmp_path / f"flax_{api}", api=api, example_inputs=inputs)
    assert not ruff_findings(out / "model.py"), ruff_findings(out / "model.py")
    loaded = _load_generated(out / "model.py").load(out)
    if api == "linen":
        module, variables = loaded
        got = module.apply(variables, *inputs)
    else:
        got = loaded(*inputs)
    got = got if isinstance(got, tuple) else (got,)
    return [np.asarray(g) for g in got], (out / "model.py").read_text()


def _torch_inputs(inputs):
    from xconv.converters.torch.runtime.dtypes import to_tensor

    return tuple(to_tensor(np.asarray(x)) for x in inputs)


def _torch_outputs(model, inputs, tmp_path) -> tuple[list, str, object]:
    """``write_torch`` of ``model``, loaded from its folder and run on ``inputs`` (as the torch
    runtime holds them): its outputs (torch tensors), its source and the loaded module."""
    out = write_torch(model, tmp_path / "torch")
    assert not ruff_findings(out / "model.py"), ruff_findings(out / "model.py")
    module = _load_generated(out / "model.py").load(out)
    with torch.no_grad():
        got = module(*_torch_inputs(inputs))
    got = got if isinstance(got, tuple) else (got,)
    return list(got), (out / "model.py").read_text(), module


def _runtime_outputs(model, inputs):
    """``to_jax``'s and ``to_torch``'s outputs on ``inputs``, and to_torch's module."""
    fn, params = xconv.to_jax(model)
    jax_out = fn(params, *inputs)
    jax_out = [np.asarray(o) for o in (jax_out if isinstance(jax_out, tuple) else (jax_out,))]
    module, _ = xconv.to_torch(model)
    with torch.no_grad():
        torch_out = module(*_torch_inputs(inputs))
    torch_out = list(torch_out) if isinstance(torch_out, tuple | list) else [torch_out]
    return jax_out, torch_out, module


def _bits(x) -> np.ndarray:
    """The bytes of a one-byte-a-value array (numpy / ml_dtypes, jax or torch)."""
    if isinstance(x, torch.Tensor):
        return x.view(torch.uint8).numpy()
    return np.asarray(x).view(np.uint8)


def _values(x) -> np.ndarray:
    """An output's values in float64 (a float4 torch tensor read through its codes)."""
    if isinstance(x, torch.Tensor):
        from xconv.converters.torch.runtime.dtypes import to_numpy

        return to_numpy(x).astype(np.float64)
    return np.asarray(x).astype(np.float64)


# ---------------------------------------------------------------- float8e8m0

#: float32 values where the three roundings differ: exact powers of two, ties and near-ties of
#: the exponent's mantissa, subnormals, the largest exponent (which rounds up to NaN unless
#: saturating), infinities, NaN, zeros and negatives (e8m0 has no sign).
_E8M0_INPUT = np.array(
    [0.0, -0.0, 1.0, 1.5, 1.25, 1.75, 3.0, 0.75, -2.5, 1e-40, 3e-39, 5.9e-39, 1.5 * 2.0**-126]
    + [2.0**127, 1.5 * 2.0**127, float(np.finfo(np.float32).max), np.inf, -np.inf, np.nan],
    np.float32,
)


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("op", ["Cast", "CastLike"])
def test_cast_to_e8m0_rounds_as_the_reference(op, saturate, round_mode, tmp_path):
    """A Cast / CastLike to float8e8m0 is the generated ``_to_e8m0`` helper in both sources:
    every rounding mode, saturating or not, gives the reference's and the runtimes' bytes."""
    x = _E8M0_INPUT
    attrs = {"saturate": saturate, "round_mode": round_mode}
    if op == "Cast":
        node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0, **attrs)
        inits = []
    else:
        node = helper.make_node("CastLike", ["x", "like"], ["y"], **attrs)
        like = np.ones(1, np.float32).astype(ml_dtypes.float8_e8m0fnu)
        inits = [numpy_helper.from_array(like, "like")]
    io = (
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT8E8M0, None)],
    )
    proto = _model([node], *io, inits)
    # (the reference's CastLike takes no round_mode: its Cast gives the values)
    cast = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0, **attrs)
    (want,) = _reference(_model([cast], *io), {"x": x})
    model = xconv.load(proto)
    jax_out, torch_out, _ = _runtime_outputs(model, (x,))
    np.testing.assert_array_equal(_bits(jax_out[0]), _bits(want))
    np.testing.assert_array_equal(_bits(torch_out[0]), _bits(want))
    for api in ("linen", "nnx"):
        got, text = _flax_outputs(model, (x,), tmp_path, api)
        assert "def _to_e8m0(" in text and "jnp.float8_e8m0fnu" in text
        np.testing.assert_array_equal(_bits(got[0]), _bits(want))
    got, text, _ = _torch_outputs(model, (x,), tmp_path)
    assert "def _to_e8m0(" in text
    assert got[0].dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(_bits(got[0]), _bits(want))


def test_e8m0_weight_read_as_float_in_both_sources(tmp_path):
    """A float8e8m0 initializer (every code, NaN's included, as a weight) cast to float32 and
    float16: both sources hold it in the type (``jnp.float8_e8m0fnu``, a
    ``torch.float8_e8m0fnu`` buffer), and the written torch module loads to_torch's state_dict."""
    w = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    nodes = [
        helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "wf"], ["y"]),
        helper.make_node("Cast", ["w"], ["y16"], to=TensorProto.FLOAT16),
    ]
    proto = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y16", TensorProto.FLOAT16, None),
        ],
        [numpy_helper.from_array(w, "w")],
    )
    x = np.linspace(-2, 2, 256, dtype=np.float32)
    want = _reference(proto, {"x": x})
    model = xconv.load(proto)
    jax_out, _, runtime = _runtime_outputs(model, (x,))
    tiny = float(np.finfo(np.float32).tiny)  # XLA:CPU flushes the subnormal products to 0
    for api in ("linen", "nnx"):
        got, text = _flax_outputs(model, (x,), tmp_path, api)
        assert "jnp.float8_e8m0fnu" in text
        for g, j, w_ in zip(got, jax_out, want, strict=True):
            np.testing.assert_array_equal(g, j)
            np.testing.assert_allclose(g, w_, rtol=0, atol=tiny)
    got, text, written = _torch_outputs(model, (x,), tmp_path)
    assert "dtype=torch.float8_e8m0fnu" in text
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.numpy(), w_)
    state = runtime.state_dict()
    assert state["w"].dtype == torch.float8_e8m0fnu
    written.load_state_dict(state)
    with torch.no_grad():
        again = written(*_torch_inputs((x,)))
    np.testing.assert_array_equal(again[0].numpy(), want[0])


# ---------------------------------------------------------------- float4e2m1

_FLOAT4 = ml_dtypes.float4_e2m1fn

#: Every float4 midpoint (ties go to the even code), values near them, saturation past 6,
#: infinities, NaN (to the zero of the opposite sign), signed zeros and a dense sweep.
_FLOAT4_INPUT = np.concatenate(
    [
        np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, np.inf, np.nan]),
        np.nextafter(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]), np.float32(0)),
        np.nextafter(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]), np.float32(9)),
        np.linspace(0, 8, 161),
    ]
)
_FLOAT4_INPUT = np.concatenate([_FLOAT4_INPUT, -_FLOAT4_INPUT, [0.0, -0.0, -np.nan]])

#: The 16 float4e2m1 codes, each once.
_FLOAT4_CODES = np.arange(16, dtype=np.uint8).view(_FLOAT4)


def _both_sources(proto, inputs, tmp_path, flax: bool = True):
    """``proto``'s outputs from the ONNX reference, to_torch, the written torch package and
    (``flax``) the written Flax linen and nnx modules; asserts the torch source gives the
    reference's values (float4: codes) and to_torch's, each Flax source to_jax's; returns
    (reference, to_torch module, written torch module, torch source)."""
    names = [
        i.name for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}
    ]
    want = _reference(proto, dict(zip(names, inputs, strict=True)))
    model = xconv.load(proto)
    jax_out, torch_out, runtime = _runtime_outputs(model, inputs)
    got, text, written = _torch_outputs(model, inputs, tmp_path)
    for g, t, w in zip(got, torch_out, want, strict=True):
        assert g.dtype == t.dtype
        if w.dtype == _FLOAT4:
            np.testing.assert_array_equal(_bits(g), _bits(t))
            np.testing.assert_array_equal(_bits(g), _bits(w))
        else:
            np.testing.assert_array_equal(_values(g), _values(t))
            np.testing.assert_allclose(_values(g), w.astype(np.float64), rtol=1e-6)
    for api in ("linen", "nnx") if flax else ():
        flax_out, _ = _flax_outputs(model, inputs, tmp_path, api)
        for g, j in zip(flax_out, jax_out, strict=True):
            np.testing.assert_array_equal(
                _bits(g) if g.itemsize == 1 else g, _bits(j) if j.itemsize == 1 else j
            )
    return want, runtime, written, text


@pytest.mark.parametrize("source", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE])
@pytest.mark.parametrize("op", ["Cast", "CastLike"])
def test_cast_to_float4_rounds_as_ml_dtypes(op, source, tmp_path):
    """A Cast / CastLike to float4e2m1 is the generated ``_to_float4`` in the torch source: the
    reference's codes (ml_dtypes' rounding) for every midpoint, neighbour, overflow and NaN,
    held one a byte in ``torch.float4_e2m1fn_x2`` as to_torch holds them."""
    np_type = helper.tensor_dtype_to_np_dtype(source)
    x = _FLOAT4_INPUT.astype(np_type)
    if op == "Cast":
        node, inits = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT4E2M1), []
    else:
        node = helper.make_node("CastLike", ["x", "like"], ["y"])
        inits = [numpy_helper.from_array(np.ones(2, np.float32).astype(_FLOAT4), "like")]
    proto = _model(
        [node],
        [helper.make_tensor_value_info("x", source, [x.size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT4E2M1, None)],
        inits,
    )
    _, _, _, text = _both_sources(proto, (x,), tmp_path)
    assert "def _to_float4(" in text and "float4_e2m1fn_x2" in text


_FROM_FLOAT4 = [
    TensorProto.FLOAT,
    TensorProto.FLOAT16,
    TensorProto.DOUBLE,
    TensorProto.INT8,
    TensorProto.INT4,
    TensorProto.FLOAT8E4M3FN,
    TensorProto.FLOAT4E2M1,
]


@pytest.mark.parametrize(
    "to", _FROM_FLOAT4, ids=[TensorProto.DataType.Name(t) for t in _FROM_FLOAT4]
)
def test_cast_from_float4_reads_the_values(to, tmp_path):
    """A Cast from float4e2m1 (every code, as a graph input) reads its values with the
    generated ``_float4_values``: the reference's numbers in each target type."""
    proto = _model(
        [helper.make_node("Cast", ["x"], ["y"], to=to)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT4E2M1, [16])],
        [helper.make_tensor_value_info("y", to, None)],
    )
    _, _, _, text = _both_sources(proto, (_FLOAT4_CODES,), tmp_path)
    assert "def _float4_values(" in text


@pytest.mark.parametrize(
    ("axis", "block_size", "zero_point"),
    [(1, 0, False), (1, 0, True), (0, 0, True), (1, 4, False), (0, 2, True)],
)
def test_quantize_and_dequantize_float4(axis, block_size, zero_point, tmp_path):
    """QuantizeLinear to float4e2m1 (``_quantize_float4``: x / scale plus the zero point's value,
    rounded by ``_to_float4``) and DequantizeLinear of the result, per tensor, per axis and
    blocked: the reference's codes and values."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 8)) * 4).astype(np.float32)
    if block_size:
        shape = (4, 8 // block_size) if axis == 1 else (4 // block_size, 8)
    else:
        shape = (x.shape[axis],) if zero_point or axis == 0 else ()
    scale = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    inits = [numpy_helper.from_array(scale, "scale")]
    q_inputs = ["x", "scale"]
    if zero_point:  # float4's zero point is added on quantize, ignored on dequantize
        zp = rng.choice([0.0, 0.5, -1.0], shape).astype(_FLOAT4)
        inits.append(numpy_helper.from_array(zp, "zp"))
        q_inputs.append("zp")
    attrs = {"axis": axis, **({"block_size": block_size} if block_size else {})}
    q_attrs = attrs if zero_point else {**attrs, "output_dtype": TensorProto.FLOAT4E2M1}
    nodes = [
        helper.make_node("QuantizeLinear", q_inputs, ["q"], **q_attrs),
        helper.make_node("DequantizeLinear", ["q", "scale"], ["y"], **attrs),
    ]
    proto = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT4E2M1, None),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
        ],
        inits,
    )
    _, _, _, text = _both_sources(proto, (x,), tmp_path)
    assert "_quantize_float4(" in text and "_dequantize_linear(_float4_values(" in text


def test_float4_layout_ops_move_the_codes(tmp_path):
    """float4e2m1 through the ops ONNX passes it through: torch's views (Transpose, Reshape,
    Flatten, Unsqueeze, Squeeze, Identity) on the type itself, Pad and ConstantOfShape on its
    codes as uint8 viewed back, a float4 constant rounded from its float32 literal."""
    w = np.arange(96, dtype=np.uint8).reshape(8, 12).__mod__(16).view(_FLOAT4)
    pad_value = np.array(-1.5, np.float32).astype(_FLOAT4)
    fill = helper.make_tensor("fill", TensorProto.FLOAT4E2M1, [1], vals=[3.0])
    nodes = [
        helper.make_node("Transpose", ["w"], ["t"], perm=[1, 0]),
        helper.make_node("Reshape", ["t", "shape"], ["r"]),
        helper.make_node("Pad", ["r", "pads", "pad_value"], ["p"]),
        helper.make_node("Pad", ["r", "pads"], ["e"], mode="edge"),
        helper.make_node("Flatten", ["p"], ["f"], axis=1),
        helper.make_node("Unsqueeze", ["f", "axes"], ["u"]),
        helper.make_node("Squeeze", ["u", "axes"], ["s"]),
        helper.make_node("Cast", ["s"], ["y"], to=TensorProto.FLOAT),
        helper.make_node("Identity", ["e"], ["edge"]),
        helper.make_node("ConstantOfShape", ["shape"], ["c"], value=fill),
        helper.make_node("Cast", ["c"], ["cf"], to=TensorProto.FLOAT),
    ]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array([3, 4, 8], np.int64), "shape"),
        numpy_helper.from_array(np.array([0, 1, 0, 0, 1, 2], np.int64), "pads"),
        numpy_helper.from_array(pad_value, "pad_value"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
    ]
    proto = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("edge", TensorProto.FLOAT4E2M1, None),
            helper.make_tensor_value_info("cf", TensorProto.FLOAT, None),
        ],
        inits,
    )
    proto.graph.node.append(helper.make_node("Identity", ["x"], ["unused"]))
    want, runtime, written, text = _both_sources(
        proto, (np.zeros(1, np.float32),), tmp_path, flax=False
    )
    assert "view(torch.uint8)" in text and ".view(torch.float4_e2m1fn_x2)" in text
    assert want[0].shape == (3, 60)


def test_fp4_weight_only_matmul_matches_to_torch_and_loads_its_state_dict(tmp_path):
    """An FP4 weight-only MatMul (a float4e2m1 weight, block-scaled DequantizeLinear, MatMul)
    through to_torch_source: its numbers are to_torch's and the reference's, the float4 weight
    is a ``torch.float4_e2m1fn_x2`` buffer under to_torch's key, and to_torch's state_dict
    (another weight) loads into the written module."""
    rng = np.random.default_rng(1)
    k, n, block = 64, 32, 16
    w = (rng.standard_normal((k, n)) * 3).astype(_FLOAT4)
    scale = rng.uniform(0.01, 0.1, (k // block, n)).astype(np.float32)
    nodes = [
        helper.make_node("DequantizeLinear", ["w", "scale"], ["wf"], axis=0, block_size=block),
        helper.make_node("MatMul", ["x", "wf"], ["y"]),
    ]
    proto = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(scale, "scale")],
        opset=23,
    )
    x = rng.standard_normal((4, k)).astype(np.float32)
    model = xconv.load(proto)
    source, state = xconv.to_torch_source(model, example_inputs=(x,))
    runtime, _ = xconv.to_torch(model)
    theirs = runtime.state_dict()
    assert state["w"].dtype == theirs["w"].dtype == torch.float4_e2m1fn_x2
    assert torch.equal(state["w"].view(torch.uint8), theirs["w"].view(torch.uint8))
    assert "_dequantize_linear(_float4_values(self.w)" in source
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    written = ns["Model"]().eval()
    other = (rng.standard_normal((k, n)) * 3).astype(_FLOAT4)
    from xconv.converters.torch.runtime.dtypes import to_tensor

    theirs = {**theirs, "w": to_tensor(other)}
    written.load_state_dict(theirs)
    runtime.load_state_dict(theirs)
    (want,) = _reference(
        _model(
            nodes,
            *_io(proto),
            [numpy_helper.from_array(other, "w"), numpy_helper.from_array(scale, "scale")],
            opset=23,
        ),
        {"x": x},
    )
    with torch.no_grad():
        got, ref = written(torch.from_numpy(x)), runtime(torch.from_numpy(x))
    np.testing.assert_array_equal(got.numpy(), ref.numpy())
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def _io(proto):
    return list(proto.graph.input), list(proto.graph.output)


def test_bit_cast_of_float4_refused_by_name(tmp_path):
    """BitCast from float4e2m1 is refused by name before anything is written."""
    proto = _model(
        [helper.make_node("BitCast", ["x"], ["y"], to=TensorProto.UINT4)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT4E2M1, [16])],
        [helper.make_tensor_value_info("y", TensorProto.UINT4, None)],
        opset=26,
    )
    with pytest.raises(xconv.errors.ConversionError, match="BitCast of float4e2m1"):
        write_torch(xconv.load(proto), tmp_path / "out")
    assert not (tmp_path / "out").exists()
