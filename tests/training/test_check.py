"""Training parity of whole runs: torch and its Flax conversion, N steps side by side.

* ResNet fixture (train mode: BatchNorm batch statistics and running stats), SGD + Nesterov
  momentum + weight decay + cosine schedule, 100 steps in float32; the same in float64 (``-m slow``),
  where the runs agree to rounding; resumed from a torch checkpoint taken at step 50.
* Transformer fixture, AdamW + linear warm-up + grad-norm clipping + label smoothing, 100
  steps in float32.
* The check is not vacuous: an optimizer rule with Nesterov's term dropped fails at step 1.

Measured drift after 100 float32 steps is written by ``benchmarks/bench_train.py``.
"""

from __future__ import annotations

import copy
import functools
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")

import xconv  # noqa: E402
from fixtures.torch_models import make_mlp, make_resnet, make_transformer  # noqa: E402
from xconv.errors import ConversionError  # noqa: E402
from xconv.training import check_training  # noqa: E402
from xconv.training.check import _load_folder  # noqa: E402

STEPS = 100
RESUME = 50
BATCH, HW = 16, 16


def _resnet_batches(n=STEPS, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(BATCH, 3, HW, HW, generator=g, dtype=dtype),
            torch.randint(0, 10, (BATCH,), generator=g),
        )
        for _ in range(n)
    ]


def _resnet_training(module):
    opt = torch.optim.SGD(
        module.parameters(), lr=0.02, momentum=0.9, nesterov=True, weight_decay=5e-4
    )
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """The ResNet fixture and its torch-to-flax (linen) folder, traced at the batch shape."""
    module, _ = make_resnet()
    model_ir = xconv.from_torch(module, (torch.zeros(BATCH, 3, HW, HW),))
    out = xconv.to_flax(model_ir, tmp_path_factory.mktemp("resnet") / "flax")
    return module, model_ir, out


@pytest.fixture(scope="module")
def resnet_report(resnet):
    module, _, out = resnet
    opt, sched = _resnet_training(module)
    return check_training(
        module, opt, torch.nn.CrossEntropyLoss(), out, _resnet_batches(), scheduler=sched
    )


def test_resnet_sgd_nesterov_cosine_100_steps(resnet_report):
    rep = resnet_report
    assert rep.steps == STEPS and len(rep.loss_rel_diff) == STEPS
    assert rep.max_loss_rel_diff(20) <= 1e-4, rep.loss_rel_diff[:20]
    assert rep.passed, rep.first_divergence
    # float32 drift after 100 steps (measured ~3e-6 on the parameters).
    assert rep.param_drift[-1] < 1e-4
    assert rep.running_stats and max(rep.running_stats.values()) < 1e-4
    assert rep.optimizer_state and max(rep.optimizer_state.values()) < 1e-3
    assert any("BatchNorm in train mode" in n for n in rep.notes)
    # Not vacuous: the model learns something, and the optimizer state is really compared.
    assert rep.torch_losses[-1] != rep.torch_losses[0]
    assert any(k.endswith("/momentum_buffer") for k in rep.optimizer_state)
    data = rep.to_json()
    assert '"passed": true' in data and "<svg" in rep.to_html()


@pytest.mark.slow  # ~35 s under load; the optimizers' float64 tests stay in default CI
def test_resnet_float64_runs_agree_to_rounding(resnet):
    module, _, out = resnet
    model, variables = _load_folder(out)
    with jax.enable_x64(True):
        variables = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), variables)
        module = copy.deepcopy(module).double()
        opt, sched = _resnet_training(module)
        rep = check_training(
            module,
            opt,
            torch.nn.CrossEntropyLoss(),
            (model, variables),
            _resnet_batches(10, torch.float64),
            scheduler=sched,
            tol=1e-12,
            state_tol=1e-11,
        )
    assert rep.passed, rep.first_divergence
    assert rep.max_loss_rel_diff() < 1e-12


