"""On the CPU, the Flax emitter gives an ``nn.Dense`` applied to inputs of 3+ axes the module's
``_flat_dot`` (formulation ``dense``): one 2-D matmul over the flattened leading axes. The
generated module computes the source's numbers (outputs and gradients), a dense on 2-D inputs
and every dense under ``"reference"`` stay plain, and a generated module read back with
``from_flax`` holds the same graph as the plain one (one product per layer, no reshapes)."""

from __future__ import annotations

import re
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
def test_generated_dense_on_tokens_is_one_flat_matmul_with_the_source_numbers(net, tmp_path, api):
    module, x, model = net
    out = xconv.to_flax(model, tmp_path / "auto", api=api)
    gen, src = import_generated(out), (out / "model.py").read_text()
    flat = re.sub(r"\s", "", src)
    assert flat.count("dot_general=_flat_dot") == 2, src  # up and down, not the head
    assert "\ndef _flat_dot(lhs, rhs, dimension_numbers, out_sharding=None, **kwargs):\n" in src
    xs = torch.randn(5, 4, 16, generator=torch.Generator().manual_seed(2))  # another batch
    want = module(xs)
    flax_model, variables, got, traced = apply_generated(gen, out, api, xs.numpy())
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-5)
    # on this suite's CPU backend every product is 2-D: the tokens' two over 5 x 4 rows
    assert sorted(_dot_lhs_shapes(traced.jaxpr)) == [(5, 16), (20, 16), (20, 32)]
    if api == "linen":
        # the gradient of the source's loss, through the flat products
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
    # from_flax traces the products as the dense layers they compute: the IR is the plain one's
    back = xconv.from_flax(flax_model, variables, (x.numpy(),))
    with formulation.use(dense="reference"):
        plain_out = xconv.to_flax(model, tmp_path / "plain", api=api)
    plain_gen, plain_src = import_generated(plain_out), (plain_out / "model.py").read_text()
    assert "_flat_dot" not in plain_src
    plain = plain_gen.load(plain_out)
    plain_back = (
        xconv.from_flax(*plain, (x.numpy(),))
        if api == "linen"
        else xconv.from_flax(plain, None, (x.numpy(),))
    )
    assert _ops(back) == _ops(plain_back), (_ops(back), _ops(plain_back))
    fn, params = xconv.to_jax(back)
    np.testing.assert_allclose(
        np.asarray(fn(params, x.numpy())[0]), module(x).detach().numpy(), rtol=1e-5, atol=1e-5
    )


def test_the_dense_formulation_is_validated(monkeypatch):
    monkeypatch.setenv("XCONV_JAX_DENSE", "flat")
    with pytest.raises(ValueError, match="XCONV_JAX_DENSE='flat'"):
        formulation.get("dense")
