"""``to_jax``'s function takes any array-like input: a torch tensor as the README passes it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import xconv
from xconv.demo import build_demo_model

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def demo():
    fn, params = xconv.to_jax(build_demo_model())
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    return fn, params, x, np.asarray(fn(params, x)[0])


@pytest.mark.parametrize(
    "make",
    [
        lambda x: torch.from_numpy(x),
        lambda x: torch.from_numpy(x).requires_grad_(),  # its values, not its graph
        lambda x: x.tolist(),
    ],
    ids=["tensor", "requires_grad", "list"],
)
def test_array_like_inputs_give_the_numpy_result(demo, make):
    fn, params, x, expected = demo
    (got,) = fn(params, make(x.copy()))
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert set(fn.intermediates(params, make(x.copy()))) >= set(fn.output_names)


def test_a_bfloat16_tensor_reads_its_values(demo):
    fn, params, x, _ = demo
    t = torch.from_numpy(x).to(torch.bfloat16)
    (got,) = fn(params, t)
    (expected,) = fn(params, np.asarray(jax.numpy.asarray(t.float().numpy(), "bfloat16")))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
