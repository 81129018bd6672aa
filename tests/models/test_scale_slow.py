"""Real sizes end to end through the CLI (``-m slow``; run under the machine's heavy lock).

GPT-2 124M and a Llama-shape 0.8B (random weights from transformers configs) exported to
``.pt2``, then ``xconv torch-to-flax model.pt2`` as a user types it, on both ends of the
supported transformers range (export and conversion under the same release): exit 0, parity
passed under the oracle policy with no downgrade (float64 oracle, block by block at these
sizes), peak RSS within 2 x the model's bytes + 1.5 GiB, and the parity check taking no
longer than the conversion.

The newest end is the installed release. The oldest is a folder holding it, installed with
``pip install --no-deps --target DIR transformers==<oldest>`` and named by
``XCONV_OLDEST_TRANSFORMERS=DIR``; it goes first on the children's ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._memory import run_measured

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
OLDEST = "XCONV_OLDEST_TRANSFORMERS"


def _pythonpath(release: str) -> str:
    if release == "newest":
        return str(ROOT)
    folder = os.environ.get(OLDEST)
    if not folder or not (Path(folder) / "transformers").is_dir():
        pytest.fail(
            f"the oldest supported transformers release is not set up: install it with "
            f"`pip install --no-deps --target DIR transformers==<oldest>` and set {OLDEST}=DIR"
        )
    return f"{folder}{os.pathsep}{ROOT}"


def _export(builder: str, pt2: Path, pythonpath: str) -> str:
    """Export under the release on ``pythonpath``; that release's version."""
    code = (
        "import sys, torch, transformers; sys.path.insert(0, sys.argv[1]);"
        "from benchmarks import bench_scale as b; torch.manual_seed(0);"
        f"m, a = b.{builder}(); m.eval();"
        "torch.export.save(torch.export.export(m, a, strict=False), sys.argv[2]);"
        "print(transformers.__version__)"
    )
    env = dict(os.environ, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), str(pt2)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip().splitlines()[-1]


def _convert(pt2: Path, out: Path, pythonpath: str) -> tuple[int, float, str]:
    """Run the CLI; its exit code, its own peak RSS (GiB) and its output's tail."""
    argv = [sys.executable, "-m", "xconv.cli", "torch-to-flax", str(pt2), "-o", str(out)]
    env = dict(os.environ, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", TERM="dumb")
    run = run_measured(argv, env=env, timeout=5400)
    return run.returncode, run.peak_gib, run.stdout[-3000:] + run.stderr[-3000:]


def _stages(log: str) -> dict[str, float]:
    """The CLI's ``seconds: load 9.2, import 10.8, ...`` line as a dict."""
    found = re.search(r"seconds: ([^\n]*)", log)
    pairs = (p.rsplit(" ", 1) for p in found.group(1).split(", ")) if found else ()
    return {k.strip(): float(v) for k, v in pairs}


@pytest.mark.slow
@pytest.mark.parametrize("release", ["oldest", "newest"])
@pytest.mark.parametrize("builder", ["gpt2", "llama_08b"])
def test_real_size_torch_to_flax(tmp_path, builder, release):
    pythonpath = _pythonpath(release)
    pt2 = tmp_path / "model.pt2"
    version = _export(builder, pt2, pythonpath)
    size = pt2.stat().st_size
    rc, peak_gib, log = _convert(pt2, tmp_path / "out", pythonpath)
    where = f"{builder} on transformers {version}"
    assert rc == 0, f"{where}: exit {rc}\n{log}"
    report = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert report["passed"] and report["policy"].startswith("oracle"), (where, report["notes"])
    assert report["downgrades"] == [], (where, report["downgrades"])
    assert len(report["scopes"]) >= 3, where  # judged block by block
    budget = 2 * size / GIB + 1.5
    assert peak_gib <= budget, f"{where}: peak RSS {peak_gib:.2f} GiB > {budget:.2f} GiB"
    stages = _stages(log)
    conversion = sum(v for k, v in stages.items() if k != "parity")
    assert stages["parity"] <= conversion, f"{where}: parity {stages} longer than conversion"
