"""Flax / JAX frontend: structure, parity against the source module, scan-first errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xconv
from fixtures import flax_models as fm
from xconv.converters.flax.importer.trace import from_flax, from_jax
from xconv.errors import UnsupportedOpError
from xconv.ir.metadata import LAYER, LAYOUT, MODULE, ROLE, SCOPE

LINEN = ["linen_mlp", "linen_cnn", "linen_transformer"]
NNX = ["nnx_mlp", "nnx_cnn", "nnx_transformer"]


def _convert(name):
    module, variables, xs = fm.build(name)
    ref = module.apply(variables, *xs) if variables is not None else module(*xs)
    return from_flax(module, variables, xs), xs, np.asarray(ref)


@pytest.mark.parametrize("name", LINEN + NNX)
def test_fixture_parity_with_to_jax(name):
    model, xs, ref = _convert(name)
    fn, params = xconv.to_jax(model)
    out = np.asarray(fn(params, *xs)[0])
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert not any(n.startswith("const_") for n in model.graph.initializers)


def test_linen_cnn_structure():
    model, _, _ = _convert("linen_cnn")
    inits = model.graph.initializers
    assert inits["Conv_0.kernel"].metadata_props[ROLE] == "kernel"
    assert inits["Conv_0.kernel"].metadata_props[LAYOUT] == "HWIO"
    assert inits["Dense_0.kernel"].metadata_props[LAYOUT] == "IO"
    assert {
        inits[f"BatchNorm_0.{k}"].metadata_props[ROLE] for k in ("scale", "bias", "mean", "var")
    } == {"scale", "bias", "mean", "var"}
    convs = [n for n in model.graph if n.op_type == "Conv"]
    assert [n.metadata_props[SCOPE] for n in convs] == ["Conv_0", "Conv_1"]
    assert convs[0].metadata_props[MODULE] == "flax.linen.Conv"
    layer = json.loads(convs[1].metadata_props[LAYER])
    assert layer["kind"] == "conv" and layer["strides"] == [2, 2] and layer["out_channels"] == 16
    bns = [n for n in model.graph if n.op_type == "BatchNormalization"]
    assert len(bns) == 2 and json.loads(bns[0].metadata_props[LAYER])["kind"] == "batch_norm"


def test_transformer_structure():
    model, _, _ = _convert("linen_transformer")
    lns = [n for n in model.graph if n.op_type == "LayerNormalization"]
    assert len(lns) == 3
    assert {n.metadata_props[SCOPE] for n in lns} == {
        "LayerNorm_0",
        "LinenBlock_0/LayerNorm_0",
        "LinenBlock_0/LayerNorm_1",
    }
    gather = next(n for n in model.graph if n.op_type == "Gather")
    assert json.loads(gather.metadata_props[LAYER]) == {
        "kind": "embedding",
        "num_embeddings": 50,
        "features": 32,
    }
    inits = model.graph.initializers
    assert inits["Embed_0.embedding"].metadata_props[ROLE] == "embedding"
    assert (
        inits["LinenBlock_0.MultiHeadDotProductAttention_0.query.kernel"].metadata_props[ROLE]
        == "q_kernel"
    )
    attn = [
        n
        for n in model.graph
        if LAYER in n.metadata_props and "attention" in n.metadata_props[LAYER]
    ]
    assert len(attn) == 1
    assert json.loads(attn[0].metadata_props[LAYER])["num_heads"] == 4


def test_nnx_scopes_and_names():
    model, _, _ = _convert("nnx_cnn")
    assert "bn1.mean" in model.graph.initializers
    conv = next(n for n in model.graph if n.op_type == "Conv")
    assert conv.metadata_props[SCOPE] == "conv1"
    assert conv.metadata_props[MODULE] == "flax.nnx.Conv"


def test_from_jax_plain_function():
    def fn(params, x, idx):
        h = jnp.tanh(x @ params["w"] + params["b"])
        h = jnp.cumsum(h, axis=1)[:, ::-1]
        g = jnp.take(params["table"], idx, axis=0)
        s = jnp.sort(h, axis=-1)
        return jnp.concatenate([s, g], axis=-1).max(axis=0) + jnp.argmax(h, axis=1).sum()

    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": rng.standard_normal((3,)).astype(np.float32),
        "table": rng.standard_normal((6, 3)).astype(np.float32),
    }
    x = rng.standard_normal((5, 4)).astype(np.float32)
    idx = np.array([0, 5, 2, 2, 1], np.int32)
    model = from_jax(fn, params, (x, idx))
    assert set(model.graph.initializers) >= {"w", "b", "table"}
    (out,) = xconv.to_jax(model)[0](xconv.to_jax(model)[1], x, idx)
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(params, x, idx)), atol=1e-5)


def test_control_flow_scan_and_cond():
    def fn(params, xs):
        def step(c, x):
            return c * params["a"] + x, c

        c, ys = jax.lax.scan(step, jnp.zeros(3), xs)
        return jax.lax.cond(c.sum() > 0, lambda v: v * 2.0, lambda v: v - 1.0, ys)

    params = {"a": np.float32(0.5)}
    xs = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    model = from_jax(fn, params, (xs,))
    fn_j, p = xconv.to_jax(model)
    np.testing.assert_allclose(np.asarray(fn_j(p, xs)[0]), np.asarray(fn(params, xs)), atol=1e-6)


def test_unsupported_primitives_listed_at_once():
    from jax.extend.core import Primitive

    unknown = Primitive("xconv_test_unknown")  # a user primitive no handler knows
    unknown.def_abstract_eval(lambda x: x)

    def fn(params, x):
        # One use inside a while body (the scan walks into sub-jaxprs), one outside.
        y = jax.lax.while_loop(lambda v: v.sum() < 10.0, lambda v: unknown.bind(v) + 1.0, x)
        a = jnp.outer(y, y) + jnp.eye(3) * params["s"]
        return jax.lax.linalg.cholesky(a).sum() + unknown.bind(y).sum()

    with pytest.raises(UnsupportedOpError) as info:
        from_jax(fn, {"s": np.float32(4.0)}, (np.zeros(3, np.float32),))
    counts = {m.op_type: m.count for m in info.value.missing}
    assert counts == {"cholesky": 1, "xconv_test_unknown": 2}
    assert "flax frontend" in str(info.value)


# --- models as outside packages write them ---------------------------------------------------


def _linen_parity(module, x, **kwargs):
    from flax import linen as nn  # noqa: F401  (linen modules below)

    variables = module.init(jax.random.PRNGKey(0), x)
    model = from_flax(module, variables, (x,), **kwargs)
    fn, params = xconv.to_jax(model)
    want = np.asarray(
        module.apply(variables, x, **({"method": kwargs["method"]} if "method" in kwargs else {}))
    )
    np.testing.assert_allclose(np.asarray(fn(params, x)[0]), want, atol=1e-5, rtol=1e-5)
    return model


def test_layers_built_in_a_helper_method_keep_their_module_scope():
    from flax import linen as nn

    class Net(nn.Module):
        def _block(self, x, name):
            return nn.relu(nn.Conv(4, (3, 3), name=name)(x))

        @nn.compact
        def __call__(self, x):
            return self._block(self._block(x, "conv1"), "conv2")

    model = _linen_parity(Net(), np.ones((1, 8, 8, 3), np.float32))
    convs = [n for n in model.graph if n.op_type == "Conv"]
    assert [n.metadata_props.get(SCOPE) for n in convs] == ["conv1", "conv2"]
    assert all(LAYER in n.metadata_props for n in convs)


def test_a_packages_own_named_scope_does_not_hide_module_paths():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            with jax.named_scope("net_forward"):
                return self.lin(x)

    net = Net()
    model = from_flax(net, None, (np.ones((2, 3), np.float32),))
    matmul = next(n for n in model.graph if n.op_type == "MatMul")
    assert matmul.metadata_props.get(SCOPE) == "lin" and LAYER in matmul.metadata_props


def test_python_constants_computed_in_call_and_norm_recovery():
    """``[float(r) for r in jnp.linspace(...)]`` in ``__call__`` (drop-path rates) needs the
    constant's value while tracing; the LayerNorm is still one node, applied once."""
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            rates = [float(r) for r in jnp.linspace(0.0, 0.2, 3)]
            return nn.Dense(4)(nn.LayerNorm()(x)) * (1.0 + rates[1])

    model = _linen_parity(
        Net(), np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    )
    assert [n.op_type for n in model.graph].count("LayerNormalization") == 1


