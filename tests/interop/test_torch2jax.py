"""torch2jax: torch modules as JAX functions through the IR, against torch autograd."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import xconv
from fixtures.torch_models import make_mlp, make_resnet, make_transformer
from xconv.errors import ConversionError, WeightsError

FACTORIES = {"mlp": make_mlp, "resnet": make_resnet, "transformer": make_transformer}


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def converted(request):
    module, example = FACTORIES[request.param]()
    fn, params = xconv.torch2jax(module, *example)
    return request.param, module, example, fn, params


def _torch_grads(module, example, weights):
    """Gradients of ``sum(out * weights)`` w.r.t. parameters and float inputs, in eval mode."""
    module.zero_grad()
    inputs = [x.clone().requires_grad_(x.is_floating_point()) for x in example]
    out = module(*inputs)
    (out * torch.from_numpy(weights)).sum().backward()
    params = {k: p.grad.numpy() for k, p in module.named_parameters()}
    return out.detach().numpy(), params, [x.grad.numpy() for x in inputs if x.is_floating_point()]


def test_params_keyed_by_state_dict_names(converted):
    _, module, _, _, params = converted
    state = module.state_dict()
    assert set(params) <= set(state)
    assert {k for k, _ in module.named_parameters()} <= set(params)
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(v), state[k].numpy())


def test_outputs_and_gradients_match_torch(converted):
    name, module, example, fn, params = converted
    float_inputs = [i for i, x in enumerate(example) if x.is_floating_point()]
    out_shape = module(*example).shape
    weights = np.random.default_rng(0).standard_normal(out_shape).astype(np.float32)
    ref_out, ref_pgrads, ref_xgrads = _torch_grads(module, example, weights)
    inputs = [jnp.asarray(x.numpy()) for x in example]

    def loss(p, *xs):
        return jnp.sum(fn(p, *xs) * weights)

    out = jax.jit(fn)(params, *inputs)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    argnums = (0, *(1 + i for i in float_inputs))
    grads = jax.jit(jax.grad(loss, argnums=argnums))(params, *inputs)
    pgrads = grads[0]
    for k, want in ref_pgrads.items():
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(
            np.asarray(pgrads[k]), want, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{name}: {k}"
        )
    assert len(grads) - 1 == len(ref_xgrads) == (0 if name == "transformer" else 1)
    for got, want in zip(grads[1:], ref_xgrads, strict=True):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * scale)


def test_vmap_over_a_stack_of_inputs(converted):
    _, module, example, fn, params = converted
    stacks = [torch.stack([x, x.flip(0), x]) for x in example]
    with torch.no_grad():
        want = np.stack([module(*(s[i] for s in stacks)).numpy() for i in range(3)])
    batched = jax.jit(jax.vmap(fn, in_axes=(None, *([0] * len(stacks)))))
    got = batched(params, *(jnp.asarray(s.numpy()) for s in stacks))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_plain_function_and_output_structure():
    def f(a, b):
        return {"prod": torch.sin(a) * b, "rest": (a + 1.0, torch.relu(b).sum(-1))}

    a, b = torch.randn(3, 4), torch.randn(3, 4)
    fn = xconv.torch2jax(f, a, b)
    got = jax.jit(fn)(jnp.asarray(a.numpy()), jnp.asarray(b.numpy()))
    want = f(a, b)
    assert set(got) == {"prod", "rest"} and isinstance(got["rest"], tuple)
    np.testing.assert_allclose(np.asarray(got["prod"]), want["prod"].numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got["rest"][1]), want["rest"][1].numpy(), rtol=1e-6)
    ga = jax.grad(lambda a: jnp.sum(fn(a, jnp.asarray(b.numpy()))["prod"]))(jnp.asarray(a.numpy()))
    np.testing.assert_allclose(np.asarray(ga), (torch.cos(a) * b).numpy(), rtol=1e-5, atol=1e-6)


def test_dynamic_batch():
    module, (x,) = make_mlp()
    fn, params = xconv.torch2jax(module, x, dynamic_batch=True)
    x7 = torch.randn(7, x.shape[1])
    with torch.no_grad():
        want = module(x7).numpy()
    np.testing.assert_allclose(np.asarray(fn(params, x7.numpy())), want, rtol=1e-5, atol=1e-6)


def test_wrong_params_are_named():
    module, (x,) = make_mlp()
    fn, params = xconv.torch2jax(module, x)
    bad = dict(params)
    bad.pop("fc1.weight")
    bad["nope"] = bad["fc1.bias"]
    with pytest.raises(WeightsError, match=r"missing \['fc1.weight'\], unexpected \['nope'\]"):
        fn(bad, x.numpy())


def test_needs_example_inputs():
    module, _ = make_mlp()
    with pytest.raises(ConversionError, match="example inputs"):
        xconv.torch2jax(module)
