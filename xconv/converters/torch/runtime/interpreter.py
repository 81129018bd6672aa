"""IR -> a ``torch.nn.Module`` that runs the graph with torch ops.

Weights become ``nn.Parameter``s in nested submodules following their source names, so the
module's ``state_dict`` keys are the IR's initializer names (``layer1.0.conv1.weight``).
Batch-norm running statistics become buffers. Other initializers are constants.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from xconv.converters.ops.context import find_handler, graph_env, handler_errors
from xconv.converters.registry import Registry, as_tuple
from xconv.converters.torch.runtime.context import TorchContext
from xconv.converters.torch.runtime.dtypes import SUB_BYTE, to_tensor, widen
from xconv.ir.metadata import ROLE
from xconv.ir.naming import nest
from xconv.ir.passes._utils import is_weight

#: Weight roles that are running statistics (buffers, not trained parameters).
BUFFER_ROLES = frozenset({"mean", "var", "num_batches"})


class _Holder(nn.Module):
    """A plain container module for one level of the weight-name tree."""


class ConvertedModule(nn.Module):
    """Runs an IR graph with the torch backend's handlers.

    ``forward(*inputs)`` returns one tensor for a single-output graph, else a tuple.
    """

    def __init__(self, model: ir.Model, registry: Registry) -> None:
        super().__init__()
        self._model = model
        self._registry = registry
        graph = model.graph
        annotated = any(ROLE in v.metadata_props for v in graph.initializers.values())
        self._weight_names: dict[str, str] = {}  # initializer name -> state_dict key
        self._constants: dict[str, Any] = {}
        flat: dict[str, tuple[torch.Tensor, bool]] = {}
        for name, value in graph.initializers.items():
            if value.const_value is None:
                continue
            array = value.const_value.numpy()
            if is_weight(value, annotated) or value.metadata_props.get(ROLE) in BUFFER_ROLES:
                is_buffer = value.metadata_props.get(ROLE) in BUFFER_ROLES
                flat[name] = (to_tensor(np.array(array)), is_buffer)
            else:
                self._constants[name] = to_tensor(np.array(array))
        self._register_tree(self, nest({k: k for k in flat}), flat, ())
        self._input_values = [v for v in graph.inputs if not v.is_initializer()]

    def _register_tree(self, owner: nn.Module, tree: dict, flat, prefix: tuple[str, ...]) -> None:
        for key, sub in tree.items():
            attr = key if key.isidentifier() or key.isdigit() else key.replace(".", "_")
            if isinstance(sub, dict):
                child = _Holder()
                owner.add_module(attr, child)
                self._register_tree(child, sub, flat, (*prefix, attr))
            else:
                tensor, is_buffer = flat[sub]
                if is_buffer or not tensor.is_floating_point():
                    owner.register_buffer(attr, tensor)
                else:
                    owner.register_parameter(attr, nn.Parameter(tensor))
                self._weight_names[sub] = ".".join((*prefix, attr))

    def forward(self, *inputs: Any) -> Any:
        if len(inputs) != len(self._input_values):
            raise TypeError(
                f"the model takes {len(self._input_values)} input(s) "
                f"{[v.name for v in self._input_values]}, got {len(inputs)}"
            )
        state = dict(self.named_parameters())
        state.update(dict(self.named_buffers()))
        graph = self._model.graph
        env: dict[ir.Value, Any] = {}
        device = next((t.device for t in state.values()), None)
        for name, key in self._weight_names.items():
            env[graph.initializers[name]] = state[key]
        for name, const in self._constants.items():
            if isinstance(const, torch.Tensor) and device is not None and const.device != device:
                const = const.to(device)
                self._constants[name] = const
            env[graph.initializers[name]] = const
        for value, x in zip(self._input_values, inputs, strict=True):
            env[value] = x
        buffers = {name: state[key] for name, key in self._weight_names.items()}
        outputs = self._run_graph(graph, env, [], buffers)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _run_graph(
        self, graph: ir.Graph, env: dict[ir.Value, Any], inputs: Iterable[Any], buffers
    ) -> list[Any]:
        env = graph_env(graph, env, inputs, lambda a: to_tensor(np.array(a)))
        for node in graph:
            outputs = self._run_node(node, env, buffers)
            for value, out in zip(node.outputs, outputs, strict=False):
                env[value] = out
        return [env[v] for v in graph.outputs]

    def _run_node(self, node: ir.Node, env: dict[ir.Value, Any], buffers) -> tuple[Any, ...]:
        handler, version = find_handler(self._registry, self._model.opset_imports, node)
        attrs = handler.parse_attributes(node)
        args = [None if v is None or v.name == "" else env[v] for v in node.inputs]

        def run_subgraph(graph: ir.Graph, sub_inputs: Iterable[Any]) -> list[Any]:
            return self._run_graph(graph, env, sub_inputs, buffers)

        ctx = TorchContext(node, version, run_subgraph, self.training, None, buffers)
        narrowed = _sub_byte_types(node, args)
        if narrowed:
            args = [widen(a) for a in args]
        with handler_errors(node):
            outputs = as_tuple(handler.fn(ctx, *args, **attrs))
        if narrowed:
            outputs = tuple(_narrow_back(y, narrowed) for y in outputs)
        return outputs


#: Ops that read a sub-byte input's type themselves (:mod:`.elementwise`, :mod:`.math`).
_SUB_BYTE_AWARE = frozenset(("Cast", "CastLike", "QuantizeLinear", "DequantizeLinear"))


def _sub_byte_types(node: ir.Node, args: list[Any]) -> dict[torch.dtype, torch.dtype]:
    """The byte type -> sub-byte type of the node's sub-byte inputs, for a handler that gets
    them as their byte type; empty when none (or the handler reads the types itself)."""
    if node.op_type in _SUB_BYTE_AWARE and node.domain in ("", "ai.onnx"):
        return {}
    found = {
        SUB_BYTE[a.dtype]: a.dtype
        for a in args
        if isinstance(a, torch.Tensor) and a.dtype in SUB_BYTE
    }
    return found


def _narrow_back(y: Any, narrowed: dict[torch.dtype, torch.dtype]) -> Any:
    """An output of a sub-byte input's byte type as that sub-byte type: ONNX's type
    constraints give such an output the input's type (T -> T); the values are the input's."""
    if isinstance(y, torch.Tensor) and y.dtype in narrowed:
        return y.view(narrowed[y.dtype])
    return y


def to_torch(model: ir.Model, *, registry: Registry | None = None):
    """Convert an IR model to a runnable ``torch.nn.Module`` and its state_dict.

    Returns:
        ``(module, state_dict)``; ``state_dict`` keys are the IR's weight names.

    Raises:
        UnsupportedOpError: naming every op the backend lacks, before any work.
    """
    import xconv.converters.torch.runtime  # noqa: F401  (registers the handlers)
    from xconv.converters.torch.runtime.registry import registry as default_registry

    reg = registry or default_registry
    reg.check_supported(model)
    module = ConvertedModule(model, reg).eval()
    return module, module.state_dict()
