"""Every optimizer and scheduler through a training checkpoint, both directions.

For each case torch trains the tiny BatchNorm model ``K`` steps and saves ``{"model",
"optimizer", "scheduler", "step"}``; :func:`write_train_state` converts it into a linen folder
(Orbax state, ``train_config.json``, ``train.py``); ``train.py`` takes ``FLAX`` steps, which
must continue torch's own loss curve; the Flax state goes back to a torch checkpoint
(:func:`train_state_to_torch`) that a fresh torch optimizer and scheduler load and resume for
``BACK`` more steps, again on torch's curve. The schedules are chosen so that SequentialLR's
milestones and OneCycleLR's phase change fall inside the Flax and the resumed torch steps.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

from flax import serialization  # noqa: E402

import xconv  # noqa: E402
from tests.training.ckpt_setup import make_tiny  # noqa: E402
from xconv.errors import ConversionError  # noqa: E402
from xconv.training.names import match_leaves  # noqa: E402
from xconv.training.optimizers import _set_path  # noqa: E402
from xconv.training.state import train_state_to_torch, write_train_state  # noqa: E402

Opt, S = torch.optim, torch.optim.lr_scheduler
K, FLAX, BACK = 4, 2, 2  # torch steps before the checkpoint, Flax steps, resumed torch steps
TOL = 1e-4  # per-step loss relative difference (the bound)


def _step_lr(o):
    return S.StepLR(o, step_size=2, gamma=0.5)


def _groups(m):
    return [
        {"params": list(m.fc1.parameters()), "lr": 0.02, "weight_decay": 0.1},
        {"params": [*m.bn.parameters(), *m.fc2.parameters()], "lr": 0.005},
    ]


#: name -> (optimizer over the module, scheduler over the optimizer, --optimizer name)
OPTIMIZERS = {
    "sgd_nesterov_wd": (
        lambda m: Opt.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        _step_lr,
        None,
    ),
    "sgd_dampening_maximize": (
        lambda m: Opt.SGD(m.parameters(), lr=0.01, momentum=0.5, dampening=0.3, maximize=True),
        _step_lr,
        None,
    ),
    "adam_amsgrad": (
        lambda m: Opt.Adam(m.parameters(), lr=0.01, amsgrad=True, weight_decay=1e-3),
        _step_lr,
        None,
    ),
    "adamw": (lambda m: Opt.AdamW(m.parameters(), lr=0.01, weight_decay=0.1), _step_lr, None),
    "rmsprop_centered_momentum": (
        lambda m: Opt.RMSprop(m.parameters(), lr=0.005, centered=True, momentum=0.5),
        _step_lr,
        None,
    ),
    "adagrad": (
        lambda m: Opt.Adagrad(
            m.parameters(), lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1
        ),
        _step_lr,
        None,
    ),
    "adamax": (lambda m: Opt.Adamax(m.parameters(), lr=0.01), _step_lr, "Adamax"),
    "nadam": (lambda m: Opt.NAdam(m.parameters(), lr=0.01, weight_decay=1e-3), _step_lr, None),
    "radam": (lambda m: Opt.RAdam(m.parameters(), lr=0.01), _step_lr, "RAdam"),
    "param_groups": (lambda m: Opt.Adam(_groups(m)), _step_lr, None),
}


def _sgd(m):
    return Opt.SGD(m.parameters(), lr=0.05, momentum=0.9)


def _adam(m):
    return Opt.Adam(m.parameters(), lr=0.01)


SCHEDULERS = {
    "multistep": (_sgd, lambda o: S.MultiStepLR(o, milestones=[3, 5, 7], gamma=0.5), None),
    "exponential": (_adam, lambda o: S.ExponentialLR(o, gamma=0.8), None),
    "cosine": (_sgd, lambda o: S.CosineAnnealingLR(o, T_max=8, eta_min=1e-3), None),
    "linear": (_adam, lambda o: S.LinearLR(o, start_factor=0.2, total_iters=6), None),
    "constant": (_sgd, lambda o: S.ConstantLR(o, factor=0.3, total_iters=5), None),
    "polynomial": (_adam, lambda o: S.PolynomialLR(o, total_iters=7, power=2.0), None),
    "one_cycle_adam_betas": (_adam, lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=10,
                                                           pct_start=0.5), None),
    "one_cycle_sgd_momentum_linear": (_sgd, lambda o: S.OneCycleLR(
        o, max_lr=0.1, total_steps=10, pct_start=0.6, anneal_strategy="linear",
        three_phase=True), None),
    "sequential_warmup_cosine": (_adam, lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.1, total_iters=5), S.CosineAnnealingLR(o, T_max=6)],
        milestones=[5]), None),
    "sequential_three": (_sgd, lambda o: S.SequentialLR(
        o, [S.ConstantLR(o, factor=0.5, total_iters=2), S.ExponentialLR(o, gamma=0.7),
            S.StepLR(o, step_size=1, gamma=0.5)], milestones=[3, 6]), None),
}  # fmt: skip

#: The default suite: each optimizer once, each with another scheduler (all of them once).
PAIRS = {
    "sgd_nesterov_wd": "sequential_three",
    "sgd_dampening_maximize": "multistep",
    "adam_amsgrad": "exponential",
    "adamw": "sequential_warmup_cosine",
    "rmsprop_centered_momentum": "one_cycle_sgd_momentum_linear",
    "adagrad": "cosine",
    "adamax": "linear",
    "nadam": "one_cycle_adam_betas",
    "radam": "polynomial",
    "param_groups": "constant",
}
CASES = {
    **{f"{o}+{s}": (OPTIMIZERS[o][0], SCHEDULERS[s][1], OPTIMIZERS[o][2]) for o, s in PAIRS.items()},
    # slow: each optimizer with StepLR, each scheduler with SGD-momentum or Adam
    **{k: pytest.param(*v, marks=pytest.mark.slow) for k, v in {**OPTIMIZERS, **SCHEDULERS}.items()},
}  # fmt: skip


def _batches():
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g))
        for _ in range(K + FLAX + BACK)
    ]


def _torch_step(module, opt, sched, batch):
    x, y = batch
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(module(x), y)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny model converted once per API; each case rewrites its variables from its
    checkpoint through the torch -> Flax correspondence (no Flax path written here)."""
    model = xconv.from_torch(make_tiny(), (torch.randn(8, 6),))
    return {
        api: _base(model, tmp_path_factory.mktemp(api) / "out", api) for api in ("linen", "nnx")
    }


