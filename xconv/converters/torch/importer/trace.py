"""PyTorch -> IR: ``torch.export`` then torch.onnx's exporter, then xconv annotations.

Route (reasons in ``docs/design.md``): the module is traced by ``torch.export.export``
(non-strict) into an ``ExportedProgram``, which ``torch.onnx.export(..., dynamo=True,
optimize=False, opset_version=23)`` translates into an ``onnx_ir.Model``. At opset 23 the
exporter keeps ``scaled_dot_product_attention`` as one ``Attention`` node,
``layer_norm``/``group_norm``/``rms_norm`` as single normalisation nodes and ``gelu`` as
``Gelu`` with its ``approximate`` attribute. ``optimize=False`` matters: the onnxscript
optimizer folds BatchNormalization into the preceding Conv, which loses the source weights.

The exporter's per-node torch metadata (``pkg.torch.onnx.name_scopes``, ``class_hierarchy``,
``stack_trace``) is turned into ``xconv.scope``, ``xconv.module`` and ``xconv.source_line``
and then dropped; standard layers get ``xconv.layer`` and weights ``xconv.role`` /
``xconv.layout`` (see :mod:`xconv.converters.torch.importer.layers`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import os
import re
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnx_ir.tensor_adapters import TorchTensor
from torch import nn

from xconv.converters.torch.importer import decoding, layers, rewrite, shapes
from xconv.errors import ConversionError, StaticValueError
from xconv.ir import OPSET
from xconv.ir.metadata import FX_GRAPH, FX_NODE, MODULE, SCOPE, SOURCE_LINE

logger = logging.getLogger(__name__)

_NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_CLASS_HIERARCHY = "pkg.torch.onnx.class_hierarchy"
_STACK_TRACE = "pkg.torch.onnx.stack_trace"
#: Model-level metadata: JSON ``{module path: class}`` for every module the graph passes through.
MODULES = "xconv.modules"
#: The symbolic name given to the batch dimension with ``dynamic_batch=True``.
BATCH_DIM = "batch"

#: Scope the exporter gives nodes whose module stack torch.export did not record.
_NO_STACK = "_empty_nn_module_stack"
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def from_torch(
    module: nn.Module | torch.export.ExportedProgram | torch.jit.ScriptModule,
    example_inputs: Any = None,
    *,
    dynamic_batch: bool = False,
    static: bool = False,
    programs: list | None = None,
    generate: bool = False,
) -> ir.Model:
    """Convert a PyTorch module to the IR.

    The module is exported in eval mode (inference semantics: dropout off, batch norm on
    running statistics); its training flag is restored afterwards.

    Args:
        module: An ``nn.Module``, an ``ExportedProgram`` (e.g. from ``torch.export.load``) or
            a TorchScript module.
        example_inputs: A tensor, a tuple of positional inputs, or a dict of keyword inputs
            (``{"input_ids": ..., "attention_mask": ...}``; the graph inputs follow its
            order) used to trace the module. Optional for an ``ExportedProgram``.
        dynamic_batch: Check that dimension 0 of every tensor input stayed symbolic (one
            ``batch`` dim shared by all inputs); a model that fixes it is refused.
        static: Trace at the example shapes (every input dimension fixed). By default an
            ``nn.Module`` is exported with every dimension of every tensor input
            ``torch.export.Dim.AUTO``: torch keeps each one symbolic unless the model fixes it
            (listed in ``model.metadata_props["xconv.fixed_dims"]``, JSON, with the source
            line that fixed it where it was recorded). The symbols are named by role
            (``batch``, ``seq``, ``height``, ``width``...). A TorchScript module is always
            static (its interpreter fixes every size); an ``ExportedProgram`` keeps the
            shapes it was exported with.
        programs: When given, the ``ExportedProgram`` the IR was translated from is appended
            (its weights are the module's own tensors): the layerwise parity check cuts it
            into blocks.
        generate: Convert a transformers causal LM as one cached decoding step (see
            :mod:`.decoding`): inputs ``input_ids``, ``cache_position``, ``attention_mask``
            (left padding) and ``key_i`` / ``value_i`` per layer, outputs the logits and the updated cache, batch, seq and
            ``max_length`` symbolic. ``example_inputs`` is not needed. The generated Flax
            model then has ``init_cache`` and ``generate``.

    Returns:
        The model as an ``onnx_ir.Model`` at opset ``xconv.ir.OPSET``, annotated with
        ``xconv.scope`` / ``xconv.module`` / ``xconv.source_line`` on nodes, ``xconv.layer`` on
        the anchor node of each standard layer and ``xconv.role`` / ``xconv.layout`` on weights
        (initializers named by their ``state_dict`` keys).

    Raises:
        ConversionError: The module cannot be traced or translated, or ``dynamic_batch`` was
            asked for but the batch dimension is fixed by the model.
    """
    description = None
    if generate:
        if not isinstance(module, nn.Module) or isinstance(
            module, torch.jit.ScriptModule | torch.export.ExportedProgram
        ):
            raise ConversionError(
                "generate=True takes the transformers model (an nn.Module), not "
                f"{type(module).__name__}: the cached step is traced from its Python code"
            )
        if static:
            raise ConversionError(
                "generate=True traces batch, seq and max_length symbolic; drop static=True"
            )
        module, example_inputs, description = decoding.step_module(module)
    args = _as_args(example_inputs)
    if isinstance(args, dict) and isinstance(module, torch.jit.ScriptModule):
        raise ConversionError("give a TorchScript module positional example inputs, not a dict")
    if isinstance(module, torch.export.ExportedProgram):
        program = module
        if dynamic_batch:
            _check_batch_dynamic_in_program(program)
        modules: dict[str, nn.Module] = {}
        state = dict(program.state_dict)
        fixed = shapes.all_fixed(program, shapes.PROGRAM)
        model = _to_ir(program)
    elif isinstance(module, torch.jit.ScriptModule):
        program = _from_torchscript(module, args, dynamic_batch)
        # TorchScript keeps each submodule's class name (``original_name``), not its instance.
        modules = dict(module.named_modules())
        state = dict(program.state_dict)
        fixed = shapes.all_fixed(program, shapes.TORCHSCRIPT)
        model = _to_ir(program)
    elif isinstance(module, nn.Module):
        if args is None:
            raise ConversionError(
                "example_inputs are required to trace an nn.Module: pass a tensor, a tuple "
                "of the forward's positional inputs or a dict of keyword inputs"
            )
        was_training = module.training
        module.eval()
        try:
            program, model = _export_to_ir(module, args, dynamic_batch, static)
        finally:
            module.train(was_training)
        fixed = shapes.fixed_of(program)
        modules = dict(module.named_modules(remove_duplicate=False))
        state = module.state_dict(keep_vars=False)
    else:
        raise ConversionError(
            f"from_torch takes an nn.Module, an ExportedProgram or a TorchScript module, got "
            f"{type(module).__name__}"
        )
    shapes.record(model, fixed)
    annotate(model, modules, state, dynamic_batch=dynamic_batch)
    # Named after the source class, not torch.onnx's "main_graph": the generated sources'
    # docstrings and model.onnx name the model the user converted.
    model.graph.name = source_class(module, program) or model.graph.name
    if description is not None:
        model.graph.name = type(module.model).__name__
        decoding.rename_cache_dims(model)
        decoding.describe(model, description)
    if programs is not None:
        programs.append(program)
    return model


_MANGLE = re.compile(r"___torch_mangle_\d+\.")


def source_class(module: Any, program: Any = None) -> str | None:
    """The qualified class of the model being converted (``models.SmallCNN``): an
    ``nn.Module``'s type, a TorchScript module's recorded type, or the root entry of an
    ``ExportedProgram``'s module stack."""
    if isinstance(module, torch.jit.ScriptModule):
        with contextlib.suppress(Exception):
            name = module._c._type().qualified_name()
            return _MANGLE.sub("", name).removeprefix("__torch__.")
        return getattr(module, "original_name", None)
    if isinstance(module, nn.Module):
        cls = type(module)
        return f"{cls.__module__}.{cls.__qualname__}".removeprefix("__main__.")
    graph = getattr(program, "graph", None)
    for node in graph.nodes if graph is not None else ():
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            if path == "" and isinstance(cls, str):
                return cls.removeprefix("__main__.")
    return None


def annotate(
    model: ir.Model,
    modules: Mapping[str, nn.Module],
    state: Mapping[str, torch.Tensor],
    *,
    dynamic_batch: bool = False,
) -> None:
    """Turn the exporter's torch metadata into xconv metadata, in place."""
    graph = model.graph
    classes = _annotate_nodes(graph)
    model.metadata_props[MODULES] = json.dumps(classes, sort_keys=True)
    model.metadata_props["xconv.source"] = "torch"
    layers.drop_zero_conv_bias(graph, modules, classes, state)
    _unique_value_names(graph)
    _single_index_gather(graph)
    _localize_constants(graph)
    RemoveUnusedNodesPass()(model)
    _add_missing_state(graph, state)
    for value in graph.initializers.values():
        _drop_torch_metadata(value.metadata_props)
    for path, mod in modules.items():
        if isinstance(mod, torch.jit.ScriptModule):
            classes.setdefault(path, mod.original_name)
    layers.annotate_weights(graph, list(state), modules, classes)
    if modules:
        layers.annotate_layers(graph, modules)
    layers.annotate_layers_from_graph(graph, classes)
    shapes.name_dims(graph)


def _as_args(example_inputs: Any) -> tuple[Any, ...] | dict[str, Any] | None:
    """Normalise example inputs to a tuple (positional) or dict (keyword); numpy -> torch."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, Mapping):
        return {k: _as_tensor(v) for k, v in example_inputs.items()}
    if isinstance(example_inputs, tuple | list):
        return tuple(_as_tensor(v) for v in example_inputs)
    return (_as_tensor(example_inputs),)


def _as_tensor(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return torch.from_numpy(np.array(value))
    if isinstance(value, torch.Tensor) and value._base is not None:
        # A view (``ids[:, :5]``): torch.export guards on its base's size, which pins the
        # dimension and sends the whole export back to the example shapes.
        return value.clone()
    return value


def _export(
    module: nn.Module,
    args: tuple[Any, ...] | dict[str, Any],
    dynamic_batch: bool,
    static: bool = False,
):
    """``torch.export`` (non-strict) of ``module`` on ``args``: every dimension of every tensor
    input ``Dim.AUTO`` unless ``static`` (then only dim 0 with ``dynamic_batch``); size-1 example
    dimensions are traced at size 2 (see :mod:`.shapes`). The dimensions the program fixes are
    kept for :func:`shapes.fixed_of`."""
    kwargs = args if isinstance(args, dict) else None
    batch = torch.export.Dim(BATCH_DIM) if dynamic_batch else None
    # A forward(*args) (a TorchScript root, a wrapped function) takes them as one input.
    varargs = kwargs is None and _takes_varargs(module)
    if static:
        tries = [(args, shapes.batch_spec(args, batch) if batch is not None else None, False)]
        if dynamic_batch and shapes.ones(args)[0]:
            tries = [(shapes.repeat_ones(args, leading_only=True), tries[0][1], True)]
    else:
        # dynamic_batch=True keeps its meaning: the batch symbolic, the other dims the example's.
        spec = shapes.batch_spec(args, batch) if dynamic_batch else shapes.dynamic_spec(args, batch)
        leading, inner = shapes.ones(args)
        tries = []
        if leading or inner:
            tries.append((shapes.repeat_ones(args, leading_only=False), spec, True))
        if leading and inner:
            tries.append((shapes.repeat_ones(args, leading_only=True), spec, True))
        tries.append((args, spec, False))
    error: Exception | None = None
    for traced_args, dynamic_shapes, repeated in tries:
        kw = traced_args if kwargs is not None else None
        positional = () if kwargs is not None else traced_args
        if varargs and dynamic_shapes is not None:
            dynamic_shapes = (tuple(dynamic_shapes),)
        try:
            with (
                shapes.recording_specialisations() as records,
                shapes.quiet_logger("torch._export.non_strict_utils"),
            ):
                program = torch.export.export(
                    module, positional, kwargs=kw, dynamic_shapes=dynamic_shapes, strict=False
                )
        except Exception as e:  # noqa: BLE001 (the next try, or the first error, below)
            logger.debug(
                "export with %s failed: %s",
                "size-1 dims at 2" if repeated else "the example",
                _first_line(e),
            )
            error = e
            continue
        break
    else:
        assert error is not None
        hint = ""
        if dynamic_batch:
            hint = (
                " With dynamic_batch=True the model must not fix the batch size (e.g. a reshape "
                "with a literal batch)."
            )
        raise ConversionError(
            f"torch.export could not trace {type(module).__name__}: {_first_line(error)}.{hint}"
        ) from error
    pooled = None if static else _adaptive_pool_over_symbols(program)
    if pooled is not None:
        # torch.onnx writes an adaptive pooling's kernel and strides from the example's size:
        # at another size the ONNX pools wrong windows. Only the batch stays free.
        logger.info("%s over symbolic sizes: only the batch is dynamic", pooled[0])
        free = {
            (name, dim)
            for name, val in shapes.program_inputs(program)
            if isinstance(val, torch.Tensor)
            for dim, raw in enumerate(val.shape)
            if shapes.static_size(raw) is None
        }
        spec = shapes.batch_spec(traced_args, batch or torch.export.Dim.AUTO)
        if varargs:
            spec = (tuple(spec),)
        kw = traced_args if kwargs is not None else None
        positional = () if kwargs is not None else traced_args
        with (
            shapes.recording_specialisations() as records,
            shapes.quiet_logger("torch._export.non_strict_utils"),
        ):
            program = torch.export.export(
                module, positional, kwargs=kw, dynamic_shapes=spec, strict=False
            )
    if static:
        fixed = shapes.all_fixed(program, shapes.STATIC)
    else:
        fixed = shapes.fixed_in_program(program, traced_args, records)
    if pooled is not None:
        for entry in fixed:
            if (entry["input"], entry["dim"]) in free:
                entry["reason"] = (
                    f"{pooled[0]}: torch.onnx writes its kernel from the example's size"
                )
                if pooled[1] and "source_line" not in entry:
                    entry["source_line"] = pooled[1]
    shapes.set_fixed(program, fixed)
    if dynamic_batch:
        _check_batch_dynamic_in_program(program)
    return program


_ADAPTIVE_POOLS = (
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "_adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
)  # fmt: skip


def _adaptive_pool_over_symbols(program: Any) -> tuple[str, str | None] | None:
    """``(what, source line)`` of an adaptive pooling to a size other than 1 whose input has a
    symbolic pooled dimension, or None (pooling to 1 is a global pooling: any size)."""
    for node in program.graph.nodes:
        name = getattr(getattr(node.target, "_schema", None), "name", "")
        if node.op != "call_function" or name.removeprefix("aten::") not in _ADAPTIVE_POOLS:
            continue
        val = node.args[0].meta.get("val") if node.args else None
        out = node.args[1] if len(node.args) > 1 else None
        sizes = list(out) if isinstance(out, list | tuple) else [out]
        if val is None or all(o == 1 for o in sizes):
            continue
        pooled = list(val.shape)[-len(sizes) :]
        if any(not isinstance(d, int) for d in pooled):
            trace = node.meta.get("stack_trace") or ""
            frames = _FRAME.findall(trace)
            user = [f"{f}:{n}" for f, n in frames if not f.startswith(_TORCH_DIR)]
            what = f"{name.removeprefix('aten::').lstrip('_')} to {tuple(sizes)}"
            return what, (user[-1] if user else None)
    return None


def _takes_varargs(module: nn.Module) -> bool:
    """``module.forward`` takes its inputs as ``*args`` only."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return (
        bool(params)
        and all(p.kind is p.VAR_POSITIONAL for p in params[:1])
        and not [p for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    )


def _export_to_ir(
    module: nn.Module, args: tuple[Any, ...] | dict[str, Any], dynamic_batch: bool, static: bool
) -> tuple[Any, ir.Model]:
    """Export and translate ``module``; a program torch.onnx cannot translate at symbolic
    shapes is exported again at the example shapes (every dimension listed as fixed, with the
    translation error as the reason)."""
    program = _export(module, args, dynamic_batch, static)
    try:
        return program, _to_ir(program)
    except ConversionError as e:
        if static or dynamic_batch or not shapes.has_symbolic_input(program):
            raise
        logger.warning("symbolic shapes do not translate (%s); converting at the example shapes", e)
        program = _export(module, args, False, static=True)
        model = _to_ir(program)
        reason = f"symbolic shapes did not translate ({_first_line(e)})"
        shapes.set_fixed(program, shapes.all_fixed(program, reason))
        return program, model


def _check_batch_dynamic_in_program(program) -> None:
    for spec in program.graph_signature.input_specs:
        if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT:
            continue
        node = next((n for n in program.graph.nodes if n.name == spec.arg.name), None)
        val = node.meta.get("val") if node is not None else None
        if isinstance(val, torch.Tensor) and val.dim() >= 1 and isinstance(val.shape[0], int):
            raise ConversionError(
                f"dynamic_batch=True but input {spec.arg.name!r} has a fixed batch size "
                f"{val.shape[0]} in the exported program; export it with a torch.export.Dim "
                "for dimension 0"
            )


class _ScriptRoot(nn.Module):
    """A TorchScript module under a Python root, so that ``torch.export`` (non-strict) traces
    through the TorchScript interpreter: export swaps the weights for fake tensors by name and
    the interpreter dispatches every aten op to the tracer. Its control flow is resolved at
    trace time, as Python's is; a branch on a tensor's value is refused with its source line.
    (``TS2EPConverter`` left every dimension symbolic, so torch.onnx refused a traced
    ``nn.TransformerEncoder``'s size arithmetic, and it rejects scripted ``prim::If``.)"""

    def __init__(self, script: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.script = script

    def named_parameters(self, *args: Any, **kwargs: Any):
        # TorchScript hands out plain tensors where export's verifier wants nn.Parameter: the
        # same storage and the same requires_grad (nn.TransformerEncoderLayer's fused fast
        # path, which no exporter translates, stays off as it does in eager mode).
        for name, p in super().named_parameters(*args, **kwargs):
            if not isinstance(p, nn.Parameter):
                p = nn.Parameter(p, requires_grad=p.requires_grad)
            yield name, p

    def forward(self, *args: Any) -> Any:
        return self.script(*args)


#: A frame of the TorchScript interpreter's traceback, and the line its marker points at.
_TS_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \w+\n((?:.*\n)*?)\s*~+ <--- HERE')


def _ts_source(text: str) -> tuple[str | None, str]:
    """``(file:line, code)`` of the innermost frame of the original-code traceback the
    TorchScript interpreter raises with."""
    section = text.partition("Traceback of TorchScript, original code")[2]
    frames = _TS_FRAME.findall(section)
    if not frames:
        return None, ""
    path, line, body = frames[-1]
    code = body.rstrip("\n").rsplit("\n", 1)[-1].strip()
    return f"{path}:{line}", code


def _from_torchscript(
    module: torch.jit.ScriptModule, args: tuple[Any, ...] | None, dynamic_batch: bool
) -> torch.export.ExportedProgram:
    if args is None:
        raise ConversionError("example_inputs are required to convert a TorchScript module")
    if dynamic_batch:
        # Measured on torch 2.13: the interpreter turns every size it reads into an int, so
        # export reports the batch constraint violated even for a plain CNN.
        raise ConversionError(
            "dynamic_batch (--dynamic-batch) is not available for a TorchScript module: its "
            "interpreter fixes every size it reads. Convert at a fixed batch, or export the "
            "model with torch.export (a torch.export.Dim for dimension 0) and convert the .pt2"
        )
    try:
        # A failing trace prints the graph so far; the raised error says what matters.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            program = _export(_ScriptRoot(module), args, dynamic_batch, static=True)
    except ConversionError as e:
        raise _torchscript_error(e) from e.__cause__
    # A traced convolution records aten::_convolution, which torch.onnx does not translate.
    conv = torch.ops.aten._convolution.default
    if any(n.target is conv for n in program.graph.nodes):
        program = program.run_decompositions(
            {conv: lambda *a: torch.ops.aten.convolution.default(*a[:9])}
        )
    return _unwrap(program, "script")


def _torchscript_error(e: ConversionError) -> ConversionError:
    """The export failure of a TorchScript module, with the user's source line the
    interpreter reports and the next step."""
    cause = e.__cause__
    text = str(cause) if cause is not None else str(e)
    line, code = _ts_source(text)
    code = f" (`{code}`)" if code else ""
    if "data-dependent" in text or "GuardOnDataDependent" in text:
        return StaticValueError(
            f"the TorchScript module branches on a tensor's value{code}, which one static "
            "graph cannot hold. Next step: trace the module (torch.jit.trace) to keep the "
            "branch its example takes, or export it with torch.export (torch.cond for both "
            "branches) and convert the .pt2",
            source_line=line,
        )
    return ConversionError(
        f"cannot trace the TorchScript module{code}: {_first_line(cause or e).rstrip('.')}. "
        "Next step: "
        "export the model with torch.export.save and convert the .pt2",
        source_line=line,
    )


def _unwrap(program: torch.export.ExportedProgram, name: str) -> torch.export.ExportedProgram:
    """Drop the ``_ScriptRoot`` level from a program traced through it, in place: weights
    keep the TorchScript module's own state_dict keys and nodes its (empty) module stack."""
    prefix = name + "."

    def strip(target: str | None) -> str | None:
        return target[len(prefix) :] if target and target.startswith(prefix) else target

    signature = program.graph_signature
    for spec in (*signature.input_specs, *signature.output_specs):
        spec.target = strip(spec.target)
    for table in (program.state_dict, program.constants):  # read-only attributes: in place
        items = [(strip(k), v) for k, v in table.items()]
        table.clear()
        table.update(items)
    for node in program.graph.nodes:
        node.meta.pop("nn_module_stack", None)
    return program


def _to_ir(program) -> ir.Model:
    source = program
    try:
        # The exporter prints progress lines, warns that torchvision's ops are not registered
        # and trips torch's own pytree deprecation warning; the library never prints.
        registration = logging.getLogger("torch.onnx._internal.exporter._registration")
        level = registration.level
        registration.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
            with rewrite.rewritten(program) as (program, table):
                onnx_program = torch.onnx.export(
                    program,
                    (),
                    dynamo=True,
                    optimize=False,
                    opset_version=OPSET,
                    verbose=False,
                    custom_translation_table=table or None,
                )
    except ConversionError:
        raise
    except Exception as e:
        raise ConversionError(
            f"torch.onnx could not translate the exported program: {_onnx_summary(e)}. Next "
            "step: re-run with --debug for the exporter's full report, which names the node"
        ) from e
    finally:
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(level)
    model = onnx_program.model
    version = model.opset_imports.get("", OPSET)
    if version < OPSET:
        from xconv.converters.onnx.io import load

        model = load(model)
    _concrete_dims(model.graph)
    try:
        record_fx_sources(model, onnx_program.exported_program, source)
    except Exception:  # noqa: BLE001 (marks only help the layerwise cuts, which fall back to names)
        logger.debug("could not record the IR values' program nodes", exc_info=True)
    return model


def _concrete_dims(graph: ir.Graph) -> None:
    """A dim torch.export specialised (``Dim.AUTO`` on a size the model fixes, e.g. a ViT's
    image size) is a ``SymInt`` equal to a constant, which torch.onnx names by its value
    (``SymbolicDim('32')``): make it the integer it is."""
    values: list[ir.Value] = [*graph.inputs, *graph.outputs]
    for node in graph.all_nodes():
        values.extend(node.outputs)
    for value in values:
        shape = value.shape
        if shape is None or not any(_is_number_dim(d) for d in shape.dims):
            continue
        value.shape = ir.Shape([int(d.value) if _is_number_dim(d) else d for d in shape.dims])


def _is_number_dim(d: Any) -> bool:
    return isinstance(d, ir.SymbolicDim) and isinstance(d.value, str) and d.value.isdigit()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _onnx_summary(e: BaseException) -> str:
    """torch.onnx's error in one line: its headline without the step counter and the advice
    list, and its "Exception summary" (the exception that stopped it)."""
    text = _ANSI.sub("", str(e)).strip()
    head = text.splitlines()[0] if text else type(e).__name__
    head = re.split(r"\s*(?:This is step \d+/\d+|Next steps:)", head)[0].rstrip(" .")
    summary = text.partition("## Exception summary")[2].strip()
    if summary:
        first = " ".join(summary.split("\n\n")[0].split()).split(" \u2b06")[0]
        first = re.sub(r"^<class '(?:[\w.]+\.)?(\w+)'>:\s*", r"\1: ", first)
        if len(first) > 300:
            first = first[:299] + "\u2026"
        head = f"{head} ({first.rstrip('.')})"
    return head


def record_fx_sources(model: ir.Model, decomposed: Any, program: Any) -> int:
    """Mark each IR value with the nodes of ``program`` (the caller's, before torch.onnx's
    decompositions) it computes: ``value.meta[FX_NODE]``, a tuple of names (in memory only).

    The IR's value names are the *decomposed* program's node names, which torch renumbers
    (a ``reshape`` becomes ``view_5``, shifting every later ``view_N``), so a name can denote
    another tensor in ``program``. The decomposed nodes keep their provenance
    (``node.meta["from_node"]``); for each node of ``program``, the last decomposed node it
    became with its shape and dtype is the value the layerwise check cuts at. A node inside
    a higher-order op's subgraph (``wrap_with_set_grad_enabled``, which the decompositions
    inline) traces back to the higher-order call; it is marked ``"{call}:{name}"``. The sizes
    of a dynamic-shape program's inputs, which the decompositions read anew (no provenance),
    are matched by input and dimension.
    ``model.meta[FX_GRAPH]`` holds a weak reference to ``program.graph``: the marks name
    that graph's nodes. Returns the number of values marked.
    """
    if decomposed is None or program is None:
        return 0
    graphs = {id(gm.graph): gm.graph for gm in program.graph_module.modules()}
    top = {n.name: n for n in program.graph.nodes}
    sizes: dict[tuple[str, int], list[str]] = {}  # a dynamic dim, read anew by the decomposition
    for n in program.graph.nodes:
        if _input_size(n) is not None:
            sizes.setdefault(_input_size(n), []).append(n.name)
    picked: dict[str, str] = {}  # mark -> decomposed node name (the last one wins)
    for node in decomposed.graph.nodes:
        root = _fx_root(node, graphs)
        original = top.get(root.name) if root is not None else None
        if original is None:
            for name in sizes.get(_input_size(node), ()):  # type: ignore[arg-type]
                picked[name] = node.name
        elif _subgraph_call(original):
            picked[f"{root.name}:{node.name}"] = node.name
        elif _same_meta(node.meta.get("val"), original.meta.get("val")):
            picked[root.name] = node.name
    marks: dict[str, list[str]] = {}
    for mark, name in picked.items():
        marks.setdefault(name, []).append(mark)
    marked = 0
    for n in model.graph.all_nodes():
        for value in n.outputs:
            if value.name in marks:
                value.meta[FX_NODE] = tuple(marks[value.name])
                marked += 1
    model.meta[FX_GRAPH] = weakref.ref(program.graph)
    return marked


def _input_size(node: Any) -> tuple[str, int] | None:
    """``(input, dim)`` for ``aten.sym_size.int(input, dim)`` of a program input."""
    if node.op != "call_function" or node.target is not torch.ops.aten.sym_size.int:
        return None
    source, dim = node.args
    return (source.name, dim) if getattr(source, "op", None) == "placeholder" else None


def _fx_root(node: Any, graphs: Mapping[int, Any]) -> Any:
    """The first node ``node`` derives from (``from_node`` chain), if in one of ``graphs``."""
    sources = node.meta.get("from_node") or ()
    if not sources:
        return None
    source = sources[-1]
    while source.from_node:
        source = source.from_node[-1]
    return source if source.graph_id in graphs else None


def _subgraph_call(node: Any) -> bool:
    """A higher-order op call: an argument is a ``get_attr`` of a subgraph."""
    return node.op == "call_function" and any(
        isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in node.args
    )


def _same_meta(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:500]


def _parse_list(raw: str | None) -> list[str] | None:
    if not raw:
        return None
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    return [str(v) for v in value] if isinstance(value, list | tuple) else None


def source_line(stack_trace: str | None) -> str | None:
    """``file:line`` of the innermost frame outside torch itself (the user's call)."""
    if not stack_trace:
        return None
    frames = _FRAME.findall(stack_trace)
    for path, line in reversed(frames):
        if not (path.startswith(_TORCH_DIR) or path.startswith("torch/") or path.startswith("<")):
            return f"{path}:{line}"
    return None


def _annotate_nodes(graph: ir.Graph) -> dict[str, str]:
    """Set scope/module/source_line on every node; return ``{module path: class}``."""
    classes: dict[str, str] = {}
    for node in graph.all_nodes():
        props = node.metadata_props
        scopes = _parse_list(props.get(_NAME_SCOPES))
        hierarchy = _parse_list(props.get(_CLASS_HIERARCHY))
        line = source_line(props.get(_STACK_TRACE))
        _drop_torch_metadata(props)
        if (
            scopes
            and hierarchy
            and len(scopes) == len(hierarchy) >= 2
            and not any(p.startswith(_NO_STACK) for p in scopes)
        ):
            # The last entry is the aten op itself; the ones before are the module chain.
            for path, cls in zip(scopes[:-1], hierarchy[:-1], strict=True):
                classes.setdefault(path, cls)
            if scopes[-2]:
                props[SCOPE] = scopes[-2]
            props[MODULE] = hierarchy[-2]
        if line:
            props[SOURCE_LINE] = line
    return dict(sorted(classes.items()))


def _localize_constants(graph: ir.Graph) -> int:
    """Give each scope its own copy of the ``Constant`` nodes it reads from another scope.

    The exporter shares one ``Constant`` (an axis, a shape piece) between module calls. A layer
    body must only read values that are true inputs of the layer, so an emitter can replace the
    body without starving another layer of a constant it defined.
    """
    names = {v.name for v in graph.inputs} | set(graph.initializers)
    for node in graph:
        names.update(o.name for o in node.outputs if o.name)
    copies = 0
    for node in list(graph):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or node.inputs:
            continue
        (value,) = node.outputs
        own = node.metadata_props.get(SCOPE) or None
        foreign: dict[str | None, list[tuple[ir.Node, int]]] = {}
        for use in value.uses():
            scope = use.node.metadata_props.get(SCOPE) or None
            if scope != own:
                foreign.setdefault(scope, []).append((use.node, use.idx))
        for scope, uses in sorted(foreign.items(), key=lambda item: item[0] or ""):
            name = f"{value.name}_{_scope_suffix(scope)}"
            while name in names:
                name += "_"
            names.add(name)
            clone = ir.Node(
                "",
                "Constant",
                [],
                attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
                outputs=[ir.Value(name=name, type=value.type, shape=value.shape)],
                name=f"{node.name}_{_scope_suffix(scope)}" if node.name else None,
            )
            first = uses[0][0]
            if scope:
                clone.metadata_props[SCOPE] = scope
            for key in (MODULE, SOURCE_LINE):
                if key in first.metadata_props:
                    clone.metadata_props[key] = first.metadata_props[key]
            graph.insert_after(node, clone)
            for consumer, index in uses:
                consumer.replace_input_with(index, clone.outputs[0])
            copies += 1
    return copies


def _unique_value_names(graph: ir.Graph) -> int:
    """Rename node outputs that share a name with an initializer or another value.

    torch.onnx names a node's output after its FX node (``index`` for ``aten.index``) and the
    initializers after their ``state_dict`` keys, without checking the two apart: a buffer
    called ``index`` and an indexing op made an invalid graph.
    """
    taken = {v.name for v in graph.inputs} | set(graph.initializers)
    renamed = 0
    for node in graph.all_nodes():
        for value in node.outputs:
            if not value.name:
                continue
            if value.name in taken:
                base, k = value.name, 1
                while f"{base}_{k}" in taken:
                    k += 1
                value.name = f"{base}_{k}"
                renamed += 1
            taken.add(value.name)
    return renamed


def _const_ints(value: ir.Value | None) -> list[int] | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else [int(v) for v in np.asarray(tensor.numpy()).ravel()]


def _single_index_gather(graph: ir.Graph) -> int:
    """``x[idx]`` (one index tensor): torchlib's ``GatherND(x, Concat(Unsqueeze(idx, -1)))``
    becomes ``Gather(x, idx, axis=0)``, the op every emitter writes as plain indexing (Swin's
    relative position bias table lookup)."""
    count = 0
    for node in list(graph):
        if node.op_type != "GatherND" or node.domain not in ("", "ai.onnx"):
            continue
        if _attr_int(node, "batch_dims", 0) != 0:
            continue
        concat = node.inputs[1].producer() if node.inputs[1] is not None else None
        if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 1:
            continue
        unsq = concat.inputs[0].producer()
        if unsq is None or unsq.op_type != "Unsqueeze" or len(unsq.inputs) != 2:
            continue
        if _const_ints(unsq.inputs[1]) != [-1]:
            continue
        gather = ir.Node(
            "",
            "Gather",
            [node.inputs[0], unsq.inputs[0]],
            attributes=[ir.AttrInt64("axis", 0)],
            name=node.name,
        )
        gather.metadata_props.update(node.metadata_props)
        graph.insert_after(node, gather)
        old, new = node.outputs[0], gather.outputs[0]
        new.shape, new.type = old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        name, old.name = old.name, None
        new.name = name
        graph.remove(node, safe=True)
        count += 1
    return count


def _attr_int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _scope_suffix(scope: str | None) -> str:
    return re.sub(r"\W", "_", scope) if scope else "root"


def _drop_torch_metadata(props: dict[str, str]) -> None:
    for key in [k for k in props if k.startswith("pkg.torch.") or k == "namespace"]:
        del props[key]


def _add_missing_state(graph: ir.Graph, state: Mapping[str, torch.Tensor]) -> None:
    """Carry state_dict entries the graph never reads (``num_batches_tracked``, unused params).

    Tied weights (one tensor under two keys) are not duplicated: the graph keeps one name.
    """
    present = {
        t.data_ptr() for name, t in state.items() if name in graph.initializers and t.numel()
    }
    for name, tensor in state.items():
        if name in graph.initializers or not isinstance(tensor, torch.Tensor):
            continue
        if tensor.numel() and tensor.data_ptr() in present:
            logger.debug("%s is tied to another weight; not duplicated", name)
            continue
        data = TorchTensor(tensor.detach().cpu().contiguous(), name=name)
        value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(data.dtype))
        value.const_value = data
        graph.register_initializer(value)


def module_classes(model: ir.Model) -> dict[str, str]:
    """The ``{module path: class}`` map an import recorded (empty if none)."""
    raw = model.metadata_props.get(MODULES)
    return json.loads(raw) if raw else {}


__all__: Sequence[str] = ["BATCH_DIM", "MODULES", "annotate", "from_torch", "module_classes"]
