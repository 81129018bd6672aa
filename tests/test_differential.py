"""``xconv.to_flax`` / ``xconv.to_torch_source`` with example inputs check the generated code
against the IR's runtime (``to_jax`` / ``to_torch``) before returning."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flax")

import xconv  # noqa: E402
from xconv.errors import ParityError  # noqa: E402


@pytest.fixture(scope="module")
def model_and_input():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x = torch.randn(2, 6)
    return xconv.from_torch(net.eval(), (x,)), x.numpy()


def test_agreeing_sources_are_returned(model_and_input, tmp_path):
    model, x = model_and_input
    for api in ("linen", "nnx"):
        out = xconv.to_flax(model, tmp_path / api, api=api, example_inputs=x)
        assert (out / "model.py").exists()
    source, state = xconv.to_torch_source(model, example_inputs=(x,))
    assert "class Model" in source and state


def test_flax_disagreement_names_the_output_and_leaves_nothing(
    model_and_input, tmp_path, monkeypatch
):
    from xconv.converters.jax import interpreter

    model, x = model_and_input
    real = interpreter.to_jax

    def shifted(m):
        fn, params = real(m)
        return (lambda p, *xs: tuple(o + 1e-2 for o in fn(p, *xs))), params

    monkeypatch.setattr(interpreter, "to_jax", shifted)
    out = tmp_path / "flax"
    with pytest.raises(
        ParityError, match=r"generated Flax \(linen\) disagrees with to_jax first at output 0"
    ):
        xconv.to_flax(model, out, example_inputs=x)
    assert not out.exists()


def _runtime_off_by(delta: float, also_float64: bool):
    """``to_jax`` whose float32 outputs are ``delta`` (relative to each output's scale) off,
    and its float64 outputs too where ``also_float64``."""
    from xconv.converters.jax import interpreter

    real = interpreter.to_jax

    def off(m, **kw):
        fn, params = real(m, **kw)

        def shifted(p, *xs):
            outs = fn(p, *xs)
            return tuple(
                o + delta * abs(o).max() if also_float64 or o.dtype == np.float32 else o
                for o in outs
            )

        return shifted, params

    return off


def test_float32_rounding_beyond_the_fixed_bound_passes_within_the_runtimes_own_error(
    model_and_input, tmp_path, monkeypatch
):
    """An output 1e-3 of its scale away from the runtime (beyond the fixed bound) passes when
    the runtime is as far from its own float64 run (as deep convnets round in float32:
    keras InceptionV3's generated Flax and to_jax differ by 1.5e-5 of the logits' scale, past
    the fixed 1e-5, each ~4e-5 from float64), and fails naming the runtime's error when the
    runtime's float64 run is off by as much (the error is then not float32 rounding)."""
    from xconv.converters.jax import interpreter

    model, x = model_and_input
    rounding, mistake = (_runtime_off_by(1e-3, also_float64=f) for f in (False, True))
    monkeypatch.setattr(interpreter, "to_jax", rounding)
    assert (xconv.to_flax(model, tmp_path / "ok", example_inputs=x) / "model.py").exists()
    monkeypatch.setattr(interpreter, "to_jax", mistake)
    with pytest.raises(ParityError, match=r"beyond 4 x to_jax's own float32 error on it, "):
        xconv.to_flax(model, tmp_path / "bad", example_inputs=x)
    assert not (tmp_path / "bad").exists()


def test_torch_source_disagreement_names_the_output(model_and_input, monkeypatch):
    from xconv.converters.torch import emitter

    model, x = model_and_input
    real = emitter.to_torch

    def shifted(m):
        module, state = real(m)
        return (lambda *xs: module(*xs) * 2.0), state

    monkeypatch.setattr(emitter, "to_torch", shifted)
    name = model.graph.outputs[0].name
    with pytest.raises(ParityError, match=f"first at output 0 \\({name!r}\\)"):
        xconv.to_torch_source(model, example_inputs=x)
    source, _ = xconv.to_torch_source(model)  # without inputs: no check, no error
    assert np.asarray(x).shape == (2, 6) and source


@pytest.mark.parametrize(
    ("target", "patch", "message"),
    [
        ("flax", "jax", r"generated Flax \(linen\) disagrees with to_jax first at output 0"),
        ("torch", "torch", r"generated torch source disagrees with to_torch first at output 0"),
    ],
)
def test_convert_checks_the_generated_source_against_the_runtime(
    tmp_path, monkeypatch, target, patch, message
):
    """The CLI's conversion (``pipeline.convert``) runs the same check on its example inputs:
    it passes on an agreeing emitter and stops, writing nothing, on a disagreeing one."""
    from xconv.converters.jax import interpreter
    from xconv.converters.torch import emitter
    from xconv.pipeline import convert

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x = torch.randn(2, 6)
    result = convert(
        net.eval(), source_kind="torch", target=target, out_dir=tmp_path / "ok",
        example_inputs=(x,),
    )  # fmt: skip
    assert result.passed and "differential" in result.timings
    if patch == "jax":
        real = interpreter.to_jax

        def shifted(m):
            fn, params = real(m)
            return (lambda p, *xs: tuple(o + 1e-2 for o in fn(p, *xs))), params

        monkeypatch.setattr(interpreter, "to_jax", shifted)
    else:
        real = emitter.to_torch

        def shifted(m):
            module, state = real(m)
            return (lambda *xs: module(*xs) * 2.0), state

        monkeypatch.setattr(emitter, "to_torch", shifted)
    with pytest.raises(ParityError, match=message):
        convert(
            net.eval(), source_kind="torch", target=target, out_dir=tmp_path / "bad",
            example_inputs=(x,),
        )  # fmt: skip
    assert not (tmp_path / "bad").exists()


def test_float64_runs_of_both_runtimes(model_and_input):
    """The differential's float64 runs: ``to_jax`` and ``to_torch`` of the IR cast to float64
    give float64 outputs within float32 rounding of the float32 runtimes'."""
    from xconv.pipeline.source import jax_float64, torch_float64

    model, x = model_and_input
    fn, params = xconv.to_jax(model)
    want = np.asarray(fn(params, x)[0])
    for run in (jax_float64, torch_float64):
        (got,) = run(model, (x,))
        assert got.dtype == np.float64, run.__name__
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=run.__name__)