def test_unused_random_draws_are_dropped():
    def fn(params, x):
        unused = jax.random.normal(jax.random.PRNGKey(0), (3,))  # noqa: F841
        return x * params["w"]

    x = np.ones((2, 3), np.float32)
    model = from_jax(fn, {"w": np.float32(2.0)}, (x,))
    assert not any("random" in n.op_type.lower() for n in model.graph)
    f, p = xconv.to_jax(model)
    np.testing.assert_allclose(np.asarray(f(p, x)[0]), 2 * x)


def test_inner_jit_closing_over_a_constant():
    table = np.arange(16, dtype=np.float32).reshape(4, 4)

    @jax.jit
    def inner(x):
        return x @ jnp.asarray(table) + 1.0

    def fn(params, x):
        return inner(x) * params["w"]

    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    params = {"w": np.ones((4,), np.float32)}
    f, p = xconv.to_jax(from_jax(fn, params, (x,)))
    np.testing.assert_allclose(np.asarray(f(p, x)[0]), np.asarray(fn(params, x)), rtol=1e-6)


def test_method_may_be_a_callable_for_eval_mode_keywords():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            return nn.BatchNorm(use_running_average=not train)(nn.Dense(3)(x))

    x = np.random.default_rng(0).standard_normal((4, 2)).astype(np.float32)
    model = _linen_parity(Net(), x, method=lambda m, v: m(v, train=False))
    assert any(n.op_type == "BatchNormalization" for n in model.graph)
