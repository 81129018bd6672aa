from __future__ import annotations

import re

from click.testing import CliRunner

import xconv
from xconv.cli import main
from xconv.demo import build_demo_model


def test_version():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and xconv.__version__ in r.output


def test_inspect_prints_a_correct_op_histogram(tmp_path):
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    r = CliRunner().invoke(main, ["inspect", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    for op in ("Conv", "BatchNormalization", "Relu", "GlobalAveragePool", "Flatten", "Gemm"):
        assert re.search(rf"{op}\s+│\s+1\b", r.output), op
    assert "6 nodes" in r.output
    assert "opset ai.onnx 23" in r.output
    assert re.search(r"conv\s+│\s+224", r.output)  # 8*3*3*3 + 8 parameters


def test_inspect_corrupt_file_is_one_line_and_nonzero(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x12\x34garbage" * 10)
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == xconv.InvalidModelError.exit_code
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "corrupt" in r.stderr


def test_inspect_truncated_file(tmp_path):
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == xconv.InvalidModelError.exit_code
    assert "Traceback" not in r.output


def _boom(exc):
    def load(*args, **kwargs):
        raise exc

    return load


def test_unexpected_exception_is_one_paragraph_with_exit_10(tmp_path, monkeypatch):
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    monkeypatch.setattr(xconv, "load", _boom(RuntimeError("kaboom\nsecond line")))
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 10, r.output
    assert r.stdout == "" and "Traceback" not in r.stderr
    text = r.stderr.strip()
    assert text.startswith("error: ") and len(text.splitlines()) == 1, text
    assert "inspect failed on" in text and str(path) in text and "RuntimeError: kaboom" in text
    assert "--debug" in text and "second line" not in text


def test_debug_prints_the_full_traceback(tmp_path, monkeypatch):
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    monkeypatch.setattr(xconv, "load", _boom(RuntimeError("kaboom")))
    r = CliRunner().invoke(main, ["--debug", "inspect", str(path)])
    assert r.exit_code == 10
    assert "Traceback (most recent call last)" in r.stderr and "kaboom" in r.stderr
    # A ConversionError keeps its own exit code, with its traceback under --debug.
    monkeypatch.setattr(xconv, "load", _boom(xconv.InvalidModelError("bad file")))
    r = CliRunner().invoke(main, ["--debug", "inspect", str(path)])
    assert r.exit_code == 3 and "Traceback" in r.stderr and "error: bad file" in r.stderr


def test_known_failures_say_the_fix(tmp_path, monkeypatch):
    import errno

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    for exc, fix in (
        (MemoryError(), "ran out of memory"),
        (OSError(errno.ENOSPC, "No space left on device"), "disk is full"),
        (PermissionError(13, "Permission denied"), "permissions"),
    ):
        monkeypatch.setattr(xconv, "load", _boom(exc))
        r = CliRunner().invoke(main, ["inspect", str(path)])
        assert r.exit_code == 10 and fix in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_truncated_pt2_in_a_fresh_process_prints_no_framework_traceback(tmp_path):
    """torch.export logs a whole traceback for an unreadable archive; the user sees one
    line and exit code 3, and no output folder."""
    import os
    import subprocess
    import sys

    import pytest

    torch = pytest.importorskip("torch")
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(3, 2), (torch.randn(1, 3),)), path)
    path.write_bytes(path.read_bytes()[:-100])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TORCH_LOGS", None)
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "xconv.cli", "torch-to-onnx", str(path), "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    assert r.stderr.strip().startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()
