"""A 1×1 convolution runs as a matmul on the CPU (``formulation`` ``conv``): ``to_jax``'s
channels-last ``Conv`` and the Flax emitter's ``nn.Conv(..., conv_general_dilated=
_pointwise_conv)`` compute the source's numbers (outputs and gradients) with no convolution
left for those kernels, ``"reference"`` keeps every convolution, and a generated module read
back with ``from_flax`` still holds one ``Conv`` per layer."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import xconv  # noqa: E402
from xconv.converters.ops import formulation  # noqa: E402


class _Bottleneck(torch.nn.Module):
    """ResNet's bottleneck shape: a strided 1×1 with a bias, a 1×1 without, a 3×3 between,
    and a strided 1×1 shortcut (3 pointwise kernels, 1 spatial)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce = torch.nn.Conv2d(8, 4, 1, stride=2)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.expand = torch.nn.Conv2d(4, 16, 1, bias=False)
        self.shortcut = torch.nn.Conv2d(8, 16, 1, stride=2, bias=False)

    def forward(self, x):
        h = torch.relu(self.conv(torch.relu(self.reduce(x))))
        return torch.relu(self.expand(h) + self.shortcut(x))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    module = _Bottleneck().eval()
    x = torch.randn(2, 8, 9, 9, generator=torch.Generator().manual_seed(1))
    return module, x, xconv.from_torch(module, x, dynamic_batch=True)


def _convolutions(fn, *args) -> int:
    return len(re.findall(r"stablehlo\.convolution", jax.jit(fn).lower(*args).as_text()))


@pytest.mark.parametrize("layout", ["HWIO", "onnx"])
def test_to_jax_runs_pointwise_kernels_as_matmuls_with_the_same_numbers(net, layout):
    module, x, model = net
    want = module(x).detach().numpy()
    results = {}
    for choice in ("auto", "reference"):
        with formulation.use(conv=choice):
            fn, params = xconv.to_jax(model, kernel_layout=layout)
            weights = {k: v for k, v in params.items()}

            def loss(p, fn=fn):
                return jnp.sum(fn(p, x.numpy())[0] ** 2)

            out = np.asarray(jax.jit(fn)(params, x.numpy())[0])
            grads = jax.jit(jax.grad(loss))(weights)
            results[choice] = (out, grads, _convolutions(fn, params, x.numpy()))
    assert results["auto"][2] == 1  # the 3×3 alone (CPU: this suite's backend)
    assert results["reference"][2] == 4
    for out, _, _ in results.values():
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    flat_auto = jax.tree_util.tree_leaves(results["auto"][1])
    flat_ref = jax.tree_util.tree_leaves(results["reference"][1])
    for a, r in zip(flat_auto, flat_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5)


def _load_generated(out):
    spec = importlib.util.spec_from_file_location(f"gen_{out.name}", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, (out / "model.py").read_text()


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_generated_flax_writes_the_pointwise_helper_and_reads_back_as_conv(net, tmp_path, api):
    module, x, model = net
    want = module(x).detach().numpy()
    out = xconv.to_flax(model, tmp_path / "auto", api=api)
    gen, src = _load_generated(out)
    flat = re.sub(r"\s", "", src)
    assert flat.count("conv_general_dilated=_pointwise_conv") == 3  # not the 3×3
    assert "\ndef _pointwise_conv(lhs, rhs, window_strides, padding, **kwargs):\n" in src
    if api == "linen":
        flax_model, variables = gen.load(out)
        got = flax_model.apply(variables, x.numpy())
        traced = jax.make_jaxpr(lambda v: flax_model.apply(v, x.numpy()))(variables)
    else:
        flax_model, variables = gen.load(out), None
        got = flax_model(x.numpy())
        traced = jax.make_jaxpr(lambda: flax_model(x.numpy()))()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert str(traced).count("conv_general_dilated[") == 1  # on this suite's CPU backend
    # from_flax traces the layers as the convolutions they compute: the IR keeps 4 Conv
    back = xconv.from_flax(flax_model, variables, (x.numpy(),))
    assert sum(n.op_type == "Conv" for n in back.graph) == 4
    assert not any(n.op_type == "MatMul" for n in back.graph)
    fn, params = xconv.to_jax(back)
    np.testing.assert_allclose(np.asarray(fn(params, x.numpy())[0]), want, rtol=1e-5, atol=1e-5)


def test_reference_formulation_writes_plain_nn_conv(net, tmp_path):
    with formulation.use(conv="reference"):
        out = xconv.to_flax(net[2], tmp_path / "ref")
    src = (out / "model.py").read_text()
    assert "_pointwise_conv" not in src
    assert "nn.Conv(16, (1, 1), strides=2, use_bias=False)" in src


def test_the_conv_formulation_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="conv='fast'"), formulation.use(conv="fast"):
        pass
    monkeypatch.setenv("XCONV_JAX_CONV", "lax")
    with pytest.raises(ValueError, match="XCONV_JAX_CONV='lax'"):
        formulation.get("conv")
