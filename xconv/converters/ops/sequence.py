"""Sequence ops on Python lists: an ONNX sequence is a list of arrays in every backend.

``static`` turns a position input into a numpy array (a backend passes ``ctx.static``);
``fail`` turns a message into the exception to raise (``ctx.error``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

Fail = Callable[[str], Exception]
Static = Callable[[Any, str], np.ndarray]


def as_sequence(seq, fail: Fail, what: str = "input_sequence") -> list:
    """``seq`` itself when it is a sequence (a list)."""
    if not isinstance(seq, list):
        raise fail(f"{what} must be a sequence, got {type(seq).__name__}")
    return seq


def position(position, length: int, static: Static, fail: Fail, *, insert: bool) -> int:
    """A static ``position`` input as a non-negative index into a sequence of ``length``."""
    pos = int(static(position, "position").reshape(-1)[0])
    hi = length if insert else length - 1
    if not -length <= pos <= hi:
        raise fail(f"position {pos} is out of range for a sequence of length {length}")
    return pos + length if pos < 0 else pos


def insert(seq, tensor, at, static: Static, fail: Fail) -> list:
    """SequenceInsert: a new list with ``tensor`` at ``at`` (default: appended)."""
    seq = list(as_sequence(seq, fail))
    if at is None:
        seq.append(tensor)
    else:
        seq.insert(position(at, len(seq), static, fail, insert=True), tensor)
    return seq


def erase(seq, at, static: Static, fail: Fail) -> list:
    """SequenceErase: a new list without the element at ``at`` (default: the last)."""
    seq = list(as_sequence(seq, fail))
    if not seq:
        raise fail("cannot erase from an empty sequence")
    pos = len(seq) - 1 if at is None else position(at, len(seq), static, fail, insert=False)
    del seq[pos]
    return seq


def split_sizes(split: np.ndarray, dim: int, fail: Fail) -> list[int]:
    """SplitToSequence's piece sizes along an axis of length ``dim`` from a static ``split``:
    a scalar chunk size (the last piece may be shorter) or a list summing to ``dim``."""
    if split.ndim == 0:
        size = int(split)
        if size <= 0:
            raise fail(f"split must be positive, got {size}")
        return [size] * (dim // size) + ([dim % size] if dim % size else [])
    sizes = [int(s) for s in split]
    if sum(sizes) != dim:
        raise fail(f"split sizes {sizes} do not sum to the axis length {dim}")
    return sizes


class SequenceKernel(Protocol):
    """What a backend provides for the sequence ops that build arrays."""

    def constant(self, a: np.ndarray) -> Any:
        """A numpy result as the backend returns constants."""

    def split(self, x: Any, sizes: list[int], axis: int) -> list[Any]: ...

    def squeeze(self, x: Any, axis: int) -> Any: ...

    def expand_dims(self, x: Any, axis: int) -> Any: ...

    def concat(self, xs: list[Any], axis: int) -> Any:
        """``xs`` joined along a non-negative ``axis`` (numpy string elements included)."""

    def dynamic_at(self, ctx: Any, seq: list[Any], position: Any) -> Any:
        """``seq[position]`` for a run-time position, or None where positions are static."""


def register_list_ops(builtin: Callable[..., Any], required: Any, k: SequenceKernel) -> None:
    """Register the sequence and optional ops: ``builtin`` is a backend registry's decorator
    factory, ``required`` its REQUIRED marker, ``k`` its kernel for the ops that build arrays."""

    @builtin("SequenceConstruct", since=11)
    def sequence_construct(ctx, *inputs):
        """SequenceConstruct(inputs...) -> output_sequence."""
        return list(inputs)

    @builtin("SequenceEmpty", since=11, attrs={"dtype": None})
    def sequence_empty(ctx, *, dtype):
        """SequenceEmpty() -> an empty sequence (of element type ``dtype``)."""
        return []

    @builtin("SequenceInsert", since=11)
    def sequence_insert(ctx, seq, tensor, position=None):
        """SequenceInsert(input_sequence, tensor, position?) -> output_sequence."""
        return insert(seq, tensor, position, ctx.static, ctx.error)

    @builtin("SequenceErase", since=11)
    def sequence_erase(ctx, seq, position=None):
        """SequenceErase(input_sequence, position?) -> output_sequence (default: the last)."""
        return erase(seq, position, ctx.static, ctx.error)

    @builtin("SequenceMap", since=17, attrs={"body": required})
    def sequence_map(ctx, seq, *additional, body):
        """SequenceMap(input_sequence, additional_inputs...) -> out_sequence... (body per item)."""
        seq = as_sequence(seq, ctx.error)
        for extra in additional:
            if isinstance(extra, list) and len(extra) != len(seq):
                raise ctx.error(f"sequence inputs differ in length ({len(extra)} vs {len(seq)})")
        results: list[list] = [[] for _ in body.outputs]
        for i, item in enumerate(seq):
            feeds = [item, *(e[i] if isinstance(e, list) else e for e in additional)]
            for k, out in enumerate(ctx.run_subgraph(body, feeds)):
                results[k].append(out)
        return tuple(results)

    @builtin("Optional", since=15, attrs={"type": None})
    def optional(ctx, x=None, *, type):  # noqa: A002 - the ONNX attribute name
        """Optional(input?) -> an optional holding input, or empty (None)."""
        return x

    @builtin("OptionalGetElement", since=15)
    def optional_get_element(ctx, x):
        """OptionalGetElement(input) -> the value held (a tensor or sequence passes through)."""
        if x is None:
            raise ctx.error("the optional input is empty")
        return x

    _register_array_ops(builtin, required, k)


def _register_array_ops(builtin: Callable[..., Any], required: Any, k: SequenceKernel) -> None:
    """The sequence and optional ops that build arrays (through the kernel ``k``)."""

    @builtin("SequenceAt", since=11)
    def sequence_at(ctx, seq, position):
        """SequenceAt(input_sequence, position) -> tensor."""
        seq = as_sequence(seq, ctx.error)
        found = k.dynamic_at(ctx, seq, position)
        if found is not None:
            return found
        return seq[_position(ctx, position, len(seq))]

    @builtin("SequenceLength", since=11)
    def sequence_length(ctx, seq):
        """SequenceLength(input_sequence) -> int64 scalar."""
        return k.constant(np.array(len(as_sequence(seq, ctx.error)), dtype=np.int64))

    @builtin("SplitToSequence", since=11, attrs={"axis": 0, "keepdims": 1})
    def split_to_sequence(ctx, x, split=None, *, axis, keepdims):
        """SplitToSequence(input, split?) -> output_sequence."""
        axis = axis % x.ndim
        dim = x.shape[axis]
        if split is None:
            if dim == 0:
                return []
            pieces = k.split(x, [1] * dim, axis)
            return pieces if keepdims else [k.squeeze(p, axis) for p in pieces]
        return k.split(x, split_sizes(ctx.static(split, "split"), dim, ctx.error), axis)

    @builtin("ConcatFromSequence", since=11, attrs={"axis": required, "new_axis": 0})
    def concat_from_sequence(ctx, seq, *, axis, new_axis):
        """ConcatFromSequence(input_sequence) -> concatenated (or stacked, new_axis=1) tensor."""
        seq = as_sequence(seq, ctx.error)
        if not seq:
            raise ctx.error("cannot concatenate an empty sequence")
        rank = np.ndim(seq[0])
        if new_axis:
            axis = axis % (rank + 1)
            seq = [k.expand_dims(s, axis) for s in seq]
        else:
            axis = axis % rank
        return k.concat(seq, axis)

    @builtin("OptionalHasElement", since=15)
    def optional_has_element(ctx, x=None):
        """OptionalHasElement(input?) -> bool scalar: whether the optional holds a value."""
        return k.constant(np.array(x is not None))


def _position(ctx, at, length: int) -> int:
    return position(at, length, ctx.static, ctx.error, insert=False)
