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
