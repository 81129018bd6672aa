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
