"""Test helper: write the torch source xconv generates for an IR model and load it."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any

import xconv


def load_generated(model: Any, folder: Path) -> tuple[Any, str]:
    """``(Model() with its state_dict loaded, source)`` for ``xconv.to_torch_source(model)``."""
    source, state = xconv.to_torch_source(model)
    path = Path(folder) / f"gen_{uuid.uuid4().hex[:8]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    module = mod.Model()
    module.load_state_dict(state)
    return module, source
