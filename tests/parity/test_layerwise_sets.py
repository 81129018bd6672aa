"""The layerwise run takes every input set through each block at once: the same verdicts and
float64 outputs as one run per set, with each block's weights cast to float64 once."""

from __future__ import annotations

import numpy as np
import torch

import xconv
import xconv.parity.layerwise as lw


def test_sets_at_once_match_one_run_per_set_and_cast_weights_once(monkeypatch):
    from fixtures.torch_models import make_resnet

    module, inputs = make_resnet()
    program = torch.export.export(module, inputs)
    model = xconv.from_torch(program)
    x = np.asarray(inputs[0])
    rng = np.random.default_rng(0)
    sets = [("example", [x]), ("random", [rng.standard_normal(x.shape).astype(np.float32)])]

    casts = []
    to64 = lw._to_torch64

    def counting(torch_, x):
        casts.append(tuple(getattr(x, "shape", ())))
        return to64(torch_, x)

    monkeypatch.setattr(lw, "_to_torch64", counting)
    together = lw.run_layerwise_sets(program, model, sets)
    n_together = len(casts)
    casts.clear()
    apart = {name: lw.run_layerwise(program, model, xs) for name, xs in sets}
    n_apart = len(casts)

    n_weights = sum(len(b.block.weights) for b in together["example"].blocks)
    n_inputs = sum(len(b.block.inputs) for b in together["example"].blocks)
    assert n_together == n_weights + 2 * n_inputs  # weights once, block inputs per set
    assert n_apart == 2 * (n_weights + n_inputs)
    for name, _ in sets:
        a, b = together[name], apart[name]
        assert a.passed and b.passed
        assert [r.block.name for r in a.blocks] == [r.block.name for r in b.blocks]
        for x, y in zip(a.oracle_outputs, b.oracle_outputs, strict=True):
            np.testing.assert_array_equal(x, y)
        for ra, rb in zip(a.blocks, b.blocks, strict=True):
            assert [m.cand_err for m in ra.outputs] == [m.cand_err for m in rb.outputs]
    assert not np.array_equal(together["example"].oracle_outputs[0],
                              together["random"].oracle_outputs[0])  # fmt: skip


class _Stack(torch.nn.Module):
    """Three identical residual blocks between a stem and a head (as a decoder's layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU())
            for _ in range(3)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def test_identical_blocks_share_one_compiled_program(monkeypatch):
    """The candidate's blocks run under ``jax.jit``, one program per block structure: the
    three layers compile once between them, the verdicts and candidate errors agree with the
    op-by-op run, and a layer's planted fault is still found in that layer."""
    torch.manual_seed(0)
    module = _Stack().eval()
    x = torch.randn(2, 5, 8)
    program = torch.export.export(module, (x,))
    model = xconv.from_torch(program)
    sets = [("example", [x.numpy()])]
    compiled = []
    compile_ = lw.IRBlocks._compile
    monkeypatch.setattr(
        lw.IRBlocks, "_compile", lambda self, *a: compiled.append(a) or compile_(self, *a)
    )
    jitted = lw.run_layerwise_sets(program, model, sets)["example"]
    names = [r.block.name for r in jitted.blocks]
    assert sum(n.startswith("layers.") for n in names) == 3, names
    # stem, one program for the three layers, one for the residual adds between them, and
    # the last add with the head: 4 programs for 7 blocks
    assert len(names) == 7 and len(compiled) == 4, names
    monkeypatch.setattr(lw.IRBlocks, "_run_compiled", lambda self, *a: None)
    eager = lw.run_layerwise_sets(program, model, sets)["example"]
    assert jitted.passed and eager.passed
    for a, b in zip(jitted.blocks, eager.blocks, strict=True):
        for ma, mb in zip(a.outputs, b.outputs, strict=True):
            np.testing.assert_allclose(ma.cand_err, mb.cand_err, rtol=0.5, atol=1e-7)
    monkeypatch.undo()

    weight = next(n for n in model.graph.initializers if n.startswith("layers.1.1.weight"))
    value = model.graph.initializers[weight]
    value.const_value = ir_tensor(value.const_value.numpy() * 1.01)
    wrong = lw.run_layerwise_sets(program, model, sets)["example"]
    assert not wrong.passed
    assert next(r.block.name for r in wrong.blocks if not r.passed) == "layers.1"


def ir_tensor(arr):
    import onnx_ir as ir

    return ir.Tensor(np.ascontiguousarray(arr, dtype=np.float32))
