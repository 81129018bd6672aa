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
