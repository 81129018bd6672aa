"""benchmarks/profile_step.py: a step's median time, its top device ops from the profiler
trace, its optimized HLO, and the variant with matching parameters held fixed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytest.importorskip("flax")
pytest.importorskip("transformers")


def test_profiles_the_transformer_step_with_and_without_its_norms(tmp_path):
    from benchmarks import profile_step

    argv = ["--model", "transformer", "--batch", "1", "--dtype", "fp32", "--paths", "to_jax,hand"]
    argv += ["--freeze", "ln|norm", "--repeat", "2", "--profiled", "1", "--out", str(tmp_path)]
    assert profile_step.main(argv) == 0
    runs = json.loads((tmp_path / "profile.json").read_text())["runs"]
    assert set(runs) == {
        f"{p}-fp32-train{v}" for p in ("to_jax", "hand") for v in ("", "-frozen-ln_norm")
    }
    for label, run in runs.items():
        assert "error" not in run, run
        assert run["median_s"] > 0 and run["ops"] and run["total_ms"] > 0, label
        assert run["frozen"] == (18 if "frozen" in label else 0), label  # 4 blocks x 2 + 1 norm
        assert "ENTRY" in (tmp_path / f"{label}.hlo.txt").read_text()
