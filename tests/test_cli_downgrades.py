"""A parity result is a verdict, never a crash, and a weaker proof says so: the CLI prints a
``warning:`` line for each downgrade (no float64 oracle, blocks merged, a layerwise run that
fell back to checking the whole model), its closing line names it, and ``parity.json`` lists
it under ``downgrades``."""

from __future__ import annotations

import html
import json

import numpy as np
import torch
from click.testing import CliRunner

import xconv
from xconv.cli import main


class Pinned(torch.nn.Module):
    """A model whose float64 twin cannot run: ``mix`` is a plain float32 attribute, which
    ``.double()`` leaves alone, so the float64 copy's matmul meets float32."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(16, 8)
        self.mix = torch.randn(8, 8, generator=g)

    def forward(self, x):
        return torch.tanh(self.lin(x)) @ self.mix


def make_pinned():
    torch.manual_seed(0)
    return Pinned().eval(), (torch.randn(4, 16, generator=torch.Generator().manual_seed(1)),)


def test_noise_policy_is_a_warning_and_in_the_closing_line(tmp_path):
    module, _ = make_pinned()
    ckpt = tmp_path / "pinned.pt"
    torch.save(module.state_dict(), ckpt)
    out = tmp_path / "pinned_flax"
    r = CliRunner().invoke(main, ["torch-to-flax", str(ckpt), "--module",
                                  "tests.test_cli_downgrades:make_pinned", "--input-shape",
                                  "4,16", "-o", str(out)], env={"COLUMNS": "200"})  # fmt: skip
    assert r.exit_code == 0, r.output
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and report["policy"].startswith("noise"), report["notes"]
    assert [d["kind"] for d in report["downgrades"]] == ["noise_policy"]
    assert "warning: no float64 oracle for the reference" in r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("parity passed (noise policy") and "a wrong model can pass" in last


def _pt2(tmp_path):
    from fixtures.torch_models import make_mlp

    module, inputs = make_mlp()
    pt2 = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(module, inputs), pt2)
    return pt2


def _block_fails(monkeypatch, n: int = -1):
    """Block ``n``'s float64 twin fails, as a graph that pins float32 did on transformers
    5.23.0 (``Tensor dtype mismatch``)."""
    import xconv.parity.layerwise as lw

    run_block = lw._run_block

    def failing(program, block, *args):
        if block.name == lw.split_program(program)[n].name:
            raise RuntimeError("Tensor dtype mismatch! Expected: Float, Got: double")
        return run_block(program, block, *args)

    monkeypatch.setattr(lw, "_run_block", failing)


def test_a_block_that_cannot_run_is_checked_whole_with_a_warning(tmp_path, monkeypatch):
    _block_fails(monkeypatch)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["torch-to-flax", str(_pt2(tmp_path)), "--parity", "layerwise",
                                  "-o", str(out)], env={"COLUMNS": "200"})  # fmt: skip
    assert r.exit_code == 0, r.output  # a right conversion: passes, checked whole
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] and report["policy"].startswith("oracle")
    kinds = [d["kind"] for d in report["downgrades"]]
    assert kinds == ["checked_whole"], report["downgrades"]
    assert "(RuntimeError: Tensor dtype mismatch" in report["downgrades"][0]["message"]
    assert "warning: layerwise parity could not run block" in r.output
    assert r.output.strip().splitlines()[-1].startswith("parity passed (checked whole")


def test_a_block_that_cannot_run_is_a_named_failure_in_check_parity(monkeypatch):
    """Through the API (no whole-model fallback) the block is the verdict: FAILED, named, and
    every report form renders its missing numbers."""
    from fixtures.torch_models import make_mlp

    _block_fails(monkeypatch)
    module, inputs = make_mlp()
    program = torch.export.export(module, inputs)
    x = [np.asarray(a) for a in inputs]
    fn, params = xconv.to_jax(xconv.from_torch(program))
    report = xconv.check_parity(program, (fn, params), x, devices="cpu", layerwise=True)
    assert not report.passed
    name = report.first_divergence
    assert name and f"block {name} could not run (RuntimeError: Tensor dtype" in report.verdict
    for text in (str(report), html.unescape(report.to_html()), report.to_json()):
        assert name in text
    assert report.closing == "parity FAILED (oracle policy)"
