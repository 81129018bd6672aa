"""What a JAX handler sees besides its inputs and attributes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import onnx_ir as ir

from xconv.converters.ops.context import NodeContext, node_error
from xconv.errors import StaticValueError


@dataclass
class JaxContext(NodeContext):
    """Per-node context passed as the first argument of every JAX handler.

    Attributes:
        node: The IR node being converted (read it, never mutate it).
        opset: The default-domain opset version the node is interpreted at.
        run_subgraph: ``run_subgraph(graph, inputs) -> list`` evaluates a subgraph (If/Loop/
            Scan body) with the enclosing scope's values visible.
        rng: The ``jax.random`` key handed to the converted function, or None.
        node_index: Position of the node in its graph (to fold into random keys).
    """

    node: ir.Node
    opset: int
    run_subgraph: Callable[[ir.Graph, Sequence[Any]], list[Any]]
    rng: Any = None
    node_index: int = 0

    @property
    def input_values(self) -> Sequence[ir.Value | None]:
        """The node's IR input values (for declared dtypes and shapes)."""
        return self.node.inputs

    @property
    def output_values(self) -> Sequence[ir.Value]:
        """The node's IR output values (for declared dtypes and shapes)."""
        return self.node.outputs

    def output_dtype(self, index: int = 0) -> np.dtype | None:
        """The numpy dtype the IR declares for an output, if it declares one."""
        dtype = self.node.outputs[index].dtype
        return None if dtype is None else dtype.numpy()

    def static(self, value: Any, what: str = "input") -> np.ndarray:
        """Return ``value`` as a numpy array, or raise if it is only known at run time.

        Shapes, axes, pads and the like must be static under ``jax.jit``; exporters compute
        them from shapes, which the interpreter folds to constants, so this holds for
        static-shape models.
        """
        if value is None:
            raise self.error(f"{what} is required")
        if isinstance(value, jax.core.Tracer) or (
            isinstance(value, list) and any(isinstance(v, jax.core.Tracer) for v in value)
        ):
            raise node_error(
                self.node,
                f"{what} must be known at trace time under jax.jit, but it is computed from "
                "run-time data; run the function without jit or make the value constant",
                StaticValueError,
            )
        if isinstance(value, list):
            return [np.asarray(v) for v in value]
        return np.asarray(value)

    def key(self, seed: float | None = None) -> jax.Array:
        """A PRNG key for a random op: from its ``seed`` attribute, else from ``rng``."""
        if seed is not None:
            return jax.random.key(int(seed))
        if self.rng is None:
            raise self.error(
                "random op without a seed attribute needs an explicit key: call the converted "
                "function with rng=jax.random.key(...)"
            )
        return jax.random.fold_in(self.rng, self.node_index)
