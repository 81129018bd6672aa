"""What every runtime's handler context and interpreter share: errors that name the node.

A backend's context (``JaxContext``, ``TorchContext``) subclasses :class:`NodeContext`; its
interpreter runs each handler under :func:`handler_errors`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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
