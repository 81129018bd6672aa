"""Flax / JAX frontend: token-id inputs get a symbolic ``seq`` beside ``batch``.

A linen model over token ids (Embed, self-attention, Dense, mean over the sequence) is
converted once at (2, 8) and run at (1, 5), (2, 8), (3, 12) through ``to_jax``, ``to_torch``
and the generated torch source against the Flax module. A model whose parameters fix the
length keeps it static, the batch still symbolic, without a warning.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
import pytest
from flax import linen as nn

import xconv
from tests.torch_source import load_generated
from xconv.converters.flax.importer.trace import from_flax, from_jax

torch = pytest.importorskip("torch")

ATOL = RTOL = 1e-5
SIZES = [(1, 5), (2, 8), (3, 12)]


class Tokens(nn.Module):
    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(100, 32)(ids)
        h = h + nn.SelfAttention(num_heads=2, qkv_features=32, deterministic=True)(h)
        h = nn.Dense(32)(nn.LayerNorm()(h))
        return nn.Dense(4)(jnp.mean(jax.nn.gelu(h), axis=1))


class FixedLength(nn.Module):
    """A learned position table added whole: only the example's length broadcasts."""

    @nn.compact
    def __call__(self, ids):
        pos = self.param("pos", nn.initializers.normal(), (8, 16))
        return nn.Dense(4)((nn.Embed(100, 16)(ids) + pos).mean(1))


def _shape(value: ir.Value) -> list:
    return [d if isinstance(d, int) else d.value for d in value.shape]


def _np(out) -> np.ndarray:
    out = out[0] if isinstance(out, tuple | list) else out
    return out.numpy() if hasattr(out, "numpy") and not isinstance(out, np.ndarray) else out


def _ids(batch: int, seq: int) -> np.ndarray:
    return np.random.default_rng(batch * 100 + seq).integers(0, 100, (batch, seq)).astype(np.int32)


@functools.cache
def _tokens():
    module = Tokens()
    variables = module.init(jax.random.PRNGKey(0), _ids(2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to static shapes
        model = from_flax(module, variables, _ids(2, 8))
    return module, variables, model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    module, variables, model = _tokens()
    fn, params = xconv.to_jax(model)
    runtime, _ = xconv.to_torch(model)
    generated, _ = load_generated(model, tmp_path_factory.mktemp("gen"))
    return module, variables, model, fn, params, runtime, generated


def test_inputs_and_outputs_are_symbolic(converted):
    model = converted[2]
    assert _shape(model.graph.inputs[0]) == ["batch", "seq"]
    assert _shape(model.graph.outputs[0]) == ["batch", 4]


@pytest.mark.parametrize(("batch", "seq"), SIZES)
def test_runs_at_any_batch_and_length(converted, batch, seq):
    module, variables, _model, fn, params, runtime, generated = converted
    ids = _ids(batch, seq)
    want = np.asarray(module.apply(variables, ids))
    with torch.no_grad():
        got = {
            "to_jax": _np(fn(params, ids)),
            "to_torch": _np(runtime(torch.from_numpy(ids))),
            "torch source": _np(generated(torch.from_numpy(ids))),
        }
    for route, out in got.items():
        assert np.shape(out) == want.shape, (route, np.shape(out))
        np.testing.assert_allclose(out, want, atol=ATOL, rtol=RTOL, err_msg=route)


def test_length_fixed_by_a_parameter_stays_static():
    module = FixedLength()
    ids = _ids(2, 8)
    variables = module.init(jax.random.PRNGKey(0), ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the batch stays symbolic: no warning
        model = from_flax(module, variables, ids)
    assert _shape(model.graph.inputs[0]) == ["batch", 8]
    fn, params = xconv.to_jax(model)
    x = _ids(3, 8)
    np.testing.assert_allclose(
        np.asarray(_np(fn(params, x))), np.asarray(module.apply(variables, x)), atol=ATOL
    )


def test_dynamic_seq_off_and_float_inputs_keep_the_length():
    """``dynamic_seq=False`` traces the length at the example's; a float input's dim 1 is
    never made ``seq``."""
    module, variables, _ = _tokens()
    ids = _ids(2, 8)
    model = from_flax(module, variables, ids, dynamic_seq=False)
    assert _shape(model.graph.inputs[0]) == ["batch", 8]

    def fn(w, x):
        return jnp.tanh(x @ w).sum(1)

    w = np.ones((3, 2), np.float32)
    model = from_jax(fn, w, np.ones((2, 5, 3), np.float32))
    assert _shape(model.graph.inputs[0]) == ["batch", 5, 3]


def test_from_jax_token_inputs_share_one_seq():
    """Two token inputs of one length share ``seq``; one of another length keeps its own."""

    def fn(table, ids, mask, other):
        h = table[ids] * mask[..., None]
        return h.sum(1) + table[other].sum(1)

    table = np.random.default_rng(0).standard_normal((20, 3)).astype(np.float32)
    ids, mask = _ids(2, 6) % 20, np.ones((2, 6), np.int32)
    other = _ids(2, 4) % 20
    model = from_jax(fn, table, (ids, mask, other))
    assert [_shape(v) for v in model.graph.inputs] == [
        ["batch", "seq"],
        ["batch", "seq"],
        ["batch", 4],
    ]
    run, params = xconv.to_jax(model)
    for batch, seq in SIZES:
        xs = (_ids(batch, seq) % 20, np.ones((batch, seq), np.int32), _ids(batch, 4) % 20)
        np.testing.assert_allclose(
            np.asarray(_np(run(params, *xs))), np.asarray(fn(table, *xs)), atol=ATOL
        )
