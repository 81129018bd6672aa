"""Symbolic dimensions of a TF import, named by role.

tf2onnx writes every ``None`` of a signature as a fresh symbol (``unk__215``), one per input
and another for each output, so nothing says that two inputs share a batch. Right after
loading, :func:`name_symbolic_dims` renames the graph inputs' symbols by role and carries the
names through every value shape:

* dim 0 of every input: ``batch`` (one symbol shared by all inputs);
* dim 1 of an integer (token id) input of rank >= 2, or of a rank-3 float input: ``seq``;
* the spatial dims of a rank-4 image input: ``height`` / ``width`` (dims 1, 2 channels-last,
  Keras's default; dims 2, 3 when dim 1 is static and dim 3 is not, channels-first);
* any other ``None`` dim: ``<input>_<axis>``.

Role names are shared across inputs (two token inputs get one ``seq``): inputs of equal sizes
are always admissible where different sizes would be, so a shared name never claims a size
the model refuses. Only dims the signature leaves ``None`` become symbols; a dim the Keras
``Input`` (or the example inputs given to ``from_tf``) fixes stays static.

Symbols of other values that tf2onnx invented (an output's ``unk__N``) are cleared to
unknown, so the ONNX shape inference of the rewrites that follow rebuilds them from the
inputs' names; :func:`restore_unknown` then names whatever inference could not resolve back to
tf2onnx's symbol (``tf_unk__N`` where ONNX inference minted the same name for another dim), so
no dimension is left anonymous where it had a name before.
"""

from __future__ import annotations

import re

import onnx_ir as ir

BATCH = "batch"
SEQ = "seq"
HEIGHT = "height"
WIDTH = "width"


def role_names(value: ir.Value) -> dict[int, str]:
    """``{axis: symbol name}`` for the symbolic dims of graph input ``value``."""
    shape = value.shape
    if shape is None:
        return {}
    dims = list(shape)
    rank = len(dims)
    symbolic = [i for i, d in enumerate(dims) if not isinstance(d, int)]
    if not symbolic:
        return {}
    dtype = value.dtype
    integer = dtype is not None and dtype.is_integer()
    roles: dict[int, str] = {0: BATCH}
    if rank >= 2 and (integer or (rank == 3 and dtype is not None and dtype.is_floating_point())):
        roles[1] = SEQ
    elif rank == 4 and not integer:
        channels_first = isinstance(dims[1], int) and not isinstance(dims[3], int)
        h, w = (2, 3) if channels_first else (1, 2)
        roles[h], roles[w] = HEIGHT, WIDTH
    stem = _identifier(value.name or "input")
    return {i: roles.get(i, f"{stem}_{i}") for i in symbolic}


def name_symbolic_dims(model: ir.Model) -> dict[ir.Value, dict[int, str]]:
    """Rename the graph inputs' symbols by role, in every value of every graph; clear the
    symbols no input carries. Returns the cleared dims, ``{value: {axis: tf2onnx symbol}}``,
    for :func:`restore_unknown`.
    """
    mapping: dict[str, str] = {}
    for value in model.graph.inputs:
        if value.is_initializer():
            continue
        for axis, name in role_names(value).items():
            old = value.shape[axis]
            key = old.value if isinstance(old, ir.SymbolicDim) else None
            if key is not None:
                mapping.setdefault(key, name)
            shape = list(value.shape)
            shape[axis] = ir.SymbolicDim(name)
            value.shape = ir.Shape(shape)
    cleared: dict[ir.Value, dict[int, str]] = {}
    inputs = {id(v) for v in model.graph.inputs}
    for graph in model.graphs():
        for value in _values(graph):
            if value.shape is None or id(value) in inputs:
                continue
            dims = list(value.shape)
            changed = False
            for i, d in enumerate(dims):
                if isinstance(d, ir.SymbolicDim) and d.value is not None:
                    new = mapping.get(d.value)
                    if new is None:
                        cleared.setdefault(value, {})[i] = d.value
                        dims[i] = ir.SymbolicDim(None)
                    else:
                        dims[i] = ir.SymbolicDim(new)
                    changed = True
            if changed:
                value.shape = ir.Shape(dims)
    return cleared


def restore_unknown(model: ir.Model, cleared: dict[ir.Value, dict[int, str]]) -> None:
    """Give the dims shape inference left unknown their tf2onnx symbol back (values the
    rewrites removed are skipped). A symbol ONNX inference has since minted for another dim
    (it counts ``unk__0``, ``unk__1``, … too) is not reused: that would claim two unrelated
    sizes equal; such a dim is named ``tf_<symbol>``."""
    taken = {
        d.value
        for graph in model.graphs()
        for value in _values(graph)
        for d in (value.shape or ())
        if isinstance(d, ir.SymbolicDim) and d.value is not None
    }
    for value, axes in cleared.items():
        if value.shape is None:
            continue
        dims = list(value.shape)
        changed = False
        for i, old in axes.items():
            if i < len(dims) and isinstance(dims[i], ir.SymbolicDim) and dims[i].value is None:
                dims[i] = ir.SymbolicDim(f"tf_{old}" if old in taken else old)
                changed = True
        if changed:
            value.shape = ir.Shape(dims)


def _values(graph: ir.Graph):
    seen: set[int] = set()
    for value in [*graph.inputs, *graph.outputs]:
        if id(value) not in seen:
            seen.add(id(value))
            yield value
    for node in graph:
        for value in node.outputs:
            if id(value) not in seen:
                seen.add(id(value))
                yield value


def _identifier(name: str) -> str:
    stem = re.sub(r"\W+", "_", name.split(":")[0]).strip("_")
    return stem or "input"


__all__ = ["BATCH", "HEIGHT", "SEQ", "WIDTH", "name_symbolic_dims", "restore_unknown"]
