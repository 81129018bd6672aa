"""Sequences and optionals.

An ONNX sequence is a Python list of arrays and an empty optional is None: both are JAX
pytrees, so they pass through ``jax.jit`` unchanged. Sequence positions and split sizes
must be known at trace time (they decide the list's structure).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import sequence as sequences


def _position(ctx, position, length: int, *, insert: bool) -> int:
    return sequences.position(position, length, ctx.static, ctx.error, insert=insert)


def _sequence(ctx, seq, what: str = "input_sequence") -> list:
    return sequences.as_sequence(seq, ctx.error, what)


# SequenceConstruct/Empty/Insert/Erase/Map, Optional, OptionalGetElement: backend-free.
sequences.register_list_ops(builtin, REQUIRED)


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
    sizes = sequences.split_sizes(ctx.static(split, "split"), dim, ctx.error)
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


@builtin("OptionalHasElement", since=15)
def optional_has_element(ctx, x=None):
    """OptionalHasElement(input?) -> bool scalar: whether the optional holds a value."""
    return np.array(x is not None)
