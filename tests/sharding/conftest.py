"""The one 8-device worker launch the default sharding suite shares (``mesh_worker``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_mesh_worker(tmp_path_factory, mode: str) -> dict:
    """``python -m tests.sharding.mesh_worker`` on 8 forced CPU devices; its JSON findings."""
    out = tmp_path_factory.mktemp(f"mesh_{mode}") / "out.json"
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sharding.mesh_worker", str(out), mode],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> dict:
    """Every default-suite mesh case, the nnx case and the torch FSDP2/DDP case, one launch."""
    return run_mesh_worker(tmp_path_factory, "default")
