"""Real sizes end to end through the CLI (``-m slow``; run under the machine's heavy lock).

GPT-2 124M and a Llama-shape 0.8B (random weights from transformers configs) exported to
``.pt2``, then ``xconv torch-to-flax model.pt2`` as a user types it: exit 0, parity passed
under the oracle policy (float64 oracle, block by block at these sizes) and peak RSS within
2 x the model's bytes + 1.5 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._memory import run_measured

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def _export(builder: str, pt2: Path) -> None:
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]);"
        "from benchmarks import bench_scale as b; torch.manual_seed(0);"
        f"m, a = b.{builder}(); m.eval();"
        "torch.export.save(torch.export.export(m, a, strict=False), sys.argv[2])"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", code, str(ROOT), str(pt2)], check=True, env=env)


def _convert(pt2: Path, out: Path) -> tuple[int, float, str]:
    """Run the CLI; its exit code, its own peak RSS (GiB) and its output's tail."""
    argv = [sys.executable, "-m", "xconv.cli", "torch-to-flax", str(pt2), "-o", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    run = run_measured(argv, env=env, timeout=5400)
    return run.returncode, run.peak_gib, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["gpt2", "llama_08b"])
def test_real_size_torch_to_flax(tmp_path, builder):
    pt2 = tmp_path / "model.pt2"
    _export(builder, pt2)
    size = pt2.stat().st_size
    rc, peak_gib, log = _convert(pt2, tmp_path / "out")
    assert rc == 0, log
    report = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert report["passed"] and report["policy"].startswith("oracle"), report["notes"]
    assert len(report["scopes"]) >= 3  # judged block by block
    budget = 2 * size / GIB + 1.5
    assert peak_gib <= budget, f"peak RSS {peak_gib:.2f} GiB > {budget:.2f} GiB"
