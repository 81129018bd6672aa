"""The conversion pipeline's writers, one per target (``_EMITTERS``).

Each writes the target into the staging folder and returns how to load it back from the
folder it ends up in (the parity check loads the candidate from there).
:mod:`xconv.pipeline` re-exports ``_EMITTERS`` (the same dict).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx_ir as ir

from xconv.errors import ConversionError
from xconv.pipeline.options import ConvertOptions

Loader = Callable[[Path], Any]


def _emit_flax(model: ir.Model, stage: Path, options: ConvertOptions) -> Loader:
    from xconv.converters.flax.source.emitter import FlaxOptions, to_flax

    flax_options = FlaxOptions(dtype=options.dtype) if options.dtype else None
    if options.partitioning is not None or options.weights_format == "orbax":
        from xconv.sharding.flax import to_flax as to_flax_sharded

        to_flax_sharded(
            model, stage, api=options.api, partitioning=options.partitioning,
            format=options.weights_format, options=flax_options,
        )  # fmt: skip
        if options.mesh is not None:
            # Restored from Orbax straight onto the mesh, as a user's load(mesh=) would.
            return lambda where: _load_generated(where / "model.py").load(where, mesh=options.mesh)
        return lambda where: _load_generated(where / "model.py").load(where)
    to_flax(model, stage, api=options.api, options=flax_options)

    def load(where: Path) -> Any:
        generated = _load_generated(where / "model.py")
        if options.api != "linen":
            return generated.load(where)
        # The generated load() reads with flax (whole file in memory, then a copy per array);
        # the check reads the same file one aligned array at a time (JAX takes them as is).
        from xconv.weights.flax_msgpack import read_msgpack

        return generated.Model(), read_msgpack(where / "variables.msgpack")

    return load


_JAX_LOADER = '''"""JAX function converted by xconv: ``fn(params, *inputs) -> tuple of outputs``.

Load with ``fn, params = load()``; ``params`` nests the weights by source scope path,
convolution kernels stored (*k, I, O) (``fn.kernel_perms`` names them).
"""

from __future__ import annotations

from pathlib import Path

import xconv
from xconv.weights.flax_msgpack import read_msgpack


def load(out_dir=None):
    """``(fn, params)``: the function over model.onnx's graph, the weights of params.msgpack
    (read one array at a time; the graph's copy of them is not read)."""
    out_dir = Path(out_dir) if out_dir is not None else Path(__file__).parent
    model = xconv.load(out_dir / "model.onnx")
    params = read_msgpack(out_dir / "params.msgpack")
    return xconv.to_jax(model, kernel_layout="HWIO", params=params)
'''


def _emit_jax(model: ir.Model, stage: Path, options: ConvertOptions) -> Loader:
    import jax
    import numpy as np

    from xconv.converters.flax.source.generation import section
    from xconv.converters.jax.interpreter import to_jax
    from xconv.weights.flax_msgpack import write_msgpack

    # float32 params whatever the compute dtype, in the layout the loader asks for
    _fn, params = to_jax(model, kernel_layout="HWIO")
    stage.mkdir(parents=True, exist_ok=True)
    with open(stage / "params.msgpack", "wb") as f:  # one array at a time
        write_msgpack(jax.tree_util.tree_map(np.asarray, params), f)
    loader = _JAX_LOADER
    if options.dtype:
        loader = loader.replace(
            "params=params)", f'params=params, dtype="{options.dtype}")'
        ).replace(
            "names them).",
            f"names them).\nComputes in {options.dtype} (params float32).",
        )
    generation = section(dict(model.metadata_props), "jax")
    if generation:  # a causal LM's cached step (--generate): init_cache, decode, generate
        loader = loader.replace(
            "from pathlib import Path\n",
            "from pathlib import Path\n\nimport jax\nimport jax.numpy as jnp\n",
        ).replace("from pathlib", "import functools\nfrom pathlib")
        loader += "\n\n" + generation + "\n"
    (stage / "model.py").write_text(loader)
    return lambda where: _load_generated(where / "model.py").load(where)


def _emit_onnx(model: ir.Model, stage: Path, options: ConvertOptions) -> Loader:
    stage.mkdir(parents=True, exist_ok=True)
    return lambda where: str(where / "model.onnx")


def _emit_torch(model: ir.Model, stage: Path, options: ConvertOptions) -> Loader:
    from xconv.converters.torch.source.write import write_torch

    write_torch(model, stage)
    return lambda where: _load_generated(where / "model.py").load(where)


_EMITTERS: dict[str, Callable[[ir.Model, Path, ConvertOptions], Loader]] = {
    "flax": _emit_flax,
    "jax": _emit_jax,
    "onnx": _emit_onnx,
    "torch": _emit_torch,
}


def _load_generated(path: Path):
    """Import a generated ``model.py`` under a unique module name."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"xconv_generated_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConversionError(f"cannot import the generated module {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
