"""How the Flax emitter writes attention: a torch block that splits heads with
``view(b, t, h, d).transpose(1, 2)`` around ``F.scaled_dot_product_attention`` becomes one
``_dot_product_attention`` call (``jax.nn.dot_product_attention`` off the CPU) on the
untransposed (B, S, H, D) arrays; a float mask keeps the ``_attention`` helper. Both match
torch."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import xconv  # noqa: E402
from xconv.converters.flax.source.classes import merge_loops  # noqa: E402


class _Masked(torch.nn.Module):
    def forward(self, q, bias):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias)


def _run(tmp_path, module, inputs):
    model = xconv.from_torch(module, inputs)
    out = xconv.to_flax(model, tmp_path / "out", api="linen")
    src = (out / "model.py").read_text()
    spec = importlib.util.spec_from_file_location("gen_attention", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    flax_model, variables = mod.load(out)
    got = np.asarray(flax_model.apply(variables, *(x.numpy() for x in inputs)))
    with torch.no_grad():
        want = module(*inputs).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return src


def test_head_split_attention_is_one_dot_product_attention_call(tmp_path):
    from fixtures import torch_models

    torch.manual_seed(0)
    block = torch_models.SelfAttentionBlock(32, 4).eval()
    src = _run(tmp_path, block, (torch.randn(2, 10, 32),))
    body = src[src.index("\nclass ") :]  # the modules, after the helpers
    call = "jax.nn.dot_product_attention("
    assert body.count(call) == 1 and "is_causal=True)" in body.split(call, 1)[1].split("\n")[0]
    # the head transposes are gone: no helper, no transpose, no swap
    assert "def _" not in src[: src.index("\nclass ")]
    for gone in ("jnp.transpose", "swapaxes"):
        assert gone not in body


def test_float_mask_keeps_the_helper(tmp_path):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    bias = torch.randn(2, 4, 6, 6, generator=g)
    src = _run(tmp_path, _Masked().eval(), (q, bias))
    assert "def _attention(" in src and "_dot_product_attention" not in src


class _WideValues(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_values_with_their_own_head_size_keep_the_helper(tmp_path):
    """``jax.nn.dot_product_attention`` takes one head size; values of another (ONNX's
    ``Attention`` and torch allow it) are written with the ``_attention`` helper (the call
    raised ``value shape should be [2, 6, 3, 8]: but got (2, 6, 3, 10)``)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 6, 8, generator=g), torch.randn(2, 3, 6, 8, generator=g)
    v = torch.randn(2, 3, 6, 10, generator=g)
    src = _run(tmp_path, _WideValues().eval(), (q, k, v))
    assert "def _attention(" in src and "jax.nn.dot_product_attention" not in src


def test_merge_loops():
    body = [
        "for block in self.layer1:",
        "    x = block(x, train=train)",
        "for block in self.layer2:",
        "    x = block(x, train=train)",
        "for block in self.layer3:",
        "    h = block(x)",
        "return x",
    ]
    assert merge_loops(body) == [
        "for block in (*self.layer1, *self.layer2):",
        "    x = block(x, train=train)",
        "for block in self.layer3:",
        "    h = block(x)",
        "return x",
    ]
    two = ["for block in self.a:", "    x = block(x)", "    x = x + 1", "for block in self.b:"]
    assert merge_loops([*two, "    x = block(x)"]) == [*two, "    x = block(x)"]
