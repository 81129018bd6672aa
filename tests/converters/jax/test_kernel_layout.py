"""``to_jax``'s ``kernel_layout``: ``"HWIO"`` (the default) stores convolution kernels
``(*k, I, O)`` (and ``Gemm`` ``transB=1`` weights ``(I, O)``), the layout XLA's CPU convolution
reads, so a jitted call does not copy every kernel out of OIHW on each call; ``"onnx"`` keeps
the IR's (the source's) shapes. Same names, same function."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import xconv  # noqa: E402
from xconv.errors import ConversionError  # noqa: E402


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(2)
        self.conv2 = torch.nn.Conv2d(8, 8, 1, bias=False)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = self.pool(torch.relu(self.bn(self.conv1(x))))
        h = torch.relu(self.conv2(h) + h)
        return self.fc(h.mean((2, 3)))


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    net = _Net().eval()
    with torch.no_grad():  # non-trivial statistics
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return net, x, xconv.from_torch(net, x, dynamic_batch=True)


def _leaves(params) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }


def _transposes(fn, params, x) -> int:
    f = jax.jit(lambda p, x: fn(p, x)[0])
    return len(re.findall(r" transpose\(", f.lower(params, x).compile().as_text()))


def test_hwio_params_match_the_ir_layout_permuted(converted):
    net, x, model = converted
    fn0, p0 = xconv.to_jax(model, kernel_layout="onnx")
    fn1, p1 = xconv.to_jax(model, kernel_layout="HWIO")
    a, b = _leaves(p0), _leaves(p1)
    assert a.keys() == b.keys()
    assert fn0.kernel_perms == {}
    # both convolutions and the Linear (Gemm transB=1, or MatMul when exported so)
    assert {"conv1.weight", "conv2.weight"} <= set(fn1.kernel_perms)
    for name, perm in fn1.kernel_perms.items():
        key = "".join(f"['{part}']" for part in name.split("."))
        np.testing.assert_array_equal(b[key], np.transpose(a[key], perm))
    for key in a.keys() - {
        "".join(f"['{part}']" for part in n.split(".")) for n in fn1.kernel_perms
    }:
        np.testing.assert_array_equal(a[key], b[key])
    assert b["['conv1']['weight']"].shape == (3, 3, 3, 8)


def test_hwio_computes_the_same_function_jitted_and_differentiated(converted):
    net, x, model = converted
    xs = x[:1].numpy()  # batch 1: not the traced batch size
    with torch.no_grad():
        want = net(x[:1]).numpy()
    fn0, p0 = xconv.to_jax(model, kernel_layout="onnx")
    fn1, p1 = xconv.to_jax(model, kernel_layout="HWIO")
    got = jax.jit(lambda p, x: fn1(p, x)[0])(p1, xs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)

    def loss(fn):
        return lambda p, x: (fn(p, x)[0] ** 2).mean()

    g0 = _leaves(jax.jit(jax.grad(loss(fn0), allow_int=True))(p0, xs))
    g1 = _leaves(jax.jit(jax.grad(loss(fn1), allow_int=True))(p1, xs))
    for name, perm in fn1.kernel_perms.items():
        key = "".join(f"['{part}']" for part in name.split("."))
        np.testing.assert_allclose(g1[key], np.transpose(g0[key], perm), rtol=1e-4, atol=1e-6)
    report = xconv.check_parity(net, (fn1, p1), [xs], intermediates=False, n_random=0)
    assert report.passed


def test_hwio_drops_the_per_call_kernel_copies_on_cpu(converted):
    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU convolution layout (the GPU picks its own)")
    _, x, model = converted
    xs = x[:1].numpy()
    fn0, p0 = xconv.to_jax(model, kernel_layout="onnx")
    fn1, p1 = xconv.to_jax(model, kernel_layout="HWIO")
    # each OIHW kernel (and the transposed Gemm B) is copied per call; HWIO ones are not
    assert _transposes(fn1, p1, xs) <= _transposes(fn0, p0, xs) - 2


def test_the_default_is_hwio(converted):
    _, _, model = converted
    fn, params = xconv.to_jax(model)
    assert fn.kernel_layout == "HWIO" and "conv1.weight" in fn.kernel_perms
    assert params["conv1"]["weight"].shape == (3, 3, 3, 8)


def test_kernel_layout_is_checked(converted):
    _, _, model = converted
    with pytest.raises(ConversionError, match="kernel_layout"):
        xconv.to_jax(model, kernel_layout="NHWC")


def test_pooling_runs_channels_last_without_activation_copies_on_cpu(converted):
    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU convolution layout (the GPU picks its own)")
    _, x, model = converted
    fn, params = xconv.to_jax(model, kernel_layout="HWIO")
    # the input's NCHW -> NHWC is the only copy: the max pool between the convolutions
    # reduces over the channels-last map the convolution wrote (it copied it to NCHW and
    # back when the window ran over the NCHW view)
    assert _transposes(fn, params, x[:1].numpy()) <= 1


def test_given_params_replace_the_model_weights_checked_by_shape(converted):
    """``to_jax(params=...)`` (a saved ``params.msgpack``, as a folder's ``load()`` reads it)
    computes with the given weights in the stored layout, and names every weight whose shape
    is not the model's, or the first one missing."""
    net, x, model = converted
    fn, params = xconv.to_jax(model)
    scaled = jax.tree_util.tree_map(lambda v: np.asarray(v) * 1.5, params)
    fn2, given = xconv.to_jax(model, params=scaled)
    assert fn2.weight_names == fn.weight_names
    assert (np.asarray(given["conv1"]["weight"]) == np.asarray(scaled["conv1"]["weight"])).all()
    got = np.asarray(fn2(given, x.numpy())[0])
    want = np.asarray(fn(scaled, x.numpy())[0])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, np.asarray(fn(params, x.numpy())[0]), atol=1e-3)

    onnx_layout = dict(scaled, conv1=dict(scaled["conv1"]))
    onnx_layout["conv1"]["weight"] = np.transpose(scaled["conv1"]["weight"], (3, 2, 0, 1))
    onnx_layout["fc"] = {"weight": scaled["fc"]["weight"].T, "bias": scaled["fc"]["bias"]}
    with pytest.raises(ConversionError, match=r"conv1\.weight: \(8, 3, 3, 3\), the model's "
                       r"\(3, 3, 3, 8\); fc\.weight: \(5, 8\), the model's \(8, 5\)"):  # fmt: skip
        xconv.to_jax(model, params=onnx_layout)
    with pytest.raises(ConversionError, match="no weight at 'fc'"):
        xconv.to_jax(model, params={k: v for k, v in scaled.items() if k != "fc"})
