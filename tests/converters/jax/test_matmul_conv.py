"""On the CPU, 1×1 convolutions and small 2-D ones with 64+ input channels run as a matmul over
their patches (``formulation`` ``conv``): ``to_jax``'s channels-last ``Conv`` and the Flax
emitter's ``nn.Conv(..., conv_general_dilated=_matmul_conv)`` compute the source's numbers
(outputs and gradients) with no convolution left for those kernels; dilated kernels, few
channels and patches over ``PATCH_LIMIT`` keep the convolution, ``"reference"`` keeps every
one, and a generated module read back with ``from_flax`` still holds one ``Conv`` per layer."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import xconv  # noqa: E402
from tests.converters.jax.generated import apply_generated, import_generated  # noqa: E402
from xconv.converters.ops import formulation  # noqa: E402


class _Bottleneck(torch.nn.Module):
    """ResNet's bottleneck shape, plus two 3×3 kernels the formulation leaves alone: a strided
    1×1 with a bias, a 3×3 on 64 channels, a dilated 3×3, a 1×1 without bias, a strided 1×1
    shortcut (4 run as matmuls) and a 3×3 on 16 channels (2 stay convolutions)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce = torch.nn.Conv2d(16, 64, 1, stride=2)
        self.conv = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False)
        self.dilated = torch.nn.Conv2d(64, 64, 3, padding=2, dilation=2, bias=False)
        self.expand = torch.nn.Conv2d(64, 16, 1, bias=False)
        self.shortcut = torch.nn.Conv2d(16, 16, 1, stride=2, bias=False)
        self.small = torch.nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.dilated(torch.relu(self.conv(torch.relu(self.reduce(x))))))
        return self.small(torch.relu(self.expand(h) + self.shortcut(x)))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    module = _Bottleneck().eval()
    x = torch.randn(2, 16, 9, 9, generator=torch.Generator().manual_seed(1))
    return module, x, xconv.from_torch(module, x, dynamic_batch=True)


def _convolutions(fn, *args) -> int:
    return len(re.findall(r"stablehlo\.convolution", jax.jit(fn).lower(*args).as_text()))


@pytest.mark.parametrize("layout", ["HWIO", "onnx"])
def test_to_jax_runs_pointwise_and_small_kernels_as_matmuls_with_the_same_numbers(net, layout):
    module, x, model = net
    want = module(x).detach().numpy()
    results = {}
    for choice in ("auto", "reference"):
        with formulation.use(conv=choice):
            fn, params = xconv.to_jax(model, kernel_layout=layout)
            weights = {k: v for k, v in params.items()}

            def loss(p, fn=fn):
                return jnp.sum(fn(p, x.numpy())[0] ** 2)

            out = np.asarray(jax.jit(fn)(params, x.numpy())[0])
            grads = jax.jit(jax.grad(loss))(weights)
            results[choice] = (out, grads, _convolutions(fn, params, x.numpy()))
    assert results["auto"][2] == 2  # the dilated and the 16-channel 3×3 (CPU: this suite's)
    assert results["reference"][2] == 6
    for out, _, _ in results.values():
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    flat_auto = jax.tree_util.tree_leaves(results["auto"][1])
    flat_ref = jax.tree_util.tree_leaves(results["reference"][1])
    for a, r in zip(flat_auto, flat_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_a_kernel_held_in_onnx_layout_is_transposed_only_where_its_patches_outweigh_it(net):
    """ONNX's (O, I, kh, kw) kernel of the 64-channel 3×3 layer stays as it is held at batch 1
    (36,864 kernel elements, 14,400 patch elements: the views are stacked to its layout) and
    is transposed to HWIO at batch 8 (57,600 patch elements), as ``STACK_RATIO`` says."""
    _, x, model = net
    counts = {}
    for batch in (1, 8):
        xs = np.repeat(x.numpy()[:1], batch, axis=0)
        for layout in ("HWIO", "onnx"):
            fn, params = xconv.to_jax(model, kernel_layout=layout)
            jaxpr = str(jax.make_jaxpr(fn)(params, xs))
            counts[batch, layout] = jaxpr.count("transpose[")
            got = np.asarray(jax.jit(fn)(params, xs)[0])
            want = net[0](torch.from_numpy(xs)).detach().numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert counts[1, "onnx"] == counts[1, "HWIO"], counts
    assert counts[8, "onnx"] == counts[8, "HWIO"] + 1, counts


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_generated_flax_writes_plain_convs_and_reads_back_as_conv(net, tmp_path, api):
    """The generated source's convolutions are the plain nn.Conv a person writes, whatever
    to_jax's ``conv`` formulation runs on this backend (that is the runtime's choice, not the
    committed model's): 6 convolutions in its trace, and back as 6 Conv nodes."""
    module, x, model = net
    want = module(x).detach().numpy()
    out = xconv.to_flax(model, tmp_path / "auto", api=api)
    gen, src = import_generated(out), (out / "model.py").read_text()
    assert "def _matmul_conv" not in src and "conv_general_dilated=" not in src, src
    flax_model, variables, got, traced = apply_generated(gen, out, api, x.numpy())
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert str(traced).count("conv_general_dilated[") == 6
    # from_flax traces the layers as the convolutions they compute: the IR keeps 6 Conv
    back = xconv.from_flax(flax_model, variables, (x.numpy(),))
    assert sum(n.op_type == "Conv" for n in back.graph) == 6
    assert not any(n.op_type == "MatMul" for n in back.graph)
    fn, params = xconv.to_jax(back)
    np.testing.assert_allclose(np.asarray(fn(params, x.numpy())[0]), want, rtol=1e-5, atol=1e-5)


def test_reference_formulation_writes_plain_nn_conv(net, tmp_path):
    with formulation.use(conv="reference"):
        out = xconv.to_flax(net[2], tmp_path / "ref")
    src = (out / "model.py").read_text()
    assert "_matmul_conv(" not in src and "def _matmul_conv" not in src
    assert "nn.Conv(16, (1, 1), strides=2, use_bias=False)" in src


def test_the_conv_formulation_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="conv='fast'"), formulation.use(conv="fast"):
        pass
    monkeypatch.setenv("XCONV_JAX_CONV", "lax")
    with pytest.raises(ValueError, match="XCONV_JAX_CONV='lax'"):
        formulation.get("conv")


