"""``to_jax`` holds activations channels-last from the first convolution on
(:mod:`xconv.converters.jax.channels_last`): the same function, outputs and intermediates in
the IR's layout, gradients unchanged, and the training step's transposes gone."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import xconv  # noqa: E402
from xconv.ir.naming import flatten  # noqa: E402


class _Mixed(torch.nn.Module):
    """Convolutions (grouped, strided, 1-D), batch norm, pooling, a residual add, PReLU's
    per-channel slope, a concat and a flatten: ops held channels-last and ops that are not."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(3, stride=2, padding=1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding="same", groups=8, bias=False)
        self.act = torch.nn.PReLU(8)
        self.pw = torch.nn.Conv2d(16, 8, 1)
        self.avg = torch.nn.AdaptiveAvgPool2d(1)
        self.line = torch.nn.Conv1d(8, 4, 3, padding=1)
        self.fc = torch.nn.Linear(8 + 4 * 8, 5)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn1(self.conv1(x))))
        h = torch.cat([self.act(self.dw(h)) * 0.5 + h, h], dim=1)
        h = self.pw(h) + h[:, :8]
        pooled = self.avg(h).flatten(1)
        seq = self.line(h.mean(2))  # (N, 8, W) -> (N, 4, W)
        return self.fc(torch.cat([pooled, seq.flatten(1)], dim=1))


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    net = _Mixed().eval()
    with torch.no_grad():
        net.bn1.running_mean.uniform_(-0.5, 0.5)
        net.bn1.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    model = xconv.from_torch(net, x, dynamic_batch=True)
    fn, params = xconv.to_jax(model)
    return net, x, fn, params


def _loss(fn):
    return lambda p, x: (fn(p, x)[0] ** 2).mean()


def test_channels_last_is_the_default_and_computes_the_same_function(converted):
    net, x, fn, params = converted
    assert fn.channels_last
    first = dataclasses.replace(fn, channels_last=False)
    with torch.no_grad():
        want = net(x[:1]).numpy()
    xs = x[:1].numpy()
    got = np.asarray(jax.jit(lambda p, x: fn(p, x)[0])(params, xs))
    ref = np.asarray(jax.jit(lambda p, x: first(p, x)[0])(params, xs))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    g = jax.jit(jax.grad(_loss(fn), allow_int=True))(params, xs)
    g0 = jax.jit(jax.grad(_loss(first), allow_int=True))(params, xs)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_flatten_with_path(g)[0],
        jax.tree_util.tree_flatten_with_path(g0)[0],
        strict=True,
    ):
        if a.dtype != jax.dtypes.float0:  # integer buffers have no gradient
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(path))
    assert xconv.check_parity(net, (fn, params), [xs], n_random=0).passed


def test_intermediates_come_back_in_the_ir_layout(converted):
    _, x, fn, params = converted
    first = dataclasses.replace(fn, channels_last=False)
    xs = x[:1].numpy()
    got, ref = fn.intermediates(params, xs), first.intermediates(params, xs)
    assert got.keys() == ref.keys()
    for name in ref:
        if hasattr(ref[name], "shape"):
            assert np.shape(got[name]) == np.shape(ref[name]), name
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_training_step_has_fewer_transposes_on_cpu(converted):
    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU layouts (the GPU picks its own)")
    _, x, fn, params = converted
    xs = x[:1].numpy()

    def transposes(f) -> int:
        step = jax.jit(jax.value_and_grad(_loss(f), allow_int=True))
        return len(re.findall(r" transpose\(", step.lower(params, xs).compile().as_text()))

    first = dataclasses.replace(fn, channels_last=False)
    assert transposes(fn) < transposes(first)


def test_kernels_are_read_as_stored_forward_and_backward(converted):
    """A kernel stored (*k, I, O) (``fn.kernel_perms``) feeds the channels-last convolution
    as it is: no transpose of it in the traced training step, forward or gradient."""
    _, x, fn, params = converted
    xs = x[:1].numpy()
    conv = {n for n, p in fn.kernel_perms.items() if len(p) >= 3}
    assert {"conv1.weight", "dw.weight", "pw.weight", "line.weight"} <= conv
    leaves = flatten(params, fn.weight_names)
    kernels = {tuple(np.shape(leaves[n])) for n in conv}
    kernels |= {tuple(np.shape(leaves[n])[i] for i in np.argsort(fn.kernel_perms[n])) for n in conv}

    def kernel_transposes(f) -> list:
        jaxpr = jax.make_jaxpr(jax.value_and_grad(_loss(f), allow_int=True))(params, xs).jaxpr
        return [
            e
            for e in jaxpr.eqns
            if e.primitive.name == "transpose"
            and {tuple(e.invars[0].aval.shape), tuple(e.outvars[0].aval.shape)} & kernels
        ]

    assert kernel_transposes(fn) == []
    # numpy params fold at trace time, on the IR's layout: the held kernel goes back to it
    folded = fn(jax.tree_util.tree_map(np.asarray, params), xs)[0]
    np.testing.assert_allclose(folded, fn(params, xs)[0], rtol=1e-5, atol=1e-6)
    # the check sees them where they are: channels-first transposes each kernel back
    assert len(kernel_transposes(dataclasses.replace(fn, channels_last=False))) >= len(conv)


def test_bfloat16_keeps_the_layout_and_the_policy(converted):
    net, x, _, _ = converted
    model = xconv.from_torch(net, x, dynamic_batch=True)
    fn, params = xconv.to_jax(model, dtype="bfloat16")
    first = dataclasses.replace(fn, channels_last=False)
    xs = x[:1].numpy()
    got = jax.jit(lambda p, x: fn(p, x)[0])(params, xs)
    ref = jax.jit(lambda p, x: first(p, x)[0])(params, xs)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2
    )
