"""Generated torch source under FSDP2 (``torch.distributed.fsdp.fully_shard``).

Generated ``nn.Module`` s are plain torch: FSDP2, DDP and ``torch.compile`` take them as they
are. The one thing to know is which submodules to make FSDP units: FSDP2 gathers a unit's
parameters in a pre-forward hook, so a unit must be a module whose ``forward`` runs. Generated
source keeps the source model's module path with *container* modules (``Scope``: no
``forward``, their children are called from the parent's ``forward``), so
:func:`fsdp_units` walks through containers and returns the called modules under them (a
layer such as ``nn.Linear`` or ``nn.MultiheadAttention``, or a generated block class, whole).
"""

from __future__ import annotations

from typing import Any


def _has_forward(module: Any) -> bool:
    from torch import nn

    return type(module).forward is not nn.Module.forward


def fsdp_units(model: Any) -> list[Any]:
    """The submodules to ``fully_shard`` before the root, innermost containers expanded."""
    units = []
    stack = list(model.children())
    while stack:
        m = stack.pop(0)
        if _has_forward(m):
            if any(p.requires_grad for p in m.parameters()):
                units.append(m)
        else:
            stack[:0] = list(m.children())
    return units


def fully_shard_generated(model: Any, **kwargs: Any) -> Any:
    """Apply FSDP2's ``fully_shard`` to each unit of :func:`fsdp_units`, then the root.

    ``kwargs`` go to ``fully_shard`` (``mesh=``, ``reshard_after_forward=``...). Returns the
    model (now an ``FSDPModule``)."""
    from torch.distributed.fsdp import fully_shard

    for unit in fsdp_units(model):
        fully_shard(unit, **kwargs)
    return fully_shard(model, **kwargs)
