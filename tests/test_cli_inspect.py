"""``xconv inspect`` reports, per target, every registry the conversion uses: a model its
runtime covers but its source templates do not is "not covered", and the conversion then
fails naming the same op."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from onnx import TensorProto as T
from onnx import helper as h

import xconv
from xconv.cli import main
from xconv.inspect import summarize

pytest.importorskip("jax")
pytest.importorskip("torch")

#: An op both runtimes implement and neither source emitter has a template for.
_OP = "GlobalLpPool"


def _model(tmp_path):
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3, 4])
    y = h.make_tensor_value_info("y", T.FLOAT, [2, 3, 1])
    nodes = [h.make_node("Relu", ["x"], ["r"]), h.make_node(_OP, ["r"], ["y"])]
    proto = h.make_model(h.make_graph(nodes, "g", [x], [y]), opset_imports=[h.make_opsetid("", 23)])
    path = tmp_path / "m.onnx"
    path.write_bytes(proto.SerializeToString())
    return path


def test_summary_lists_each_registry_of_each_target(tmp_path):
    cov = summarize(xconv.load(_model(tmp_path))).coverage_by_target
    assert cov["jax"] == {"jax runtime": []}
    assert cov["flax"]["jax runtime"] == []
    assert [m.qualified_name for m in cov["flax"]["flax source templates"]] == [_OP]
    assert cov["torch"]["torch runtime"] == []
    assert [m.qualified_name for m in cov["torch"]["torch source templates"]] == [_OP]


@pytest.mark.parametrize(
    ("target", "label"), [("flax", "flax source templates"), ("torch", "torch source templates")]
)
def test_runtime_covers_templates_do_not_and_the_command_fails_on_that_op(tmp_path, target, label):
    path = _model(tmp_path)
    r = CliRunner().invoke(main, ["inspect", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "target jax: all ops supported (jax runtime)" in r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith(f"target {target}:"))
    assert "not covered" in line and f"{label} lacks {_OP} x1" in line, line
    assert "runtime lacks" not in line, line

    out = tmp_path / target
    r = CliRunner().invoke(main, [f"onnx-to-{target}", str(path), "-o", str(out)])
    assert r.exit_code == 4, r.output
    assert re.search(rf"- {_OP} x1\b", r.stderr), r.stderr
    assert not out.exists()
