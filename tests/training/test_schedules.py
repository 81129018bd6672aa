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


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adam(p, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        pytest.param(
            lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5), marks=pytest.mark.slow
        ),
        pytest.param(lambda p: torch.optim.NAdam(p, lr=0.01), marks=pytest.mark.slow),
    ],
    ids=["adam_betas", "sgd_nesterov", "rmsprop", "nadam"],  # the last two: test_train_matrix
)
def test_one_cycle_momentum_continues_and_goes_back(make):
    """OneCycleLR(cycle_momentum=True) anneals beta1 / momentum each step: converted after 7
    steps, the optax run follows torch's parameters (float64: to rounding), and the torch
    optimizer written back holds the momentum and OneCycleLR's group values."""
    import optax

    from xconv.training import to_torch_optimizer

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2).double()
    opt = make(m.parameters())
    sched = S.OneCycleLR(opt, max_lr=0.5, total_steps=30, pct_start=0.3)
    gen = torch.Generator().manual_seed(1)
    grads = [[torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in m.parameters()]
             for _ in range(25)]  # fmt: skip

    def torch_step(gs):
        for p, g in zip(m.parameters(), gs, strict=True):
            p.grad = g
        opt.step()
        sched.step()

    for gs in grads[:7]:
        torch_step(gs)
    with jax.enable_x64(True):
        variables = {
            "weight": m.weight.detach().numpy().copy(),
            "bias": m.bias.detach().numpy().copy(),
        }
        tx, state = from_torch_optimizer(opt, variables, scheduler=sched, model=m)
        params = jax.tree_util.tree_map(jax.numpy.asarray, variables)
        for gs in grads[7:]:
            torch_step(gs)
            updates, state = tx.update(
                {"weight": gs[0].numpy(), "bias": gs[1].numpy()}, state, params
            )
            params = optax.apply_updates(params, updates)
            np.testing.assert_allclose(
                params["weight"], m.weight.detach().numpy(), rtol=1e-12, atol=1e-14
            )
        back = to_torch_optimizer(tx, state, m)
    key = "betas" if "betas" in opt.param_groups[0] else "momentum"
    assert back.param_groups[0][key] == pytest.approx(opt.param_groups[0][key], rel=1e-12)
    assert opt.param_groups[0][key] != pytest.approx(
        sched.optimizer.param_groups[0]["max_momentum"]
    )
    for k in ("lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "initial_lr"):
        assert back.param_groups[0][k] == pytest.approx(opt.param_groups[0][k], rel=1e-12), k


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
