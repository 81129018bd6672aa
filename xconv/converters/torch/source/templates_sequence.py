"""PyTorch source templates for the sequence and optional ops: an ONNX sequence is a Python
list of tensors, an empty optional None, as in ``to_torch`` (``ops/sequence``). Importing this
module registers them in ``templates.registry``.
"""

from __future__ import annotations

import numpy as np

from xconv.converters import expressions_structured as exs
from xconv.converters.registry import REQUIRED
from xconv.converters.torch.source.templates import OpCall, registry, template


def _position(c: OpCall, i: int) -> str | None:
    """Input ``i`` (a position) as a Python int expression; None when absent."""
    if not c.has(i):
        return None
    if c.consts[i] is not None:
        return str(int(np.asarray(c.consts[i]).reshape(-1)[0]))
    return f"int({c.args[i]})"


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
    return f"torch.tensor(len({c.args[0]}), dtype=torch.int64)"


@template("ConcatFromSequence", axis=REQUIRED, new_axis=0)
def _concat_from_sequence(c: OpCall) -> str:
    fn = "stack" if c.attrs["new_axis"] else "cat"
    return f"torch.{fn}({c.args[0]}, dim={int(c.attrs['axis'])})"


@template("SplitToSequence", axis=0, keepdims=1)
def _split_to_sequence(c: OpCall) -> str:
    """A Python list of tensors: pieces of one (squeezed without keepdims) when no split is
    given, else of the given sizes or of one chunk size (the last piece shorter)."""
    x, a = c.args[0], c.attrs["axis"]
    if not c.has(1):
        expr = f"torch.split({x}, 1, dim={a})"
        if not c.attrs["keepdims"]:
            return f"[t.squeeze({a}) for t in {expr}]"
        return f"list({expr})"
    split = c.consts[1]  # a chunk size (a scalar) or the sizes; .tolist() reads either
    sizes = str(int(split)) if split is not None and np.ndim(split) == 0 else c.ints(1)
    return f"list(torch.split({x}, {sizes}, dim={a}))"


@template("OptionalHasElement")
def _optional_has_element(c: OpCall) -> str:
    return f"torch.tensor({c.args[0] if c.has(0) else 'None'} is not None)"


@template("OptionalGetElement")
def _optional_get_element(c: OpCall) -> str:
    return c.args[0]
