"""Parity at several shapes: a model with symbolic input dims is checked at two other
admissible shapes (``shape_small``, ``shape_large``) beside the example's.

A conversion that folds an example-shape constant (the sequence length in a mean, a causal
mask built at the example's length) is right at the example shape and wrong at every other:
it passed the check before these sets and fails it now. A right dynamic model passes with
the sets listed, a static model gets none, and a shape the source rejects is dropped with a
note instead of failing the conversion.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
import torch

import xconv
from xconv.parity.shapes import SymbolicShapes, from_model, shape_sets

Dim = torch.export.Dim


class Pool(torch.nn.Module):
    """A mean over the sequence written as ``sum / length``: a static trace folds the
    length into a constant."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h.sum(1) / x.shape[1]


class Causal(torch.nn.Module):
    """Causal self-attention without weights: a static trace keeps the mask at the example's
    length."""

    def forward(self, x):
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = (x @ x.transpose(1, 2)).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ x


class OnlyAtEight(Pool):
    """The same model with a source-side check: it rejects every sequence length but 8."""

    def forward(self, x):
        if x.shape[1] != 8:
            raise ValueError(f"this model runs at sequence length 8, not {x.shape[1]}")
        return super().forward(x)


def _x(batch=2, seq=8):
    return np.random.default_rng(0).uniform(-1, 1, (batch, seq, 4)).astype(np.float32)


def _dynamic(module, x):
    shapes = ({0: Dim.AUTO, 1: Dim.AUTO},)
    program = torch.export.export(module, (torch.from_numpy(x),), dynamic_shapes=shapes)
    return program, xconv.from_torch(program)


def _example_constant(module, x, dynamic_model):
    """A conversion that marks the inputs symbolic but folds example-shape sizes: the static
    trace's IR with the dynamic IR's input dims."""
    model = xconv.from_torch(torch.export.export(module, (torch.from_numpy(x),)))
    for bad, good in zip(model.graph.inputs, dynamic_model.graph.inputs, strict=True):
        bad.shape = good.shape
    return model


def _set_shapes(report):
    return {s["name"]: [tuple(i["shape"]) for i in s["inputs"]] for s in report.input_sets}


def test_sets_resize_shared_dims_together_and_keep_ids_and_masks_valid():
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 50, (2, 8))
    mask = np.ones((2, 8), np.int64)
    mask[1, 6:] = 0
    feats = rng.uniform(-2, 3, (2, 8, 4)).astype(np.float32)
    dims = SymbolicShapes((("b", "s"), ("b", "s"), ("b", "s", None)))
    got = shape_sets([ids, mask, feats], dims)
    assert not got.notes
    sets = dict(got.sets)
    assert [a.shape for a in sets["shape_small"]] == [(1, 5), (1, 5), (1, 5, 4)]
    assert [a.shape for a in sets["shape_large"]] == [(3, 12), (3, 12), (3, 12, 4)]
    small_ids, small_mask, _ = sets["shape_small"]
    large_ids, large_mask, large_feats = sets["shape_large"]
    np.testing.assert_array_equal(small_ids, ids[:1, :5])  # cropped: ids stay the example's
    np.testing.assert_array_equal(large_mask[1], np.r_[mask[1], mask[1, :4]])  # tiled
    assert set(np.unique(large_ids)) <= set(np.unique(ids))
    assert large_feats.dtype == np.float32 and -2 <= large_feats.min() < large_feats.max() <= 3
    assert not np.array_equal(large_feats[:2, :8], feats)  # floats drawn anew


def test_sizes_stay_within_limits_and_a_set_with_none_left_is_skipped_with_a_note():
    ids = np.zeros((2, 8), np.int64)
    limited = SymbolicShapes((("b", "s"),), {"b": (2, 64), "s": (2, 10)})
    sets = dict(shape_sets([ids], limited).sets)
    assert sets["shape_small"][0].shape == (2, 5)  # batch 1 is below the limit
    assert sets["shape_large"][0].shape == (3, 10)  # sequence capped at its max

    stuck = SymbolicShapes((("b", "s"),), {"b": (2, 2), "s": (8, 8)})
    got = shape_sets([ids], stuck)
    assert got.sets == []
    assert len(got.notes) == 2 and all("no symbolic dim" in n for n in got.notes), got.notes
    assert "'shape_small' skipped" in got.notes[0] and "s in [8, 8]" in got.notes[0]


def test_spatial_dims_step_by_their_stride_factor():
    x = np.zeros((2, 3, 32, 224), np.float32)
    got = dict(shape_sets([x], SymbolicShapes((("n", None, "h", "w"),))).sets)
    assert got["shape_small"][0].shape == (1, 3, 16, 192)
    assert got["shape_large"][0].shape == (3, 3, 48, 256)


