"""The conversion pipeline's importers: a source (file or in-memory model) -> IR + reference.

One function per source kind (``_IMPORTERS``): each returns the IR, what the parity check runs
as ground truth, the example inputs and, for torch, the exported program the layerwise check
cuts into blocks.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.errors import UsageError
from xconv.pipeline.options import ConvertOptions, _Imported

#: The flags that supply example inputs, listed by every "no example inputs" error.
_INPUT_FLAGS = (
    ("--input-shape", "each input's shape, e.g. 1,3,224,224 or 2,16:int64 (repeatable)"),
    ("--inputs", "or an .npz file holding the example inputs in order"),
)


def _import_torch(source: Any, options: ConvertOptions, given: Sequence[Any] | None) -> _Imported:
    from xconv.converters.torch.importer.files import example_inputs, load_torch_model
    from xconv.converters.torch.importer.trace import from_torch

    inputs = (
        given
        if given is not None
        else example_inputs(
            list(options.input_shapes) or None, list(options.input_dtypes), npz=options.inputs_npz
        )
    )
    start = time.perf_counter()
    if isinstance(source, str | os.PathLike) and Path(source).is_dir():
        from xconv.converters.torch.importer.hub import load_folder

        module, file_inputs, description = load_folder(source, trust_code=options.trust_code)
    elif isinstance(source, str | os.PathLike):
        module, file_inputs = load_torch_model(
            source,
            module_factory=options.module_factory,
            trust_pickle=options.trust_pickle,
            need_inputs=inputs is None,
        )
        description = str(source)
    else:
        module, file_inputs = source, None
        description = type(source).__name__
    loaded = time.perf_counter()
    inputs = inputs if inputs is not None else file_inputs
    if options.generate:
        # The cached step is traced at example inputs of its own (prompt and cache sizes).
        inputs = None
    elif inputs is None and not _is_exported_program(module):
        raise UsageError(
            f"no example inputs for {description}: a .pt2, a traced TorchScript archive, a "
            "save_pretrained folder and a module with an example_input_array attribute record "
            "theirs; this one does not",
            missing=_INPUT_FLAGS,
        )
    programs: list[Any] = []
    model = from_torch(
        module,
        inputs,
        dynamic_batch=options.dynamic_batch,
        static=options.static,
        programs=programs,
        generate=options.generate,
    )
    # An ExportedProgram is its own reference: its adapter builds the float64 oracle from the
    # graph (module().double() trips the program's dtype guards). With generate, the cached
    # step's program is the reference, at its own example inputs.
    reference = programs[0] if options.generate else module
    if inputs is None:
        inputs = _exported_example_inputs(reference)
    timings = {"load": loaded - start, "import": time.perf_counter() - loaded}
    program = programs[0] if programs and _is_exported_program(programs[0]) else None
    source = module if options.generate else None
    return _Imported(model, reference, inputs, description, timings, program, source)


def _is_exported_program(obj: Any) -> bool:
    mod = sys.modules.get("torch.export")
    return mod is not None and isinstance(obj, mod.ExportedProgram)


def _exported_example_inputs(program: Any) -> Sequence[Any] | None:
    example = getattr(program, "example_inputs", None)
    if example is None:
        return None
    args, _kwargs = example
    return tuple(args)


def _import_onnx(source: Any, options: ConvertOptions, given: Sequence[Any] | None) -> _Imported:
    from xconv.converters.onnx.io import load

    model = load(source)
    inputs = given
    if inputs is None and (options.input_shapes or options.inputs_npz):
        inputs = _numpy_inputs(options)
    description = str(source) if isinstance(source, str | os.PathLike) else "ONNX model"
    # The reference is the original file run by onnxruntime, not the upgraded IR.
    reference = str(source) if isinstance(source, str | os.PathLike) else source
    return _Imported(model, reference, inputs, description)


def _numpy_inputs(options: ConvertOptions) -> tuple[Any, ...]:
    if options.inputs_npz:
        from xconv.weights.io import read_npz_inputs

        return read_npz_inputs(options.inputs_npz)
    from xconv.inputs import example_arrays

    return example_arrays(options.input_shapes, options.input_dtypes)


def _import_flax(source: Any, options: ConvertOptions, given: Sequence[Any] | None) -> _Imported:
    """``source`` is ``(linen_module, variables)``, an nnx module, or a variables file
    (msgpack, Orbax, safetensors, npz) with ``options.module_factory`` building the module."""
    from xconv.converters.flax.importer.trace import from_flax

    description = None
    if isinstance(source, str | os.PathLike):
        description = str(source)
        source, factory_inputs = _flax_from_files(Path(source), options)
        given = given if given is not None else factory_inputs
    if given is None and (options.input_shapes or options.inputs_npz):
        given = _numpy_inputs(options)
    if given is None:
        raise UsageError("no example inputs: the factory returned none", missing=_INPUT_FLAGS)
    if isinstance(source, tuple) and len(source) == 2:
        module, variables = source
        reference: Any = (module, variables)
        if description is not None:  # read from a file: check it fits before tracing
            _check_linen_variables(module, variables, tuple(given), description)
    else:
        module, variables = source, None
        reference = module
    model = from_flax(module, variables, tuple(given))
    return _Imported(model, reference, tuple(given), description or type(module).__name__)


def _check_linen_variables(module: Any, variables: Any, inputs: tuple, where: str) -> None:
    import jax

    from xconv.weights.io import check_fits

    expected = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs))
    check_fits(expected, variables, where)


def _flax_from_files(path: Path, options: ConvertOptions) -> tuple[Any, Any]:
    """Build the module with the factory and load the variables file into it."""
    from xconv.factories import resolve_factory
    from xconv.weights.io import read_checkpoint, unflatten

    if not options.module_factory:
        raise UsageError(
            "a Flax variables file needs the module it belongs to",
            missing=[("--module", "pkg.mod:factory returning the module (or (module, inputs))")],
        )
    built = resolve_factory(options.module_factory)()
    # The factory returns the module, (module, inputs) or (module, variables, inputs).
    module, inputs = (built[0], built[-1]) if isinstance(built, tuple) else (built, None)
    tree = unflatten(read_checkpoint(path))
    if hasattr(module, "apply") and hasattr(module, "init"):  # linen
        return (module, tree), inputs
    from flax import nnx

    from xconv.weights.io import check_fits

    state = nnx.state(module)
    check_fits(nnx.to_pure_dict(state), tree, str(path))
    nnx.replace_by_pure_dict(state, tree)
    nnx.update(module, state)
    return module, inputs


def _import_tf(source: Any, options: ConvertOptions, given: Sequence[Any] | None) -> _Imported:
    """``source`` is a Keras model, a ``tf.function``, a SavedModel folder, ``.keras`` or ``.pb``."""
    from xconv.converters.tf.importer import from_tf, load_source

    inputs = given
    if inputs is None and (options.input_shapes or options.inputs_npz):
        inputs = _numpy_inputs(options)
    obj, reference = load_source(source)
    model = from_tf(obj, inputs)
    if inputs is None and options.check:
        inputs = _tf_inputs_from_ir(model)
    description = str(source) if isinstance(source, str | os.PathLike) else type(source).__name__
    return _Imported(model, reference, inputs, description)


#: Example sizes of the TF importer's role symbols (``xconv.converters.tf.dims``) when no
#: inputs are given: a length or an image size of 1 would hide mixing along that axis, and a
#: convolution stack needs room. Other symbols (the batch included) are 1.
_TF_ROLE_SIZES = {"seq": 8, "height": 32, "width": 32}


def _tf_inputs_from_ir(model: ir.Model) -> tuple[Any, ...] | None:
    """Random inputs matching the graph's input types (symbolic dims by role, else 1)."""

    rng = np.random.default_rng(0)
    out = []
    for value in model.graph.inputs:
        if value.shape is None or value.dtype is None:
            return None
        shape = tuple(
            d if isinstance(d, int) else _TF_ROLE_SIZES.get(getattr(d, "value", None), 1)
            for d in value.shape.dims
        )
        dt = np.dtype(value.dtype.numpy())
        out.append(rng.standard_normal(shape).astype(dt) if dt.kind == "f" else np.zeros(shape, dt))
    return tuple(out)


