"""Sizes in generated Flax are Python expressions (``xconv/converters/flax/source/sizes.py``).

A symbolic model's sizes (``Shape → Squeeze → Reshape``, ``Concat`` with constants) are read
as ``x.shape[1]`` by the ops that take them (a slice bound, a broadcast target, a range), with
no numpy plumbing; the generated module runs under ``jax.jit`` at shapes other than the
example's and matches torch. A local a size expression reads is not rebound while the size
still has readers.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xconv  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


class Positions(torch.nn.Module):
    """Rebinds ``x`` (to a tensor whose dim 1 is another size) before the slice that reads
    the input's length; the sum over the rebound ``x`` broadcasts to a size-built shape."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(64, dtype=torch.float32)[None] / 7)
        self.lin = torch.nn.Linear(6, 6)
        self.cls = torch.nn.Parameter(torch.randn(1, 1, 6))

    def forward(self, x):  # (batch, seq, 6)
        n = x.shape[1]
        x = self.lin(x).transpose(1, 2)  # (batch, 6, seq): dim 1 is no longer seq
        first = self.cls.expand(x.shape[0], -1, -1)  # (batch, 1, 6)
        pos = torch.arange(n).float()
        return x.sum(1) + self.table[:, :n] + pos, first


def _generated(tmp_path, module, example):
    model = xconv.from_torch(module, (example,))
    out = xconv.to_flax(model, tmp_path / "out")
    source = (out / "model.py").read_text()
    flax_module, variables = _load_generated(out / "model.py").load(out)
    return source, jax.jit(flax_module.apply), variables


def test_sizes_are_expressions_and_a_read_name_is_not_rebound(tmp_path):
    torch.manual_seed(0)
    module = Positions().eval()
    source, apply, variables = _generated(tmp_path, module, torch.randn(5, 7, 6))
    call = source.split("def __call__", 1)[1].split("\ndef load(")[0]
    assert "x.shape[1]]" in call and "x.shape[0], 1, 6)" in call, call
    assert "np.arange(x.shape[1]" in call, call
    for plumbing in ("np.squeeze", "np.concatenate", "_slice(", "broadcast_shapes", "+ 0"):
        assert plumbing not in call, (plumbing, call)
    for shape in ((5, 7, 6), (1, 3, 6), (3, 11, 6)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
        with torch.no_grad():
            want = [t.numpy() for t in module(x)]
        got = apply(variables, x.numpy())
        for w, g in zip(want, got, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=str(shape))


def test_a_size_only_as_far_as_its_rank_is_kept(tmp_path):
    """An unsqueezed shape vector is 2-D (not a size): the generated source computes it as
    ONNX does, and the sizes beside it (a squeezed dim, a sum) keep their values."""
    import onnx
    from onnx import TensorProto, helper

    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Unsqueeze", ["s", "axes"], ["grid"]),  # (1, 2)
            helper.make_node("Add", ["s", "one"], ["plus"]),  # (2,)
        ],
        "sizes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [
            helper.make_tensor_value_info("grid", TensorProto.INT64, [1, 2]),
            helper.make_tensor_value_info("plus", TensorProto.INT64, [2]),
        ],
        initializer=[axes, one],
    )
    path = tmp_path / "sizes.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    out = xconv.to_flax(xconv.load(path), tmp_path / "out")
    module, variables = _load_generated(out / "model.py").load(out)
    for n in (2, 5):
        grid, plus = module.apply(variables, np.zeros((n, 3), np.float32))
        np.testing.assert_array_equal(np.asarray(grid), [[n, 3]])
        np.testing.assert_array_equal(np.asarray(plus), [n + 1, 4])
