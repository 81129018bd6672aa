"""Checkpoints larger than memory: trace without weights, stream the weights, check by block.

``xconv torch-to-flax --module transformers:LlamaForCausalLM --config config.json --weights
'model-*.safetensors' -o OUT`` runs :func:`convert_checkpoint`:

1. The checkpoint's headers are read and checked against the module built with no parameter
   data (:mod:`xconv.converters.torch.importer.meta`): every missing, unexpected, mis-shaped or
   mis-typed tensor, truncated shard or missing shard file is listed in one
   :class:`~xconv.errors.WeightsError` (exit 6) before anything is written.
2. The module is traced with ``torch.export`` on fake parameters and translated to the IR; its
   initializers become lazy references into the shards (:class:`~xconv.weights.stream.LazyWeight`).
3. The target's source is generated against stand-in weights, then the weights are streamed
   shard by shard into the target's shard files (:mod:`xconv.weights.stream`): Flax gets
   safetensors shards + index read by the generated ``load(out_dir)``; ONNX (and JAX) get the
   checkpoint's shards copied beside ``model.onnx`` as its external data. (The Flax folder has
   no ``model.onnx``: its IR is what ``torch-to-onnx --weights`` writes.) For Flax the stream
   starts in a child process as soon as step 1 is done, beside the trace, on a layout guessed from
   the module (:class:`~xconv.weights.stream.EarlyStream`); the emitter's plan is then checked
   against the guess, and a difference streams the weights again.
4. ``parity="layerwise"`` checks the result block by block against torch with a float64 oracle,
   one block's weights in memory at a time.

Everything is written into a staging folder moved into place at the end: a failure leaves
nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import replace_dir
from xconv.errors import ConversionError, UsageError
from xconv.weights.shards import CheckpointIndex, numpy_dtype
from xconv.weights.stream import (
    INDEX_NAME,
    EarlyStream,
    Planned,
    StreamReport,
    Target,
    planning_copy,
)

logger = logging.getLogger(__name__)

TARGETS = ("flax", "jax", "onnx")


@dataclass
class Traced:
    """A model traced without its weights.

    Attributes:
        model: The IR; checkpoint entries are lazy references (``LazyWeight``).
        index: The checkpoint's tensors (from the shard headers).
        meta: The weightless module, its expected entries and ties.
        inputs: The example inputs it was traced with.
        program: The weightless ``torch.export`` program (the layerwise reference).
        route: How it was traced: ``"full trace (why)"``, or the repeated list traced with
            two entries and copied (:mod:`xconv.converters.torch.importer.repeat`).
    """

    model: ir.Model
    index: CheckpointIndex
    meta: Any
    inputs: tuple[Any, ...]
    program: Any = None
    route: str = "full trace"

    @property
    def sources(self) -> dict[str, str]:
        """``{initializer name: checkpoint key}`` for every lazy weight."""
        from xconv.weights.stream import LazyWeight

        return {
            name: v.const_value.ref.name
            for name, v in self.model.graph.initializers.items()
            if isinstance(v.const_value, LazyWeight)
        }


def from_checkpoint(
    module: Any,
    weights: str | os.PathLike,
    *,
    config: Any = None,
    example_inputs: Sequence[Any] | None = None,
    dynamic_batch: bool = False,
    static: bool = False,
    input_shapes: tuple[str, ...] = (),
    on_checked: Callable[[CheckpointIndex, Any], None] | None = None,
    repeat: bool = True,
) -> Traced:
    """Trace ``module`` on fake parameters and point its IR weights into ``weights``.

    Args:
        module: A torch module class taking the config (``transformers.LlamaForCausalLM``), a
            factory returning the module, or a ``"pkg.mod:name"`` string naming either.
        weights: The checkpoint: ``*.safetensors.index.json``, a glob of shards, a folder.
        config: ``config.json`` path, a dict, or None for a factory taking no config.
        example_inputs: Inputs to trace with (default: token ids ``(1, 8)`` when the config has
            a ``vocab_size``).
        dynamic_batch: Require a symbolic batch dimension (refused when the model fixes it).
        static: Trace at the example shapes; by default every input dimension is symbolic
            unless the model fixes it (``xconv.fixed_dims`` metadata), as in ``from_torch``.
        input_shapes: ``--input-shape`` strings instead of ``example_inputs``.
        on_checked: Called with the index and the weightless module (``MetaModule``) once the
            checkpoint was checked against it, before the trace (the early stream starts here).
        repeat: Trace a list of interchangeable blocks (decoder layers) with two entries and
            copy the second for the rest (:mod:`xconv.converters.torch.importer.repeat`); it falls back
            to the full trace when its preconditions do not hold (``Traced.route`` says which).

    Raises:
        WeightsError: The checkpoint does not fit the module (every problem listed).
    """
    from xconv.converters.torch.importer.meta import build_meta_module, load_config
    from xconv.converters.torch.importer.trace import annotate
    from xconv.factories import resolve_factory
    from xconv.weights.stream import attach

    factory = resolve_factory(module) if isinstance(module, str) else module
    index = CheckpointIndex(weights)
    cfg = load_config(factory, config)
    dtype = None
    if not _config_dtype(cfg):
        dtype = _majority_float_dtype(index)
    meta = build_meta_module(factory, cfg, dtype=dtype)
    index.check(meta.expected, tied=meta.tied)
    if on_checked is not None:
        on_checked(index, meta)
    inputs = _example_inputs(cfg, example_inputs, input_shapes)
    model, program, route = _trace(meta.module, inputs, dynamic_batch, repeat, static)
    logger.info("trace route: %s", route)
    names = set(model.graph.initializers)
    state = {k: v for k, v in meta.module.state_dict().items() if k in names}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # data_ptr of fake tensors (tie check)
        annotate(
            model,
            dict(meta.module.named_modules(remove_duplicate=False)),
            state,
            dynamic_batch=dynamic_batch,
        )
    attach(model, index, meta.tied)
    fake = [
        n
        for n, v in model.graph.initializers.items()
        if v.const_value is not None and _is_fake(v.const_value)
    ]
    if fake:
        raise ConversionError(f"weights with no checkpoint entry and no value: {fake[:10]}")
    return Traced(model, index, meta, inputs, program, route)


def _example_inputs(cfg: Any, given: Sequence[Any] | None, shapes: tuple[str, ...]) -> tuple:
    """The inputs to trace with: ``given`` (numpy arrays as tensors), else the default ones."""
    import torch

    from xconv.converters.torch.importer.meta import default_inputs

    inputs = tuple(given) if given is not None else default_inputs(cfg, shapes)
    if inputs is None:
        raise UsageError(
            "no example inputs: the config has no vocab_size to make token ids from",
            missing=[("--input-shape", "each input's shape, e.g. 1,16:int64 (repeatable)")],
        )
    return tuple(torch.as_tensor(np.asarray(x)) if isinstance(x, np.ndarray) else x for x in inputs)


def _trace(
    module: Any, inputs: tuple, dynamic_batch: bool, repeat: bool, static: bool = False
) -> tuple:
    """``(IR, program, route)``: the repeated block list traced with two entries when
    ``repeat`` and its preconditions hold, else the full trace (``route`` says which). The
    IR's ``xconv.fixed_dims`` lists the input dimensions the model fixes (no extra export:
    the lines are recorded while tracing)."""
    from xconv.converters.torch.importer import shapes
    from xconv.converters.torch.importer.trace import _export

    def trace(m: Any) -> tuple[ir.Model, Any]:
        exported = _export(m, inputs, dynamic_batch, static)
        model, program = _to_ir_and_program(exported)
        shapes.record(model, shapes.fixed_of(exported))
        return model, program

    if not repeat:
        return (*trace(module), "full trace")
    from xconv.converters.torch.importer.repeat import trace_repeated

    repeated, why = trace_repeated(module, trace)
    if repeated is None:
        return (*trace(module), f"full trace ({why})")
    return repeated.model, repeated.program, repeated.note


def _to_ir_and_program(program: Any) -> tuple[ir.Model, Any]:
    """The IR and the decomposed program torch.onnx translated: the IR's value names are that
    program's node names (an ``aten.to`` cast becomes ``_to_copy``), so the layerwise check
    splits the same graph the IR came from."""
    import contextlib
    import io
    import warnings

    import torch

    from xconv.ir import OPSET

    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
            onnx_program = torch.onnx.export(
                program, (), dynamo=True, optimize=False, opset_version=OPSET, verbose=False
            )
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:500]
        raise ConversionError(
            f"torch.onnx could not translate the exported program: {first}"
        ) from e
    finally:
        registration.setLevel(level)
    model = onnx_program.model
    if model.opset_imports.get("", OPSET) < OPSET:
        from xconv.converters.onnx.io import load

        model = load(model)
    return model, onnx_program.exported_program or program


def _is_fake(tensor: Any) -> bool:
    raw = getattr(tensor, "raw", None)
    return type(raw).__name__ == "FakeTensor" or getattr(raw, "device", None) == "meta"


def _config_dtype(cfg: Any) -> Any:
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        return cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)


def _majority_float_dtype(index: CheckpointIndex):
    import torch

    sizes: dict[str, int] = {}
    for ref in index.tensors.values():
        if ref.dtype.startswith(("float", "bfloat")):
            sizes[ref.dtype] = sizes.get(ref.dtype, 0) + ref.nbytes
    if not sizes:
        return None
    return getattr(torch, max(sizes, key=sizes.get), None)


# --- planning: the emitter's source against stand-in weights ------------------------------


def plan_flax(
    traced: Traced, api: str = "linen", partitioning: Any = None
) -> tuple[str, list[Target]]:
    """Generated ``model.py`` and the variables to stream. Without ``partitioning`` its
    ``load`` reads the streamed safetensors shards; with it, ``model.py`` carries the
    sharding section (``LOGICAL_AXES``, ``RULES``, ``load(out_dir, mesh=)`` from Orbax)."""
    from xconv.converters.flax.source import emitter as fe
    from xconv.ir.passes import canonicalize

    if api not in ("linen", "nnx"):
        raise ConversionError(f"api={api!r}; supported: 'linen', 'nnx'")
    model = canonicalize(planning_copy(traced.model, traced.sources))
    em = fe._Emitter(model, api, fe.FlaxOptions())
    em.plan_layers()
    em.check_supported()
    em.emit()
    source = fe.render(em, model.graph.name or "model")
    if partitioning is None:
        source = _streamed_loader(source, api)
    targets = []
    for var in em.src.variables:
        path = (var.collection, *var.path) if api == "linen" else var.path
        name = "/".join(path)
        value = var.value
        if isinstance(value, Planned):
            targets.append(Target(name, value.shape, value.dtype.name, planned=value))
        else:
            arr = np.asarray(value)
            targets.append(Target(name, tuple(arr.shape), arr.dtype.name, value=arr))
    targets = sorted(targets, key=lambda t: t.name)
    if partitioning is not None:
        from xconv.sharding.flax import partitioned_source
        from xconv.sharding.stream import _nest

        tree = _nest({tuple(t.name.split("/")): t for t in targets})  # leaves with .shape
        source = partitioned_source(source, tree, model, partitioning, api)
    return source, targets


_LINEN_LOAD = '''def load(out_dir=None):
    """Return ``(model, variables)``; run with ``model.apply(variables, *inputs)``.

    The variables are the safetensors shards listed in ``variables.safetensors.index.json``.
    """
    out_dir = Path(out_dir or Path(__file__).parent)
    return Model(), _read_variables(out_dir)'''

_NNX_LOAD = '''def load(out_dir=None):
    """Return the model with its variables loaded; call ``model(*inputs)``.

    The variables are the safetensors shards listed in ``variables.safetensors.index.json``.
    """
    out_dir = Path(out_dir or Path(__file__).parent)
    model = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, _read_variables(out_dir))
    return nnx.merge(graphdef, state)'''

_READ = '''def _read_variables(out_dir):
    """The variable tree from the shards, one shard file at a time."""
    index = json.loads((out_dir / "variables.safetensors.index.json").read_text())
    tree = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, value in load_file(out_dir / shard).items():
            *keys, leaf = name.split("/")
            node = tree
            for key in keys:
                node = node.setdefault(key, {})
            node[leaf] = value
    return tree'''


def _streamed_loader(source: str, api: str) -> str:
    """Swap the generated ``load`` (one msgpack file) for one reading the streamed shards."""
    start = source.index("def load(out_dir=None):")
    end = source.find("\n\n\n", start)
    end = len(source.rstrip("\n")) if end < 0 else end
    new = _READ + "\n\n\n" + (_LINEN_LOAD if api == "linen" else _NNX_LOAD)
    source = source[:start] + new + source[end:]
    first_std = "import math\n" if "\nimport math\n" in source else "from pathlib import Path\n"
    source = source.replace(first_std, "import json\n" + first_std, 1)  # isort order
    source = source.replace("from flax import nnx, serialization\n", "from flax import nnx\n", 1)
    # isort order: after the last of ``from flax ...`` and ``from jax import lax``
    after = "from flax import nnx\n" if api == "nnx" else "from flax import serialization\n"
    if "\nfrom jax import lax\n" in source:
        after = "from jax import lax\n"
    source = source.replace(after, after + "from safetensors.flax import load_file\n", 1)
    if "serialization." not in source:
        source = source.replace("from flax import serialization\n", "")
    return source


# --- the whole route ------------------------------------------------------------------------


@dataclass
class CheckpointResult:
    """What :func:`convert_checkpoint` wrote and measured."""

    out_dir: Path
    files: list[Path]
    stream: StreamReport
    checkpoint_bytes: int
    parity: Any = None
    targets: list[Target] = field(default_factory=list, repr=False)
    route: str = ""  # how the module was traced (``Traced.route``)
    #: One line per input dimension the model fixes (``xconv.ir.metadata.fixed_summary``).
    fixed: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.parity is None or bool(self.parity.passed)


@dataclass(frozen=True)
class CheckpointOptions:
    """Choices of :func:`convert_checkpoint`, passed down the call chain.

    Attributes:
        api: Flax API of the generated module (``"linen"`` or ``"nnx"``).
        parity: ``"layerwise"`` (block by block against torch, float64 oracle) or ``"none"``.
        dynamic_batch: Require a symbolic batch dimension.
        static: Trace at the example shapes (default: every input dimension symbolic
            unless the model fixes it; see :func:`from_checkpoint`).
        input_shapes: ``--input-shape`` strings (default: token ids ``(1, 8)``).
        early: Flax: stream the weights while tracing, on a guessed layout checked afterwards
            (``False``: trace, plan, then stream).
        partitioning: Flax: ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` or a rule table: ``model.py``
            gets the sharding section and the weights are streamed into an Orbax checkpoint
            in parts, each placed by the rules (:func:`xconv.sharding.stream.stream_orbax_parts`),
            which ``load(out_dir, mesh=)`` restores onto a mesh.
        mesh: With ``partitioning``: the ``"DATAxMODEL"`` mesh the parts are placed on while
            written (default: the visible devices as ``1xN``; any mesh can restore them);
            given, the layerwise parity check runs the candidate blocks sharded on it.
        repeat: Trace repeated blocks once and copy them (see :func:`from_checkpoint`).
    """

    api: str = "linen"
    parity: str = "layerwise"
    dynamic_batch: bool = False
    static: bool = False
    input_shapes: tuple[str, ...] = ()
    early: bool = True
    partitioning: Any = None
    mesh: Any = None
    repeat: bool = True

    def __post_init__(self) -> None:
        if self.parity not in ("layerwise", "none"):
            raise ConversionError(f"parity={self.parity!r}; choose 'layerwise' or 'none'")


def convert_checkpoint(
    module: Any,
    weights: str | os.PathLike,
    *,
    target: str,
    out_dir: str | os.PathLike,
    config: Any = None,
    options: CheckpointOptions | None = None,
    example_inputs: Sequence[Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> CheckpointResult:
    """Convert a checkpoint larger than memory to ``target`` (``flax``, ``jax``, ``onnx``).

    See the module docstring for the steps. For Flax (``options.early``, the default) the
    weights stream in a child process while the module is traced (:class:`EarlyStream`), on the
    layout guessed from the module's ``nn.Linear`` layers; the emitter's real plan is checked
    against that guess, and any difference streams the weights again. Returns a
    :class:`CheckpointResult`; ``parity`` is the layerwise report (None with
    ``options.parity="none"``).
    """
    options = options or CheckpointOptions()
    say = progress or (lambda msg: logger.info(msg))
    if target not in TARGETS:
        raise ConversionError(f"unknown target {target!r} for a checkpoint; choose {TARGETS}")
    if options.partitioning is not None or options.mesh is not None:
        from xconv.sharding.rules import make_mesh, read_rules

        if target != "flax":
            raise ConversionError("partitioning / mesh: only the flax target has them")
        read_rules(options.partitioning)  # bad rules and meshes fail before any work
        if options.mesh is not None:
            make_mesh(options.mesh)
    out, parent, stage = _staging(out_dir)
    early: list[EarlyStream] = []

    def start_early(index: CheckpointIndex, meta: Any) -> None:
        # (Orbax parts are written after planning: the early stream writes safetensors.)
        sharded = options.partitioning is not None or options.mesh is not None
        if target == "flax" and options.early and not sharded:
            say("streaming the weights while tracing")
            early.append(EarlyStream(index, guess_layouts(meta.module, index), stage).start())

    try:
        say("reading the checkpoint headers and tracing on fake weights")
        traced = from_checkpoint(
            module,
            weights,
            config=config,
            example_inputs=example_inputs,
            dynamic_batch=options.dynamic_batch,
            static=options.static,
            input_shapes=options.input_shapes,
            on_checked=start_early,
            repeat=options.repeat,
        )
        return _write_staged(traced, target, out, stage, options, say, early[0] if early else None)
    finally:
        for e in early:
            e.cancel()  # a no-op once finished; stops the thread on a failure
        shutil.rmtree(parent, ignore_errors=True)


def guess_layouts(module: Any, index: CheckpointIndex) -> dict[str, Planned]:
    """``{checkpoint key: Planned}``: every ``nn.Linear`` weight transposed to a Flax kernel,
    every other tensor as it is (what the Flax emitter does for a transformer; checked)."""
    from xconv.converters.torch.importer.meta import linear_weights

    linear = linear_weights(module)
    guesses = {}
    for name, ref in index.tensors.items():
        planned = Planned(name, ref.shape, numpy_dtype(ref.dtype))
        guesses[name] = planned.transpose() if name in linear and len(ref.shape) == 2 else planned
    return guesses


def write_target(
    traced: Traced,
    *,
    target: str,
    out_dir: str | os.PathLike,
    options: CheckpointOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> CheckpointResult:
    """Write a traced checkpoint as ``target`` into ``out_dir`` (staged, then moved in place)."""
    options = options or CheckpointOptions()
    say = progress or (lambda msg: logger.info(msg))
    if target not in _WRITERS:
        raise ConversionError(f"unknown target {target!r} for a checkpoint; choose {TARGETS}")
    out, parent, stage = _staging(out_dir)
    try:
        return _write_staged(traced, target, out, stage, options, say, None)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _staging(out_dir: str | os.PathLike) -> tuple[Path, Path, Path]:
    """``(out, staging parent, stage)``: the output is built in ``stage`` beside ``out``."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    parent = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.staging."))
    stage = parent / out.name
    stage.mkdir()
    return out, parent, stage


def _write_staged(
    traced: Traced,
    target: str,
    out: Path,
    stage: Path,
    options: CheckpointOptions,
    say: Callable[[str], None],
    early: EarlyStream | None,
) -> CheckpointResult:
    say(f"writing {target} output")
    if target == "flax":
        report, targets = _write_flax(traced, stage, options, say, early)
    else:
        report, targets = _WRITERS[target](traced, stage, options, say)
    parity = None
    if options.parity == "layerwise":
        from xconv.parity.streamed import check_streamed

        say("checking parity block by block")
        mesh = options.mesh if target == "flax" else None
        if mesh is not None:
            from xconv.sharding.rules import read_rules

            rules = read_rules(options.partitioning) or "fsdp+tp"
            parity = check_streamed(traced, stage, targets, progress=say, mesh=mesh, rules=rules)
        else:
            parity = check_streamed(traced, stage, targets, progress=say)
        from xconv.ir.metadata import FIXED_DIMS, fixed_dims

        if FIXED_DIMS in traced.model.metadata_props:
            parity.fixed_dims = fixed_dims(traced.model)
        parity.to_json(stage / "parity.json")
        parity.to_html(stage / "parity.html")
    replace_dir(stage, out)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    from xconv.ir.metadata import fixed_summary

    return CheckpointResult(
        out,
        files,
        report,
        traced.index.nbytes,
        parity,
        targets,
        route=traced.route,
        fixed=fixed_summary(traced.model),
    )


def _write_flax(
    traced: Traced, stage: Path, options: CheckpointOptions, say, early: EarlyStream | None = None
) -> tuple[StreamReport, list[Target]]:
    import json

    from xconv.weights.stream import stream_targets

    if options.partitioning is not None or options.mesh is not None:
        return _write_flax_sharded(traced, stage, options, say)
    source, targets = plan_flax(traced, options.api)
    (stage / "model.py").write_text(source)
    (stage / "xconv.json").write_text(
        json.dumps({"api": options.api, "format": 1, "weights": INDEX_NAME}, sort_keys=True)
    )
    if early is not None:
        say("waiting for the weights streamed while tracing")
        report = early.finish(targets)
        if report is not None:
            return report, targets
        logger.warning("streaming the weights again: %s", early.reason)
    return stream_targets(targets, traced.index, stage, progress=say), targets


def _write_flax_sharded(
    traced: Traced, stage: Path, options: CheckpointOptions, say
) -> tuple[StreamReport, list[Target]]:
    """``model.py`` with the sharding section; the weights as Orbax parts placed by the rules."""
    import json

    from xconv.sharding.flax import ORBAX_DIR
    from xconv.sharding.rules import read_rules
    from xconv.sharding.stream import stream_orbax_parts

    rules = read_rules(options.partitioning) or "fsdp+tp"
    source, targets = plan_flax(traced, options.api, partitioning=rules)
    (stage / "model.py").write_text(source)
    strategy = rules if isinstance(rules, str) else "custom"
    meta = {"api": options.api, "format": 1, "weights": "orbax", "partitioning": strategy}
    (stage / "xconv.json").write_text(json.dumps(meta, sort_keys=True))
    axes = _generated_axes(source)
    before = dict(traced.index.log.bytes_read)
    written = stream_orbax_parts(
        targets, traced.index, stage / ORBAX_DIR, axes, options.mesh, rules, progress=say
    )
    report = StreamReport(
        files=written["parts"],
        bytes_written=written["bytes_written"],
        tensors=written["tensors"],
        sharding=written,
    )
    report.bytes_read = {
        k: n - before.get(k, 0)
        for k, n in traced.index.log.bytes_read.items()
        if n != before.get(k, 0)
    }
    for note in written["notes"]:
        logger.info("sharding: %s", note)
    return report, targets


def _generated_axes(source: str) -> dict[str, tuple]:
    """``LOGICAL_AXES`` of a generated ``model.py`` (the table its ``load(mesh=)`` uses)."""
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "LOGICAL_AXES":
            return {k: tuple(v) for k, v in ast.literal_eval(node.value).items()}
    raise ConversionError("the partitioned model.py has no LOGICAL_AXES")


def _write_onnx(
    traced: Traced, stage: Path, options: CheckpointOptions, say
) -> tuple[StreamReport, list[Target]]:
    """The shards copied beside ``model.onnx`` (a safetensors shard's data region is raw
    little-endian tensors: ONNX external data as it is), each read once, in bounded memory."""
    from xconv.weights.stream import LazyWeight

    report = StreamReport()
    shards = traced.index.shards
    for k, shard in enumerate(shards, start=1):
        say(f"weights shard {k}/{len(shards)}")
        dst = stage / shard.name
        shutil.copyfile(shard, dst)  # kernel-side copy: no tensor is held in Python
        report.files.append(dst)
        report.bytes_written += dst.stat().st_size
        report.bytes_read[str(shard)] = shard.stat().st_size
        report.tensors += sum(1 for r in traced.index.tensors.values() if r.shard == shard)
    model = traced.model
    proto = ir.to_proto(model)  # lazy weights are references: nothing read
    for init in proto.graph.initializer:
        tensor = model.graph.initializers[init.name].const_value
        if isinstance(tensor, LazyWeight):
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = tensor.ref.shard.name
    (stage / "model.onnx").write_bytes(proto.SerializeToString())
    # Each tensor is its own target, unchanged (the parity pass compares the copies).
    targets = [
        Target(r.name, r.shape, r.dtype, planned=Planned(r.name, r.shape, numpy_dtype(r.dtype)))
        for r in traced.index.tensors.values()
    ]
    return report, targets


_JAX_LOADER = '''"""JAX function converted by xconv from a checkpoint: ``fn(params, *inputs) -> outputs``.

``model.onnx`` holds the graph; its weights are the safetensors shards beside it (external
data, memory-mapped when read). Load with ``fn, params = load()``.
"""

from __future__ import annotations

from pathlib import Path

import xconv


def load(out_dir=None):
    out_dir = Path(out_dir) if out_dir is not None else Path(__file__).parent
    return xconv.to_jax(xconv.load(out_dir / "model.onnx"))
'''


def _write_jax(
    traced: Traced, stage: Path, options: CheckpointOptions, say
) -> tuple[StreamReport, list[Target]]:
    report, targets = _write_onnx(traced, stage, options, say)
    (stage / "model.py").write_text(_JAX_LOADER)
    return report, targets


_WRITERS = {"flax": _write_flax, "onnx": _write_onnx, "jax": _write_jax}
