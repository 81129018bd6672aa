"""``scaled_dot_product_attention`` of every form becomes one ONNX ``Attention`` node.

One module runs SDPA with a float mask and a scale, a bool mask, ``is_causal``, grouped
key/value heads (``enable_gqa``), one key/value head broadcast to every query head (multi-query
without ``enable_gqa``) and rank-3 inputs; it converts once and the IR's runtimes and both
generated sources must reproduce torch. ``nn.MultiheadAttention(need_weights=True)`` keeps its
explicit path (the weights are an output).
"""

from __future__ import annotations

import importlib.util
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
F = torch.nn.functional


class AllForms(torch.nn.Module):
    """Six SDPA calls, each a form torch.onnx's own path could not take, and an
    ``nn.MultiheadAttention`` asked for its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(16, 32)
        self.kv = torch.nn.Linear(16, 32)
        # Swin's relative position bias: a table indexed by a constant buffer.
        self.table = torch.nn.Parameter(torch.randn(11, 4))
        pos = torch.arange(6)
        self.register_buffer("index", (pos[:, None] - pos[None, :] + 5).reshape(-1))
        self.mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)  # (b, 4, s, 8)
        kv = self.kv(x).view(b, s, 4, 8).transpose(1, 2)
        k, v = kv[:, :2], kv[:, 2:]  # 2 kv heads
        bias = self.table[self.index].view(6, 6, 4).permute(2, 0, 1).unsqueeze(0)
        float_mask = F.scaled_dot_product_attention(q, q, q, attn_mask=bias, scale=0.5)
        keep = torch.ones(s, s, dtype=torch.bool).tril()
        bool_mask = F.scaled_dot_product_attention(q, kv, kv, attn_mask=keep)
        causal = F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        gqa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        mqa = F.scaled_dot_product_attention(q, k[:, :1], v[:, :1])  # broadcast 1 head
        flat = q.reshape(b * 4, s, 8)
        rank3 = F.scaled_dot_product_attention(flat, flat, flat, scale=0.25).view(b, 4, s, 8)
        # T5/Swin's layout step: transpose then view of the attention output.
        merged = float_mask.transpose(1, 2).contiguous().view(b, s, 32)
        _, weights = self.mha(x, x, x, need_weights=True)  # explicit path: weights are output
        return merged, bool_mask, causal, gqa, mqa, rank3, weights


def _torch(module, args):
    with torch.no_grad():
        out = module(*args)
    return [o.numpy() for o in (out if isinstance(out, tuple) else (out,))]


def _import(path):
    spec = importlib.util.spec_from_file_location(f"sdpa_{uuid.uuid4().hex}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _close(got, want) -> None:
    got = got if isinstance(got, tuple | list) else (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert np.abs(w).max() > 0.1  # a real reference, not zeros
        np.testing.assert_allclose(np.asarray(g), w, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def converted():
    """Converted from an ExportedProgram, which must come back unchanged."""
    torch.manual_seed(0)
    module = AllForms().eval()
    args = (torch.randn(2, 6, 16),)
    program = torch.export.export(module, args, strict=False)
    before = [str(n.target) for n in program.graph.nodes]
    model = xconv.from_torch(program)
    assert [str(n.target) for n in program.graph.nodes] == before
    assert sum("scaled_dot_product_attention" in t for t in before) == 6
    return module, args, model


def test_every_form_is_one_attention_node(converted):
    _, _, model = converted
    ops = [n.op_type for n in model.graph]
    assert ops.count("Attention") == 6
    assert ops.count("Softmax") == 1  # need_weights=True keeps its explicit path
    assert "GatherND" not in ops  # the one-index table lookup is a plain Gather
    causal = [
        n for n in model.graph if n.op_type == "Attention" and n.attributes["is_causal"].value
    ]
    assert len(causal) == 1
    scales = sorted(
        n.attributes["scale"].value
        for n in model.graph
        if n.op_type == "Attention" and "scale" in n.attributes
    )
    assert scales == [0.25, 0.5]


def test_every_form_runs_on_both_runtimes(converted):
    module, args, model = converted
    want = _torch(module, args)
    fn, params = xconv.to_jax(model)
    _close(fn(params, *[a.numpy() for a in args]), want)
    runtime, _ = xconv.to_torch(model)
    with torch.no_grad():
        _close([o.numpy() for o in runtime(*args)], want)


def test_every_form_in_generated_flax_and_torch_source(converted, tmp_path):
    module, args, model = converted
    want = _torch(module, args)
    out = xconv.to_flax(model, tmp_path / "linen")
    flax_model, variables = _import(out / "model.py").load(out)
    _close(flax_model.apply(variables, *[a.numpy() for a in args]), want)
    source, state = xconv.to_torch_source(model)
    namespace: dict = {}
    exec(compile(source, "generated", "exec"), namespace)
    generated = namespace["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        _close([o.numpy() for o in generated(*args)], want)
