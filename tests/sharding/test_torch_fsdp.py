"""Generated torch source (from a Flax model) under FSDP2 and DDP on 2 gloo CPU processes.

``fsdp_worker.run`` (called by the suite's one ``mesh_worker`` launch, ``conftest.py``)
converts the Flax transformer fixture to torch source, runs one training step in one process,
then the same step on 2 ranks (half the batch each) under ``fully_shard``
(``xconv.sharding.torch.fully_shard_generated``) and under DDP. torch.distributed runs in
its own processes, so the suite's process never initialises a process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *flags: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sharding.fsdp_worker", str(tmp_path), *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


def test_generated_torch_source_under_fsdp2_and_ddp_matches_one_process(default_run):
    r = default_run["torch_fsdp"]  # run by the shared worker launch (conftest.default_run)
    if "spawn_retried" in r:  # a rank died of a signal once (fsdp_worker.run); say so
        warnings.warn(f"gloo ranks spawned twice: {r['spawn_retried']}", stacklevel=1)
    assert r["single"]["vs_flax"] < 1e-5  # the generated module is the Flax model
    assert r["single"]["moved"] > 1e-3  # the step changed the weights
    fsdp = r["fsdp"]
    # Parameters really are sharded: DTensors, each rank holding about half of them.
    assert fsdp["dtensor"]
    assert all(n < 0.6 * fsdp["total_numel"] for n in fsdp["local_numel"])
    # FSDP units: every generated block class (one per source Flax module class) whole, and
    # the layers called directly by the root.
    assert fsdp["blocks"] and set(fsdp["blocks"]) <= set(fsdp["units"]), fsdp
    assert "Linear" in fsdp["units"]
    # Outputs of the two half-batches, and the parameters after one SGD step, equal the
    # single-process run (up to the float32 order of the gradient all-reduce).
    assert fsdp["out_max_abs"] <= 1e-6
    assert fsdp["param_max_abs"] <= 1e-6
    assert fsdp["ranks_agree"]
    assert r["ddp"]["out_max_abs"] <= 1e-6
    assert r["ddp"]["param_max_abs"] <= 1e-6


@pytest.mark.slow
def test_generated_torch_source_compiles(tmp_path):
    """torch.compile (inductor, CPU) of the generated module matches eager (~20 s)."""
    r = _run(tmp_path, "--compile")
    assert r["compile"]["max_abs"] <= 1e-5
