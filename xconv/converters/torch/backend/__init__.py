"""PyTorch backend: run the IR with torch ops (``xconv.to_torch``)."""

from __future__ import annotations

import importlib

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

for _name in HANDLER_MODULES:
    try:
        importlib.import_module(f"xconv.converters.torch.backend.{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"xconv.converters.torch.backend.{_name}":
            raise
