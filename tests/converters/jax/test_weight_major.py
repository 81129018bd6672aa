"""On the CPU, ``to_jax`` computes a float32 product with a torch ``Linear``'s ``(out, in)``
weight (``MatMul(x, Transpose(w))``) over few rows (2-64, or up to 128 where ``in >= 2·out``)
weight-major, as ``(w @ x.T).T`` (formulation ``dense``,
:func:`xconv.converters.jax.kernel.weight_major`). The function computes the source's
numbers, outputs and gradients, at row counts on each side of the limits. One row (a decode
step) is a product against the stored weight (:func:`~xconv.converters.jax.kernel.row_product`);
more rows, a matrix multiplied as stored, bfloat16 and ``dense="reference"`` keep ``x @ w.T``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import xconv  # noqa: E402
from xconv.converters.jax.kernel import one_row, weight_major  # noqa: E402
from xconv.converters.ops import formulation  # noqa: E402

#: A weight-major product's dimension numbers: the transposed weight contracted on its axis 0
#: against the rows' last axis.
_WEIGHT_MAJOR = (((0,), (1,)), ((), ()))
#: A one-row product's: the (B, T, in) rows' last axis against the stored weight's axis 1.
_ROW = (((2,), (1,)), ((), ()))


class _Net(torch.nn.Module):
    """On (B, T, 16) tokens: ``up`` 16 -> 48 (in < out), ``down`` 48 -> 16 (in >= 2·out), a
    (16, 16) matrix multiplied as stored (no ``Transpose`` in the graph); ``head`` 16 -> 5 on
    the (B, 16) mean."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 48)
        self.down = torch.nn.Linear(48, 16)
        self.mix = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        h = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return self.head((h @ self.mix).mean(1))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    module = _Net().eval()
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    return module, xconv.from_torch(module, x, dynamic_batch=True)


def _weight_major_dots(jaxpr, numbers=_WEIGHT_MAJOR) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            count += eqn.params["dimension_numbers"] == numbers
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                count += _weight_major_dots(inner, numbers)
    return count


# (batch, tokens) -> (weight-major, one-row) products: up (in < out) at 2-64 rows, down
# (in >= 2·out) at 2-128 rows, both one-row at one row; never the stored (16, 16) matrix (no
# Transpose), nor the head (a Gemm, its weight stored (in, out) by to_jax).
CASES = {
    (2, 3): (2, 0),  # 6 token rows: up, down
    (4, 16): (2, 0),  # 64 token rows: up, down
    (4, 25): (1, 0),  # 100 token rows: down only
    (1, 128): (1, 0),  # 128 token rows: down only
    (3, 50): (0, 0),  # 150 token rows: neither
    (1, 1): (0, 2),  # one row: up and down against the stored weights
}


@pytest.mark.parametrize("shape", list(CASES), ids=lambda s: f"{s[0]}x{s[1]}")
def test_weight_major_products_compute_the_source_numbers_and_gradients(net, shape):
    module, model = net
    x = torch.randn(*shape, 16, generator=torch.Generator().manual_seed(2))
    fn, params = xconv.to_jax(model)
    jaxpr = jax.make_jaxpr(lambda p, v: fn(p, v)[0])(params, x.numpy())
    assert (_weight_major_dots(jaxpr.jaxpr), _weight_major_dots(jaxpr.jaxpr, _ROW)) == CASES[shape]

    want = module(x)
    got = np.asarray(fn(params, x.numpy())[0])
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-5)

    # the SGD step's gradient, through the weight-major products, against torch's
    module.zero_grad()
    (0.5 * (want**2).mean()).backward()
    grads = jax.grad(lambda p: 0.5 * jnp.mean(jnp.square(fn(p, x.numpy())[0])))(params)
    for name, param in module.named_parameters():
        got_grad = grads
        for part in name.split("."):
            got_grad = got_grad[part]
        stored = np.argsort(fn.kernel_perms.get(name, range(param.ndim)))  # back to torch's
        np.testing.assert_allclose(
            np.transpose(np.asarray(got_grad), stored), param.grad.numpy(), rtol=1e-4,
            atol=1e-6, err_msg=name,
        )  # fmt: skip
    module.zero_grad()


def test_reference_and_bfloat16_keep_the_plain_product(net):
    _, model = net
    x = np.random.default_rng(3).standard_normal((2, 3, 16)).astype(np.float32)
    with formulation.use(dense="reference"):
        fn, params = xconv.to_jax(model)
        jaxpr = jax.make_jaxpr(lambda p, v: fn(p, v)[0])(params, x)
    assert _weight_major_dots(jaxpr.jaxpr) == 0
    fn, params = xconv.to_jax(model, dtype="bfloat16")
    assert _weight_major_dots(jax.make_jaxpr(lambda p, v: fn(p, v)[0])(params, x).jaxpr) == 0


def test_the_rule_reads_rows_and_widths():
    w_t = jnp.zeros((3072, 768))  # a (768, 3072) weight, transposed: in = 4·out
    assert [weight_major(jnp.zeros((m, 3072)), w_t) for m in (1, 2, 64, 128, 129)] == [
        False,
        True,
        True,
        True,
        False,
    ]
    square = jnp.zeros((768, 768))
    assert [weight_major(jnp.zeros((1, m, 768)), square) for m in (64, 65, 128)] == [
        True,
        False,
        False,
    ]
    assert not weight_major(jnp.zeros((8, 768), jnp.bfloat16), square.astype(jnp.bfloat16))
    assert not weight_major(jnp.zeros((768,)), square)  # a vector: no rows
    assert [one_row(jnp.zeros(shape), square) for shape in ((1, 768), (1, 1, 768), (2, 768))] == [
        True,
        True,
        False,
    ]
    assert not one_row(jnp.zeros((1, 768), jnp.bfloat16), square.astype(jnp.bfloat16))
    with formulation.use(dense="reference"):
        assert not one_row(jnp.zeros((1, 768)), square)
