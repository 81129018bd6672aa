"""The Flax module ``xconv.to_flax`` wrote, imported and applied as a linen or an nnx module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def load_generated(out: Path) -> tuple[Any, str]:
    """The generated ``model.py`` of ``out`` as a module, and its source."""
    spec = importlib.util.spec_from_file_location(f"gen_{out.name}", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, (out / "model.py").read_text()


def apply_generated(gen: Any, out: Path, api: str, x) -> tuple[Any, Any, Any, Any]:
    """``(model, variables, output, closed jaxpr)`` of the generated module on ``x``
    (``variables`` is None for nnx, whose model holds its state)."""
    import jax

    if api == "linen":
        model, variables = gen.load(out)
        got = model.apply(variables, x)
        return model, variables, got, jax.make_jaxpr(lambda v: model.apply(v, x))(variables)
    model = gen.load(out)
    return model, None, model(x), jax.make_jaxpr(lambda: model(x))()
