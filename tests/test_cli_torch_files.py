"""``xconv torch-to-flax FILE`` for every PyTorch file a user holds, in one try: TorchScript
traced (its recorded inputs) and scripted, a pickled module (its ``example_input_array``),
a state_dict with ``--module``; a file that needs flags names every one at once (exit 2)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("flax")

from click.testing import CliRunner  # noqa: E402
from torch import nn  # noqa: E402

from xconv.cli import main  # noqa: E402

SHAPE = (1, 2, 6, 6)


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


class LitCNN(TinyCNN):
    """PyTorch Lightning's convention: the module names its example input."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = torch.randn(SHAPE)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return y * 2
        return y - 1


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return TinyCNN().eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-files")
    model, x = tiny_cnn(), torch.randn(SHAPE)
    paths = {k: root / f"{k}.pt" for k in ("traced", "scripted", "pickled", "lit", "state")}
    torch.jit.trace(model, (x,)).save(str(paths["traced"]))
    torch.jit.script(model).save(str(paths["scripted"]))
    torch.save(model, paths["pickled"])
    torch.manual_seed(0)
    torch.save(LitCNN().eval(), paths["lit"])
    torch.save(model.state_dict(), paths["state"])
    from safetensors.torch import save_file

    paths["safetensors"] = root / "weights.safetensors"
    save_file(model.state_dict(), str(paths["safetensors"]))
    paths["gate"] = root / "gate.pt"
    torch.jit.script(Gate().eval()).save(str(paths["gate"]))
    return paths


def _run(*argv: str):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _passed(out) -> bool:
    return json.loads((out / "parity.json").read_text())["passed"] is True


def test_traced_torchscript_needs_only_the_trust_flag(files, tmp_path):
    out = tmp_path / "out"
    argv = ("torch-to-flax", files["traced"], "-o", out, "--trust-pickle", "--devices", "cpu")
    r = CliRunner().invoke(main, [str(a) for a in argv], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert _passed(out)
    # The stage timings are one line at any width: scripts read them (bench_scale.py).
    seconds = next(line for line in r.output.splitlines() if line.startswith("seconds: "))
    assert "model.onnx" in seconds and "parity " in seconds, r.output
    # model.py names the source class, not torch.onnx's graph name.
    doc = (out / "model.py").read_text().split('"""')[1]
    assert f"{__name__}.TinyCNN" in doc and "main_graph" not in doc, doc


def test_scripted_torchscript_with_input_shape(files, tmp_path):
    out = tmp_path / "out"
    shape = ",".join(map(str, SHAPE))
    argv = ("torch-to-jax", files["scripted"], "-o", out, "--trust-pickle", "--input-shape", shape)
    r = _run(*argv, "--devices", "cpu")
    assert r.exit_code == 0, r.output
    assert _passed(out)


def test_pickled_module_with_example_input_array(files, tmp_path):
    out = tmp_path / "out"
    r = _run("torch-to-flax", files["lit"], "-o", out, "--trust-pickle", "--devices", "cpu")
    assert r.exit_code == 0, r.output
    assert _passed(out)


def test_state_dict_with_module(files, tmp_path):
    out = tmp_path / "out"
    factory = f"{__name__}:tiny_cnn"
    shape = ",".join(map(str, SHAPE))
    argv = ("torch-to-flax", files["state"], "-o", out, "--module", factory, "--input-shape", shape)
    r = _run(*argv, "--devices", "cpu")
    assert r.exit_code == 0, r.output
    assert _passed(out)


@pytest.mark.parametrize(
    ("kind", "flags"),
    [
        ("pickled", ["--trust-pickle", "--input-shape"]),
        ("scripted", ["--trust-pickle", "--input-shape"]),
        ("traced", ["--trust-pickle"]),  # it records its inputs
        ("lit", ["--trust-pickle"]),  # its pickle names example_input_array
        ("state", ["--module", "--input-shape"]),
        ("safetensors", ["--module", "--input-shape"]),
    ],
)
def test_every_missing_flag_named_at_once(files, tmp_path, kind, flags):
    r = _run("torch-to-flax", files[kind], "-o", tmp_path / "out")
    assert r.exit_code == 2, r.output
    named = [
        line.split()[0].rstrip(":") for line in r.stderr.splitlines() if line.startswith("  --")
    ]
    assert named == flags, r.stderr
    assert "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_scripted_branch_on_a_value_names_the_source_line(files, tmp_path):
    r = _run(
        "torch-to-flax",
        files["gate"],
        "-o",
        tmp_path / "o",
        "--trust-pickle",
        "--input-shape",
        "2,4",
    )
    assert r.exit_code == 5, r.output
    assert f"{__file__}:{Gate.forward.__code__.co_firstlineno + 2}" in r.stderr, r.stderr
    assert "if y.sum() > 0:" in r.stderr and "torch.jit.trace" in r.stderr
