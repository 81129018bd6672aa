"""Training migration: optimizer, schedule, loss and training state torch <-> optax, and the
N-step training-parity check that proves it.

Imported lazily: ``import xconv.training`` loads neither torch nor JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, attribute)
_LAZY = {
    "from_torch_optimizer": ("xconv.training.optimizers", "from_torch_optimizer"),
    "to_torch_optimizer": ("xconv.training.optimizers", "to_torch_optimizer"),
    "from_torch_loss": ("xconv.training.losses", "from_torch_loss"),
    "schedule_for": ("xconv.training.schedules", "schedule_for"),
    "torch_transform": ("xconv.training.transforms", "torch_transform"),
    "clip_grad_norm": ("xconv.training.transforms", "clip_grad_norm"),
    "clip_grad_value": ("xconv.training.transforms", "clip_grad_value"),
    "check_training": ("xconv.training.check", "check_training"),
    "TrainingReport": ("xconv.training.check", "TrainingReport"),
    "write_train_state": ("xconv.training.state", "write_train_state"),
    "load_train_state": ("xconv.training.state", "load_train_state"),
    "train_state_to_torch": ("xconv.training.state", "train_state_to_torch"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'xconv.training' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = list(_LAZY)
