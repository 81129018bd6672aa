"""The Flax module ``xconv.to_flax`` wrote, imported and applied as a linen or an nnx module."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from typing import Any


def import_generated(out_dir: Path) -> Any:
    """The generated ``model.py`` of ``out_dir`` as a module, registered under a fresh name."""
    name = f"xconv_generated_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, out_dir / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_generated(out_dir: Path, api: str, *inputs, jit: bool = True) -> tuple[Any, tuple]:
    """The generated module's output on ``inputs`` (jitted unless ``jit`` is False), and
    ``(module, model, variables)`` (``variables`` None for nnx, whose model holds its state)."""
    import jax

    mod = import_generated(out_dir)
    if api == "linen":
        model, variables = mod.load(out_dir)

        def fn(v, *x):
            return model.apply(v, *x)

        fn = jax.jit(fn) if jit else fn
        return fn(variables, *inputs), (mod, model, variables)
    model = mod.load(out_dir)
    if jit:
        from flax import nnx

        out = nnx.jit(lambda m, *x: m(*x))(model, *inputs)
    else:
        out = model(*inputs)
    return out, (mod, model, None)


def apply_generated(gen: Any, out: Path, api: str, x) -> tuple[Any, Any, Any, Any]:
    """``(model, variables, output, closed jaxpr)`` of the generated module ``gen`` (see
    :func:`import_generated`) on ``x`` (``variables`` is None for nnx, whose model holds its
    state)."""
    import jax

    if api == "linen":
        model, variables = gen.load(out)
        got = model.apply(variables, x)
        return model, variables, got, jax.make_jaxpr(lambda v: model.apply(v, x))(variables)
    model = gen.load(out)
    return model, None, model(x), jax.make_jaxpr(lambda: model(x))()
