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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnx_ir.tensor_adapters import TorchTensor
from torch import nn

from xconv.converters.torch.importer import layers, rewrite
from xconv.errors import ConversionError
from xconv.ir import OPSET
from xconv.ir.metadata import MODULE, SCOPE, SOURCE_LINE

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
    programs: list | None = None,
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
        dynamic_batch: Make dimension 0 of every tensor input a symbolic ``batch`` dim so the
            converted model runs at any batch size.
        programs: When given, the ``ExportedProgram`` the IR was translated from is appended
            (its weights are the module's own tensors): the layerwise parity check cuts it
            into blocks.

    Returns:
        The model as an ``onnx_ir.Model`` at opset ``xconv.ir.OPSET``, annotated with
        ``xconv.scope`` / ``xconv.module`` / ``xconv.source_line`` on nodes, ``xconv.layer`` on
        the anchor node of each standard layer and ``xconv.role`` / ``xconv.layout`` on weights
        (initializers named by their ``state_dict`` keys).

    Raises:
        ConversionError: The module cannot be traced or translated, or ``dynamic_batch`` was
            asked for but the batch dimension is fixed by the model.
    """
    args = _as_args(example_inputs)
    if isinstance(args, dict) and isinstance(module, torch.jit.ScriptModule):
        raise ConversionError("give a TorchScript module positional example inputs, not a dict")
    if isinstance(module, torch.export.ExportedProgram):
        program = module
        if dynamic_batch:
            _check_batch_dynamic_in_program(program)
        modules: dict[str, nn.Module] = {}
        state = dict(program.state_dict)
    elif isinstance(module, torch.jit.ScriptModule):
        program = _from_torchscript(module, args)
        # TorchScript keeps each submodule's class name (``original_name``), not its instance.
        modules = dict(module.named_modules())
        state = dict(program.state_dict)
    elif isinstance(module, nn.Module):
        if args is None:
            raise ConversionError(
                "example_inputs are required to trace an nn.Module: pass a tensor, a tuple "
                "of the forward's positional inputs or a dict of keyword inputs"
            )
        was_training = module.training
        module.eval()
        try:
            program = _export(module, args, dynamic_batch)
        finally:
            module.train(was_training)
        modules = dict(module.named_modules(remove_duplicate=False))
        state = module.state_dict(keep_vars=False)
    else:
        raise ConversionError(
            f"from_torch takes an nn.Module, an ExportedProgram or a TorchScript module, got "
            f"{type(module).__name__}"
        )
    model = _to_ir(program)
    annotate(model, modules, state, dynamic_batch=dynamic_batch)
    if programs is not None:
        programs.append(program)
    return model


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
    if dynamic_batch:
        _rename_batch_dim(graph)


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
    return value


def _export(module: nn.Module, args: tuple[Any, ...] | dict[str, Any], dynamic_batch: bool):
    kwargs = args if isinstance(args, dict) else None
    args = () if kwargs is not None else args
    dynamic_shapes = None
    if dynamic_batch:
        batch = torch.export.Dim(BATCH_DIM)

        def spec(a: Any) -> dict[int, Any] | None:
            return {0: batch} if isinstance(a, torch.Tensor) and a.dim() >= 1 else None

        if kwargs is not None:
            dynamic_shapes = {k: spec(v) for k, v in kwargs.items()}
        else:
            dynamic_shapes = tuple(spec(a) for a in args)
    try:
        program = torch.export.export(
            module, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, strict=False
        )
    except Exception as e:
        hint = ""
        if dynamic_batch:
            hint = (
                " With dynamic_batch=True the example batch must be >= 2 and the model must not "
                "fix the batch size (e.g. a reshape with a literal batch)."
            )
        raise ConversionError(
            f"torch.export could not trace {type(module).__name__}: {_first_line(e)}.{hint}"
        ) from e
    if dynamic_batch:
        _check_batch_dynamic_in_program(program)
    return program


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


def _from_torchscript(module: torch.jit.ScriptModule, args: tuple[Any, ...] | None):
    if args is None:
        raise ConversionError("example_inputs are required to convert a TorchScript module")
    try:
        from torch._export.converter import TS2EPConverter

        return TS2EPConverter(module, args).convert()
    except Exception as e:
        raise ConversionError(
            f"cannot convert the TorchScript module to an ExportedProgram: {_first_line(e)}"
        ) from e


def _to_ir(program) -> ir.Model:
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
            f"torch.onnx could not translate the exported program: {_first_line(e)}"
        ) from e
    finally:
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(level)
    model = onnx_program.model
    version = model.opset_imports.get("", OPSET)
    if version < OPSET:
        from xconv.converters.onnx.io import load

        model = load(model)
    return model


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


def _rename_batch_dim(graph: ir.Graph) -> None:
    """Name the symbolic batch dimension ``batch`` wherever torch.export called it ``s0``."""
    names = set()
    for value in graph.inputs:
        if value.shape is not None and len(value.shape) >= 1:
            dim = value.shape[0]
            if isinstance(dim, ir.SymbolicDim) and dim.value:
                names.add(dim.value)
    names.discard(BATCH_DIM)
    if not names:
        return
    values: list[ir.Value] = [*graph.inputs]
    for node in graph.all_nodes():
        values.extend(node.outputs)
    for value in values:
        shape = value.shape
        if shape is None:
            continue
        dims = [
            ir.SymbolicDim(BATCH_DIM) if isinstance(d, ir.SymbolicDim) and d.value in names else d
            for d in shape.dims
        ]
        if dims != list(shape.dims):
            value.shape = ir.Shape(dims)


def module_classes(model: ir.Model) -> dict[str, str]:
    """The ``{module path: class}`` map an import recorded (empty if none)."""
    raw = model.metadata_props.get(MODULES)
    return json.loads(raw) if raw else {}


__all__: Sequence[str] = ["BATCH_DIM", "MODULES", "annotate", "from_torch", "module_classes"]
