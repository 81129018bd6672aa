"""If and Scan in both source emitters: a torch.cond exported by xconv.from_torch (ONNX If)
and hand-built Scans (a cumulative sum, a simple RNN cell reading an outer weight by
closure), written as Flax and torch source with their bodies as nested functions, against
torch's own numbers or the Scan written out in numpy; the traced-condition If under jax.jit; the
generated code ruff-clean."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from tests.generated_lint import ruff_findings  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _sources(model, inputs, tmp_path):
    """The generated Flax (linen) module and torch source of ``model`` (each checked
    against its runtime on ``inputs``): ``(flax module, variables, torch module, texts)``."""
    out = xconv.to_flax(model, tmp_path / "flax", example_inputs=inputs)
    assert not ruff_findings(out / "model.py"), ruff_findings(out / "model.py")
    module, variables = _load_generated(out / "model.py").load(out)
    source, state = xconv.to_torch_source(model, example_inputs=inputs)
    (tmp_path / "torch_model.py").write_text(source)
    assert not ruff_findings(tmp_path / "torch_model.py"), ruff_findings(
        tmp_path / "torch_model.py"
    )
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    return module, variables, generated, (out / "model.py").read_text() + source


def _torch_run(module, inputs):
    with torch.no_grad():
        got = module(*(torch.as_tensor(x) for x in inputs))
    return [g.numpy() for g in (got if isinstance(got, tuple) else (got,))]


class _Branchy(torch.nn.Module):
    """A branch chosen by the data: torch.cond, which torch's exporter writes as ONNX If."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.cond(h.sum() > 0, lambda h: h * 2 + 1, lambda h: torch.sin(h) - 1, (h,))


def test_torch_cond_through_both_sources_matches_torch(tmp_path):
    torch.manual_seed(0)
    module = _Branchy().eval()
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    model = xconv.from_torch(module, (torch.as_tensor(x),))
    assert "If" in {n.op_type for n in model.graph}
    flax_module, variables, torch_module, text = _sources(model, (x,), tmp_path)
    assert "def then_branch():" in text and "def else_branch():" in text
    assert "_if(" in text and "bool(" in text
    jitted = jax.jit(flax_module.apply)
    for sample in (x, -x, x + 3.0, x - 3.0):  # both branches taken
        with torch.no_grad():
            want = module(torch.as_tensor(sample)).numpy()
        np.testing.assert_allclose(flax_module.apply(variables, sample), want, rtol=1e-5, atol=1e-5)
        # under jit the condition is traced: lax.cond
        np.testing.assert_allclose(jitted(variables, sample), want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_torch_run(torch_module, (sample,))[0], want, rtol=1e-5)


def _scan_model(*, rnn: bool) -> onnx.ModelProto:
    """A Scan over axis 1 of x [2, 5, 3]: a cumulative sum (its outputs read backwards), or
    an RNN cell ``h = tanh(h @ W + x_t)`` whose W lives in the outer graph."""
    f = TensorProto.FLOAT
    s_in = helper.make_tensor_value_info("s_in", f, [2, 3])
    x_t = helper.make_tensor_value_info("x_t", f, [2, 3])
    s_out = helper.make_tensor_value_info("s_out", f, [2, 3])
    y_t = helper.make_tensor_value_info("y_t", f, [2, 3])
    if rnn:
        nodes = [
            helper.make_node("MatMul", ["s_in", "W"], ["hw"]),
            helper.make_node("Add", ["hw", "x_t"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ]
    else:
        nodes = [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Mul", ["s_out", "s_out"], ["y_t"]),
        ]
    body = helper.make_graph(nodes, "body", [s_in, x_t], [s_out, y_t])
    scan = helper.make_node(
        "Scan",
        ["s0", "x"],
        ["s_final", "ys"],
        body=body,
        num_scan_inputs=1,
        scan_input_axes=[1],
        scan_output_axes=[1],
        scan_output_directions=[0 if rnn else 1],
    )
    weights = [
        helper.make_tensor(
            "W", f, [3, 3], np.random.default_rng(1).standard_normal(9).astype(np.float32)
        )
    ]
    graph = helper.make_graph(
        [scan],
        "scan",
        [
            helper.make_tensor_value_info("s0", f, [2, 3]),
            helper.make_tensor_value_info("x", f, [2, 5, 3]),
        ],
        [
            helper.make_tensor_value_info("s_final", f, [2, 3]),
            helper.make_tensor_value_info("ys", f, [2, 5, 3]),
        ],
        initializer=weights if rnn else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _numpy_scan(proto, s0, x, *, rnn: bool) -> list[np.ndarray]:
    """The Scan written out in numpy (onnx's reference evaluator scans axis 0 only)."""
    w = onnx.numpy_helper.to_array(proto.graph.initializer[0]) if rnn else None
    s, ys = s0, []
    for t in range(x.shape[1]):
        s = np.tanh(s @ w + x[:, t]) if rnn else s + x[:, t]
        ys.append(s if rnn else s * s)
    ys = np.stack(ys if rnn else ys[::-1], axis=1)
    return [s, ys]


@pytest.mark.parametrize("rnn", [False, True], ids=["cumsum", "rnn_cell"])
def test_scan_through_both_sources_matches_the_reference(rnn, tmp_path):
    proto = _scan_model(rnn=rnn)
    rng = np.random.default_rng(2)
    inputs = (
        rng.standard_normal((2, 3)).astype(np.float32),
        rng.standard_normal((2, 5, 3)).astype(np.float32),
    )
    want = _numpy_scan(proto, *inputs, rnn=rnn)
    model = xconv.load(proto)
    flax_module, variables, torch_module, text = _sources(model, inputs, tmp_path)
    assert "def scan_body(" in text and "lax.scan(" in text and "torch.stack(" in text
    flax_out = flax_module.apply(variables, *inputs)
    for got in (flax_out, jax.jit(flax_module.apply)(variables, *inputs)):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
    for g, w in zip(_torch_run(torch_module, inputs), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
