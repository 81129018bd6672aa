"""Torch conversions are symbolic by default: every input dimension stays free unless the
model fixes it, named by role, and each fixed one is listed (``xconv.fixed_dims``) and
printed by the CLI. Numbers are checked against torch at several shapes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

from click.testing import CliRunner  # noqa: E402
from torch import nn  # noqa: E402

import xconv  # noqa: E402
from xconv.ir.metadata import fixed_dims  # noqa: E402


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


class FixesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).view(2, -1) * 2  # fixes the batch at 2


def dims(value) -> list:
    return [d.value if hasattr(d, "value") and not isinstance(d, int) else d for d in value.shape]


def torch_out(module, *args) -> np.ndarray:
    with torch.no_grad():
        out = module(*args)
    out = out[0] if isinstance(out, tuple | list) else getattr(out, "last_hidden_state", out)
    return out.numpy()


def test_cnn_symbolic_by_default_runs_at_three_shapes():
    torch.manual_seed(0)
    module = SmallCNN().eval()
    model = xconv.from_torch(module, torch.randn(1, 3, 8, 8))  # batch 1 stays symbolic
    (x,) = model.graph.inputs
    assert [str(d) for d in x.shape] == ["batch", "3", "height", "width"]
    assert [str(d) for d in model.graph.outputs[0].shape] == ["batch", "5"]
    (entry,) = fixed_dims(model)  # the convolution fixes the channels
    assert (entry["input"], entry["dim"], entry["size"], entry["reason"]) == ("x", 1, 3, "model")
    assert entry["source_line"].endswith(f"{__file__}:{_line_of('self.conv(x)')}")
    fn, params = xconv.to_jax(model)
    for shape in ((1, 3, 8, 8), (3, 3, 12, 10), (2, 3, 5, 7)):
        x = torch.randn(*shape)
        got = np.asarray(fn(params, x.numpy())[0])
        np.testing.assert_allclose(got, torch_out(module, x), rtol=1e-4, atol=1e-5)


def test_static_keeps_example_shapes():
    module = SmallCNN().eval()
    model = xconv.from_torch(module, torch.randn(2, 3, 8, 8), static=True)
    assert dims(model.graph.inputs[0]) == [2, 3, 8, 8]
    assert {e["reason"] for e in fixed_dims(model)} == {"static"}


def test_model_that_fixes_a_dim_lists_it():
    torch.manual_seed(0)
    module = FixesBatch().eval()
    model = xconv.from_torch(module, torch.randn(2, 5, 6))
    (x,) = model.graph.inputs
    assert [str(d) for d in x.shape] == ["2", "seq", "6"]
    fixed = {(e["input"], e["dim"]): e for e in fixed_dims(model)}
    assert fixed[("x", 0)]["size"] == 2
    assert fixed[("x", 0)]["source_line"].endswith(f":{_line_of('.view(2, -1)')}")
    fn, params = xconv.to_jax(model)
    for seq in (5, 3, 9):
        x = torch.randn(2, seq, 6)
        got = np.asarray(fn(params, x.numpy())[0])
        np.testing.assert_allclose(got, torch_out(module, x), rtol=1e-4, atol=1e-5)


def test_bert_wrapper_symbolic_batch_and_seq():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    bert = transformers.BertModel(cfg, add_pooling_layer=False).eval()

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    module = Wrapper().eval()
    ids = torch.randint(0, 100, (1, 8))
    model = xconv.from_torch(module, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    shapes = {v.name: [str(d) for d in v.shape] for v in model.graph.inputs}
    assert shapes["input_ids"] == ["batch", "seq"]
    # BERT reads the mask's batch by indexing, never equating it with the ids' batch: its own
    # symbol, so its own name.
    assert shapes["attention_mask"] == ["batch_2", "seq"]
    assert [str(d) for d in model.graph.outputs[0].shape] == ["batch", "seq", "32"]
    assert fixed_dims(model) == []
    fn, params = xconv.to_jax(model)
    for batch, seq in ((1, 8), (3, 12), (2, 5)):
        ids = torch.randint(0, 100, (batch, seq))
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        got = np.asarray(fn(params, ids.numpy(), mask.numpy())[0])
        np.testing.assert_allclose(got, torch_out(module, ids, mask), rtol=1e-4, atol=1e-5)


def test_role_names_are_unique_per_symbol():
    class Two(nn.Module):
        def forward(self, a, b):  # two independent batches and sequence lengths
            return a.sum(1), b.sum(1)

    model = xconv.from_torch(Two(), (torch.randn(2, 3, 4), torch.randn(5, 6, 4)))
    a, b = model.graph.inputs
    assert [str(d) for d in a.shape] == ["batch", "seq", "a_2"]
    assert [str(d) for d in b.shape] == ["batch_2", "seq_2", "b_2"]


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


@pytest.fixture
def saved_cnn(tmp_path):
    torch.manual_seed(0)
    module = SmallCNN().eval()
    x = torch.randn(1, 3, 8, 8)
    program = torch.export.export(module, (x,))
    path = tmp_path / "cnn.pt2"
    torch.export.save(program, path)
    return path


def test_cli_static_and_fixed_lines(saved_cnn, tmp_path, monkeypatch):
    from xconv.cli import main

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    # A .pt2 exported at static shapes: one line with how to export it dynamic.
    out = runner.invoke(main, ["torch-to-jax", str(saved_cnn), "-o", "static_pt2"])
    assert out.exit_code == 0, out.output
    assert "fixed at its example shapes" in out.output and "Dim.AUTO" in out.output
    report = json.loads((tmp_path / "static_pt2" / "parity.json").read_text())
    assert {e["reason"] for e in report["fixed_dims"]} == {"exported program"}
    # A state_dict through --module: symbolic, the channel dim printed as fixed.
    torch.save(SmallCNN().state_dict(), tmp_path / "cnn.pt")
    (tmp_path / "cnn_factory.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_symbolic_default import SmallCNN\n\ndef make():\n    return SmallCNN()\n"
    )
    args = ["torch-to-jax", "cnn.pt", "--module", "cnn_factory:make", "--input-shape", "2,3,8,8"]
    out = runner.invoke(main, [*args, "-o", "dyn"])
    assert out.exit_code == 0, out.output
    assert "fixed: input x dim 1 fixed at 3: the model fixes it at" in out.output
    report = json.loads((tmp_path / "dyn" / "parity.json").read_text())
    assert [(e["input"], e["dim"]) for e in report["fixed_dims"]] == [("x", 1)]
    out = runner.invoke(main, [*args, "--static", "-o", "stat"])
    assert out.exit_code == 0, out.output
    assert "--static: every input is fixed at its example shape" in out.output
    onnx_model = xconv.load(tmp_path / "stat" / "model.onnx")
    assert dims(onnx_model.graph.inputs[0]) == [2, 3, 8, 8]


def test_adaptive_pooling_keeps_its_spatial_dims_and_says_why():
    """torch.onnx writes an adaptive pooling's kernel from the example's size: pooled to 4x4,
    the spatial dims stay the example's (at 16x16 the ONNX pooled the wrong windows), the
    batch stays free, and the fixed dims say why."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64, 5),
    ).eval()  # fmt: skip
    model = xconv.from_torch(net, (torch.randn(1, 3, 32, 32),))
    (value,) = model.graph.inputs
    assert [getattr(d, "value", d) for d in value.shape] == ["batch", 3, 32, 32]
    reasons = {e["dim"]: e["reason"] for e in fixed_dims(model)}
    assert "adaptive_avg_pool2d to (4, 4)" in reasons[2] and "adaptive" in reasons[3]
    fn, params = xconv.to_jax(model)
    x = torch.randn(3, 3, 32, 32)
    np.testing.assert_allclose(np.asarray(fn(params, x)[0]), net(x).detach().numpy(), atol=1e-5)