def test_an_integer_output_that_disagrees_is_named():
    """Integer outputs compare exactly; a mismatch raises ParityError with its first index
    (it raised UnboundLocalError: the message read a note only float outputs set)."""
    import onnx_ir as ir

    from xconv.pipeline.source import _differential

    x = ir.Value(name="x", shape=ir.Shape([3]), type=ir.TensorType(ir.DataType.UINT8))
    node = ir.node("Identity", [x])
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 21})
    model = ir.Model(graph, ir_version=10)
    got, want = np.array([1, 2, 3], np.uint8), np.array([1, 2, 4], np.uint8)
    with pytest.raises(ParityError, match=r"output 0 \('y'\): 1 of 3 elements, first at index"):
        _differential(model, "generated torch", "to_torch", got, want)
    _differential(model, "generated torch", "to_torch", got, got.copy())


def _identity_model(dtype, shape):
    import onnx_ir as ir

    x = ir.Value(name="x", shape=ir.Shape(shape), type=ir.TensorType(dtype))
    node = ir.node("Identity", [x])
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


def test_string_and_scalar_outputs_are_judged_by_the_parity_judge():
    """The differential goes through ``parity.metrics.compare``: string outputs compare
    exactly (no distance to compute), a 0-d output is one element, and a float output where
    the runtime gives integers is named, not cast."""
    import onnx_ir as ir

    from xconv.pipeline.source import _differential

    strings = _identity_model(ir.DataType.STRING, [2])
    got, want = np.array(["a", "b"], object), np.array(["a", "c"], object)
    with pytest.raises(ParityError, match=r"1 of 2 elements, first at index \(1,\): 'b' vs 'c'"):
        _differential(strings, "generated torch", "to_torch", got, want)
    _differential(strings, "generated torch", "to_torch", got, got.copy())

    scalar = _identity_model(ir.DataType.FLOAT, [])
    with pytest.raises(ParityError, match=r"1 of 1 elements, first at index \(0,\)"):
        _differential(scalar, "generated Flax", "to_jax", np.float32(1.0), np.float32(1.1))
    _differential(scalar, "generated Flax", "to_jax", np.float32(1.0), np.float32(1.00001))

    ints = _identity_model(ir.DataType.INT64, [2])
    with pytest.raises(ParityError, match="a float and a non-float output are never equal"):
        _differential(ints, "generated Flax", "to_jax", np.ones(2, np.float32), np.ones(2, int))


def test_differential_policy_is_reassociations_bound():
    """``differential_policy``: 1e-5 of the output's scale plus 1e-4 of the element, 4 ULPs
    at half precision, widened by 4x the runtime's own error; the bfloat16 pair's bound is
    relative to the element and the scale."""
    from xconv.parity.metrics import compare
    from xconv.parity.policies import differential_policy

    want = np.array([100.0, 1.0, 0.0], np.float32)
    fixed = differential_policy(np.float32, 100.0)
    assert (fixed.rtol, fixed.atol) == (1e-4, pytest.approx(1e-3))
    assert compare("y", want + np.float32([0.0, 0.0, 9e-4]), want, fixed).passed
    assert not compare("y", want + np.float32([0.0, 0.0, 2e-3]), want, fixed).passed
    wide = differential_policy(np.float32, 100.0, noise=1e-3)
    assert compare("y", want + np.float32([0.0, 0.0, 4e-3]), want, wide).passed
    half = differential_policy(np.float16, 1.0)
    assert half.rtol == pytest.approx(4 * float(np.finfo(np.float16).eps))
    bf16 = differential_policy(np.float32, 100.0, bf16=0.01)
    assert (bf16.rtol, bf16.atol) == (0.01, 1.0)
