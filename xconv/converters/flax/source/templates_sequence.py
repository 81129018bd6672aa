"""Flax source templates for the sequence and optional ops: an ONNX sequence is a Python list
of arrays, an empty optional None, as in ``to_jax`` (``ops/sequence``). Positions and split
sizes the graph computes at run time are read eagerly (``_static``). Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

import numpy as np

from xconv.converters import expressions_structured as exs
from xconv.converters.flax.source.templates import OpCall, registry, template
from xconv.converters.registry import REQUIRED


def _position(c: OpCall, i: int) -> str | None:
    """Input ``i`` (a position) as a Python int expression; None when absent."""
    if not c.has(i):
        return None
    if c.consts[i] is not None:
        return str(int(np.asarray(c.consts[i]).reshape(-1)[0]))
    c.helpers.add("static_ints")
    return f'_static_ints({c.args[i]}, "{c.node.op_type} position")[0]'


registry.builtin("SequenceConstruct")(exs.sequence_construct_expr)
registry.builtin("Optional", attrs={"type": None})(exs.optional_expr)


@template("SequenceEmpty", dtype=None)
def _sequence_empty(c: OpCall) -> str:
    return "[]"


@template("SequenceInsert")
def _sequence_insert(c: OpCall) -> str:
    return exs.sequence_insert_expr(c, _position(c, 2))


@template("SequenceErase")
def _sequence_erase(c: OpCall) -> str:
    return exs.sequence_erase_expr(c, _position(c, 1))


@template("SequenceAt")
def _sequence_at(c: OpCall) -> str:
    return f"{c.args[0]}[{_position(c, 1)}]"


@template("SequenceLength")
def _sequence_length(c: OpCall) -> str:
    return f"np.asarray(len({c.args[0]}), dtype=np.int64)"


@template("ConcatFromSequence", axis=REQUIRED, new_axis=0)
def _concat_from_sequence(c: OpCall) -> str:
    fn = "stack" if c.attrs["new_axis"] else "concatenate"
    return f"jnp.{fn}({c.args[0]}, axis={int(c.attrs['axis'])})"


@template("SplitToSequence", axis=0, keepdims=1)
def _split_to_sequence(c: OpCall) -> str:
    """A Python list of arrays: pieces of one (squeezed without keepdims) when no split is
    given, else of the given sizes or of one chunk size (the last piece shorter)."""
    x, a = c.args[0], c.attrs["axis"]
    shape = c.shapes[0]
    dim = shape[a] if shape is not None and -len(shape) <= a < len(shape) else None
    if not c.has(1):
        pieces = f"jnp.split({x}, {x}.shape[{a}], axis={a})"
        if c.attrs["keepdims"]:
            return f"list({pieces})"
        return f"[jnp.squeeze(p, axis={a}) for p in {pieces}]"
    if c.consts[1] is None:  # read eagerly
        if c.shapes[1] is None:
            raise c.fail("SplitToSequence by a split of unknown rank computed at run time")
        chunk = len(c.shapes[1]) == 0
        c.helpers.add("static_ints")
        split = f'_static_ints({c.args[1]}, "SplitToSequence split")'
        if chunk:
            cuts = f"list(range({split}[0], {x}.shape[{a}], {split}[0]))"
        else:
            cuts = f"np.cumsum({split})[:-1].tolist()"
        return f"list(jnp.split({x}, {cuts}, axis={a}))"
    split = np.asarray(c.consts[1])
    if split.ndim == 0:
        if dim is None:
            raise c.fail("SplitToSequence by a chunk size along an axis of unknown size")
        cuts = list(range(int(split), dim, int(split)))
    else:
        cuts = [int(v) for v in np.cumsum(split)[:-1]]
    return f"list(jnp.split({x}, {cuts}, axis={a}))"


@template("OptionalHasElement")
def _optional_has_element(c: OpCall) -> str:
    return f"np.asarray({c.args[0] if c.has(0) else 'None'} is not None)"


@template("OptionalGetElement")
def _optional_get_element(c: OpCall) -> str:
    return c.args[0]
