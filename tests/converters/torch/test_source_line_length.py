"""The generated torch source keeps to 100 characters a line, laid out as ruff's formatter
would: ONNX backend cases whose calls, constants, nested function names or docstring passed
the line length, written with ``write_torch``, linted for E501 at 100 and run against
``xconv.to_torch``."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xconv  # noqa: E402
from tests.conformance import harness  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.converters.torch.runtime.dtypes import to_numpy, to_tensor  # noqa: E402
from xconv.converters.torch.source.write import write_torch  # noqa: E402

CASES = [
    "test_linear_attention_decode_step",  # a long keyword argument list
    "test_linear_attention_linear_expanded",  # a Scan body with long inlined-function names
    "test_nonmaxsuppression_suppress_by_IOU",  # the NMS helper's call
    "test_convtranspose",  # F.conv_transpose2d with every argument written
    "test_attention_4d_causal_expanded",  # a mask constant longer than a line
    "test_attention_4d_with_qk_matmul_softcap",  # a call subscripted by [:4]
]


@pytest.fixture(scope="module")
def cases() -> dict[str, harness.Case]:
    found = {}
    for name in CASES:
        found.update({c.name: c for c in harness.load_cases(("node",), pattern=name)})
    return found


@pytest.mark.parametrize("name", CASES)
def test_lines_fit_and_numbers_match(name, cases, tmp_path):
    case = cases[name]
    inputs = case.data_sets[0][0]
    model = xconv.load(case.model)
    out = write_torch(model, tmp_path / name)
    path = out / "model.py"
    findings = ruff_findings(path, line_length=100)
    assert findings == "", findings
    spec = importlib.util.spec_from_file_location(f"gen_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    generated = mod.load(out)
    runtime, _ = xconv.to_torch(model)
    with torch.no_grad():
        got = generated(*(to_tensor(x) for x in inputs))
        want = runtime(*(to_tensor(x) for x in inputs))
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(to_numpy(g), to_numpy(w), rtol=1e-5, atol=1e-6)


_LONG_STATEMENTS = [
    "def loop_body(SequenceMap_loop_body_itercount, SequenceMap_loop_body_cond_in, "
    "SequenceMap_loop_body_out0_in):",
    "    return SequenceMap_loop_body_cond_out, SequenceMap_loop_body_out0_out, "
    "SequenceMap_loop_body_out1_out",
    "    h = torch.cat([torch.tensor([[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], "
    "[0.0, 0.0]]], dtype=torch.float32), x_with_a_long_name_here], dim=2)",
    '    h = h + torch.tensor([[0.0, -float("inf"), -float("inf"), -float("inf"), -float("inf")], '
    '[0.0, 0.0, -float("inf"), -float("inf"), -float("inf")]], dtype=torch.float32)',
    "    h, h2 = _scan(scan_body, (torch.full((2, 4, 8, 8), 0.0, dtype=torch.float32),), "
    "(h, h2, h3, h4, h5, h6, h7))",
]


@pytest.mark.parametrize("line", _LONG_STATEMENTS)
def test_wrap_line_full_lays_out_as_ruff_format(line):
    """``wrap_line(..., full=True)`` writes what ``ruff format`` writes for the statement."""
    import subprocess
    import sys

    from xconv.converters.module_tree import wrap_line

    # a def on its own (with a body); any other statement inside one
    head, body = ("", "\n    pass") if line.startswith("def") else ("def f():\n", "")
    ruff = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--isolated", "--line-length", "100", "-"],
        input=head + line + body + "\n", capture_output=True, text=True, check=True,
    )  # fmt: skip
    wrapped = wrap_line(line, full=True)
    assert all(len(w) <= 100 for w in wrapped)
    assert head + "\n".join(wrapped) + body + "\n" == ruff.stdout


def test_a_wrapped_index_keeps_its_meaning():
    """A subscript split over lines takes no trailing comma: ``x[a,]`` indexes by the tuple
    ``(a,)`` (a long gather index made the Mamba2 source index wrongly)."""
    import ast

    from xconv.converters.module_tree import wrap_lines

    rows = ", ".join(f"[{i}]" for i in range(16))
    line = f"h4 = h4[torch.tensor([{rows}], dtype=torch.int64).long().unbind(-1)]"
    wrapped = wrap_lines(line, full=True)
    assert len(wrapped.splitlines()) > 1 and all(len(w) <= 100 for w in wrapped.splitlines())
    assert ast.dump(ast.parse(wrapped)) == ast.dump(ast.parse(line))
    assert wrapped.splitlines()[-2].strip() == ").long().unbind(-1)"


def test_wrap_lines_keeps_a_line_whose_layout_would_change_its_code(monkeypatch):
    """The safety net: a wrapped statement that parses to other code stays on its line."""
    from xconv.converters import module_tree

    line = "y = f(" + ", ".join(f"argument_{i}" for i in range(12)) + ")"
    monkeypatch.setattr(module_tree, "wrap_line", lambda *a, **k: ["y = (", "    g(1),", ")"])
    assert module_tree.wrap_lines(line, full=True) == line
