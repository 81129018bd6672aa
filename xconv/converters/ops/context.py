"""What every runtime's handler context and interpreter share: errors that name the node.

A backend's context (``JaxContext``, ``TorchContext``) subclasses :class:`NodeContext`; its
interpreter runs each handler under :func:`handler_errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.errors import ConversionError
from xconv.ir.metadata import SOURCE_LINE, get_scope


def node_error(
    node: ir.Node, message: str, cls: type[ConversionError] = ConversionError
) -> ConversionError:
    """``cls(message)`` carrying ``node``'s op, name, scope and source line."""
    return cls(
        message,
        op=node.op_type,
        node=node.name,
        scope=get_scope(node),
        source_line=node.metadata_props.get(SOURCE_LINE),
    )


@contextmanager
def handler_errors(node: ir.Node) -> Iterator[None]:
    """Re-raise a handler's non-ConversionError exception as one naming ``node``."""
    try:
        yield
    except ConversionError:
        raise
    except Exception as e:
        raise node_error(node, f"{type(e).__name__}: {e}") from e


class NodeContext:
    """The part of a handler context every backend shares (it has a ``node`` field)."""

    node: ir.Node

    def error(self, message: str) -> ConversionError:
        """A ConversionError carrying this node's op, name, scope and source line."""
        return node_error(self.node, message)


def find_handler(registry: Any, opset_imports: Mapping[str, int], node: ir.Node) -> tuple[Any, int]:
    """``(handler, opset version)`` for ``node`` in ``registry``, or the error naming it."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    version = node.version or opset_imports.get(domain, 1)
    handler, reason = registry.lookup(domain, node.op_type, version)
    if handler is None:
        raise node_error(node, reason)
    return handler, version


def graph_env(
    graph: ir.Graph,
    env: Mapping[ir.Value, Any],
    inputs: Iterable[Any],
    constant: Callable[[np.ndarray], Any],
) -> dict[ir.Value, Any]:
    """The values a (sub)graph starts from: the enclosing ``env``, its ``inputs`` and its
    initializers (as ``constant(numpy array)``) not already given."""
    env = dict(env)
    for value, x in zip(graph.inputs, inputs, strict=False):
        env[value] = x
    for value in graph.initializers.values():
        if value not in env and value.const_value is not None:
            env[value] = constant(value.const_value.numpy())
    return env
