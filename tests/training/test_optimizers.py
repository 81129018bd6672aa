"""Every converted torch optimizer against torch itself, step by step.

A small module's parameters get the same gradient sequence on both sides; after each step the
optax parameters must equal torch's (float64: to rounding; float32: to float32 noise). Runs
start fresh and mid-run (torch steps first, then its state is converted), so the mapped state
(``exp_avg``, ``momentum_buffer``, ``step``, ...) is checked, not only the update rule.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from xconv.errors import ConversionError  # noqa: E402
from xconv.training import from_torch_optimizer  # noqa: E402

optim = torch.optim

CASES = {
    "sgd": lambda p: optim.SGD(p, lr=0.1),
    "sgd_momentum_dampening": lambda p: optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3),
    "sgd_nesterov_wd": lambda p: optim.SGD(
        p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2
    ),
    "sgd_maximize": lambda p: optim.SGD(p, lr=0.05, momentum=0.5, maximize=True),
    "adam": lambda p: optim.Adam(p, lr=1e-2),
    "adam_amsgrad_wd": lambda p: optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.1, eps=1e-3),
    "adamw": lambda p: optim.AdamW(p, lr=1e-2, weight_decay=0.5, betas=(0.8, 0.95)),
    "adamw_amsgrad_max": lambda p: optim.AdamW(p, lr=1e-2, amsgrad=True, maximize=True),
    "rmsprop": lambda p: optim.RMSprop(p, lr=1e-2),
    "rmsprop_centered_momentum": lambda p: optim.RMSprop(
        p, lr=1e-2, centered=True, momentum=0.9, weight_decay=0.01, eps=1e-3
    ),
    "adagrad": lambda p: optim.Adagrad(p, lr=0.1),
    "adagrad_decay_init": lambda p: optim.Adagrad(
        p, lr=0.1, lr_decay=0.05, initial_accumulator_value=0.3, weight_decay=0.01
    ),
    "adamax": lambda p: optim.Adamax(p, lr=1e-2, weight_decay=0.01),
    "nadam": lambda p: optim.NAdam(p, lr=1e-2, momentum_decay=0.01, weight_decay=0.01),
    "nadam_decoupled": lambda p: optim.NAdam(
        p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "radam": lambda p: optim.RAdam(p, lr=1e-2, weight_decay=0.01),
    "radam_decoupled": lambda p: optim.RAdam(
        p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(5, 6)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6))


def _net(dtype):
    torch.manual_seed(0)
    return Net().to(dtype)


def _grads(net, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in net.named_parameters()}
        for _ in range(steps)
    ]


def _flax_layout(net):
    """The tree torch-to-flax writes for ``Net``: kernels transposed (OIHW->HWIO, OI->IO)."""
    sd = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    return {
        "params": {
            "conv": {"kernel": sd["conv.weight"].transpose(2, 3, 1, 0), "bias": sd["conv.bias"]},
            "fc": {"kernel": sd["fc.weight"].T, "bias": sd["fc.bias"]},
            "scale": sd["scale"],
        }
    }


_TO_FLAX = {
    "conv.weight": (("conv", "kernel"), (2, 3, 1, 0)),
    "conv.bias": (("conv", "bias"), None),
    "fc.weight": (("fc", "kernel"), (1, 0)),
    "fc.bias": (("fc", "bias"), None),
    "scale": (("scale",), None),
}


def _to_tree(named):
    out = {}
    for name, t in named.items():
        (path, perm) = _TO_FLAX[name]
        a = t.detach().numpy() if hasattr(t, "detach") else t
        a = a.transpose(perm) if perm else a
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = jax.numpy.asarray(a)
    return out


def _torch_step(net, opt, grads, sched=None):
    for n, p in net.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    if sched is not None:
        sched.step()


def run_parity(make_opt, dtype, *, warm=0, steps=6, make_sched=None, groups=None, **kw):
    """Run torch ``warm`` steps, convert, then both ``steps``; return the max relative
    difference of the parameters after each converted step."""
    net = _net(dtype)
    params = groups(net) if groups else net.parameters()
    opt = make_opt(params)
    sched = make_sched(opt) if make_sched else None
    grads = _grads(net, warm + steps)
    for g in grads[:warm]:
        _torch_step(net, opt, g, sched)
    variables = _flax_layout(net)
    tx, state = from_torch_optimizer(opt, variables, scheduler=sched, model=net, **kw)
    params = jax.tree_util.tree_map(jax.numpy.asarray, variables["params"])
    step = tx.update
    diffs = []
    for g in grads[warm:]:
        if kw.get("clip_grad_norm") is not None:
            for n, p in net.named_parameters():
                p.grad = g[n].clone()
            torch.nn.utils.clip_grad_norm_(net.parameters(), kw["clip_grad_norm"])
            opt.step()
            if sched is not None:
                sched.step()
        else:
            _torch_step(net, opt, g, sched)
        updates, state = step(_to_tree(g), state, params)
        params = optax.apply_updates(params, updates)
        want = _to_tree(dict(net.named_parameters()))
        d = jax.tree_util.tree_map(
            lambda a, b: (
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                / max(float(np.max(np.abs(np.asarray(b)))), 1e-30)
            ),
            params,
            want,
        )
        diffs.append(max(jax.tree_util.tree_leaves(d)))
    return diffs, state


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_fresh_and_mid_run(name):
    with jax.enable_x64(True):
        for warm in (0, 3):
            diffs, _ = run_parity(CASES[name], torch.float64, warm=warm)
            assert max(diffs) < 1e-13, (name, warm, diffs)


#: float32: one case per optimizer with every option switched on (float64 covers the rest
#: exactly, every optimizer in default CI); two in default CI, the others under -m slow.
FLOAT32 = [
    "sgd_nesterov_wd",
    "adamw",
    *(
        pytest.param(name, marks=pytest.mark.slow)
        for name in (
            "adam_amsgrad_wd",
            "rmsprop_centered_momentum",
            "adagrad_decay_init",
            "adamax",
            "nadam",
            "radam",
        )
    ),
]


@pytest.mark.parametrize("name", FLOAT32)
def test_float32(name):
    diffs, _ = run_parity(CASES[name], torch.float32, warm=2)
    assert max(diffs) < 2e-6, (name, diffs)


def test_state_is_laid_out_like_the_variables():
    net = _net(torch.float64)
    opt = optim.Adam(net.parameters(), lr=1e-2)
    for g in _grads(net, 2):
        _torch_step(net, opt, g)
    with jax.enable_x64(True):
        _, state = from_torch_optimizer(opt, _flax_layout(net), model=net)
        inner = state.inner_states["group_0"].inner_state
        kernel = np.asarray(inner.slots["exp_avg"]["conv"]["kernel"])
        want = opt.state[net.conv.weight]["exp_avg"].numpy().transpose(2, 3, 1, 0)
        np.testing.assert_array_equal(kernel, want)
        assert int(inner.count) == 2


def test_param_groups_with_own_lr_and_weight_decay():
    def groups(net):
        return [
            {"params": [net.conv.weight, net.fc.weight], "weight_decay": 0.1},
            {"params": [net.conv.bias, net.fc.bias, net.scale], "lr": 1e-3, "weight_decay": 0.0},
        ]

    with jax.enable_x64(True):
        diffs, state = run_parity(
            lambda p: optim.AdamW(p, lr=1e-2), torch.float64, warm=2, groups=groups
        )
    assert max(diffs) < 1e-13
    assert set(state.inner_states) == {"frozen", "group_0", "group_1"}


def test_parameters_outside_the_optimizer_stay_frozen():
    net = _net(torch.float64)
    opt = optim.SGD([net.fc.weight], lr=0.1)
    with jax.enable_x64(True):
        variables = _flax_layout(net)
        tx, state = from_torch_optimizer(opt, variables, model=net)
        params = variables["params"]
        grads = jax.tree_util.tree_map(np.ones_like, params)
        updates, _ = tx.update(grads, state, params)
    assert not np.asarray(updates["conv"]["kernel"]).any()
    assert np.asarray(updates["fc"]["kernel"]).all()


def test_clip_grad_norm_matches_torch():
    with jax.enable_x64(True):
        diffs, _ = run_parity(
            lambda p: optim.SGD(p, lr=0.1, momentum=0.9), torch.float64, clip_grad_norm=0.5
        )
    assert max(diffs) < 1e-13


def test_clip_grad_norm_differs_from_optax_global_norm():
    """torch's 1e-6 in the divisor is kept: optax's clip_by_global_norm would differ."""
    from xconv.training import clip_grad_norm

    g = {"a": np.full(4, 3.0)}
    ours, _ = clip_grad_norm(1.0).update(g, clip_grad_norm(1.0).init(g))
    t = torch.full((4,), 3.0, requires_grad=True)
    t.grad = torch.full((4,), 3.0)
    torch.nn.utils.clip_grad_norm_([t], 1.0)
    np.testing.assert_allclose(np.asarray(ours["a"]), t.grad.numpy(), rtol=1e-7)


def test_clip_grad_value_matches_torch():
    from xconv.training import clip_grad_value

    g = torch.linspace(-2, 2, 9)
    t = torch.zeros(9, requires_grad=True)
    t.grad = g.clone()
    torch.nn.utils.clip_grad_value_([t], 0.7)
    ours, _ = clip_grad_value(0.7).update({"a": g.numpy()}, clip_grad_value(0.7).init(None))
    np.testing.assert_array_equal(np.asarray(ours["a"]), t.grad.numpy())


def test_gradient_accumulation_matches_torch():
    """torch summing ``loss / k`` over k micro-batches then stepping == MultiSteps."""
    k = 3
    net = _net(torch.float64)
    opt = optim.Adam(net.parameters(), lr=1e-2)
    grads = _grads(net, 2 * k)
    with jax.enable_x64(True):
        variables = _flax_layout(net)
        tx, state = from_torch_optimizer(opt, variables, model=net, accumulate_steps=k)
        params = variables["params"]
        for i, g in enumerate(grads):
            for n, p in net.named_parameters():
                p.grad = g[n] / k if p.grad is None or i % k == 0 else p.grad + g[n] / k
            if i % k == k - 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
            updates, state = tx.update(_to_tree(g), state, params)
            params = optax.apply_updates(params, updates)
        want = _to_tree(dict(net.named_parameters()))
        for a, b in zip(
            jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-14)


def test_unsupported_optimizer_and_options_are_clear_errors():
    net = _net(torch.float32)
    with pytest.raises(ConversionError, match="Rprop has no optax conversion"):
        from_torch_optimizer(optim.Rprop(net.parameters()), _flax_layout(net), model=net)
    with pytest.raises(ConversionError, match="needs model="):
        from_torch_optimizer(optim.SGD(net.parameters(), lr=0.1), _flax_layout(net))


def test_variables_not_from_this_module_are_a_weights_error():
    net = _net(torch.float32)
    variables = _flax_layout(net)
    variables["params"]["fc"]["kernel"] = variables["params"]["fc"]["kernel"] + 1
    with pytest.raises(ConversionError, match="fc.weight"):
        from_torch_optimizer(optim.SGD(net.parameters(), lr=0.1), variables, model=net)


@pytest.mark.parametrize(
    "name",
    ["sgd_momentum_dampening", "adamw", "adam_amsgrad_wd", "nadam", "rmsprop_centered_momentum"],
)
def test_to_torch_optimizer_continues_the_run(name):
    """torch 2 steps -> optax 2 steps -> back to torch 2 steps == torch 6 steps, float64."""
    from xconv.training import to_torch_optimizer

    ref = _net(torch.float64)
    ref_opt = CASES[name](ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    grads = _grads(ref, 6)
    net = _net(torch.float64)
    opt = CASES[name](net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for g in grads[:2]:
        _torch_step(ref, ref_opt, g, ref_sched)
        _torch_step(net, opt, g, sched)
    with jax.enable_x64(True):
        variables = _flax_layout(net)
        tx, state = from_torch_optimizer(opt, variables, scheduler=sched, model=net)
        params = variables["params"]
        for g in grads[2:4]:
            _torch_step(ref, ref_opt, g, ref_sched)
            updates, state = tx.update(_to_tree(g), state, params)
            params = optax.apply_updates(params, updates)
        back = _net(torch.float64)
        with torch.no_grad():
            for n, p in back.named_parameters():
                (path, perm) = _TO_FLAX[n]
                node = params
                for k in path:
                    node = node[k]
                a = np.array(node)
                p.copy_(torch.from_numpy(a.transpose(np.argsort(perm)) if perm else a))
        opt2 = to_torch_optimizer(tx, state, back)
    assert opt2.xconv_last_epoch == 4
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3, gamma=0.5, last_epoch=-1)
    sched2.last_epoch = opt2.xconv_last_epoch
    for g in grads[4:]:
        _torch_step(ref, ref_opt, g, ref_sched)
        _torch_step(back, opt2, g, sched2)
    for (n, a), b in zip(ref.named_parameters(), back.parameters(), strict=True):
        np.testing.assert_allclose(b.detach().numpy(), a.detach().numpy(), rtol=1e-12, err_msg=n)
