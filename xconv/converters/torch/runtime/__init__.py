"""PyTorch backend: run the IR with torch ops (``xconv.to_torch``)."""

from __future__ import annotations

from xconv.converters.ops import RUNTIME_FAMILIES
from xconv.converters.registry import import_handler_modules

#: Handler modules, one per op family; importing one registers its handlers.
HANDLER_MODULES = RUNTIME_FAMILIES

import_handler_modules(__name__, HANDLER_MODULES)