def test_patches_over_the_limit_keep_the_convolution(net):
    module, _, model = net
    # 9×9 → 5×5 after the strided 1×1: 64·9·25 patch elements per image for the 64-channel
    # 3×3, so a batch of 160 passes PATCH_LIMIT (2**21) and that layer convolves again
    assert 64 * 9 * 25 * 160 > formulation.PATCH_LIMIT >= 64 * 9 * 25 * 2
    x = torch.randn(160, 16, 9, 9, generator=torch.Generator().manual_seed(2))
    fn, params = xconv.to_jax(model)
    assert _convolutions(fn, params, x.numpy()) == 3
    got = np.asarray(jax.jit(fn)(params, x.numpy())[0])
    np.testing.assert_allclose(got, module(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_bfloat16_patches_match_the_convolution(net):
    _, x, model = net
    outs = {}
    for choice in ("auto", "reference"):
        with formulation.use(conv=choice):
            fn, params = xconv.to_jax(model, dtype="bfloat16")
            outs[choice] = np.asarray(jax.jit(fn)(params, x.numpy())[0], np.float32)
    scale = float(np.max(np.abs(outs["reference"])))
    assert float(np.max(np.abs(outs["auto"] - outs["reference"]))) <= 2e-2 * scale


@pytest.mark.parametrize(
    ("kernel", "padding", "groups", "dilations", "channels", "positions", "want"),
    [
        ((1, 1), ((0, 0), (0, 0)), 1, (1, 1), 8, 10**9, "pointwise"),
        ((1,), ((0, 0),), 1, (1,), 3, None, "pointwise"),
        ((1, 1), ((1, 1), (1, 1)), 1, (1, 1), 8, 4, None),  # padded, few channels
        ((3, 3), ((1, 1), (1, 1)), 1, (1, 1), 64, 49, "patches"),
        ((3, 3), ((1, 1), (1, 1)), 1, (1, 1), 64, None, "patches"),  # batch not known yet
        ((3, 3), ((1, 1), (1, 1)), 1, (1, 1), 63, 49, None),
        ((3, 3), ((1, 1), (1, 1)), 1, (1, 1), 64, 2**21 // 576 + 1, None),
        ((3, 3), ((1, 1), (1, 1)), 2, (1, 1), 64, 49, None),
        ((3, 3), ((2, 2), (2, 2)), 1, (2, 2), 64, 49, None),
        ((3, 3, 3), ((1, 1),) * 3, 1, (1, 1, 1), 64, 8, None),
        ((3, 3), ((-1, 0), (0, 0)), 1, (1, 1), 64, 49, None),
    ],
)
def test_which_convolutions_run_as_matmuls(
    kernel, padding, groups, dilations, channels, positions, want
):
    got = formulation.matmul_conv(kernel, padding, groups, dilations, channels, positions)
    assert got == want
    with formulation.use(conv="reference"):
        assert formulation.matmul_conv(kernel, padding, groups, dilations, channels) is None
