"""On the CPU, the Flax emitter gives an ``nn.Dense`` applied to inputs of 3+ axes the module's
``_flat_dot`` (formulation ``dense``): one 2-D matmul over the flattened leading axes. The
generated module computes the source's numbers (outputs and gradients), a dense on 2-D inputs
and every dense under ``"reference"`` stay plain, and a generated module read back with
``from_flax`` holds the same graph as the plain one (one product per layer, no reshapes)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import xconv  # noqa: E402
from tests.converters.jax.generated import apply_generated, import_generated  # noqa: E402
from xconv.converters.ops import formulation  # noqa: E402


class _Mlp(torch.nn.Module):
    """Two Linears on (B, T, E) tokens and one on their (B, E) mean."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16, bias=False)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return self.head(h.mean(1))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    module = _Mlp().eval()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    return module, x, xconv.from_torch(module, x, dynamic_batch=True)


def _dot_lhs_shapes(jaxpr) -> list[tuple[int, ...]]:
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            shapes.append(tuple(eqn.invars[0].aval.shape))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                shapes += _dot_lhs_shapes(inner)
    return shapes


def _ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_generated_dense_is_the_plain_layer_under_every_formulation(net, tmp_path, api):
    """The flat-matmul ``dense`` formulation is to_jax's (the runtime's) choice: the generated
    source writes the plain nn.Dense under either setting, with the source's numbers and
    gradients at another batch, and reads back as the dense layers it computes."""
    module, x, model = net
    srcs = {}
    for choice in ("auto", "reference"):
        with formulation.use(dense=choice):
            out = xconv.to_flax(model, tmp_path / choice, api=api)
        srcs[choice] = (out / "model.py").read_text()
    assert srcs["auto"] == srcs["reference"]
    src = srcs["auto"]
    assert "dot_general" not in src and "_flat_dot" not in src, src
    gen = import_generated(out := tmp_path / "auto")
    xs = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(2))  # another batch
    want = module(xs)
    flax_model, variables, got, traced = apply_generated(gen, out, api, xs.numpy())
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-5)
    # the tokens' products contract their (5, 4, in) input as nn.Dense does
    assert sorted(_dot_lhs_shapes(traced.jaxpr)) == [(5, 4, 16), (5, 4, 32), (5, 16)]
    if api == "linen":
        want_loss = 0.5 * (want**2).mean()
        want_loss.backward()
        grads = jax.grad(lambda v: 0.5 * jnp.mean(jnp.square(flax_model.apply(v, xs.numpy()))))(
            variables
        )["params"]
        np.testing.assert_allclose(
            np.asarray(grads["up"]["kernel"]), module.up.weight.grad.numpy().T, rtol=1e-4,
            atol=1e-6,
        )  # fmt: skip
        module.zero_grad()
    back = xconv.from_flax(flax_model, variables, (x.numpy(),))
    assert _ops(back)["MatMul"] + _ops(back)["Gemm"] == 3, _ops(back)
    fn, params = xconv.to_jax(back)
    np.testing.assert_allclose(
        np.asarray(fn(params, x.numpy())[0]), module(x).detach().numpy(), rtol=1e-5, atol=1e-5
    )


def test_the_dense_formulation_is_validated(monkeypatch):
    monkeypatch.setenv("XCONV_JAX_DENSE", "flat")
    with pytest.raises(ValueError, match="XCONV_JAX_DENSE='flat'"):
        formulation.get("dense")