@pytest.fixture
def linen_base(bases):
    return bases["linen"]


def _base(model, out, api):
    module = make_tiny()
    folder = xconv.to_flax(model, out, api=api)
    variables = serialization.msgpack_restore((folder / "variables.msgpack").read_bytes())
    entries = {k: v for k, v in module.state_dict().items() if "num_batches" not in k}
    return folder, match_leaves(entries, variables)


def _folder_for(base, leaves, model_sd, dst):
    shutil.copytree(base, dst)
    variables = serialization.msgpack_restore((dst / "variables.msgpack").read_bytes())
    variables = {k: dict(v) for k, v in variables.items()}
    for name, leaf in leaves.items():
        _set_path(variables, leaf.path, leaf.to_flax(model_sd[name].numpy()))
    (dst / "variables.msgpack").write_bytes(serialization.msgpack_serialize(variables))
    return dst


def _train_py(folder):
    spec = importlib.util.spec_from_file_location(f"train_{folder.name}", folder / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("make_opt", "make_sched", "opt_name"), list(CASES.values()), ids=list(CASES)
)
def test_checkpoint_round_trip_continues_torchs_curve(
    make_opt, make_sched, opt_name, linen_base, tmp_path
):
    batches = _batches()
    module = make_tiny().train()
    opt = make_opt(module)
    sched = make_sched(opt)
    for b in batches[:K]:
        _torch_step(module, opt, sched, b)
    ckpt = copy.deepcopy(
        {"model": module.state_dict(), "optimizer": opt.state_dict(),
         "scheduler": sched.state_dict(), "step": K}
    )  # fmt: skip
    want = [_torch_step(module, opt, sched, b) for b in batches[K:]]
    assert max(want) - min(want) > 1e-4  # the curve moves over the compared steps

    # torch -> Flax: the converted state continues torch's curve.
    folder = _folder_for(*linen_base, ckpt["model"], tmp_path / "flax")
    write_train_state(folder, make_tiny(), ckpt, torch.nn.CrossEntropyLoss(), optimizer=opt_name)
    train = _train_py(folder)
    state, loss = train.load(folder)
    step = train.make_train_step(loss)
    got = []
    for x, y in batches[K : K + FLAX]:
        state, value = step(state, (x.numpy(),), y.numpy())
        got.append(float(value))
    np.testing.assert_allclose(got, want[:FLAX], rtol=TOL)

    # Flax -> torch: a fresh torch optimizer and scheduler resume from the written state.
    tree = {k: getattr(state, k) for k in ("step", "params", "batch_stats", "opt_state")}
    back = train_state_to_torch(folder, make_tiny(), state=tree)
    assert back["step"] == K + FLAX
    resumed = make_tiny()
    resumed.load_state_dict(back["model"])
    opt2 = make_opt(resumed)
    sched2 = make_sched(opt2)  # constructing it writes its values into the groups ...
    opt2.load_state_dict(back["optimizer"])  # ... which the checkpoint's groups replace
    sched2.load_state_dict(back["scheduler"])
    got += [_torch_step(resumed.train(), opt2, sched2, b) for b in batches[K + FLAX :]]
    np.testing.assert_allclose(got, want, rtol=TOL)
    for g_back, g_want in zip(opt2.param_groups, opt.param_groups, strict=True):
        assert g_back["lr"] == pytest.approx(g_want["lr"], rel=1e-6)
        for key in ("momentum", "betas"):
            if key in g_want:
                assert g_back[key] == pytest.approx(g_want[key], rel=1e-6)


