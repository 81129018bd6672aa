"""The PyTorch source of a Flax model writes a traced softmax / tanh GELU as the one call a
person writes (``xconv/converters/torch/source/fuse.py``), with the numbers unchanged."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
nn = pytest.importorskip("flax.linen")

import xconv  # noqa: E402


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        scores = nn.Dense(8, name="proj")(x)
        h = jax.nn.softmax(scores, axis=-1)
        return nn.gelu(nn.Dense(8, name="out")(h), approximate=True), jax.nn.softmax(h, axis=1)


def _source(module, x):
    variables = module.init(jax.random.PRNGKey(0), x)
    want = module.apply(variables, x)
    src, state = xconv.to_torch_source(xconv.from_flax(module, variables, (x,)))
    ns: dict = {}
    exec(compile(src, "model.py", "exec"), ns)
    gen = ns["Model"]()
    gen.load_state_dict(state)
    with torch.no_grad():
        got = gen.eval()(torch.from_numpy(x))
    return src, want, got


def test_softmax_and_tanh_gelu_are_one_call():
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    src, want, got = _source(_Block(), x)
    assert src.count("torch.softmax(") == 2
    assert "dim=-1)" in src and "dim=1)" in src  # the axis each softmax normalises over
    assert 'F.gelu(self.out(attn), approximate="tanh")' in src
    assert "torch.exp(" not in src and "torch.tanh(" not in src and "torch.amax(" not in src
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), np.asarray(w), rtol=1e-5, atol=1e-6)


class _NotSoftmax(nn.Module):
    """exp(x - max) divided by something other than its own sum: not a softmax."""

    @nn.compact
    def __call__(self, x):
        e = jnp_exp(x - x.max(axis=-1, keepdims=True))
        return e / (e.sum(axis=-1, keepdims=True) + 1.0)


def jnp_exp(x):
    import jax.numpy as jnp

    return jnp.exp(x)


def test_a_different_chain_is_not_fused():
    x = np.random.default_rng(1).standard_normal((3, 6)).astype(np.float32)
    src, want, got = _source(_NotSoftmax(), x)
    assert "torch.softmax(" not in src
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)
