"""What a PyTorch handler sees besides its inputs and attributes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from xconv.converters.ops.context import NodeContext
from xconv.ir.metadata import get_layer


@dataclass
class TorchContext(NodeContext):
    """Per-node context passed as the first argument of every PyTorch handler.

    Attributes:
        node: The IR node being run (read it, never mutate it).
        opset: The node's opset version.
        run_subgraph: ``run_subgraph(graph, inputs) -> list`` evaluates an If/Loop/Scan body
            with the enclosing scope's values visible.
        training: The converted module's ``training`` flag: BatchNormalization nodes of a
            recognised ``batch_norm`` layer use batch statistics and update their running
            buffers in place, recognised ``dropout`` layers drop.
        generator: The ``torch.Generator`` for random ops (None: torch's global one).
        buffers: Running-statistics buffers of the converted module by initializer name, so
            training-mode BatchNorm can update them in place.
    """

    node: ir.Node
    opset: int
    run_subgraph: Callable[[ir.Graph, Sequence[Any]], list[Any]]
    training: bool = False
    generator: torch.Generator | None = None
    buffers: dict[str, torch.Tensor] | None = None

    @property
    def layer(self) -> dict[str, Any] | None:
        """The node's ``xconv.layer`` metadata, if it anchors a recognised layer."""
        return get_layer(self.node)

    def output_dtype(self, index: int = 0) -> torch.dtype | None:
        """The torch dtype the IR declares for an output, if it declares one."""
        from xconv.converters.torch.runtime.dtypes import torch_dtype

        dtype = self.node.outputs[index].dtype
        return None if dtype is None else torch_dtype(dtype)

    def static(self, value: Any, what: str = "input") -> np.ndarray:
        """A shape/axes-like input as numpy (they are small; this syncs with the device)."""
        if value is None:
            raise self.error(f"{what} is required")
        if isinstance(value, torch.Tensor):
            from xconv.converters.torch.runtime.dtypes import to_numpy

            # bfloat16, float8 ... come back as ml_dtypes' arrays (tensor.numpy() refuses them).
            return to_numpy(value)
        return np.asarray(value)
