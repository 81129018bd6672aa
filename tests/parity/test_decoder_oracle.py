"""The float64 oracle of a decoder's ``.pt2``, whole and block by block, on every supported
transformers release.

Each causal LM of the transformers zoo is built offline from a tiny config, exported as a user
exports a ``.pt2`` (``torch.export.export(model, (ids,), strict=False)``), converted
(``xconv.from_torch`` then ``xconv.to_jax``) and checked against its ``ExportedProgram``:

* whole: ``check_parity`` keeps the **oracle** policy (the program's float64 twin runs;
  transformers 5.23.0 pins float32 in a ``wrap_with_set_grad_enabled`` subgraph around the
  rotary tables, OPT in a ``torch.ones`` without a dtype and dtype asserts) and passes;
* layerwise: every block of ``split_program`` is cut (none merged: GPT-2's and OPT's final
  norm included) and judged under the oracle, and the verdict passes;
* a planted fault (one layer-1 weight of the candidate scaled by 1.001) fails both, and the
  layerwise run names that layer;
* exported with ``Dim.AUTO`` batch and sequence (Llama, GPT-2), the float64 oracle judges the
  example and the two other shapes the check adds (``shape_small``, ``shape_large``), block by
  block and through ``xconv.convert`` of the saved ``.pt2``.

CI runs this file on the newest transformers and again on the oldest supported release
(``.ci/run``, 5.23.0); each test id and failure message names the release it ran on.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")
transformers = pytest.importorskip("transformers")

import xconv  # noqa: E402
from tests.decoder_zoo import FAST, MOE, SLOW, tiny_decoder  # noqa: E402
from xconv.parity.layerwise import float64_program, split_program  # noqa: E402

TF = transformers.__version__
FAMILIES = [pytest.param(f, id=f"{f}-tf{TF}") for f in FAST] + [
    pytest.param(f, id=f"{f}-tf{TF}", marks=pytest.mark.slow) for f in SLOW
]


def test_runs_on_the_release_ci_asks_for():
    """``.ci/run`` sets ``XCONV_TRANSFORMERS`` for its oldest-release run: a path mix-up that
    imported the newest release instead fails here, not silently."""
    expected = os.environ.get("XCONV_TRANSFORMERS")
    assert expected in (None, TF), f"asked for transformers {expected}, imported {TF}"


def _export(family: str, dynamic: bool = False):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    cls, config = tiny_decoder(family)
    module = cls(config).eval()
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    shapes = None
    if dynamic:  # as a user exports a dynamic .pt2: torch chooses the symbols and ranges
        shapes = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
    program = torch.export.export(module, (ids,), strict=False, dynamic_shapes=shapes)
    return program, module, ids


DYNAMIC = [pytest.param(f, id=f"{f}-tf{TF}") for f in ("llama", "gpt2")]


def _shape_sets(report) -> dict[str, list[int]]:
    return {s["name"]: s["inputs"][0]["shape"] for s in report["input_sets"]}


@pytest.mark.parametrize("family", DYNAMIC)
def test_dynamic_shape_decoder_keeps_the_oracle_block_by_block(family):
    """Batch and sequence symbolic: the float64 twin runs, and the blocks are cut though
    the sizes cross them as ``sym_size`` ints the decompositions read anew; every block is
    judged at the example's shape and at the two other shapes the check adds."""
    program, _module, ids = _export(family, dynamic=True)
    where = f"dynamic-shape {family} on transformers {TF}"
    model = xconv.from_torch(program)
    fn, params = xconv.to_jax(model)
    report = xconv.check_parity(
        program, (fn, params), [ids.numpy()], devices="cpu", n_random=0, layerwise=model
    )
    assert report.policy.startswith("oracle") and report.passed, (where, report.notes)
    assert not report.downgrades, (where, report.downgrades)
    blocks = [b.name for b in split_program(program)]
    assert [s.name for s in report.scopes] == blocks, (where, "a block was merged", report.notes)
    sets = _shape_sets(report.to_dict())
    assert sets["shape_small"] == [1, 4] and sets["shape_large"] == [3, 9], (where, sets)