def test_program_limits_reach_the_ir_names_by_position():
    x = _x()
    shapes = ({0: Dim("b", min=2, max=6), 1: Dim("s", min=3, max=9)},)
    program = torch.export.export(Pool(), (torch.from_numpy(x),), dynamic_shapes=shapes)
    model = xconv.from_torch(program)
    for value in model.graph.inputs:  # another naming of the same dims (by role)
        value.shape = ir.Shape([ir.SymbolicDim("batch"), ir.SymbolicDim("seq"), 4])
    dims = from_model(model, program)
    # torch.export's lower bound 2 (it specialises 0 and 1 while tracing) reads as 1: the
    # program runs at batch 1, and a source that does not is dropped with a note.
    assert dims.limits == {"batch": (1, 6), "seq": (3, 9)}
    sets = dict(shape_sets([x], dims).sets)
    assert sets["shape_small"][0].shape == (1, 5, 4)
    assert sets["shape_large"][0].shape == (3, 9, 4)


def test_right_dynamic_model_passes_at_every_shape_with_the_sets_listed():
    x = _x()
    program, model = _dynamic(Pool(), x)
    report = xconv.check_parity(program, xconv.to_jax(model), [x], devices="cpu", n_random=0)
    assert report.passed and report.policy.startswith("oracle"), report.summary()
    shapes = _set_shapes(report)
    assert shapes["shape_small"] == [(1, 5, 4)]  # Dim.AUTO's lower bound 2 reads as 1
    assert shapes["shape_large"] == [(3, 12, 4)]
    assert "shape_small (1, 5, 4), shape_large (3, 12, 4)" in report.summary()
    rows = {r.inputs for r in report.matrix if r.role == "candidate" and r.passed}
    assert {"shape_small", "shape_large"} <= rows


@pytest.mark.parametrize("module", [Pool, Causal], ids=["length-in-a-mean", "causal-mask"])
def test_example_shape_constant_passed_before_and_fails_now(module):
    x = _x()
    program, model = _dynamic(module(), x)
    bad = xconv.to_jax(_example_constant(module(), x, model))
    kw = {"devices": "cpu", "n_random": 0, "intermediates": False}
    before = xconv.check_parity(program, bad, [x], shapes=False, **kw)
    assert before.passed, before.summary()  # right at the example shape: the old check passed
    now = xconv.check_parity(program, bad, [x], **kw)
    assert not now.passed, now.summary()
    failing = {s["name"] for s in now.input_sets if not s["passed"]}
    assert failing == {"shape_small", "shape_large"}, now.summary()
    assert "failing input sets: shape_small, shape_large" in now.verdict


def test_static_model_gets_no_shape_sets_and_no_note_claiming_them():
    x = _x()
    program = torch.export.export(Pool(), (torch.from_numpy(x),))
    model = xconv.from_torch(program)
    report = xconv.check_parity(program, xconv.to_jax(model), [x], devices="cpu", n_random=0)
    assert report.passed
    assert [s["name"] for s in report.input_sets] == ["example", "zeros", "large"]
    assert not any("shape" in n for n in report.notes), report.notes


def test_a_shape_the_source_rejects_is_dropped_with_a_note_not_failed():
    x = _x()
    _, model = _dynamic(Pool(), x)
    report = xconv.check_parity(OnlyAtEight(), xconv.to_jax(model), [x], devices="cpu",
                                n_random=0)  # fmt: skip
    assert report.passed, report.summary()
    assert "shape_small" not in _set_shapes(report)  # seq 5: the source rejects it
    dropped = [n for n in report.notes if "shape not admissible by the source" in n]
    assert len(dropped) == 2 and "'shape_small' at (1, 5, 4)" in dropped[0], report.notes

    # The pipeline's layerwise route drops them before the blocks run, the same way.
    from xconv.pipeline.checks import _admissible_shapes

    sets = shape_sets([x], from_model(model))
    kept, ran = _admissible_shapes(OnlyAtEight(), sets)
    assert kept.sets == [] and ran == {}
    assert sum("shape not admissible by the source" in n for n in kept.notes) == 2


@pytest.mark.parametrize("parity", ["whole", "layerwise"])
def test_pipeline_checks_a_dynamic_pt2_at_other_shapes(tmp_path, parity):
    """``xconv.convert`` of a ``.pt2`` with symbolic batch and sequence: parity.json lists the
    shape sets, judged by the float64 oracle, whole and block by block."""
    x = _x()
    program, _ = _dynamic(Pool(), x)
    torch.export.save(program, tmp_path / "pool.pt2")
    options = xconv.ConvertOptions(parity=parity, devices="cpu", parity_random_inputs=0)
    result = xconv.convert(str(tmp_path / "pool.pt2"), source_kind="torch", target="jax",
                           out_dir=tmp_path / "out", options=options)  # fmt: skip
    saved = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert saved["passed"] and saved["policy"].startswith("oracle"), saved["notes"]
    assert not saved["downgrades"], saved["downgrades"]
    sets = {s["name"]: s["inputs"][0]["shape"] for s in saved["input_sets"]}
    assert sets["shape_small"] == [1, 5, 4] and sets["shape_large"] == [3, 12, 4]
    if parity == "layerwise":
        assert result.parity.scopes, "no block verdicts"
