"""What the source wrote around its attention, recovered by ``xconv.ir.passes.attention`` for
the generated Flax and PyTorch sources: a causal mask a model builds from its input's sizes is
``is_causal=True``, and only such a mask (a sliding window, a mask that is not causal, and a
mask that reads data keep their own computation); keys and values repeated per query head as
transformers' ``repeat_kv`` does are the grouped ones (a repeat in another order is kept).
Every case matches torch at more than one batch and sequence length."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import xconv  # noqa: E402
from tests.converters.jax.generated import run_generated  # noqa: E402
from tests.torch_source import load_generated  # noqa: E402
from xconv.ir.passes.attention import fold_causal_masks  # noqa: E402

SHAPES = [(2, 6), (3, 9), (1, 1)]


class _Attend(torch.nn.Module):
    """Self-attention over (B, T, 16) whose boolean mask is built from T: ``kind`` "causal"
    (``i >= j``), "full" (``i >= 0``: every position), "window" (causal and ``i - j < 3``),
    "anti" (``i <= j``), or "data" (causal and the ``keep`` input's positions)."""

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
        elif self.kind == "full":
            mask = (i[:, None] >= 0).expand(t, t)
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
    ("kind", "folded"), [("causal", 1), ("full", 1), ("window", 0), ("anti", 0), ("data", 0)]
)
def test_only_a_causal_or_a_full_mask_from_sizes_is_folded(kind, folded):
    _, model = _convert(kind)
    copy = ir.from_proto(ir.to_proto(model))
    assert fold_causal_masks(copy) == folded
    attention = [n for n in copy.graph if n.op_type == "Attention"]
    assert len(attention) == 1
    has_mask = len(attention[0].inputs) > 3 and attention[0].inputs[3] is not None
    assert has_mask is not bool(folded)
    is_causal = attention[0].attributes.get("is_causal")
    assert (is_causal is not None and is_causal.as_int() == 1) is (kind == "causal")
    if folded:  # what computed the mask is gone: no range, comparison or expand is left
        ops = {n.op_type for n in copy.graph}
        assert not ops & {"Range", "GreaterOrEqual", "LessOrEqual", "Expand"}, ops


@pytest.mark.parametrize("kind", ["causal", "full", "window", "anti", "data"])
def test_generated_sources_match_torch_at_every_size(kind, tmp_path):
    module, model = _convert(kind)
    out = xconv.to_flax(model, tmp_path / "flax", api="linen")
    flax_src = (out / "model.py").read_text()
    torch_module, torch_src = load_generated(model, tmp_path)
    causal = kind == "causal"
    assert ("is_causal=True" in flax_src) is causal, flax_src
    assert ("is_causal=True" in torch_src) is causal, torch_src
    if kind in ("causal", "full"):  # no mask computed: the one attention call
        assert "arange" not in flax_src and "arange" not in torch_src
    for b, t in SHAPES:
        xs = _inputs(kind, b, t, seed=b * 100 + t)
        with torch.no_grad():
            want = module(*xs).numpy()
            got_torch = torch_module(*xs).numpy()
        got_flax, _ = run_generated(out, "linen", *(x.numpy() for x in xs))
        np.testing.assert_allclose(np.asarray(got_flax), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_torch, want, rtol=1e-5, atol=1e-5)


class _Grouped(torch.nn.Module):
    """Causal grouped-query attention over (B, T, 16): 4 query heads, 2 key / value heads,
    repeated to 4 as ``how`` says: "repeat_kv" (transformers': each head twice in a row),
    "tile" (``Tensor.repeat``: the heads in turn, another attention)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q = torch.nn.Linear(16, 16)
        self.kv = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 2, 4).permute(2, 0, 3, 1, 4)
        if self.how == "repeat_kv":
            k, v = (h[:, :, None, :, :].expand(b, 2, 2, t, 4).reshape(b, 4, t, 4) for h in (k, v))
        else:
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h.transpose(1, 2).reshape(b, t, 16)


@pytest.mark.parametrize(("how", "folded"), [("repeat_kv", 2), ("tile", 0)])
def test_repeated_keys_and_values_are_the_grouped_ones(how, folded, tmp_path):
    from xconv.ir.passes import canonicalize
    from xconv.ir.passes.attention import fold_repeated_kv

    torch.manual_seed(0)
    module = _Grouped(how).eval()
    model = xconv.from_torch(module, (torch.randn(2, 6, 16),))
    copy = canonicalize(ir.from_proto(ir.to_proto(model)))
    assert fold_repeated_kv(copy) == folded
    if folded:  # the repeats are gone: the attention reads 2 key / value heads
        (attention,) = [n for n in copy.graph if n.op_type == "Attention"]
        assert attention.inputs[1].shape[1] == 2 and attention.inputs[2].shape[1] == 2
        assert not {n.op_type for n in copy.graph} & {"Expand", "Tile"}
    out = xconv.to_flax(model, tmp_path / "flax", api="linen")
    flax_src = (out / "model.py").read_text()
    torch_module, torch_src = load_generated(model, tmp_path)
    assert ("enable_gqa=True" in torch_src) is bool(folded), torch_src
    assert ("broadcast_to" in flax_src) is not bool(folded), flax_src
    for b, t in SHAPES:
        (x,) = _inputs("causal", b, t, seed=b * 10 + t)
        with torch.no_grad():
            want = module(x).numpy()
            got_torch = torch_module(x).numpy()
        got_flax, _ = run_generated(out, "linen", x.numpy())
        np.testing.assert_allclose(np.asarray(got_flax), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_torch, want, rtol=1e-5, atol=1e-5)
