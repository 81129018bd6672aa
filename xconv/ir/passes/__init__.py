"""Canonicalisation passes: make the IR show the model's computation, not the exporter's.

All passes are ``onnx_ir`` in-place passes, framework-free and deterministic.
:func:`canonicalize` runs them in order until nothing changes.
"""

from __future__ import annotations

import onnx_ir as ir

from xconv.ir.passes.folding import ConstantFoldingPass, ShapeFoldingPass, evaluate_node
from xconv.ir.passes.simplify import (
    DeadNodeRemovalPass,
    NoOpEliminationPass,
    TransposeCancellationPass,
)

#: Upper bound on rounds of the pass pipeline; each round only shrinks the graph.
MAX_ROUNDS = 8


def canonicalize(model: ir.Model) -> ir.Model:
    """Fold constants and static shape arithmetic, drop no-ops, cancel transposes, remove dead
    nodes; in place, repeated until nothing changes.

    Args:
        model: The IR model (modified in place).

    Returns:
        The same model.
    """
    from onnx_ir.passes.common import TopologicalSortPass

    TopologicalSortPass()(model)
    passes = [
        ShapeFoldingPass(),
        ConstantFoldingPass(),
        NoOpEliminationPass(),
        TransposeCancellationPass(),
        DeadNodeRemovalPass(),
    ]
    for _ in range(MAX_ROUNDS):
        changed = False
        for p in passes:
            changed |= p(model).modified
        if not changed:
            break
    return model


__all__ = [
    "ConstantFoldingPass",
    "DeadNodeRemovalPass",
    "NoOpEliminationPass",
    "ShapeFoldingPass",
    "TransposeCancellationPass",
    "canonicalize",
    "evaluate_node",
]
