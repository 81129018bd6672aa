"""One conversion, end to end: import -> IR -> emit -> parity check -> files.

``convert`` is what every ``xconv <source>-to-<target>`` command calls. It writes into a
staging folder beside ``out_dir`` and moves it into place only when every file is written, so
a failed run leaves nothing half-written.

By role: :mod:`~xconv.pipeline.options` (the frozen options, the result),
:mod:`~xconv.pipeline.importers` (one importer per source kind),
:mod:`~xconv.pipeline.targets` (one writer per target, into the staging folder),
:mod:`~xconv.pipeline.checks` (parity and differential checks), :mod:`~xconv.pipeline.source`
(the public ``to_flax`` / ``to_torch_source``); this module runs them in order.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir

from xconv.converters.codegen import replace_dir
from xconv.errors import ConversionError, UsageError
from xconv.parity.policies import DIFFERENTIAL_ATOL, DIFFERENTIAL_RTOL
from xconv.pipeline.checks import _check, _differential_check, _layerwise, _release_memory
from xconv.pipeline.importers import _IMPORTERS, import_model
from xconv.pipeline.options import (
    APIS,
    LAYERWISE_BYTES,
    PARITY_MODES,
    SOURCES,
    TARGETS,
    ConversionResult,
    ConvertOptions,
    Progress,
    _Imported,
)
from xconv.pipeline.source import (
    _as_input_tuple,
    _differential,
    bf16_differential_bound,
    to_flax,
    to_torch_source,
)
from xconv.pipeline.targets import (
    _EMITTERS,
    Loader,
    _emit_flax,
    _emit_jax,
    _emit_onnx,
    _emit_torch,
    _load_generated,
)

logger = logging.getLogger(__name__)

#: Weight bytes above which a by-product ``model.onnx`` keeps its weights in
#: ``model.onnx.data`` (streamed tensor by tensor) instead of in one in-memory proto.
EXTERNAL_BYTES = 64 * 2**20


def _weight_bytes(model: ir.Model) -> int:
    return sum(
        v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None
    )


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
    _validate(source_kind, target, options)
    out = Path(out_dir)
    clock = _Clock()
    say(f"importing {source_kind} model")
    imported = _IMPORTERS[source_kind](source, options, example_inputs)
    if imported.timings:  # the importer split its own time (load, import)
        clock.timings.update(imported.timings)
        clock.last = time.perf_counter()
    else:
        clock.done("import")
    out.parent.mkdir(parents=True, exist_ok=True)
    parent = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.staging."))
    try:
        stage = parent / out.name
        report = _write_and_check(imported, target, stage, options, say, clock)
        replace_dir(stage, out)
        _rebase_external(imported.model, stage, out)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    return ConversionResult(out, imported.model, files, report, clock.timings)


def _validate(source_kind: str, target: str, options: ConvertOptions) -> None:
    """Reject a source, target or option combination before any work."""
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
    if options.generate and (source_kind != "torch" or target not in ("flax", "jax")):
        raise UsageError(
            f"generate: a torch causal LM converts with --generate to a flax or jax model.py "
            f"with generate(); not {source_kind} to {target}. Next step: use torch-to-flax"
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


class _Clock:
    """Wall seconds per stage: ``done(stage)`` books the time since the last call."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.last = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = self.timings.get(stage, 0.0) + now - self.last
        self.last = now


def _write_and_check(
    imported: _Imported,
    target: str,
    stage: Path,
    options: ConvertOptions,
    say: Progress,
    clock: _Clock,
) -> Any:
    """Write the target and ``model.onnx`` into ``stage``, then check them; the parity report
    (None with ``check=False``)."""
    say(f"writing {target} output")
    candidate_loader = _EMITTERS[target](imported.model, stage, options)
    clock.done("emit")
    from xconv.converters.onnx.io import save

    # The IR is the main artifact only for target onnx (one file up to 2 GB); beside
    # another target its weights are streamed to model.onnx.data, never serialised whole.
    by_product = target != "onnx" and _weight_bytes(imported.model) > EXTERNAL_BYTES
    say("writing model.onnx")
    save(
        imported.model,
        stage / "model.onnx",
        external=True if by_product else None,
        canonical=target == "onnx",  # the artifact; beside another target, the IR as imported
    )
    clock.done("model.onnx")
    report = None
    differential = None
    if options.check and target in ("flax", "torch"):
        differential = _differential_check(
            imported, target, lambda: candidate_loader(stage), options, say, by_product
        )
        clock.done("differential")
    if options.check:
        say("checking parity against the source model")
        ir_file = stage / "model.onnx" if by_product else None
        report = _check(imported, lambda: candidate_loader(stage), options, say, ir_file)
        if differential:
            report.notes.append(differential)
        from xconv.ir.metadata import FIXED_DIMS, fixed_dims

        if FIXED_DIMS in imported.model.metadata_props:
            report.fixed_dims = fixed_dims(imported.model)
        if options.generate:
            from xconv.parity.generation import check_generation

            say("checking generation (greedy tokens and cached steps against torch)")
            check_generation(imported.source, stage, report, options)
        report.to_json(stage / "parity.json")
        report.to_html(stage / "parity.html")
        clock.done("parity")
    return report


def _rebase_external(model: ir.Model, old: Path, new: Path) -> None:
    """External tensors that pointed into the staging folder now read from ``new``."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and Path(tensor.base_dir) == old:
            tensor.base_dir = str(new)


__all__ = [
    "APIS",
    "DIFFERENTIAL_ATOL",
    "DIFFERENTIAL_RTOL",
    "EXTERNAL_BYTES",
    "LAYERWISE_BYTES",
    "PARITY_MODES",
    "SOURCES",
    "TARGETS",
    "ConversionResult",
    "ConvertOptions",
    "Loader",
    "Progress",
    "bf16_differential_bound",
    "convert",
    "import_model",
    "to_flax",
    "to_torch_source",
]
#: Private names tests and benchmarks reach through ``xconv.pipeline`` (``_EMITTERS`` is the
#: dict ``convert`` reads: patching an entry here patches the run).
_REEXPORTED = (
    _EMITTERS,
    _IMPORTERS,
    _Imported,
    _as_input_tuple,
    _differential,
    _emit_flax,
    _emit_jax,
    _emit_onnx,
    _emit_torch,
    _layerwise,
    _load_generated,
    _release_memory,
)
