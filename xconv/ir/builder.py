"""A small builder for IR graphs: ops with scopes, weights with roles (tests, importers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.ir import OPSET
from xconv.ir.layers import mark_weight
from xconv.ir.metadata import MODULE, SCOPE


class GraphBuilder:
    """Build an ``onnx_ir.Model`` op by op.

    Example::

        b = GraphBuilder()
        x = b.input("x", np.float32, (1, 4))
        w = b.weight("fc.weight", np.ones((3, 4), np.float32), role="kernel", layout="OI")
        y = b.op("Gemm", [x, w], {"transB": 1}, scope="fc")
        model = b.build([y])
    """

    def __init__(self, name: str = "main", opset: int = OPSET) -> None:
        self._graph = ir.Graph([], [], nodes=[], name=name, opset_imports={"": opset})
        self._count = 0

    def input(self, name: str, dtype: Any, shape: Sequence[int | str | None]) -> ir.Value:
        value = ir.Value(
            name=name,
            type=ir.TensorType(ir.DataType.from_numpy(np.dtype(dtype))),
            shape=ir.Shape(shape),
        )
        self._graph.inputs.append(value)
        return value

    def weight(
        self, name: str, array: np.ndarray, *, role: str | None = None, layout: str | None = None
    ) -> ir.Value:
        tensor = ir.tensor(np.asarray(array), name=name)
        value = ir.Value(
            name=name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor
        )
        if role:
            mark_weight(value, role, layout)
        self._graph.register_initializer(value)
        return value

    def constant(self, array: Any, name: str | None = None) -> ir.Value:
        self._count += 1
        return self.weight(name or f"const_{self._count}", np.asarray(array))

    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: Mapping[str, Any] | None = None,
        *,
        num_outputs: int = 1,
        domain: str = "",
        scope: str | None = None,
        module: str | None = None,
        name: str | None = None,
    ) -> Any:
        """Append a node; returns its output value (or a tuple for several outputs)."""
        self._count += 1
        node = ir.Node(
            domain,
            op_type,
            inputs,
            attributes=[
                ir.convenience.convert_attribute(k, v) for k, v in (attributes or {}).items()
            ],
            num_outputs=num_outputs,
            name=name or f"{op_type.lower()}_{self._count}",
        )
        for i, out in enumerate(node.outputs):
            out.name = f"{node.name}_out{i}" if num_outputs > 1 else node.name
        if scope is not None:
            node.metadata_props[SCOPE] = scope
        if module is not None:
            node.metadata_props[MODULE] = module
        self._graph.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def build(self, outputs: Sequence[ir.Value], *, infer_shapes: bool = True) -> ir.Model:
        self._graph.outputs.extend(outputs)
        model = ir.Model(self._graph, ir_version=10, producer_name="xconv")
        if infer_shapes:
            from onnx_ir.passes.common import ShapeInferencePass

            ShapeInferencePass()(model)
        return model
