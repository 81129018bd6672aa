"""PyTorch backend: run the IR with torch ops (``xconv.to_torch``)."""

from __future__ import annotations

from xconv.converters.registry import import_handler_modules

#: Handler modules, one per op family; importing one registers its handlers.
HANDLER_MODULES = (
    "elementwise",
    "math",
    "linalg",
    "reduce",
    "attention",
    "nn",
    "rnn",
    "shape",
    "indexing",
    "control",
    "sequence",
    "random",
    "misc",
    "signal",
)

import_handler_modules(__name__, HANDLER_MODULES)
