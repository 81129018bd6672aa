"""The shared IR: ONNX semantics held in memory by ``onnx_ir``.

This package imports no framework (torch, jax, tensorflow); converters depend on it, never
the other way round.
"""

from __future__ import annotations

from xconv.ir.metadata import (
    LAYER,
    LAYOUT,
    MODULE,
    ROLE,
    SCOPE,
    SOURCE_LINE,
    get_layer,
    get_scope,
    set_layer,
)

#: The default-domain opset every IR model is held at. Importers upgrade older models to it
#: with the ONNX version converter. 23 is the first opset with ``Attention``,
#: ``RMSNormalization`` and ``RotaryEmbedding``, and onnxruntime runs it.
OPSET = 23

#: The custom domain for ops ONNX lacks (each documented with a schema and numpy reference).
XCONV_DOMAIN = "xconv"

__all__ = [
    "LAYER",
    "LAYOUT",
    "MODULE",
    "OPSET",
    "ROLE",
    "SCOPE",
    "SOURCE_LINE",
    "XCONV_DOMAIN",
    "get_layer",
    "get_scope",
    "set_layer",
]