@pytest.mark.parametrize("family", DYNAMIC)
def test_dynamic_pt2_converts_with_the_oracle_at_every_shape(family, tmp_path):
    """A dynamic ``.pt2`` saved with ``torch.export.save`` and converted as the CLI converts
    it: parity.json judges the example and both other shapes by the float64 oracle (no
    noise-policy downgrade)."""
    program, _module, _ids = _export(family, dynamic=True)
    where = f"dynamic .pt2 {family} on transformers {TF}"
    torch.export.save(program, tmp_path / "model.pt2")
    options = xconv.ConvertOptions(devices="cpu", parity_random_inputs=0)
    xconv.convert(str(tmp_path / "model.pt2"), source_kind="torch", target="jax",
                  out_dir=tmp_path / "out", options=options)  # fmt: skip
    saved = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert saved["passed"] and saved["policy"].startswith("oracle"), (where, saved["notes"])
    assert not saved["downgrades"], (where, saved["downgrades"])
    sets = _shape_sets(saved)
    assert sets["shape_small"] == [1, 4] and sets["shape_large"] == [3, 9], (where, sets)
    assert all(s["passed"] for s in saved["input_sets"]), (where, saved["input_sets"])


def _layer_weight(model, program, rank: int = 2) -> tuple[str, str]:
    """The last 2-d weight of the second numbered layer (its MLP's output projection, which
    adds straight to the residual: a q-projection fault of 1e-3 can vanish in a nearly
    uniform softmax), and the block that reads it. ``rank=3``: the experts' stacked output
    projection of a mixture-of-experts layer (its last 2-d weight is a router, whose fault
    of 1e-3 seldom changes the experts chosen)."""
    blocks = split_program(program)
    for block in blocks[2:]:
        for name in reversed(block.weights):
            value = model.graph.initializers.get(name)
            if value is not None and value.const_value is not None and len(value.shape) == rank:
                return name, block.name
    raise AssertionError(f"no 2-d layer weight in {[b.name for b in blocks]}")


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_keeps_the_float64_oracle(family):
    program, module, ids = _export(family)
    where = f"{family} on transformers {TF}"
    inputs = [ids.numpy()]

    # The float64 twin runs, in float64, and agrees with the float32 model it doubles.
    (twin,) = float64_program(program)(ids)
    assert twin.dtype == torch.float64, where
    with torch.no_grad():
        want = module(ids).logits.double()
    torch.testing.assert_close(twin, want, rtol=1e-4, atol=1e-4, msg=where)

    model = xconv.from_torch(program)
    fn, params = xconv.to_jax(model)
    whole = xconv.check_parity(program, (fn, params), inputs, devices="cpu", n_random=0)
    assert whole.policy.startswith("oracle"), (where, whole.policy, whole.notes)
    assert whole.passed, (where, whole.notes)

    layers = xconv.check_parity(
        program, (fn, params), inputs, devices="cpu", n_random=0, layerwise=model
    )
    assert layers.policy.startswith("oracle"), (where, layers.policy, layers.notes)
    assert layers.passed, (where, layers.first_divergence, layers.notes)
    blocks = [b.name for b in split_program(program)]
    assert [s.name for s in layers.scopes] == blocks, (where, "a block was merged", layers.notes)

    # A planted fault: one layer weight of the candidate off by 1e-3.
    weight, block = _layer_weight(model, program, rank=3 if family in MOE else 2)
    value = model.graph.initializers[weight]
    good = value.const_value
    value.const_value = xconv_tensor(good.numpy() * 1.001)
    try:
        bad_fn, bad_params = xconv.to_jax(model)
        wrong = xconv.check_parity(program, (bad_fn, bad_params), inputs, devices="cpu",
                                   n_random=0, intermediates=False)  # fmt: skip
        assert not wrong.passed, (where, weight, wrong.notes)
        wrong = xconv.check_parity(program, (bad_fn, bad_params), inputs, devices="cpu",
                                   n_random=0, layerwise=model)  # fmt: skip
        assert not wrong.passed and wrong.first_divergence == block, (where, weight, wrong.notes)
    finally:
        value.const_value = good


def xconv_tensor(arr):
    import onnx_ir as ir

    return ir.Tensor(np.ascontiguousarray(arr, dtype=np.float32))
