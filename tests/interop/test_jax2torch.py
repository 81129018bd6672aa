"""jax2torch: JAX functions called from torch, with autograd, compared with ``jax.grad``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import xconv
from xconv.errors import ConversionError
from xconv.interop.dlpack import jax_to_torch, torch_to_jax

RNG = np.random.default_rng(0)
PARAMS = {
    "w1": jnp.asarray(RNG.standard_normal((6, 16), dtype=np.float32) * 0.5),
    "b1": jnp.asarray(RNG.standard_normal(16, dtype=np.float32) * 0.1),
    "w2": jnp.asarray(RNG.standard_normal((16, 3), dtype=np.float32) * 0.5),
}


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


def test_zero_copy_both_ways():
    t = torch.randn(8, 5)
    a = torch_to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    y = jnp.sin(a)
    back = jax_to_torch(y)
    assert back.data_ptr() == y.unsafe_buffer_pointer()
    np.testing.assert_allclose(back.numpy(), np.sin(t.numpy()), rtol=1e-6, atol=1e-6)


def test_non_contiguous_input():
    t = torch.randn(5, 7).t()[:, ::2]
    assert not t.is_contiguous()
    f = xconv.jax2torch(lambda x: x * 2.0)
    np.testing.assert_allclose(f(t).numpy(), t.numpy() * 2.0)
    x = t.clone().requires_grad_()
    (f(x) * torch.arange(x.numel()).reshape(x.shape)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * np.arange(x.numel()).reshape(x.shape))


def test_grad_inputs_closed_over_params():
    f = xconv.jax2torch(lambda x: jnp.sum(mlp(PARAMS, x) ** 2))
    x_np = RNG.standard_normal((4, 6), dtype=np.float32)
    x = torch.from_numpy(x_np.copy()).requires_grad_()
    loss = f(x)
    loss.backward()
    ref_loss, ref_grad = jax.value_and_grad(lambda x: jnp.sum(mlp(PARAMS, x) ** 2))(x_np)
    np.testing.assert_allclose(loss.item(), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), np.asarray(ref_grad), rtol=1e-5, atol=1e-6)


def test_grad_params_passed_as_tensors():
    def fn(w1, b1, w2, x):
        return mlp({"w1": w1, "b1": b1, "w2": w2}, x)

    f = xconv.jax2torch(fn)
    x_np = RNG.standard_normal((4, 6), dtype=np.float32)
    r = RNG.standard_normal((4, 3), dtype=np.float32)
    ws = [torch.from_numpy(np.array(PARAMS[k])).requires_grad_() for k in ("w1", "b1", "w2")]
    x = torch.from_numpy(x_np.copy()).requires_grad_()
    (f(*ws, x) * torch.from_numpy(r)).sum().backward()
    ref = jax.grad(lambda *a: jnp.sum(fn(*a) * r), argnums=(0, 1, 2, 3))(
        PARAMS["w1"], PARAMS["b1"], PARAMS["w2"], x_np
    )
    for got, want in zip([*ws, x], ref, strict=True):
        np.testing.assert_allclose(got.grad.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_matches_torch_training_step():
    """A jax2torch layer inside a torch model trains like its torch twin."""
    lin = torch.nn.Linear(6, 3)
    f = xconv.jax2torch(lambda x, w, b: x @ w.T + b)
    x = torch.randn(5, 6)
    f(x, lin.weight, lin.bias).pow(2).mean().backward()
    got = [lin.weight.grad.clone(), lin.bias.grad.clone()]
    lin.zero_grad()
    lin(x).pow(2).mean().backward()
    torch.testing.assert_close(got, [lin.weight.grad, lin.bias.grad], rtol=1e-5, atol=1e-6)


def test_integer_input_and_pytree_output():
    def fn(x, idx):
        g = x[idx]
        return {"gathered": g, "pair": (g.sum(), jnp.argmax(x, axis=-1)), "list": [x * 3.0]}

    f = xconv.jax2torch(fn)
    x = torch.randn(5, 4, requires_grad=True)
    idx = torch.tensor([0, 2, 2])
    out = f(x, idx)
    assert set(out) == {"gathered", "pair", "list"}
    assert isinstance(out["pair"], tuple) and isinstance(out["list"], list)
    assert out["pair"][1].dtype == torch.int32 and not out["pair"][1].requires_grad
    np.testing.assert_allclose(out["gathered"].detach().numpy(), x.detach().numpy()[[0, 2, 2]])
    (out["gathered"].sum() + out["pair"][0] + out["list"][0].sum()).backward()
    want = np.full((5, 4), 3.0, np.float32)
    want[0] += 2.0
    want[2] += 4.0
    np.testing.assert_allclose(x.grad.numpy(), want)
    assert idx.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_preserved(dtype):
    f = xconv.jax2torch(lambda x: x * x)
    x = torch.randn(6).to(dtype).requires_grad_()
    y = f(x)
    assert y.dtype == dtype
    y.sum().backward()
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_no_grad_path_runs_plain_function():
    f = xconv.jax2torch(lambda x: jnp.exp(x))
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        y = f(x)
    assert not y.requires_grad
    torch.testing.assert_close(y, torch.exp(x.detach()))


def test_gradcheck_float64():
    with jax.enable_x64(True):
        f = xconv.jax2torch(lambda x, w: jnp.sin(x @ w).sum(axis=0) * jnp.cos(w[0]))
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        w = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        assert f(x, w).dtype == torch.float64
        assert torch.autograd.gradcheck(f, (x, w))


def test_unjitted_matches_jitted():
    x = torch.randn(4, 6, requires_grad=True)
    grads = []
    for jit in (True, False):
        x.grad = None
        xconv.jax2torch(lambda x: mlp(PARAMS, x), jit=jit)(x).sum().backward()
        grads.append(x.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_rejects_non_tensor_argument():
    f = xconv.jax2torch(lambda x: x)
    with pytest.raises(ConversionError, match="not a torch.Tensor"):
        f(np.ones(3))