def _import_jax(source: Any, options: ConvertOptions, given: Sequence[Any] | None) -> _Imported:
    """``source`` is ``(fn, params)`` for ``fn(params, *inputs)``, or a params file with
    ``options.module_factory`` returning ``(fn, params[, example_inputs])``."""
    from xconv.converters.flax.importer.trace import from_jax

    description = None
    if isinstance(source, str | os.PathLike):
        from xconv.factories import resolve_factory
        from xconv.weights.io import read_checkpoint, unflatten

        if not options.module_factory:
            raise UsageError(
                "a JAX params file needs the function it belongs to",
                missing=[("--module", "pkg.mod:factory returning (fn, params[, inputs])")],
            )
        built = resolve_factory(options.module_factory)()
        fn, factory_inputs = built[0], (built[2] if len(built) > 2 else None)
        description = str(source)
        source = (fn, unflatten(read_checkpoint(Path(source))))
        given = given if given is not None else factory_inputs
    if given is None and (options.input_shapes or options.inputs_npz):
        given = _numpy_inputs(options)
    if given is None:
        raise UsageError("no example inputs: the factory returned none", missing=_INPUT_FLAGS)
    fn, params = source
    model = from_jax(fn, params, tuple(given))
    name = description or getattr(fn, "__name__", "fn")
    return _Imported(model, (fn, params), tuple(given), name)


_IMPORTERS: dict[str, Callable[[Any, ConvertOptions, Sequence[Any] | None], _Imported]] = {
    "torch": _import_torch,
    "onnx": _import_onnx,
    "flax": _import_flax,
    "jax": _import_jax,
    "tf": _import_tf,
}


def import_model(source: Any, source_kind: str, options: ConvertOptions | None = None) -> ir.Model:
    """The IR of ``source`` as ``convert`` imports it (``xconv inspect`` reads every source
    kind through here)."""
    if source_kind not in _IMPORTERS:
        raise UsageError(f"unknown source kind {source_kind!r}; choose one of {list(_IMPORTERS)}")
    return _IMPORTERS[source_kind](source, options or ConvertOptions(check=False), None).model
