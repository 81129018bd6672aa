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
