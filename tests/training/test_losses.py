"""Each converted torch loss against torch, option by option, with gradients."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

from xconv.errors import ConversionError  # noqa: E402
from xconv.training import from_torch_loss  # noqa: E402

nn = torch.nn
G = torch.Generator().manual_seed(0)


def _randn(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


def _labels(n, *shape, lo=0):
    return torch.randint(lo, n, shape, generator=G)


def _prob(*shape, axis=1):
    return torch.softmax(_randn(*shape), dim=axis)


W5 = torch.linspace(0.5, 2.0, 5, dtype=torch.float64)

CASES = {
    # name: (module, inputs as a function of nothing)
    "ce": (nn.CrossEntropyLoss(), lambda: (_randn(8, 5), _labels(5, 8))),
    "ce_sum": (nn.CrossEntropyLoss(reduction="sum"), lambda: (_randn(8, 5), _labels(5, 8))),
    "ce_none_2d": (
        nn.CrossEntropyLoss(reduction="none"),
        lambda: (_randn(2, 5, 3, 4), _labels(5, 2, 3, 4)),
    ),
    "ce_weight_ignore_smooth": (
        nn.CrossEntropyLoss(weight=W5, ignore_index=2, label_smoothing=0.1),
        lambda: (_randn(16, 5), _labels(5, 16)),
    ),
    "ce_ignore_smooth_sum": (
        nn.CrossEntropyLoss(ignore_index=1, label_smoothing=0.2, reduction="sum"),
        lambda: (_randn(2, 5, 3, 3), _labels(5, 2, 3, 3)),
    ),
    "ce_smooth_noweight_mean": (
        nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.3),
        lambda: (_randn(2, 5, 6), _labels(5, 2, 6)),
    ),
    "ce_probs_smooth_weight": (
        nn.CrossEntropyLoss(weight=W5, label_smoothing=0.1),
        lambda: (_randn(6, 5), _prob(6, 5)),
    ),
    "nll_weight_ignore": (
        nn.NLLLoss(weight=W5, ignore_index=3),
        lambda: (torch.log_softmax(_randn(10, 5), 1), _labels(5, 10)),
    ),
    "mse": (nn.MSELoss(), lambda: (_randn(4, 3), _randn(4, 3))),
    "mse_sum": (nn.MSELoss(reduction="sum"), lambda: (_randn(4, 3), _randn(4, 3))),
    "l1_none": (nn.L1Loss(reduction="none"), lambda: (_randn(4, 3), _randn(4, 3))),
    "smooth_l1_beta": (nn.SmoothL1Loss(beta=0.5), lambda: (_randn(40), _randn(40))),
    "smooth_l1_beta0": (nn.SmoothL1Loss(beta=0.0), lambda: (_randn(40), _randn(40))),
    "huber_delta": (nn.HuberLoss(delta=0.7, reduction="sum"), lambda: (_randn(40), _randn(40))),
    "bce_weight": (
        nn.BCELoss(weight=torch.linspace(0.1, 1, 3, dtype=torch.float64)),
        lambda: (torch.sigmoid(_randn(4, 3)), torch.rand(4, 3, generator=G, dtype=torch.float64)),
    ),
    "bce_edges": (
        nn.BCELoss(reduction="none"),
        lambda: (
            torch.tensor([0.0, 1.0, 0.5, 1e-50], dtype=torch.float64),
            torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64),
        ),
    ),
    "bce_logits_pos_weight": (
        nn.BCEWithLogitsLoss(
            weight=torch.linspace(0.5, 1, 3, dtype=torch.float64),
            pos_weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64),
        ),
        lambda: (10 * _randn(4, 3), (_randn(4, 3) > 0).double()),
    ),
    "kl_batchmean": (
        nn.KLDivLoss(reduction="batchmean"),
        lambda: (torch.log_softmax(_randn(4, 5), 1), _prob(4, 5)),
    ),
    "kl_log_target_sum": (
        nn.KLDivLoss(reduction="sum", log_target=True),
        lambda: (torch.log_softmax(_randn(4, 5), 1), torch.log_softmax(_randn(4, 5), 1)),
    ),
    "cosine_embedding": (
        nn.CosineEmbeddingLoss(margin=0.2),
        lambda: (_randn(6, 4), _randn(6, 4), torch.tensor([1, -1, 1, -1, -1, 1])),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradient_match_torch(name):
    module, make = CASES[name]
    inputs = make()
    x = inputs[0].clone().requires_grad_(True)
    want = module(x, *inputs[1:])
    fn = from_torch_loss(module)
    args = [i.numpy() for i in inputs]
    with jax.enable_x64(True):
        got = fn(*args)
        np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-12, atol=1e-14)
        if want.ndim == 0 and name != "bce_edges":
            want.backward()
            grad = jax.grad(lambda a: fn(a, *args[1:]))(args[0])
            np.testing.assert_allclose(np.asarray(grad), x.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "module",
    [nn.CrossEntropyLoss(weight=W5, ignore_index=1, label_smoothing=0.1), nn.NLLLoss()],
)
def test_channel_last_outputs(module):
    """An NHWC model output with (N, H, W) class targets gives torch's NCHW loss."""
    x, y = _randn(2, 5, 3, 4), _labels(5, 2, 3, 4)
    want = module(x, y).item()
    fn = from_torch_loss(module, channel_axis=-1)
    with jax.enable_x64(True):
        got = float(fn(x.permute(0, 2, 3, 1).numpy(), y.numpy()))
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_unsupported_loss_and_option_are_clear_errors():
    with pytest.raises(ConversionError, match="MarginRankingLoss has no JAX conversion"):
        from_torch_loss(nn.MarginRankingLoss())
    loss = nn.MSELoss()
    loss.something_new = 3
    with pytest.raises(ConversionError, match="something_new"):
        from_torch_loss(loss)


def test_every_supported_loss_has_a_builder_and_no_other():
    from xconv.training import losses

    assert sorted(losses.SUPPORTED) == sorted(losses._LOSSES)