def test_resume_from_a_torch_checkpoint_continues_torchs_curve(resnet, resnet_report):
    """torch trains 50 steps and saves ``{"model", "optimizer", "scheduler", "step"}``; the
    checkpoint (weights_only load) is converted and trained 50 more steps on the Flax side."""
    from xconv.weight_template import torch_to_flax

    module, model_ir, out = resnet
    batches = _resnet_batches()
    run = copy.deepcopy(module).train()
    opt, sched = _resnet_training(run)
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in batches[:RESUME]:
        opt.zero_grad()
        loss_fn(run(x), y).backward()
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(
        {
            "model": run.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "step": RESUME,
        },
        buf,
    )
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    resumed, _ = make_resnet()
    resumed.load_state_dict(ckpt["model"])
    opt2, sched2 = _resnet_training(resumed)
    opt2.load_state_dict(ckpt["optimizer"])
    sched2.load_state_dict(ckpt["scheduler"])
    model, _ = _load_folder(out)
    variables = torch_to_flax(ckpt["model"], model_ir)
    rep = check_training(
        resumed, opt2, loss_fn, (model, variables), batches[RESUME:], scheduler=sched2
    )
    assert rep.passed, rep.first_divergence
    own = np.array(resnet_report.torch_losses[RESUME:])
    # The resumed torch run is torch's own run; the Flax run continues that curve.
    np.testing.assert_allclose(rep.torch_losses, own, rtol=1e-6)
    np.testing.assert_allclose(rep.candidate_losses, own, rtol=1e-4)


class _LM(torch.nn.Module):
    """The transformer fixture with classes on axis 1, as CrossEntropyLoss takes them."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(ids).transpose(1, 2)


def test_transformer_adamw_warmup_clipping_label_smoothing(tmp_path):
    inner, _ = make_transformer()
    module = _LM(inner)
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randint(1, 50, (4, 10), generator=g), torch.randint(0, 50, (4, 10), generator=g))
        for _ in range(STEPS)
    ]
    out = xconv.to_flax(xconv.from_torch(module, (batches[0][0],)), tmp_path / "lm")
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.05)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    rep = check_training(
        module,
        opt,
        torch.nn.CrossEntropyLoss(label_smoothing=0.1),
        out,
        batches,
        scheduler=warm,
        clip_grad_norm=0.5,
    )
    assert rep.max_loss_rel_diff(20) <= 1e-4, rep.loss_rel_diff[:20]
    assert rep.max_loss_rel_diff() <= 1e-4, rep.loss_rel_diff
    assert any("dropout off" in n for n in rep.notes)
    # A key bias (the middle third of nn.MultiheadAttention's in_proj_bias and of the
    # fixture's fused qkv bias) has no effect on the output (softmax is shift invariant), so
    # its true gradient is 0 and each side sees only rounding noise, which Adam normalises into
    # full-size steps: those tensors part from step 1 and are the only ones allowed to.
    key_bias = ("attn.in_proj_bias", "qkv.bias")
    others = {k: v for k, v in rep.params.items() if not k.endswith(key_bias)}
    assert others and max(others.values()) < 1e-3, others
    if not rep.passed:
        assert rep.first_divergence.name.endswith(key_bias), rep.first_divergence
    assert any(k.endswith("/exp_avg_sq") for k in rep.optimizer_state)


def test_to_jax_candidate():
    module, (x,) = make_mlp()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(5)]
    model_ir = xconv.from_torch(module, (x,))
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    rep = check_training(module, opt, torch.nn.MSELoss(), xconv.to_jax(model_ir), batches)
    assert rep.passed, rep.first_divergence
    assert len(rep.params) == 5


def test_nnx_candidate(tmp_path):
    module, (x,) = make_mlp()
    out = xconv.to_flax(xconv.from_torch(module, (x,)), tmp_path / "nnx", api="nnx")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(5)]
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    rep = check_training(module, opt, torch.nn.MSELoss(), _load_folder(out), batches)
    assert rep.passed, rep.first_divergence
    assert len(rep.params) == 5 and rep.optimizer_state


@functools.cache
def _no_nesterov_rule():
    from xconv.training import transforms

    original = transforms.RULES["sgd"]

    def broken(hp, g, p, s, step, lr):
        return original({**hp, "nesterov": False}, g, p, s, step, lr)

    return broken


def test_a_wrong_update_rule_fails_at_the_first_step(monkeypatch):
    from xconv.training import transforms

    monkeypatch.setitem(transforms.RULES, "sgd", _no_nesterov_rule())
    module, (x,) = make_mlp()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(3)]
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    candidate = xconv.to_jax(xconv.from_torch(module, (x,)))
    rep = check_training(module, opt, torch.nn.MSELoss(), candidate, batches)
    assert not rep.passed
    assert rep.first_divergence.step == 1
    assert rep.first_divergence.what == "param"
    assert rep.first_divergence.name in dict(module.named_parameters())


def test_to_jax_candidate_with_batch_norm_is_refused(resnet):
    module, model_ir, _ = resnet
    opt, _ = _resnet_training(module)
    with pytest.raises(ConversionError, match="eval-mode graph"):
        check_training(
            module, opt, torch.nn.CrossEntropyLoss(), xconv.to_jax(model_ir), _resnet_batches(1)
        )
