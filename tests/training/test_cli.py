"""``xconv train-check`` end to end, and the re-exports from ``xconv``."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flax")
pytest.importorskip("optax")

from click.testing import CliRunner  # noqa: E402

import xconv  # noqa: E402
from fixtures.torch_models import make_mlp  # noqa: E402
from xconv.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def mlp_folder(tmp_path_factory):
    module, (x,) = make_mlp()
    return xconv.to_flax(xconv.from_torch(module, (x,)), tmp_path_factory.mktemp("mlp") / "out")


def test_train_check_passes_and_writes_reports(mlp_folder, tmp_path):
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    args = ["train-check", "tests.training.cli_setup:mlp_setup", str(mlp_folder), "--trust-code"]
    r = CliRunner().invoke(main, [*args, "--json", str(out_json), "--html", str(out_html)])
    assert r.exit_code == 0, r.output
    assert "passed" in r.output and "dropout off" in r.output
    data = json.loads(out_json.read_text())
    assert data["passed"] and data["steps"] == 5 and len(data["torch_losses"]) == 5
    assert "<svg" in out_html.read_text()


def test_train_check_fails_with_exit_1_when_runs_part(mlp_folder):
    args = ["train-check", "tests.training.cli_setup:mlp_setup", str(mlp_folder), "--trust-code"]
    r = CliRunner().invoke(main, [*args, "--tol", "0", "--state-tol", "0"])
    assert r.exit_code == 1, r.output
    assert "training runs part" in r.output


def test_train_check_needs_trust_code(mlp_folder):
    r = CliRunner().invoke(
        main, ["train-check", "tests.training.cli_setup:mlp_setup", str(mlp_folder)]
    )
    assert r.exit_code == 2 and "--trust-code" in r.output


def test_reexports():
    from xconv import training

    assert xconv.check_training is training.check_training
    assert xconv.from_torch_optimizer is training.from_torch_optimizer
