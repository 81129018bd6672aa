"""Symbolic shapes for the torch importer: which dimensions stay free, what the model fixes.

A module is exported with every dimension of every tensor input ``torch.export.Dim.AUTO``:
torch keeps a dimension symbolic unless the model fixes it (a reshape with a literal, a
weight's size), in which case it specialises that one dimension. An example dimension of size
1 would be specialised by torch's 0/1 rule, so the export runs on the example repeated to
size 2 along such dimensions (the user's own inputs stay the parity check's); when the model
needs one of them to be 1 (a grayscale convolution's channel), only the leading dimensions
are repeated, then none.

:func:`name_dims` renames torch.onnx's ``s72``-style symbols by role (``batch``, ``seq``,
``height``...), and each input dimension the exported program fixes is listed in the model's
``xconv.fixed_dims`` metadata (JSON) with the reason: the user-code line whose guard fixed it
(recorded while tracing, at no extra export), an example size of 1 the model would not take
at 2, TorchScript, or an ``ExportedProgram`` exported at static shapes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import traceback
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import onnx_ir as ir
import torch

from xconv.ir.metadata import FIXED_DIMS, describe_fixed_dim, fixed_dims

#: Why a dimension is fixed (the ``reason`` of a :data:`FIXED_DIMS` entry).
MODEL = "model"  # the model's code fixed it (source_line says where, when known)
SIZE_ONE = "size-1 example"  # example size 1, kept: the model did not trace at size 2
STATIC = "static"  # static=True / --static
TORCHSCRIPT = "torchscript"  # the TorchScript interpreter fixes every size
PROGRAM = "exported program"  # an ExportedProgram traced with this dimension static

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_XCONV_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))) + os.sep
_SYMBOL = re.compile(r"\b(s\d+)\b")
_SOURCE = re.compile(r"^L\[(?:'kwargs'\]\[)?'([^']+)'\]\.size\(\)\[(\d+)\]$")

_FIXED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fixed_of(program: Any) -> list[dict[str, Any]]:
    """The :data:`FIXED_DIMS` entries :func:`export` found for ``program`` (empty if none)."""
    try:
        return list(_FIXED.get(program, ()))
    except TypeError:
        return []


def set_fixed(program: Any, fixed: list[dict[str, Any]]) -> None:
    with contextlib.suppress(TypeError):
        _FIXED[program] = fixed


def dynamic_spec(args: tuple | dict, batch: Any = None) -> tuple | dict:
    """``dynamic_shapes`` for ``args``: every dim of every tensor ``Dim.AUTO`` (dim 0 ``batch``
    when given)."""
    auto = torch.export.Dim.AUTO

    def spec(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if a.dim() == 0:
                return None
            return {i: (batch if i == 0 and batch is not None else auto) for i in range(a.dim())}
        if isinstance(a, list | tuple) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(spec(x) for x in a)
        if isinstance(a, dict) and any(isinstance(x, torch.Tensor) for x in a.values()):
            return {k: spec(v) for k, v in a.items()}
        return None

    if isinstance(args, dict):
        return {k: spec(v) for k, v in args.items()}
    return tuple(spec(a) for a in args)


def batch_spec(args: tuple | dict, batch: Any) -> tuple | dict:
    """``dynamic_shapes`` with only dim 0 of each tensor input the named ``batch`` Dim."""

    def spec(a: Any) -> dict[int, Any] | None:
        return {0: batch} if isinstance(a, torch.Tensor) and a.dim() >= 1 else None

    if isinstance(args, dict):
        return {k: spec(v) for k, v in args.items()}
    return tuple(spec(a) for a in args)


def repeat_ones(args: tuple | dict, leading_only: bool) -> tuple | dict:
    """``args`` with every size-1 dimension of each tensor repeated to 2 (``leading_only``:
    dimension 0 only); the repeated rows equal the example's."""

    def grow(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            dims = range(1) if leading_only else range(a.dim())
            reps = [2 if (i in dims and a.shape[i] == 1) else 1 for i in range(a.dim())]
            return a.repeat(*reps) if any(r == 2 for r in reps) else a
        if isinstance(a, list | tuple):
            return type(a)(grow(x) for x in a)
        return a

    if isinstance(args, dict):
        return {k: grow(v) for k, v in args.items()}
    return tuple(grow(a) for a in args)


def ones(args: tuple | dict) -> tuple[bool, bool]:
    """``(a tensor has dim 0 of size 1, a tensor has another dim of size 1)``."""
    leading = inner = False
    for a in args.values() if isinstance(args, dict) else args:
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            leading = leading or a.shape[0] == 1
            inner = inner or 1 in tuple(a.shape[1:])
    return leading, inner


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Silence a framework logger below ERROR for the duration: torch warns for each size-1
    example dimension it specialises (reported in ``xconv.fixed_dims`` instead; the library
    never prints) and logs a whole traceback for an unreadable archive before raising."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def user_line(frames: traceback.StackSummary | None = None) -> str | None:
    """``file:line`` of the innermost frame outside torch and xconv (the model's code), or
    None when the trace reached it only through torch's own modules (an ``nn.Sequential`` of
    torch layers): a frame outside xconv's export call (the CLI, a test runner) is not the
    model's."""
    inside = False  # past the innermost frames (this recorder's own) into torch's
    for frame in reversed(frames if frames is not None else traceback.extract_stack()):
        path = frame.filename
        if path.startswith(_XCONV_DIR):
            if inside:
                return None
            continue
        inside = True
        if path.startswith((_TORCH_DIR, "<")):
            continue
        return f"{path}:{frame.lineno}"
    return None


@contextlib.contextmanager
def recording_specialisations() -> Iterator[list[tuple[Any, Any, str | None]]]:
    """While tracing, record ``(symbol, target, user line)`` for each replacement the shape
    environment makes (a symbol set to a constant is a dimension the model fixed). A torch
    without ``ShapeEnv._set_replacement`` records nothing."""
    records: list[tuple[Any, Any, str | None]] = []
    try:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        original = ShapeEnv._set_replacement
    except (ImportError, AttributeError):
        yield records
        return

    def patched(self: Any, a: Any, tgt: Any, msg: str) -> None:
        before = self.replacements.get(a)
        original(self, a, tgt, msg)
        if self.replacements.get(a) is not before:
            with contextlib.suppress(Exception):
                records.append((a, self.replacements.get(a), user_line()))

    ShapeEnv._set_replacement = patched
    try:
        yield records
    finally:
        ShapeEnv._set_replacement = original


def _input_symbols(program: Any) -> dict[tuple[str, int], Any]:
    """``{(input name, dim): symbol}`` from the program's shape environment sources."""
    out: dict[tuple[str, int], Any] = {}
    env = _shape_env(program)
    if env is None:
        return out
    for symbol, sources in getattr(env, "var_to_sources", {}).items():
        for source in sources:
            match = _SOURCE.match(getattr(source, "name", "") or "")
            if match:
                out.setdefault((match.group(1), int(match.group(2))), symbol)
    return out


def _shape_env(program: Any) -> Any:
    for node in program.graph.nodes:
        val = node.meta.get("val")
        mode = getattr(val, "fake_mode", None)
        if mode is not None and getattr(mode, "shape_env", None) is not None:
            return mode.shape_env
    return None


def _lines_by_symbol(records: list[tuple[Any, Any, str | None]]) -> dict[Any, str | None]:
    """For every symbol, the user line that set it (or a symbol it was unified with) to a
    constant."""
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        while parent.get(x, x) is not x and parent.get(x, x) != x:
            x = parent[x]
        return x

    constant_line: dict[Any, str | None] = {}
    for symbol, target, line in records:
        free = getattr(target, "free_symbols", set())
        if getattr(target, "is_number", False):
            root = find(symbol)
            constant_line.setdefault(root, line)
        elif len(free) == 1:
            (other,) = free
            a, b = find(symbol), find(other)
            if a != b:
                parent[a] = b
                if a in constant_line:
                    constant_line.setdefault(b, constant_line[a])
    return {s: constant_line.get(find(s)) for s, _, _ in records}


def program_inputs(program: Any) -> list[tuple[str, Any]]:
    """``(name, fake value)`` of each user input of ``program`` (in order)."""
    kind = torch.export.graph_signature.InputKind.USER_INPUT
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != kind or not hasattr(spec.arg, "name"):
            continue
        node = nodes.get(spec.arg.name)
        out.append((spec.arg.name, node.meta.get("val") if node is not None else None))
    return out


def static_size(size: Any) -> int | None:
    """The size of a dimension when it is a constant (an int, or a SymInt the shape
    environment replaced by one), else None."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    expr = getattr(node, "expr", None)
    if expr is not None and getattr(expr, "is_number", False):
        return int(expr)
    return None


def fixed_in_program(
    program: Any,
    traced: tuple | dict | None,
    records: list[tuple[Any, Any, str | None]],
) -> list[dict[str, Any]]:
    """The input dimensions ``program`` fixes, with why (see :data:`FIXED_DIMS`).

    ``traced`` are the inputs it was traced with: a dimension of size 1 there is fixed by
    torch's 0/1 rule (the model did not trace with it at 2), not by a line of the model."""
    by_symbol = _lines_by_symbol(records)
    symbols = _input_symbols(program)
    examples = _flat_examples(traced)
    fixed = []
    for position, (name, val) in enumerate(program_inputs(program)):
        if not isinstance(val, torch.Tensor):
            continue
        source = _source_name(name, position, symbols)
        for dim, raw in enumerate(val.shape):
            size = static_size(raw)
            if size is None:
                continue
            entry: dict[str, Any] = {"input": name, "dim": dim, "size": size, "reason": MODEL}
            given = examples[position] if position < len(examples) else None
            line = None
            if source is not None:
                symbol = symbols.get((source, dim))
                line = by_symbol.get(symbol) if symbol is not None else None
            one = given is not None and given.dim() > dim and given.shape[dim] == 1
            if size == 1 and one and line is None:
                entry["reason"] = SIZE_ONE
            if line:
                entry["source_line"] = line
            fixed.append(entry)
    return fixed


def _source_name(name: str, position: int, symbols: Mapping[tuple[str, int], Any]) -> str | None:
    """The shape-environment source name of input ``name`` (``L['x']``) or None."""
    names = {source for source, _ in symbols}
    if name in names:
        return name
    base = re.sub(r"_\d+$", "", name)
    return base if base in names else None


def _flat_examples(example: tuple | dict | None) -> list[Any]:
    if example is None:
        return []
    values = example.values() if isinstance(example, dict) else example
    return [v for v in values if isinstance(v, torch.Tensor)]


def all_fixed(program: Any, reason: str) -> list[dict[str, Any]]:
    """Every dimension of every tensor input of ``program`` as a fixed entry."""
    out = []
    for name, val in program_inputs(program):
        if isinstance(val, torch.Tensor):
            for dim, raw in enumerate(val.shape):
                size = static_size(raw)
                if size is not None:
                    out.append({"input": name, "dim": dim, "size": size, "reason": reason})
    return out


def has_symbolic_input(program: Any) -> bool:
    for _name, val in program_inputs(program):
        if isinstance(val, torch.Tensor) and any(static_size(d) is None for d in val.shape):
            return True
    return False


def record(model: ir.Model, fixed: list[dict[str, Any]]) -> None:
    """Write ``fixed`` to the model's :data:`FIXED_DIMS` metadata (torch.onnx names the graph
    inputs as the program's placeholders)."""
    model.metadata_props[FIXED_DIMS] = json.dumps(fixed)


read = fixed_dims
describe = describe_fixed_dim


# --- naming ------------------------------------------------------------------------------------


def _role(value: ir.Value, dim: int, rank: int) -> str:
    if dim == 0:
        return "batch"
    dtype = value.dtype
    integer = dtype is not None and (dtype.is_integer() or dtype == ir.DataType.BOOL)
    if dim == 1 and (integer or rank == 3):
        return "seq"
    if dtype is not None and dtype.is_floating_point():
        if rank == 4 and dim in (2, 3):
            return ("height", "width")[dim - 2]
        if rank == 5 and dim in (2, 3, 4):
            return ("depth", "height", "width")[dim - 2]
    return f"{value.name}_{dim}"


def role_names(graph: ir.Graph) -> dict[str, str]:
    """``{torch symbol: role name}`` for the symbolic dims of the graph inputs: dim 0
    ``batch``; dim 1 of an integer or rank-3 input ``seq``; dims 2, 3 (4) of a float rank-4
    (5) input ``height``, ``width`` (``depth``); else ``<input>_<dim>``. One symbol gets one
    name; a name taken by another symbol gets ``_2``, ``_3``."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    # A symbol the user already named (Dim("batch")) keeps its name.
    for value in graph.inputs:
        for d in value.shape.dims if value.shape is not None else ():
            named = isinstance(d, ir.SymbolicDim) and d.value and d.value.isidentifier()
            if named and not _SYMBOL.fullmatch(d.value):
                names[d.value] = d.value
                taken.add(d.value)
    for value in graph.inputs:
        if value.shape is None or value.is_initializer():
            continue
        rank = len(value.shape)
        for i, d in enumerate(value.shape.dims):
            if not isinstance(d, ir.SymbolicDim) or not d.value or d.value in names:
                continue
            if not _SYMBOL.fullmatch(d.value):
                continue
            base = _role(value, i, rank)
            name, k = base, 2
            while name in taken:
                name, k = f"{base}_{k}", k + 1
            names[d.value] = name
            taken.add(name)
    return {k: v for k, v in names.items() if k != v}


def name_dims(graph: ir.Graph) -> dict[str, str]:
    """Rename the graph's torch symbols by role (:func:`role_names`) in every value's shape
    (expressions such as ``2*s72`` included); returns the renaming."""
    renames = role_names(graph)
    if not renames:
        return renames

    def sub(text: str) -> str:
        return _SYMBOL.sub(lambda m: renames.get(m.group(1), m.group(1)), text)

    values: list[ir.Value] = [*graph.inputs, *graph.outputs]
    for node in graph.all_nodes():
        values.extend(node.outputs)
    seen: set[int] = set()
    for value in values:
        if id(value) in seen or value.shape is None:
            continue
        seen.add(id(value))
        dims = list(value.shape.dims)
        new = [
            ir.SymbolicDim(sub(d.value)) if isinstance(d, ir.SymbolicDim) and d.value else d
            for d in dims
        ]
        if any(a is not b for a, b in zip(new, dims, strict=True)) and [
            getattr(d, "value", d) for d in new
        ] != [getattr(d, "value", d) for d in dims]:
            value.shape = ir.Shape(new)
    return renames
