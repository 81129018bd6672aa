"""A training set-up for ``xconv train-check`` in the CLI tests: the MLP fixture, SGD with
momentum, a step schedule, MSE, five batches."""

from __future__ import annotations

import torch

from fixtures.torch_models import make_mlp


def mlp_setup():
    module, _ = make_mlp()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(5)]
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    return {
        "module": module,
        "optimizer": opt,
        "loss_fn": torch.nn.MSELoss(),
        "batches": batches,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    }
