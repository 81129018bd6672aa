"""A torch-only install (``pip install -e ".[torch]"``, no jax) runs its directions."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import xconv
from tests.torch_source import load_generated
from xconv.cli import main
from xconv.demo import build_demo_model
from xconv.errors import MissingFrameworkError


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        y = torch.relu(self.norm(self.conv(x)))
        return self.fc(y.flatten(1)).softmax(-1)


@pytest.fixture(scope="module")
def net_and_ir():
    torch.manual_seed(0)
    net = _Net().eval()
    with torch.no_grad():
        net.norm.running_mean.uniform_(-0.5, 0.5)
        net.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 6, 6)
    return net, x, xconv.from_torch(net, (x,))


def test_jax_is_not_importable():
    for name in ("jax", "flax"):
        with pytest.raises(ImportError):
            importlib.import_module(name)


def test_from_torch_to_torch_matches_the_source(net_and_ir):
    net, x, model = net_and_ir
    with torch.no_grad():
        expected = net(x).numpy()
        module, _ = xconv.to_torch(model)
        got = module(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_to_torch_source_matches_the_source(net_and_ir, tmp_path):
    net, x, model = net_and_ir
    module, source = load_generated(model, tmp_path)
    module.eval()
    assert "import jax" not in source
    with torch.no_grad():
        np.testing.assert_allclose(module(x).numpy(), net(x).numpy(), rtol=1e-5, atol=1e-6)


def test_cli_onnx_to_torch(tmp_path):
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["onnx-to-torch", str(path), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "model.py").is_file() and _passed(out)


def _passed(out) -> bool:
    return json.loads((out / "parity.json").read_text())["passed"] is True


@pytest.mark.parametrize("shape", [["--input-shape", "2,3,6,6"], []], ids=["shape", "default"])
def test_cli_torch_to_onnx(net_and_ir, tmp_path, shape):
    """``pip install "xconv[torch]"`` completes the default conversion, parity included (its
    candidate runs on onnxruntime, which the extra installs)."""
    net, x, _ = net_and_ir
    pt2 = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(net, (x,)), pt2)
    out = tmp_path / "onnx"
    r = CliRunner().invoke(main, ["torch-to-onnx", str(pt2), "-o", str(out), *shape])
    assert r.exit_code == 0, r.output
    assert (out / "model.onnx").is_file() and _passed(out)
    assert "onnxruntime" in json.loads((out / "parity.json").read_text())["candidate"]


def test_missing_jax_is_the_not_installed_error(net_and_ir, tmp_path):
    with pytest.raises(MissingFrameworkError, match=r"xconv\[jax\]"):
        xconv.to_jax(net_and_ir[2])
    # The library calls that import the framework inside the call, not at attribute access.
    with pytest.raises(MissingFrameworkError, match=r"xconv\[jax\]"):
        xconv.to_flax(net_and_ir[2], tmp_path / "f")
    assert not (tmp_path / "f").exists()
    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    with pytest.raises(MissingFrameworkError, match=r"xconv\[jax\]"):
        xconv.convert(path, source_kind="onnx", target="flax", out_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()
    r = CliRunner().invoke(main, ["onnx-to-jax", str(path), "-o", str(tmp_path / "j")])
    assert r.exit_code == MissingFrameworkError.exit_code == 7, r.output
    assert "xconv[jax]" in r.output and "Traceback" not in r.output
