"""One conversion, end to end: import -> IR -> emit -> parity check -> files.

``convert`` is what every ``xconv <source>-to-<target>`` command calls. It writes into a
staging folder beside ``out_dir`` and moves it into place only when every file is written, so
a failed run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import replace_dir
from xconv.errors import ConversionError

logger = logging.getLogger(__name__)

SOURCES = ("torch", "onnx", "flax", "jax", "tf")
TARGETS = ("flax", "jax", "onnx", "torch")
APIS = ("linen", "nnx")
PARITY_MODES = ("auto", "whole", "layerwise")
#: Float weight bytes above which ``parity="auto"`` checks a torch model block by block: a
#: whole-model float64 oracle would hold twice these bytes again.
LAYERWISE_BYTES = 256 * 2**20
#: Weight bytes above which a by-product ``model.onnx`` keeps its weights in
#: ``model.onnx.data`` (streamed tensor by tensor) instead of in one in-memory proto.
EXTERNAL_BYTES = 64 * 2**20


def _weight_bytes(model: ir.Model) -> int:
    return sum(
        v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None
    )


@dataclass(frozen=True)
class ConvertOptions:
    """Everything a conversion can be told; passed down the call chain, never global.

    Attributes:
        api: Flax API of the generated module: ``"linen"`` or ``"nnx"``.
        check: Run the parity check against the source model.
        policy: Parity policy (``"oracle"``, ``"dtype"``).
        devices: Devices the parity check runs the candidate on (``"all"``, ``"cpu"``).
        dynamic_batch: Give the converted model a symbolic batch dimension.
        module_factory: ``"pkg.mod:factory"`` building the module a state_dict loads into.
        trust_pickle: Allow unpickling a full torch module (runs code from the file).
        input_shapes: Example input shapes (``"2,3,224,224"``, optionally ``":int64"``).
        input_dtypes: Their dtypes (one for all, or one each).
        inputs_npz: Example inputs from an ``.npz`` file instead.
        parity_random_inputs: Random input sets the parity check draws within the example
            inputs' range (besides the example and edge inputs).
        parity: How the float64 oracle runs: ``"whole"`` (one float64 copy of the model),
            ``"layerwise"`` (one block at a time, per-block report; torch ``.pt2`` /
            ``nn.Module`` sources) or ``"auto"`` (layerwise once the model's float weights
            pass :data:`LAYERWISE_BYTES`, so the float64 copy stays within memory bounds).
        partitioning: Target ``flax``: ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` or a rule table;
            written into ``model.py`` with each variable's logical axes (:mod:`xconv.sharding`).
        weights_format: Target ``flax``: ``"msgpack"`` (default) or ``"orbax"`` (implied by
            ``partitioning``), which the generated ``load(out_dir, mesh=)`` restores sharded.
        dtype: Targets ``flax`` / ``jax``: compute dtype, ``"float32"`` (default) or
            ``"bfloat16"`` (float32 params, bfloat16 matmuls / convolutions / attention, norms
            and softmax in float32; :mod:`xconv.converters.ops.precision`). A bfloat16 model
            is checked with :func:`xconv.parity.policies.bf16_policy`, its bound in the report.
        mesh: Targets ``flax`` and ``jax``: the parity check runs the candidate sharded over
            this ``"DATAxMODEL"`` mesh of the visible devices (the flax output restored onto
            it by its ``load(out_dir, mesh=)``; parameters placed by ``partitioning``, default
            ``"fsdp+tp"``); the report states the mesh and each parameter's sharding.
    """

    api: str = "linen"
    check: bool = True
    policy: str = "oracle"
    devices: str = "all"
    dynamic_batch: bool = False
    module_factory: str | None = None
    trust_pickle: bool = False
    input_shapes: tuple[str, ...] = ()
    input_dtypes: tuple[str, ...] = ("float32",)
    inputs_npz: str | None = None
    parity_random_inputs: int = 2
    parity: str = "auto"
    partitioning: Any = None
    weights_format: str | None = None
    dtype: str | None = None
    mesh: Any = None

    def __post_init__(self) -> None:
        from xconv.converters.ops.precision import resolve_dtype

        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        if self.parity not in PARITY_MODES:
            raise ConversionError(
                f"unknown parity mode {self.parity!r}; choose one of {list(PARITY_MODES)}"
            )
        if self.api not in APIS:
            raise ConversionError(f"unknown Flax api {self.api!r}; choose one of {list(APIS)}")


@dataclass
class ConversionResult:
    """What a conversion wrote, and its parity report (None with ``check=False``)."""

    out_dir: Path
    model: ir.Model
    files: list[Path] = field(default_factory=list)
    parity: Any = None
    #: Wall seconds per stage (``load``, ``import``, ``emit``, ``model.onnx``, ``parity``).
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.parity is None or bool(self.parity.passed)


@dataclass
class _Imported:
    model: ir.Model
    reference: Any  # what the parity check runs as ground truth
    inputs: Sequence[Any] | None
    description: str
    timings: dict[str, float] = field(default_factory=dict)
    #: The torch ``ExportedProgram`` the IR came from (a ``.pt2`` or an ``nn.Module``
    #: exported), which the layerwise parity check cuts into blocks.
    program: Any = None


Progress = Callable[[str], None]


def convert(
    source: Any,
    *,
    source_kind: str,
    target: str,
    out_dir: str | os.PathLike,
    options: ConvertOptions | None = None,
    example_inputs: Sequence[Any] | None = None,
    progress: Progress | None = None,
) -> ConversionResult:
    """Convert ``source`` to ``target`` and write the result to ``out_dir``.

    Args:
        source: A model file path, or an in-memory model of ``source_kind`` (an
            ``nn.Module`` for torch, a ``ModelProto``/``onnx_ir.Model`` for onnx).
        source_kind: One of ``SOURCES``.
        target: One of ``TARGETS``: ``flax`` (model.py + variables.msgpack), ``jax``
            (model.py loading the function + params.msgpack), ``onnx`` (model.onnx),
            ``torch`` (model.py with an ``nn.Module`` + its weights).
        out_dir: Output folder; replaced as a whole when the conversion succeeds.
        options: See :class:`ConvertOptions`.
        example_inputs: Inputs to trace and check with (in-memory sources); files get
            theirs from ``options`` or from the file itself.
        progress: Called with a short description as each step starts.

    Returns:
        A :class:`ConversionResult`. Every target also gets ``model.onnx`` (the IR, viewable
        in Netron) and, when checked, ``parity.json`` and ``parity.html``.
    """
    options = options or ConvertOptions()
    say = progress or (lambda msg: logger.info(msg))
    if source_kind not in SOURCES:
        raise ConversionError(f"unknown source {source_kind!r}; choose one of {list(SOURCES)}")
    if target not in TARGETS:
        raise ConversionError(f"unknown target {target!r}; choose one of {list(TARGETS)}")
    # (Target jax takes a partitioning as the rules of its --mesh parity check.)
    jax_mesh = target == "jax" and options.mesh is not None
    if target != "flax" and (
        (options.partitioning is not None and not jax_mesh) or options.weights_format
    ):
        raise ConversionError("partitioning / weights format: only the flax target has them")
    if options.dtype is not None and target not in ("flax", "jax"):
        raise ConversionError(
            f"dtype {options.dtype!r}: only the flax and jax targets have a compute dtype; "
            f"target {target!r} keeps the source's dtypes"
        )
    if options.mesh is not None:
        from xconv.sharding.rules import make_mesh, read_rules

        if target not in ("flax", "jax"):
            raise ConversionError(
                f"mesh: the parity check runs a {target} candidate unsharded; --mesh applies to "
                "the flax and jax targets"
            )
        if not options.check:
            raise ConversionError("mesh: --mesh shards the parity check; drop --no-check")
        make_mesh(options.mesh)  # a mesh the visible devices do not match fails before any work
        read_rules(options.partitioning)
    out = Path(out_dir)
    timings: dict[str, float] = {}
    clock = [time.perf_counter()]

    def done(stage: str) -> None:
        now = time.perf_counter()
        timings[stage] = timings.get(stage, 0.0) + now - clock[0]
        clock[0] = now

    say(f"importing {source_kind} model")
    imported = _IMPORTERS[source_kind](source, options, example_inputs)
    if imported.timings:  # the importer split its own time (load, import)
        timings.update(imported.timings)
        clock[0] = time.perf_counter()
    else:
        done("import")
    out.parent.mkdir(parents=True, exist_ok=True)
    parent = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.staging."))
    try:
        stage = parent / out.name
        say(f"writing {target} output")
        candidate_loader = _EMITTERS[target](imported.model, stage, options)
        done("emit")
        from xconv.converters.onnx.io import save

        # The IR is the main artifact only for target onnx (one file up to 2 GB); beside
        # another target its weights are streamed to model.onnx.data, never serialised whole.
        by_product = target != "onnx" and _weight_bytes(imported.model) > EXTERNAL_BYTES
        say("writing model.onnx")
        save(imported.model, stage / "model.onnx", external=True if by_product else None)
        done("model.onnx")
        report = None
        differential = None
        if options.check and target in ("flax", "torch"):
            differential = _differential_check(
                imported, target, lambda: candidate_loader(stage), options, say, by_product
            )
            done("differential")
        if options.check:
            say("checking parity against the source model")
            ir_file = stage / "model.onnx" if by_product else None
            report = _check(imported, lambda: candidate_loader(stage), options, say, ir_file)
            if differential:
                report.notes.append(differential)
            report.to_json(stage / "parity.json")
            report.to_html(stage / "parity.html")
            done("parity")
        replace_dir(stage, out)
        _rebase_external(imported.model, stage, out)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    return ConversionResult(out, imported.model, files, report, timings)


# --- importers -------------------------------------------------------------------------


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
    if isinstance(source, str | os.PathLike):
        module, file_inputs = load_torch_model(
            source, module_factory=options.module_factory, trust_pickle=options.trust_pickle
        )
        description = str(source)
    else:
        module, file_inputs = source, None
        description = type(source).__name__
    loaded = time.perf_counter()
    inputs = inputs if inputs is not None else file_inputs
    if inputs is None and not _is_exported_program(module):
        raise ConversionError(
            "no example inputs: give --input-shape (e.g. 1,3,224,224, repeatable) or --inputs "
            "FILE.npz; a .pt2 file carries its own"
        )
    programs: list[Any] = []
    model = from_torch(module, inputs, dynamic_batch=options.dynamic_batch, programs=programs)
    # An ExportedProgram is its own reference: its adapter builds the float64 oracle from the
    # graph (module().double() trips the program's dtype guards).
    reference = module
    if inputs is None:
        inputs = _exported_example_inputs(module)
    timings = {"load": loaded - start, "import": time.perf_counter() - loaded}
    program = programs[0] if programs and _is_exported_program(programs[0]) else None
    return _Imported(model, reference, inputs, description, timings, program)


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
    import numpy as np

    if options.inputs_npz:
        from xconv.weights.io import read_npz_inputs

        return read_npz_inputs(options.inputs_npz)
    rng = np.random.default_rng(0)
    dtypes = list(options.input_dtypes)
    if len(dtypes) == 1:
        dtypes = dtypes * len(options.input_shapes)
    out = []
    for spec, dtype in zip(options.input_shapes, dtypes, strict=True):
        shape_text, _, dt = spec.partition(":")
        shape = tuple(int(d) for d in shape_text.split(",") if d.strip())
        dt = np.dtype(dt or dtype)
        out.append(rng.standard_normal(shape).astype(dt) if dt.kind == "f" else np.zeros(shape, dt))
    return tuple(out)


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
        raise ConversionError("no example inputs: give --input-shape or --inputs FILE.npz")
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
        raise ConversionError(
            "a Flax variables file needs --module pkg.mod:factory returning the module "
            "(or (module, example_inputs))"
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


def _tf_inputs_from_ir(model: ir.Model) -> tuple[Any, ...] | None:
    """Random inputs matching the graph's input types (symbolic dims become 1)."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for value in model.graph.inputs:
        if value.shape is None or value.dtype is None:
            return None
        shape = tuple(d if isinstance(d, int) else 1 for d in value.shape.dims)
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
            raise ConversionError(
                "a JAX params file needs --module pkg.mod:factory returning (fn, params) "
                "or (fn, params, example_inputs)"
            )
        built = resolve_factory(options.module_factory)()
        fn, factory_inputs = built[0], (built[2] if len(built) > 2 else None)
        description = str(source)
        source = (fn, unflatten(read_checkpoint(Path(source))))
        given = given if given is not None else factory_inputs
    if given is None and (options.input_shapes or options.inputs_npz):
        given = _numpy_inputs(options)
    if given is None:
        raise ConversionError("no example inputs: give --input-shape or --inputs FILE.npz")
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

# --- emitters: write the target into the staging folder, return how to load it back -----

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

Load with ``fn, params = load()``; ``params`` nests the weights by source scope path.
"""

from __future__ import annotations

from pathlib import Path

from flax import serialization

import xconv


def load(out_dir=None):
    out_dir = Path(out_dir) if out_dir is not None else Path(__file__).parent
    fn, _ = xconv.to_jax(xconv.load(out_dir / "model.onnx"))
    params = serialization.msgpack_restore((out_dir / "params.msgpack").read_bytes())
    return fn, params
'''


def _emit_jax(model: ir.Model, stage: Path, options: ConvertOptions) -> Loader:
    from flax import serialization

    from xconv.converters.jax.interpreter import to_jax

    _fn, params = to_jax(model)  # float32 params whatever the compute dtype
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "params.msgpack").write_bytes(serialization.msgpack_serialize(params))
    loader = _JAX_LOADER
    if options.dtype:
        loader = loader.replace(
            '"model.onnx"))', f'"model.onnx"), dtype="{options.dtype}")'
        ).replace(
            "the weights by source scope path.",
            f"the weights by source scope path.\nComputes in {options.dtype} (params float32).",
        )
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


def _check(
    imported: _Imported,
    load_candidate: Callable[[], Any],
    options: ConvertOptions,
    say: Progress,
    ir_file: Path | None = None,
):
    """The parity check. With a layerwise oracle and ``ir_file`` (the IR written with its
    weights in ``model.onnx.data``), the reference is run ahead on every input set and then
    released, and the IR's weights are re-pointed at that file, before the candidate loads:
    the source's and the candidate's weights are never in memory together."""
    from xconv.parity.checker import check_parity

    policy: Any = options.policy
    if options.dtype:
        from xconv.converters.ops.precision import rounding_depth
        from xconv.parity.policies import bf16_policy

        policy = bf16_policy(rounding_depth(imported.model), options.policy)
    layerwise: Any = False
    failed = None
    if _layerwise(imported, options):
        # The block-by-block oracle runs before the candidate is loaded, so the two never
        # hold memory at the same time.
        from xconv.parity.adapters import to_numpy
        from xconv.parity.checker import input_sets
        from xconv.parity.layerwise import run_layerwise

        arrays = [to_numpy(x) for x in imported.inputs]
        sets = input_sets(arrays, n_random=options.parity_random_inputs)
        try:
            layerwise = {
                name: run_layerwise(
                    imported.program,
                    imported.model,
                    xs,
                    policy=policy,
                    progress=lambda msg, name=name: say(
                        f"parity (float64 oracle, inputs {name}), {msg}"
                    ),
                )
                for name, xs in sets
            }
        except Exception as e:  # a program the block splitter cannot cut: check it whole
            logger.debug("layerwise parity failed", exc_info=True)
            failed = f"layerwise parity could not run ({type(e).__name__}: {e}); checked whole"
        if failed is None and ir_file is not None:
            from xconv.parity.layerwise import recorded_reference

            say("parity (the source model on every input set)")
            imported.reference = recorded_reference(imported.reference, sets)
            imported.program = None
            _weights_from_file(imported.model, ir_file)
        _release_memory()
    say("parity (the candidate against the source model)")
    report = check_parity(
        imported.reference,
        load_candidate(),
        imported.inputs,
        policy=policy,
        devices=options.devices,
        n_random=options.parity_random_inputs,
        layerwise=layerwise,
        **({"mesh": options.mesh, "rules": options.partitioning} if options.mesh else {}),
    )
    if failed:
        report.notes.append(failed)
    return report


def _differential_check(
    imported: _Imported,
    target: str,
    load_candidate: Callable[[], Any],
    options: ConvertOptions,
    say: Progress,
    big: bool,
) -> str | None:
    """The generated source against the IR's runtime (``to_jax`` for Flax, ``to_torch`` for
    torch) on the example inputs, as ``xconv.to_flax`` / ``xconv.to_torch_source`` check it.

    Raises ParityError on a disagreement (an emitter bug, named before the parity check
    blames the conversion); returns a note for the parity report when it could not run.
    """
    if imported.inputs is None:
        return "generated source not checked against the IR runtime: no example inputs"
    if big or _layerwise(imported, options):
        return (
            "generated source not checked against the IR runtime: the model's weights would "
            "be held a third time (the parity check still compares it with the source)"
        )
    say(f"checking the generated {target} source against the IR runtime")
    from xconv.errors import ParityError

    try:
        _run_differential(imported, target, load_candidate, options)
    except ParityError:
        raise
    except Exception as e:  # noqa: BLE001 (inputs the runtime cannot take: the parity check runs)
        return f"generated source not checked against the IR runtime ({type(e).__name__}: {e})"
    return None


def _run_differential(
    imported: _Imported, target: str, load_candidate: Callable[[], Any], options: ConvertOptions
) -> None:
    inputs = _as_input_tuple(imported.inputs)
    candidate = load_candidate()
    if target == "flax":
        from xconv.converters.jax.interpreter import to_jax

        if options.api == "linen":
            module, variables = candidate
            got = module.apply(variables, *inputs)
        else:
            got = candidate(*inputs)
        fn, params = to_jax(imported.model)
        want = fn(params, *inputs)
        what, runtime = f"generated Flax ({options.api})", "to_jax"
    else:
        import torch

        from xconv.converters.torch.emitter import to_torch

        runtime_module, _ = to_torch(imported.model)
        targs = tuple(torch.as_tensor(np.asarray(x)) for x in inputs)
        with torch.no_grad():
            got, want = candidate(*targs), runtime_module(*targs)
        what, runtime = "generated torch source", "to_torch"
    del candidate
    _differential(imported.model, what, runtime, got, want)


def _weights_from_file(model: ir.Model, path: Path) -> None:
    """Point the IR's initializers at the external data just written beside ``path``
    (memory-mapped when read), dropping the in-memory tensors they were (torch storage)."""
    written = ir.load(path)
    for name, value in model.graph.initializers.items():
        saved = written.graph.initializers.get(name)
        tensor = saved.const_value if saved is not None else None
        if isinstance(tensor, ir.ExternalTensor):
            value.const_value = tensor


def _rebase_external(model: ir.Model, old: Path, new: Path) -> None:
    """External tensors that pointed into the staging folder now read from ``new``."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and Path(tensor.base_dir) == old:
            tensor.base_dir = str(new)


def _release_memory() -> None:
    """Give the float64 blocks' freed memory back to the OS before the candidate is loaded.

    glibc keeps freed heap chunks (torch's and numpy's buffers below its mmap threshold) in
    the process, so the next allocations would land on top of them in the peak RSS.
    """
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _layerwise(imported: _Imported, options: ConvertOptions) -> bool:
    """Whether to run the float64 oracle block by block (see ``ConvertOptions.parity``)."""
    if options.parity == "whole":
        return False
    program = imported.program
    if program is None or not isinstance(imported.inputs, list | tuple):
        if options.parity == "layerwise":
            raise ConversionError(
                "--parity layerwise needs a torch source (a .pt2 or an nn.Module); "
                f"{imported.description} is checked whole (--parity whole)"
            )
        return False
    if options.parity == "layerwise":
        return True
    total = 0
    for t in (*program.state_dict.values(), *program.constants.values()):
        if hasattr(t, "is_floating_point") and t.is_floating_point():
            total += t.numel() * t.element_size()
    return total > LAYERWISE_BYTES


# --- the public source emitters, checked against the IR's runtime on example inputs --------

#: Generated source and the IR's runtime run the same graph in the same framework: they may
#: differ by float reassociation, never by more.
DIFFERENTIAL_RTOL, DIFFERENTIAL_ATOL = 1e-4, 1e-5


def to_flax(
    model: ir.Model,
    out_dir: str | os.PathLike,
    *,
    api: str = "linen",
    options: Any = None,
    example_inputs: Any = None,
    partitioning: Any = None,
    format: str | None = None,
    dtype: Any = None,
) -> Path:
    """Write Flax source for ``model`` (see ``flax_emitter.to_flax``; ``partitioning`` and
    ``format`` as in ``xconv.sharding.flax.to_flax``); with ``example_inputs`` (an array or a
    tuple of arrays), run the written ``model.py`` and check it against ``xconv.to_jax`` of
    the same IR before returning.

    ``dtype="bfloat16"`` writes a model computing in bfloat16 with float32 parameters (layers
    get ``dtype=jnp.bfloat16``; norms and softmax run in float32); it is checked against
    ``xconv.to_jax(model, dtype="bfloat16")`` within :func:`bf16_differential_bound`.

    Raises:
        ParityError: the generated module disagrees with the runtime; names the first differing
            output. ``out_dir`` is removed: nothing wrong is left behind.
    """
    from xconv.converters.ops.precision import resolve_dtype
    from xconv.sharding.flax import to_flax as emit

    low = resolve_dtype(dtype)
    if low is not None:
        from dataclasses import replace

        from xconv.converters.flax.source.emitter import FlaxOptions

        options = replace(options or FlaxOptions(), dtype=low)
    out = emit(model, out_dir, api=api, options=options, partitioning=partitioning, format=format)
    if example_inputs is None:
        return out
    try:
        inputs = _as_input_tuple(example_inputs)
        generated = _load_generated(out / "model.py")
        if api == "linen":
            module, variables = generated.load(out)
            got = module.apply(variables, *inputs)
        else:
            got = generated.load(out)(*inputs)
        from xconv.converters.jax.interpreter import to_jax

        fn, params = to_jax(model) if low is None else to_jax(model, dtype=low)
        bound = None if low is None else bf16_differential_bound(model)
        what = f"generated Flax ({api}{', bfloat16' if low else ''})"
        _differential(model, what, "to_jax", got, fn(params, *inputs), bound)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def to_torch_source(model: ir.Model, example_inputs: Any = None) -> tuple[str, dict[str, Any]]:
    """Readable torch source and its state_dict (see ``source_emitter.to_torch_source``); with
    ``example_inputs``, run the source and check it against ``xconv.to_torch`` of the same IR.

    Raises:
        ParityError: the generated module disagrees with the runtime; names the first differing
            output.
    """
    from xconv.converters.torch.emitter import to_torch
    from xconv.converters.torch.emitter import to_torch_source as emit

    source, state = emit(model)
    if example_inputs is None:
        return source, state
    import torch

    inputs = tuple(torch.as_tensor(np.asarray(x)) for x in _as_input_tuple(example_inputs))
    namespace: dict[str, Any] = {"__name__": "xconv_generated_torch_source"}
    exec(compile(source, "<xconv generated torch source>", "exec"), namespace)  # noqa: S102
    generated = namespace["Model"]().eval()
    generated.load_state_dict(state)
    runtime, _ = to_torch(model)
    with torch.no_grad():
        got, want = generated(*inputs), runtime(*inputs)
    _differential(model, "generated torch source", "to_torch", got, want)
    return source, state


def _as_input_tuple(example_inputs: Any) -> tuple[Any, ...]:
    items = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    return tuple(x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x) for x in items)


def bf16_differential_bound(model: ir.Model) -> float:
    """Generated bfloat16 Flax vs bfloat16 ``to_jax``: the same ops, rounded to bfloat16 in
    different places (inside a Flax layer vs after an ONNX op): per element, within
    ``4 * 2**-8 * sqrt(L) * (|want| + max|want|)``, L the matmul/conv depth
    (:func:`xconv.converters.ops.precision.rounding_depth`)."""
    from xconv.converters.ops.precision import rounding_depth

    return 4 * 2.0**-8 * float(np.sqrt(rounding_depth(model)))


def _differential(
    model: ir.Model, what: str, runtime: str, got: Any, want: Any, bf16: float | None = None
) -> None:
    """Raise ParityError at the first output where ``got`` and ``want`` disagree (within
    ``bf16`` relative to the element and the output's largest magnitude, when given)."""
    from xconv.errors import ParityError

    got = list(got) if isinstance(got, tuple | list) else [got]
    want = list(want) if isinstance(want, tuple | list) else [want]
    names = [v.name for v in model.graph.outputs]
    if len(got) != len(want):
        raise ParityError(f"{what} returned {len(got)} outputs, {runtime} {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = _numpy(g), _numpy(w)
        name = names[i] if i < len(names) else str(i)
        if g.shape != w.shape:
            raise ParityError(
                f"{what} disagrees with {runtime} first at output {i} ({name!r}): shape "
                f"{g.shape} vs {w.shape}"
            )
        if not (_is_float(w.dtype) or _is_float(g.dtype)):
            bad = g != w
        else:
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            finite = np.isfinite(w64)
            scale = float(np.abs(w64[finite]).max()) if finite.any() else 0.0
            # Half-precision outputs: a few ulps of their own dtype (reassociation in fp16
            # moves the last bit at any magnitude).
            tiny = 4 * _eps(w.dtype)
            rtol, atol = max(DIFFERENTIAL_RTOL, tiny), max(DIFFERENTIAL_ATOL, tiny)
            bound = atol * max(1.0, scale) + rtol * np.abs(w64)
            if bf16 is not None:
                bound = bf16 * (scale + np.abs(w64))
            with np.errstate(invalid="ignore"):
                close = np.abs(g64 - w64) <= bound
                same = np.isclose(g64, w64, equal_nan=True)  # inf / nan by position
                bad = ~np.where(finite, close, same)
        if bad.any():
            where = tuple(int(j) for j in np.argwhere(bad)[0])
            raise ParityError(
                f"{what} disagrees with {runtime} first at output {i} ({name!r}): "
                f"{int(bad.sum())} of {bad.size} elements, first at index {where}: "
                f"{g[where]!r} vs {w[where]!r}. The source emitter and the IR runtime differ "
                "on this graph: please report it."
            )


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; bfloat16 has no numpy dtype
        x = x.detach().cpu()
        return (x.float() if x.dtype.is_floating_point and x.element_size() < 4 else x).numpy()
    return np.asarray(x)


def _eps(dtype: np.dtype) -> float:
    try:
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)
    except (ImportError, ValueError, TypeError):
        return float(np.finfo(np.float32).eps)


def _is_float(dtype: np.dtype) -> bool:
    """numpy's floats and ml_dtypes' (bfloat16, float8 ...: numpy kind 'V')."""
    return dtype.kind in "fc" or dtype.name.startswith(("bfloat", "float"))
