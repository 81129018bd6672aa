"""On the CPU, ``to_jax`` computes a matmul of a weight (a 2-D right operand) by at least
``kernel.ROW_BLOCKS_MIN`` rows in ``kernel.ROW_BLOCK``-row blocks, one after another
(formulation ``row_blocks``): the same values and gradients as one dot, which XLA:CPU runs
slower per row over many rows. Under ``"reference"``, with fewer rows, and for batched
matmuls, one dot."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402

import xconv  # noqa: E402
from xconv.converters.jax import kernel  # noqa: E402
from xconv.converters.ops import formulation  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU formulation")


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for param in e.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def _scans(fn, *args) -> int:
    """How many ``scan`` equations (``lax.map``'s) ``fn``'s jaxpr and those it calls hold."""
    return sum(e.primitive.name == "scan" for e in _eqns(jax.make_jaxpr(fn)(*args).jaxpr))


def _run(model, xs, choice: str, dtype: str | None = None):
    """``to_jax(model)`` under ``row_blocks=choice``: its output on ``xs``, the gradient of
    its mean square, and how many scans its forward and that gradient hold."""
    with formulation.use(row_blocks=choice):
        fn, params = xconv.to_jax(model, **({"dtype": dtype} if dtype else {}))

        def loss(p):
            return jnp.mean(fn(p, xs)[0].astype(jnp.float32) ** 2)

        out = np.asarray(fn(params, xs)[0], np.float32)
        scans = _scans(lambda p: fn(p, xs), params), _scans(jax.grad(loss), params)
        return out, jax.grad(loss)(params), scans


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_linear_over_many_rows_runs_in_row_blocks_with_the_same_values(dtype):
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)
    ).eval()
    x = torch.randn(4, kernel.ROW_BLOCK, 16)  # 8,192 rows: four blocks
    model = xconv.from_torch(module, x)
    xs = jnp.asarray(x.numpy())
    out, grads, scans = _run(model, xs, "auto", dtype)
    # each Linear's forward; the gradient is the one dot's
    assert scans == (2, 2), scans
    want, want_grads, plain = _run(model, xs, "reference", dtype)
    assert plain == (0, 0)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    if dtype is None:  # the source's numbers
        np.testing.assert_allclose(out, module(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_fewer_rows_a_batched_matmul_or_reference_stay_one_dot():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((16, 8)), "float32")

    def scans(a, b):
        return _scans(lambda a, b: kernel.matmul(a, b), a, b)  # not jit's trace cache

    many = jnp.asarray(rng.standard_normal((2 * kernel.ROW_BLOCKS_MIN, 16)), "float32")
    assert scans(many, w) == 1
    np.testing.assert_allclose(kernel.matmul(many, w), jnp.matmul(many, w), rtol=1e-6)
    assert scans(many[: kernel.ROW_BLOCKS_MIN - kernel.ROW_BLOCK], w) == 0  # too few rows
    assert scans(many[: kernel.ROW_BLOCKS_MIN + 1], w) == 0  # not whole blocks
    batched = many.reshape(4, -1, 16)
    assert scans(batched, jnp.broadcast_to(w, (4, 16, 8))) == 0  # not a weight
    with formulation.use(row_blocks="reference"):
        assert scans(many, w) == 0
