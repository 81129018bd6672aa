"""Training checkpoints through the CLI: torch trains 5 steps and saves ``{"model",
"optimizer", "scheduler", "step"}``; ``xconv torch-to-flax --train-state`` writes the Flax
training state (Orbax) and ``train.py``, whose restored state continues torch's loss curve;
``xconv weights flax-to-torch --train-state`` gives torch its optimizer state back."""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

from click.testing import CliRunner  # noqa: E402

from tests.training.ckpt_setup import make_tiny  # noqa: E402
from xconv.cli import main  # noqa: E402

BATCH = 8
FIRST, MORE = 5, 3


def _batches():
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randn(BATCH, 6, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
        for _ in range(FIRST + MORE)
    ]


def _step(module, opt, sched, batch):
    x, y = batch
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(module(x), y)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    module = make_tiny().train()
    opt = torch.optim.Adam(module.parameters(), lr=0.01, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    batches = _batches()
    for b in batches[:FIRST]:
        _step(module, opt, sched, b)
    ckpt = {
        "model": module.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": FIRST,
    }
    torch.save(ckpt, tmp / "ckpt.pt")
    saved = copy.deepcopy((module, opt, sched))
    torch_losses = [_step(module, opt, sched, b) for b in batches[FIRST:]]
    out = tmp / "flax"
    args = ["torch-to-flax", str(tmp / "ckpt.pt"), "--module",
            "tests.training.ckpt_setup:make_tiny", "--input-shape", f"{BATCH},6",
            "--train-state", "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    return out, batches, torch_losses, saved


def test_flax_state_continues_torchs_loss_curve(converted):
    out, batches, torch_losses, _ = converted
    assert (out / "train_state").is_dir() and (out / "train.py").is_file()
    spec = importlib.util.spec_from_file_location("xconv_train_py", out / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    state, loss = train.load(out)
    assert int(state.step) == FIRST and state.batch_stats
    step = train.make_train_step(loss)
    flax_losses = []
    for x, y in batches[FIRST:]:
        state, value = step(state, (x.numpy(),), y.numpy())
        flax_losses.append(float(value))
    np.testing.assert_allclose(flax_losses, torch_losses, rtol=1e-4)
    # Not vacuous: the curve moves over these steps.
    assert abs(torch_losses[-1] - torch_losses[0]) > 1e-3


@pytest.mark.parametrize("command", [["weights", "flax-to-torch"], ["flax-to-torch"]])
def test_reverse_restores_torchs_optimizer_state(converted, tmp_path, command):
    out, _, _, (module, opt, sched) = converted
    back = tmp_path / "back.pt"
    args = [*command, str(out), "--template",
            "tests.training.ckpt_setup:make_tiny", "--train-state", "-o", str(back)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    ckpt = torch.load(back, weights_only=True)
    assert ckpt["step"] == FIRST
    for k, v in module.state_dict().items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=1e-6, atol=1e-7)
    want, got = opt.state_dict(), ckpt["optimizer"]
    assert len(got["state"]) == len(want["state"]) == len(list(module.parameters()))
    for i, st in want["state"].items():
        for slot, value in st.items():
            torch.testing.assert_close(
                got["state"][i][slot].float(), value.float(), rtol=1e-6, atol=1e-8
            )
    for gw, gg in zip(want["param_groups"], got["param_groups"], strict=True):
        assert gg["lr"] == pytest.approx(gw["lr"])
    assert ckpt["scheduler"]["last_epoch"] == sched.last_epoch
    # The restored torch run continues: load it and take the same next step.
    resumed = make_tiny()
    resumed.load_state_dict(ckpt["model"])
    opt2 = torch.optim.Adam(resumed.parameters(), lr=0.01, weight_decay=1e-3)
    opt2.load_state_dict(ckpt["optimizer"])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(ckpt["scheduler"])
    x = _batches()[FIRST]
    a = _step(resumed.train(), opt2, sched2, x)
    b = _step(copy.deepcopy(module).train(), copy.deepcopy(opt), copy.deepcopy(sched), x)
    assert a == pytest.approx(b, rel=1e-6)


def test_flax_to_torch_train_state_needs_template(converted):
    out = converted[0]
    r = CliRunner().invoke(main, ["flax-to-torch", str(out), "--train-state"])
    assert r.exit_code == 2 and "--template" in r.output
    r = CliRunner().invoke(main, ["flax-to-torch", str(out / "train.py"), "-o", "x.pt"])
    assert r.exit_code == 2 and "--module" in r.output


@pytest.mark.slow
def test_nnx_train_state_through_the_cli(tmp_path):
    """``--api nnx --train-state``: an nnx.Optimizer in Orbax and nnx's train.py continue
    torch's curve; ``flax-to-torch --train-state`` gives torch its checkpoint back."""
    module = make_tiny().train()
    opt = torch.optim.Adam(module.parameters(), lr=0.01, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    batches = _batches()
    for b in batches[:FIRST]:
        _step(module, opt, sched, b)
    ckpt = copy.deepcopy({"model": module.state_dict(), "optimizer": opt.state_dict(),
                          "scheduler": sched.state_dict(), "step": FIRST})  # fmt: skip
    torch.save(ckpt, tmp_path / "ckpt.pt")
    torch_losses = [_step(module, opt, sched, b) for b in batches[FIRST:]]
    out = tmp_path / "nnx"
    args = ["torch-to-flax", str(tmp_path / "ckpt.pt"), "--module",
            "tests.training.ckpt_setup:make_tiny", "--input-shape", f"{BATCH},6", "--api", "nnx",
            "--train-state", "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    spec = importlib.util.spec_from_file_location("xconv_train_nnx", out / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    model, optimizer, loss = train.load(out)
    step = train.make_train_step(loss)
    got = [float(step(model, optimizer, (x.numpy(),), y.numpy())) for x, y in batches[FIRST:]]
    np.testing.assert_allclose(got, torch_losses, rtol=1e-4)
    back = tmp_path / "back.pt"
    args = ["flax-to-torch", str(out), "--train-state", "--template",
            "tests.training.ckpt_setup:make_tiny", "-o", str(back)]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    restored = torch.load(back, weights_only=True)
    assert restored["step"] == FIRST and restored["scheduler"]["last_epoch"] == FIRST
    for i, st in ckpt["optimizer"]["state"].items():
        for slot, value in st.items():
            torch.testing.assert_close(restored["optimizer"]["state"][i][slot].float(),
                                       value.float(), rtol=1e-6, atol=1e-8)  # fmt: skip
