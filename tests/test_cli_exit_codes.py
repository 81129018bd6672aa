"""Each row of README.md's exit-code table, reached through the CLI with tiny inputs.

The table is read from README.md, so a row added there without a case here fails
:func:`test_every_row_of_the_readme_table_has_a_case`. Exit code 10 is for errors xconv did
not expect: the usage errors (a missing flag, a path of the wrong kind, an untrusted file)
must exit 2 and name the flag that supplies what is missing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import xconv
from xconv.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _readme_codes() -> list[int]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return [int(code) for code in re.findall(r"^\|\s*(\d+)\s*\|", section, flags=re.M)]


def _onnx(path: Path, node, *, const: float | None = None, domain: str | None = None) -> Path:
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", T.FLOAT, [2, 3])
    inits = []
    if const is not None:
        inits.append(numpy_helper.from_array(np.full((2, 3), const, np.float32), "c"))
    opsets = [h.make_opsetid("", 23)] + ([h.make_opsetid(domain, 1)] if domain else [])
    proto = h.make_model(h.make_graph([node], "g", [x], [y], initializer=inits),
                         opset_imports=opsets)  # fmt: skip
    path.write_bytes(proto.SerializeToString())
    return path


def _add(path: Path, const: float) -> Path:
    return _onnx(path, h.make_node("Add", ["x", "c"], ["y"]), const=const)


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], env={"COLUMNS": "200"})


def _ok(tmp_path):
    r = _run("onnx-to-jax", _add(tmp_path / "m.onnx", 1.0), "-o", tmp_path / "out")
    assert (tmp_path / "out" / "parity.json").is_file()
    return r


def _parity_fails(tmp_path):
    return _run("check", _add(tmp_path / "a.onnx", 1.0), _add(tmp_path / "b.onnx", 1.5))


def _corrupt(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x12\x34garbage" * 10)
    return _run("onnx-to-jax", bad, "-o", tmp_path / "out")


def _unsupported_op(tmp_path):
    node = h.make_node("Frobnicate", ["x"], ["y"], domain="custom")
    return _run("onnx-to-jax", _onnx(tmp_path / "m.onnx", node, domain="custom"),
                "-o", tmp_path / "out", "--no-check")  # fmt: skip


def _unsupported_attribute(tmp_path):
    node = h.make_node("Gelu", ["x"], ["y"], approximate="cubic")
    return _run("onnx-to-flax", _onnx(tmp_path / "m.onnx", node), "-o", tmp_path / "out",
                "--no-check")  # fmt: skip


def _torch_files(tmp_path) -> dict[str, Path]:
    torch = pytest.importorskip("torch")
    from fixtures.torch_models import make_mlp

    module, _ = make_mlp()
    files = {"state_dict": tmp_path / "sd.pt", "pickled": tmp_path / "pickled.pt"}
    torch.save(module.state_dict(), files["state_dict"])
    torch.save(module, files["pickled"])
    return files


def _weights_do_not_fit(tmp_path):
    files = _torch_files(tmp_path)
    return _run("torch-to-onnx", files["state_dict"], "--module",
                "fixtures.torch_models:make_resnet", "-o", tmp_path / "out")  # fmt: skip


_BLOCKED = """
import sys
sys.modules["jax"] = None  # what Python does for a module that is not installed
from xconv.cli import main
main({args!r})
"""


def _missing_framework(tmp_path):
    model = _add(tmp_path / "m.onnx", 1.0)
    args = ["onnx-to-jax", str(model), "-o", str(tmp_path / "out")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run([sys.executable, "-c", _BLOCKED.format(args=args)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip

    class _Result:
        exit_code = r.returncode
        output = r.stdout + r.stderr

    return _Result()


def _unexpected(tmp_path, monkeypatch):
    path = _add(tmp_path / "m.onnx", 1.0)

    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(xconv, "load", boom)
    return _run("inspect", path)


#: exit code -> (how to reach it through the CLI, text its message must hold)
CASES = {
    0: (_ok, "parity PASSED"),
    1: (_parity_fails, "does not match"),
    2: (lambda tmp_path: _run("torch-to-flax", tmp_path), "not a save_pretrained folder"),
    3: (_corrupt, "corrupt"),
    4: (_unsupported_op, "Frobnicate"),
    5: (_unsupported_attribute, "approximate='cubic'"),
    6: (_weights_do_not_fit, "does not fit"),
    7: (_missing_framework, "pip install 'xconv[jax]'"),
    10: (_unexpected, "RuntimeError: kaboom"),
}


def test_every_row_of_the_readme_table_has_a_case():
    codes = _readme_codes()
    assert codes, "no exit-code table in README.md"
    assert sorted(codes) == sorted(CASES), f"README rows {codes}, cases {sorted(CASES)}"
    assert {cls.exit_code for cls in xconv.errors.EXIT_CODES} <= set(codes)


@pytest.mark.parametrize("code", sorted(CASES))
def test_readme_exit_code_row(tmp_path, monkeypatch, code):
    if code in (0, 1, 4, 5, 7):
        pytest.importorskip("jax")
        pytest.importorskip("onnxruntime")
    run, text = CASES[code]
    r = run(tmp_path, monkeypatch) if code == 10 else run(tmp_path)
    assert r.exit_code == code, r.output
    assert text in r.output, r.output
    if code:
        assert "Traceback" not in r.output, r.output


#: Usage errors: (arguments, the flag or hint the message must name). Files are made per case.
USAGE = {
    "state_dict without --module": (["torch-to-flax", "{state_dict}"], "--module"),
    "pickled module without --trust-pickle": (["torch-to-jax", "{pickled}"], "--trust-pickle"),
    "no example inputs": (["torch-to-jax", "{pickled}", "--trust-pickle"], "--input-shape"),
    "no MODEL": (["torch-to-flax"], "missing argument MODEL"),
    "a path that does not exist": (["torch-to-flax", "{tmp}/nothere.pt"], "does not exist"),
    "an ONNX folder": (["onnx-to-jax", "{tmp}"], "give the .onnx file"),
    "a generated folder without --trust-code": (["check", "{gen}", "{gen}"], "--trust-code"),
    "a malformed factory": (
        ["torch-to-flax", "{state_dict}", "--module", "nocolon"],
        "package.module:function",
    ),  # fmt: skip
    "a factory module that is not there": (
        ["torch-to-flax", "{state_dict}", "--module", "no_such_pkg.mod:make"],
        "cannot import",
    ),
    "inspect, a path that does not exist": (["inspect", "{tmp}/nothere.onnx"], "does not exist"),
    # one --input-shape grammar and error on every route (xconv.inputs)
    "a bad --input-shape, torch": (
        ["torch-to-jax", "{pickled}", "--trust-pickle", "--input-shape", "2,a"],
        "--input-shape '2,a': bad shape",
    ),
    "a bad --input-shape, ONNX": (
        ["onnx-to-flax", "{onnx}", "--input-shape", "2,a", "-o", "{tmp}/out"],
        "--input-shape '2,a': bad shape",
    ),
    "a bad --input-dtype, ONNX": (
        ["onnx-to-flax", "{onnx}", "--input-shape", "2x3", "--input-dtype", "f8", "-o", "{tmp}/o"],
        "unknown dtype 'f8'",
    ),
}


@pytest.mark.parametrize("case", sorted(USAGE))
def test_usage_errors_exit_2_naming_the_next_step(tmp_path, monkeypatch, case):
    monkeypatch.chdir(ROOT)  # the factories name modules of the repository (fixtures.*)
    args, text = USAGE[case]
    names = {"tmp": str(tmp_path)}
    if any("{state_dict}" in a or "{pickled}" in a for a in args):
        names.update({k: str(v) for k, v in _torch_files(tmp_path).items()})
    if any("{onnx}" in a for a in args):
        import onnx
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
        names["onnx"] = str(tmp_path / "relu.onnx")
        onnx.save(helper.make_model(graph), names["onnx"])
    if any("{gen}" in a for a in args):
        gen = tmp_path / "generated"
        gen.mkdir()
        (gen / "model.py").write_text("raise SystemExit('must not run')\n")
        (gen / "xconv.json").write_text("{}")
        names["gen"] = str(gen)
    r = _run(*(a.format(**names) for a in args))
    assert r.exit_code == 2, r.output
    assert text in r.output, r.output
    assert "Traceback" not in r.output and "did not expect" not in r.output, r.output
