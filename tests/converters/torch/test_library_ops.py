"""Library custom ops (``torch.ops.<lib>.*``) before torch.onnx.

An op defined with ``torch.library.custom_op`` is replaced by its traced Python
implementation (a mixture-of-experts grouped matmul becomes an ``Einsum``); an op with only a
compiled kernel stops the import with one ``UnsupportedOpError`` naming every such op, its count
and module scope.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

import xconv  # noqa: E402
from xconv.errors import UnsupportedOpError  # noqa: E402


@torch.library.custom_op("xconv_test_moe::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("gnk,gkm->gnm", x, w)


@grouped_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])


_KERNELS = torch.library.Library("xconv_test_kernels", "DEF")
_KERNELS.define("fused_act(Tensor x) -> Tensor")
_KERNELS.impl("fused_act", lambda x: x * torch.sigmoid(x), "CPU")  # a "compiled" kernel
_KERNELS.impl("fused_act", lambda x: torch.empty_like(x), "Meta")


class Experts(torch.nn.Module):
    def __init__(self, kernel: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 8, 4))
        self.kernel = kernel

    def forward(self, x):
        y = torch.ops.xconv_test_moe.grouped_mm(x, self.w)
        return torch.ops.xconv_test_kernels.fused_act(y) if self.kernel else y


class Net(torch.nn.Module):
    def __init__(self, kernel: bool = False) -> None:
        super().__init__()
        self.experts = Experts(kernel)
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.out(self.experts(x))


def test_custom_op_is_traced_through_its_python_implementation():
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 3, 8)
    model = xconv.from_torch(net, (x,))
    ops = {n.op_type for n in model.graph}
    assert "Einsum" in ops
    fn, params = xconv.to_jax(model)
    with torch.no_grad():
        want = net(x).numpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(np.asarray(fn(params, x.numpy())[0]), want, rtol=1e-4, atol=1e-5)


def test_kernel_only_op_is_one_clear_error():
    net = Net(kernel=True).eval()
    with pytest.raises(UnsupportedOpError) as info:
        xconv.from_torch(net, (torch.randn(2, 3, 8),))
    text = str(info.value)
    assert "xconv_test_kernels::fused_act x1 (scope 'experts')" in text
    assert "no Python implementation" in text
    assert "grouped_mm" not in text  # traceable: not reported
    assert info.value.exit_code == UnsupportedOpError.exit_code


def test_transformers_grouped_mm_traces_through_a_loop_free_equivalent():
    """transformers' MoE ``grouped_mm_fallback`` loops over ``offs.tolist()`` (export cannot
    trace it); the importer's equivalent gives the same rows, with empty groups and rows past
    the last offset (zeros) included, and the op imports with the model's numbers."""
    pytest.importorskip("transformers.integrations.moe")
    from xconv.converters.torch.importer.rewrite import _grouped_mm_by_rows

    op = torch.ops.transformers.grouped_mm_fallback
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 4, generator=g), torch.randn(4, 4, 3, generator=g)
    for offs in ([2, 2, 5, 9], [0, 3, 3, 7], [9, 9, 9, 9]):
        offs = torch.tensor(offs)
        torch.testing.assert_close(_grouped_mm_by_rows(x, w, offs), op(x, w, offs))

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4, 3, generator=g))

        def forward(self, x):
            ids = x.abs().argmax(dim=1) % 4  # a data-dependent routing, as a router's top-1
            order = torch.argsort(ids)  # ties in any order: each row comes back to its place
            offs = torch.cumsum(torch.nn.functional.one_hot(ids, 4).sum(0), 0)
            out = op(x[order], self.w, offs)
            return torch.zeros_like(out).index_copy(0, order, out)

    net = Routed().eval()
    model = xconv.from_torch(net, (x,), static=True)
    fn, params = xconv.to_jax(model)
    for inputs in (x, torch.randn(9, 4, generator=g)):
        with torch.no_grad():
            want = net(inputs).numpy()
        got = np.asarray(fn(params, inputs.numpy())[0])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
