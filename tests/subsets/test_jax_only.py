"""A JAX-only install (``pip install -e ".[jax]"``, no torch) runs its directions."""

from __future__ import annotations

import importlib
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

import xconv
from xconv.cli import main
from xconv.demo import build_demo_model
from xconv.errors import MissingFrameworkError


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.Conv(4, (3, 3))(x))
        y = nn.LayerNorm()(y)
        return jax.nn.softmax(nn.Dense(5)(y.reshape((y.shape[0], -1))))


@pytest.fixture(scope="module")
def net_and_ir():
    net = _Net()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 6, 3))
    variables = net.init(jax.random.PRNGKey(1), x)
    return net, variables, x, xconv.from_flax(net, variables, (x,))


def test_torch_is_not_importable():
    with pytest.raises(ImportError):
        importlib.import_module("torch")


def test_from_flax_to_jax_matches_the_source(net_and_ir):
    net, variables, x, model = net_and_ir
    fn, params = xconv.to_jax(model)
    (got,) = jax.jit(fn)(params, x)
    np.testing.assert_allclose(got, net.apply(variables, x), rtol=1e-5, atol=1e-6)


def test_from_jax_to_jax_matches_the_source():
    def fn(params, x):
        return jnp.tanh(x @ params["w"] + params["b"]).sum(-1)

    params = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3),
              "b": np.array([0.1, -0.2, 0.3], np.float32)}  # fmt: skip
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    run, run_params = xconv.to_jax(xconv.from_jax(fn, params, (x,)))
    np.testing.assert_allclose(run(run_params, x)[0], fn(params, x), rtol=1e-5, atol=1e-6)


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(nn.gelu(nn.Dense(8)(x)))
        return jax.nn.softmax(nn.Dense(5)(y))


def test_to_flax_source_matches_the_source(tmp_path):
    net = _Mlp()
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 6))
    variables = net.init(jax.random.PRNGKey(1), x)
    out = xconv.to_flax(xconv.from_flax(net, variables, (x,)), tmp_path / "flax")
    sys.path.insert(0, str(out))
    try:
        generated = importlib.import_module("model")
        module, loaded = generated.load()
    finally:
        sys.path.remove(str(out))
        sys.modules.pop("model", None)
    assert "torch" not in (out / "model.py").read_text()
    np.testing.assert_allclose(
        module.apply(loaded, x), net.apply(variables, x), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("command", ["onnx-to-flax", "onnx-to-jax"])
def test_cli_onnx_to_jax_and_flax(tmp_path, command):
    """``pip install "xconv[jax]"`` completes the default conversions, parity included (the
    reference is the .onnx file on onnxruntime, which the extra installs)."""
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, [command, str(path), "-o", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "parity.json").read_text())
    assert (out / "model.py").is_file() and report["passed"] is True
    assert "onnxruntime" in report["reference"]


def test_missing_torch_is_the_not_installed_error(net_and_ir, tmp_path):
    with pytest.raises(MissingFrameworkError, match=r"xconv\[torch\]"):
        xconv.to_torch(net_and_ir[3])
    # The library calls that import the framework inside the call, not at attribute access.
    with pytest.raises(MissingFrameworkError, match=r"xconv\[torch\]"):
        xconv.to_torch_source(net_and_ir[3])
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    with pytest.raises(MissingFrameworkError, match=r"xconv\[torch\]"):
        xconv.convert(path, source_kind="onnx", target="torch", out_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()
    r = CliRunner().invoke(main, ["onnx-to-torch", str(path), "-o", str(tmp_path / "t")])
    assert r.exit_code == MissingFrameworkError.exit_code == 7, r.output
    assert "xconv[torch]" in r.output and "Traceback" not in r.output


def make_net():
    """``flax-to-onnx``'s ``--module`` factory: the Flax module and its example input."""
    return _Net(), (jnp.linspace(-1, 1, 108, dtype=jnp.float32).reshape(1, 6, 6, 3),)


def make_fn():
    """``jax-to-onnx``'s ``--module`` factory: ``(fn, params, example_inputs)``."""

    def fn(params, x):
        return jnp.tanh(x @ params["w"] + params["b"])

    params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(4, 3),
              "b": jnp.array([0.1, -0.2, 0.3], jnp.float32)}  # fmt: skip
    return fn, params, (jnp.arange(8, dtype=jnp.float32).reshape(2, 4) / 8,)


@pytest.mark.parametrize(
    ("command", "factory"), [("flax-to-onnx", make_net), ("jax-to-onnx", make_fn)]
)
def test_cli_flax_and_jax_to_onnx(tmp_path, command, factory):
    """The README's extras table: ``xconv[jax]`` runs flax-to-onnx and jax-to-onnx, parity
    included (the candidate .onnx on onnxruntime)."""
    from flax import serialization

    made = factory()
    if command == "flax-to-onnx":
        module, inputs = made
        tree = module.init(jax.random.PRNGKey(0), *inputs)
    else:
        tree = made[1]
    weights = tmp_path / "weights.msgpack"
    weights.write_bytes(serialization.to_bytes(tree))
    out = tmp_path / "out"
    spec = f"{__file__}:{factory.__name__}"
    r = CliRunner().invoke(main, [command, str(weights), "--module", spec, "-o", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "parity.json").read_text())
    assert (out / "model.onnx").is_file() and report["passed"] is True
    assert "onnxruntime" in report["candidate"] + report["reference"]
