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
