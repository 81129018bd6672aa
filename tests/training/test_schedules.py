"""torch learning-rate schedulers against their optax schedules, for three times the schedule's
length, fresh and continued from a scheduler already stepped (``last_epoch``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from xconv.errors import ConversionError  # noqa: E402
from xconv.training import from_torch_optimizer, schedule_for  # noqa: E402

S = torch.optim.lr_scheduler
L = 20  # schedule length (steps)

CASES = {
    "step": lambda o: S.StepLR(o, step_size=7, gamma=0.5),
    "multistep": lambda o: S.MultiStepLR(o, milestones=[3, 8, 8, 15], gamma=0.3),
    "exponential": lambda o: S.ExponentialLR(o, gamma=0.9),
    "cosine": lambda o: S.CosineAnnealingLR(o, T_max=L, eta_min=1e-3),
    "linear": lambda o: S.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=L),
    "constant": lambda o: S.ConstantLR(o, factor=0.25, total_iters=L // 2),
    "polynomial": lambda o: S.PolynomialLR(o, total_iters=L, power=2.0),
    "warmup_cosine": lambda o: S.SequentialLR(
        o,
        [
            S.LinearLR(o, start_factor=0.01, total_iters=5),
            S.CosineAnnealingLR(o, T_max=L - 5),
        ],
        milestones=[5],
    ),
    "three_stage": lambda o: S.SequentialLR(
        o,
        [
            S.ConstantLR(o, factor=0.5, total_iters=4),
            S.ExponentialLR(o, gamma=0.8),
            S.StepLR(o, step_size=3, gamma=0.5),
        ],
        milestones=[4, 10],
    ),
}


def _optimizer(lr=0.1):
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    return torch.optim.SGD([p], lr=lr), p


def _torch_lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_matches_torch_for_three_lengths(name):
    opt, _ = _optimizer()
    sched = CASES[name](opt)
    fn = schedule_for(sched)
    want = _torch_lrs(sched, opt, 3 * L)
    with jax.enable_x64(True):
        got = np.array([float(fn(e)) for e in range(3 * L)])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("anneal", ["cos", "linear"])
def test_one_cycle(three_phase, anneal):
    """OneCycleLR stops at total_steps (torch raises past it), so it is checked up to there."""
    opt, _ = _optimizer()
    sched = S.OneCycleLR(
        opt,
        max_lr=0.5,
        total_steps=L,
        pct_start=0.3,
        anneal_strategy=anneal,
        three_phase=three_phase,
        cycle_momentum=False,
    )
    fn = schedule_for(sched)
    want = _torch_lrs(sched, opt, L)
    with jax.enable_x64(True):
        got = np.array([float(fn(e)) for e in range(L)])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


def test_one_cycle_momentum_is_a_clear_error():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    with pytest.raises(ConversionError, match="cycle_momentum=False"):
        schedule_for(S.OneCycleLR(opt, max_lr=0.5, total_steps=10))


def test_lambda_lr_names_the_lambda():
    def warmup(epoch):
        return min(1.0, (epoch + 1) / 10)

    opt, _ = _optimizer()
    with pytest.raises(ConversionError, match="test_lambda_lr_names_the_lambda.<locals>.warmup"):
        schedule_for(S.LambdaLR(opt, warmup))
    with pytest.raises(ConversionError, match="ReduceLROnPlateau has no optax conversion"):
        schedule_for(S.ReduceLROnPlateau(opt))


@pytest.mark.parametrize("name", ["warmup_cosine", "multistep", "cosine"])
def test_converted_optimizer_continues_from_the_current_step(name):
    """Convert after 7 torch steps: the next optax updates use torch's next learning rates."""
    opt, p = _optimizer()
    sched = CASES[name](opt)
    for _ in range(7):
        p.grad = torch.ones(2, dtype=torch.float64)
        opt.step()
        sched.step()
    module = torch.nn.Module()
    module.p = p
    with jax.enable_x64(True):
        tx, state = from_torch_optimizer(
            opt, {"p": p.detach().numpy().copy()}, scheduler=sched, model=module
        )
        params = {"p": jax.numpy.asarray(p.detach().numpy().copy())}
        for _ in range(10):
            want = opt.param_groups[0]["lr"]
            updates, state = tx.update({"p": np.ones(2)}, state, params)
            np.testing.assert_allclose(-np.asarray(updates["p"]), want, rtol=1e-12)
            opt.step()
            sched.step()
