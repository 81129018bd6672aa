"""A causal mask a model builds from its input's sizes is written as ``is_causal=True`` in the
generated Flax and PyTorch sources (``xconv.ir.passes.causal``), and only such a mask: a
sliding window, a mask that is not causal, and a mask that reads data keep their own
computation. Every case matches torch at more than one batch and sequence length."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import xconv  # noqa: E402
from tests.converters.jax.generated import run_generated  # noqa: E402
from tests.torch_source import load_generated  # noqa: E402
from xconv.ir.passes.causal import fold_causal_masks  # noqa: E402

SHAPES = [(2, 6), (3, 9), (1, 1)]


class _Attend(torch.nn.Module):
    """Self-attention over (B, T, 16) whose boolean mask is built from T: ``kind`` "causal"
    (``i >= j``), "window" (causal and ``i - j < 3``), "anti" (``i <= j``), or "data" (causal
    and the ``keep`` input's positions)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x, keep=None):
        b, t, _ = x.shape
        q, k, v = self.proj(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(t, device=x.device)
        mask = i[:, None] >= i[None, :]
        if self.kind == "window":
            mask = mask & (i[:, None] - i[None, :] < 3)
        elif self.kind == "anti":
            mask = i[:, None] <= i[None, :]
        mask = mask[None, None].expand(b, 1, t, t)
        if self.kind == "data":
            mask = mask & keep[:, None, None, :]
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return h.transpose(1, 2).reshape(b, t, 16)


def _inputs(kind: str, b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, 16, generator=g)
    if kind != "data":
        return (x,)
    keep = torch.rand(b, t, generator=g) > 0.3
    keep[:, 0] = True  # every query keeps a key
    return x, keep


def _convert(kind: str):
    torch.manual_seed(0)
    module = _Attend(kind).eval()
    return module, xconv.from_torch(module, _inputs(kind, 2, 6))


@pytest.mark.parametrize(
    ("kind", "folded"), [("causal", 1), ("window", 0), ("anti", 0), ("data", 0)]
)
def test_only_a_causal_mask_from_sizes_becomes_is_causal(kind, folded):
    _, model = _convert(kind)
    copy = ir.from_proto(ir.to_proto(model))
    assert fold_causal_masks(copy) == folded
    attention = [n for n in copy.graph if n.op_type == "Attention"]
    assert len(attention) == 1
    has_mask = len(attention[0].inputs) > 3 and attention[0].inputs[3] is not None
    assert has_mask is not bool(folded)
    if folded:  # what computed the mask is gone: no range, comparison or expand is left
        ops = {n.op_type for n in copy.graph}
        assert not ops & {"Range", "GreaterOrEqual", "LessOrEqual", "Expand"}, ops


@pytest.mark.parametrize("kind", ["causal", "window", "anti", "data"])
def test_generated_sources_match_torch_at_every_size(kind, tmp_path):
    module, model = _convert(kind)
    out = xconv.to_flax(model, tmp_path / "flax", api="linen")
    flax_src = (out / "model.py").read_text()
    torch_module, torch_src = load_generated(model, tmp_path)
    causal = kind == "causal"
    assert ("is_causal=True" in flax_src) is causal, flax_src
    assert ("is_causal=True" in torch_src) is causal, torch_src
    if causal:
        assert "arange" not in flax_src and "arange" not in torch_src
    for b, t in SHAPES:
        xs = _inputs(kind, b, t, seed=b * 100 + t)
        with torch.no_grad():
            want = module(*xs).numpy()
            got_torch = torch_module(*xs).numpy()
        got_flax, _ = run_generated(out, "linen", *(x.numpy() for x in xs))
        np.testing.assert_allclose(np.asarray(got_flax), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_torch, want, rtol=1e-5, atol=1e-5)