NNX_CASES = ["adamw+sequential_warmup_cosine", "nadam+one_cycle_adam_betas",
             "sgd_nesterov_wd+sequential_three"]  # fmt: skip


@pytest.mark.parametrize(
    "case", [c if c == NNX_CASES[1] else pytest.param(c, marks=pytest.mark.slow) for c in NNX_CASES]
)
def test_nnx_optimizer_round_trip_continues_torchs_curve(case, bases, tmp_path):
    """The same for nnx: an ``nnx.Optimizer`` in Orbax, nnx's ``train.py``, and back."""
    make_opt, make_sched, opt_name = CASES[case]
    batches = _batches()
    module = make_tiny().train()
    opt = make_opt(module)
    sched = make_sched(opt)
    for b in batches[:K]:
        _torch_step(module, opt, sched, b)
    ckpt = copy.deepcopy(
        {"model": module.state_dict(), "optimizer": opt.state_dict(),
         "scheduler": sched.state_dict(), "step": K}
    )  # fmt: skip
    want = [_torch_step(module, opt, sched, b) for b in batches[K:]]

    folder = _folder_for(*bases["nnx"], ckpt["model"], tmp_path / "nnx")
    write_train_state(folder, make_tiny(), ckpt, torch.nn.CrossEntropyLoss(), optimizer=opt_name)
    train = _train_py(folder)
    model, optimizer, loss = train.load(folder)
    assert type(optimizer).__name__ == "Optimizer" and int(optimizer.step[...]) == K
    step = train.make_train_step(loss)
    got = [float(step(model, optimizer, (x.numpy(),), y.numpy())) for x, y in batches[K : K + FLAX]]
    np.testing.assert_allclose(got, want[:FLAX], rtol=TOL)

    back = train_state_to_torch(folder, make_tiny(), state=(model, optimizer))
    assert back["step"] == K + FLAX
    resumed = make_tiny()
    resumed.load_state_dict(back["model"])
    opt2 = make_opt(resumed)
    sched2 = make_sched(opt2)
    opt2.load_state_dict(back["optimizer"])
    sched2.load_state_dict(back["scheduler"])
    got += [_torch_step(resumed.train(), opt2, sched2, b) for b in batches[K + FLAX :]]
    np.testing.assert_allclose(got, want, rtol=TOL)


def test_lambda_lr_checkpoint_is_a_clear_error(linen_base, tmp_path):
    module = make_tiny()
    opt = _sgd(module)
    sched = S.LambdaLR(opt, lambda e: 0.9**e)
    ckpt = {"model": module.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "step": 0}  # fmt: skip
    folder = _folder_for(*linen_base, ckpt["model"], tmp_path / "flax")
    with pytest.raises(ConversionError, match="LambdaLR"):
        write_train_state(folder, make_tiny(), ckpt, torch.nn.CrossEntropyLoss())
    assert not (folder / "train_state").exists()
