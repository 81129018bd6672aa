"""Sequences and optionals.

An ONNX sequence is a Python list of arrays and an empty optional is None: both are JAX
pytrees, so they pass through ``jax.jit`` unchanged. Sequence positions and split sizes
must be known at trace time (they decide the list's structure).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.common import sequence as sequences
from xconv.converters.jax.registry import REQUIRED, builtin


def _position(ctx, position, length: int, *, insert: bool) -> int:
    return sequences.position(position, length, ctx.static, ctx.error, insert=insert)


def _sequence(ctx, seq, what: str = "input_sequence") -> list:
    return sequences.as_sequence(seq, ctx.error, what)


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
    return sequences.insert(seq, tensor, position, ctx.static, ctx.error)


@builtin("SequenceErase", since=11)
def sequence_erase(ctx, seq, position=None):
    """SequenceErase(input_sequence, position?) -> output_sequence (default: the last)."""
    return sequences.erase(seq, position, ctx.static, ctx.error)


@builtin("SequenceAt", since=11)
def sequence_at(ctx, seq, position):
    """SequenceAt(input_sequence, position) -> tensor."""
    seq = _sequence(ctx, seq)
    if isinstance(position, jax.core.Tracer):
        # A run-time position still works when the elements are alike: index a stack.
        if not seq or len({(np.shape(s), jnp.asarray(s).dtype) for s in seq}) != 1:
            raise ctx.error(
                "under jax.jit a run-time SequenceAt position needs elements of one shape and dtype"
            )
        pos = jnp.reshape(position, (-1,))[0]
        return jnp.stack([jnp.asarray(s) for s in seq])[jnp.where(pos < 0, pos + len(seq), pos)]
    return seq[_position(ctx, position, len(seq), insert=False)]


@builtin("SequenceLength", since=11)
def sequence_length(ctx, seq):
    """SequenceLength(input_sequence) -> int64 scalar (static)."""
    return np.array(len(_sequence(ctx, seq)), dtype=np.int64)


@builtin("SplitToSequence", since=11, attrs={"axis": 0, "keepdims": 1})
def split_to_sequence(ctx, x, split=None, *, axis, keepdims):
    """SplitToSequence(input, split?) -> output_sequence."""
    x = jnp.asarray(x)
    axis = axis % x.ndim
    dim = x.shape[axis]
    if split is None:
        pieces = [jnp.take(x, i, axis=axis) for i in range(dim)]
        if keepdims:
            pieces = [jnp.expand_dims(p, axis) for p in pieces]
        return pieces
    split = ctx.static(split, "split")
    if split.ndim == 0:
        size = int(split)
        if size <= 0:
            raise ctx.error(f"split must be positive, got {size}")
        sizes = [size] * (dim // size) + ([dim % size] if dim % size else [])
    else:
        sizes = [int(s) for s in split]
        if sum(sizes) != dim:
            raise ctx.error(f"split sizes {sizes} do not sum to the axis length {dim}")
    offsets = np.cumsum([0, *sizes])
    return [
        jax_slice(x, axis, int(start), int(stop))
        for start, stop in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def jax_slice(x, axis: int, start: int, stop: int):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


@builtin("ConcatFromSequence", since=11, attrs={"axis": REQUIRED, "new_axis": 0})
def concat_from_sequence(ctx, seq, *, axis, new_axis):
    """ConcatFromSequence(input_sequence) -> concatenated (or stacked, new_axis=1) tensor."""
    seq = _sequence(ctx, seq)
    if not seq:
        raise ctx.error("cannot concatenate an empty sequence")
    arrays = [jnp.asarray(s) for s in seq]
    if new_axis:
        return jnp.stack(arrays, axis=axis)
    return jnp.concatenate(arrays, axis=axis)


@builtin("SequenceMap", since=17, attrs={"body": REQUIRED})
def sequence_map(ctx, seq, *additional, body):
    """SequenceMap(input_sequence, additional_inputs...) -> out_sequence... (body per item)."""
    seq = _sequence(ctx, seq)
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


@builtin("OptionalHasElement", since=15)
def optional_has_element(ctx, x=None):
    """OptionalHasElement(input?) -> bool scalar: whether the optional holds a value."""
    return np.array(x is not None)


@builtin("OptionalGetElement", since=15)
def optional_get_element(ctx, x):
    """OptionalGetElement(input) -> the value held (a tensor or sequence passes through)."""
    if x is None:
        raise ctx.error("the optional input is empty")
    return x
