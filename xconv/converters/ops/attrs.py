"""Attribute and static-input helpers every backend's handlers share (``ctx`` is the
backend's handler context: it has ``node``, ``static`` and ``error``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xconv.converters.ops.context import node_error
from xconv.errors import UnsupportedAttributeError

#: The attributes (and defaults) every ONNX convolution op shares: Conv, ConvTranspose,
#: ConvInteger, QLinearConv.
CONV_ATTRS = {
    "auto_pad": "NOTSET",
    "dilations": None,
    "group": 1,
    "kernel_shape": None,
    "pads": None,
    "strides": None,
}


def static_ints(ctx, value: Any, what: str) -> list[int]:
    """A static 0-d or 1-d integer input as a list of Python ints."""
    return [int(v) for v in np.asarray(ctx.static(value, what)).reshape(-1)]


def static_int(ctx, value: Any, what: str) -> int:
    """A static input holding exactly one integer, as a Python int."""
    arr = np.asarray(ctx.static(value, what))
    if arr.size != 1:
        raise ctx.error(f"{what} must hold a single integer, got shape {arr.shape}")
    return int(arr.reshape(()))


def unsupported(ctx, message: str) -> UnsupportedAttributeError:
    """An UnsupportedAttributeError carrying the node's op, name, scope and source line."""
    return node_error(ctx.node, message, UnsupportedAttributeError)


def check_choice(ctx, name: str, value: str, choices: Sequence[str]) -> None:
    """Reject an attribute value outside ``choices``, listing the supported ones."""
    if value not in choices:
        raise unsupported(ctx, f"{name} {value!r} not supported; supported: {list(choices)}")
