"""Every metric state renders in every report form: None (a block that could not run, an
output judged without an oracle), NaN and inf, in text, rich, HTML and JSON."""

from __future__ import annotations

import io
import json
import math

import pytest

from xconv.parity.localize import ScopeResult
from xconv.parity.metrics import Metrics
from xconv.parity.report import DeviceRun, ParityReport, format_metrics

FLOATS = ("max_abs", "max_rel", "mean_abs", "ulp_p99", "cosine", "argmax_agree", "topk_agree")
ORACLE = ("cand_err", "ref_err", "bound", "rtol", "atol", "excess")


def _metrics(value) -> Metrics:
    m = Metrics(name="out", passed=False, shape=(2, 3), dtype="float32", topk=5, mismatches=2)
    for f in (*FLOATS, *ORACLE):
        setattr(m, f, value)
    m.first_mismatch = (0, 1)
    m.worst = [{"index": [0, 1], "cand": value, "ref": 1.0, "oracle": None, "err": value,
                "bound": None}]  # fmt: skip
    return m


def _report(metrics: list[Metrics]) -> ParityReport:
    row = DeviceRun("flax", "cpu:0", "candidate", False, metrics)
    scopes = [ScopeResult(name=f"m.layers.{i}", index=i, output=m, inputs_ok=True,
                          status="diverged") for i, m in enumerate(metrics)]  # fmt: skip
    return ParityReport(
        passed=False,
        reference="torch",
        candidate="flax",
        policy="oracle",
        outputs=metrics,
        scopes=scopes,
        matrix=[row],
        grads=metrics,
        first_divergence="m.layers.0",
        policy_kind="oracle",
    )


def _every_form(report: ParityReport) -> list[str]:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    console.print(report)
    data = json.loads(report.to_json())
    return [str(report), console.file.getvalue(), report.to_html(), json.dumps(data)]


@pytest.mark.parametrize("value", [None, math.nan, math.inf, -math.inf, 0.0, 1e-7])
def test_every_metric_state_renders(value):
    m = _metrics(value)
    line = format_metrics(m)
    assert line.startswith("out [FAIL] [2, 3] float32")
    text, rich, page, data = _every_form(_report([m, _metrics(1.0)]))
    if value is None:
        assert "max_abs=-" in text  # None shows as a dash, not as a crash
    elif math.isnan(value):
        assert "max_abs=nan" in text
    assert "m.layers.0" in rich and "<svg" in page and '"passed": false' in data


def test_a_block_that_could_not_run_renders():
    """The layerwise row of a block whose float64 twin failed: no outputs, an error."""
    from xconv.parity.layerwise import Block, BlockResult

    block = Block("m.embed_tokens .. m.norm", ("n",), ("x",), ("y",), ())
    res = BlockResult(block, 0, False, [], "RuntimeError: Tensor dtype mismatch!")
    scope = res.as_scope()
    report = _report([_metrics(None)])
    report.scopes = [scope]
    report.first_divergence = block.name
    text, rich, page, data = _every_form(report)
    assert "Tensor dtype mismatch" in text and "m.embed_tokens .. m.norm" in rich
    assert "m.embed_tokens .. m.norm" in page and "m.embed_tokens .. m.norm" in data
