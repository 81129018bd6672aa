"""The pytest plugin: assert_parity messages, the xconv_parity fixture, --xconv-devices."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from xconv.testing import assert_parity, parse_devices

ROOT = Path(__file__).resolve().parents[2]


def test_plugin_module_imports_no_framework():
    code = (
        "import sys, xconv.testing; "
        "bad = [m for m in ('torch', 'jax', 'tensorflow', 'flax', 'onnxruntime') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_assert_parity_message_names_metrics_and_scope():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).eval()
    cand = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).eval()
    cand.load_state_dict(ref.state_dict())
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    assert assert_parity(ref, cand, x).passed
    with torch.no_grad():
        cand[2].weight.mul_(1.01)
    with pytest.raises(AssertionError) as info:
        assert_parity(ref, cand, x)
    msg = str(info.value)
    assert "parity FAILED" in msg and "max_abs=" in msg and "cos=" in msg
    assert "first divergence: scope '2'" in msg


def test_parse_devices():
    assert parse_devices("all") == "all"
    assert parse_devices("cpu, cuda:0") == ["cpu", "cuda:0"]


def test_fixture_and_option_in_a_pytest_run(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            import numpy as np, torch

            def test_ok(xconv_parity, request):
                assert request.config.getoption("--xconv-devices") == "cpu"
                m = torch.nn.Linear(3, 2)
                report = xconv_parity(m, m, np.ones((2, 3), np.float32))
                assert {r.device for r in report.matrix} == {"cpu"}

            def test_bad(xconv_parity):
                a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
                xconv_parity(a, b, np.ones((2, 3), np.float32))
            """
        )
    )
    installed = any(
        e.value == "xconv.testing" for e in importlib.metadata.entry_points(group="pytest11")
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    if not installed:  # editable install predating the entry point
        args[3:3] = ["-p", "xconv.testing"]
    args += ["--xconv-devices", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in out, out
    assert "xconv parity check failed" in out
