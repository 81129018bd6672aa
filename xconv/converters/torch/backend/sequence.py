"""PyTorch handlers for sequences and optionals.

An ONNX sequence is a Python list of tensors and an empty optional is None.
"""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.ops import sequence as sequences
from xconv.converters.torch.backend.dtypes import is_numpy
from xconv.converters.torch.backend.registry import REQUIRED, builtin
from xconv.converters.torch.backend.shape import concatenate


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
    return seq[_position(ctx, position, len(seq), insert=False)]


@builtin("SequenceLength", since=11)
def sequence_length(ctx, seq):
    """SequenceLength(input_sequence) -> int64 scalar."""
    return torch.tensor(len(_sequence(ctx, seq)), dtype=torch.int64)


@builtin("SplitToSequence", since=11, attrs={"axis": 0, "keepdims": 1})
def split_to_sequence(ctx, x, split=None, *, axis, keepdims):
    """SplitToSequence(input, split?) -> output_sequence."""
    axis = axis % x.ndim
    dim = x.shape[axis]
    if split is None:
        pieces = [x.select(axis, i) for i in range(dim)]
        if keepdims:
            pieces = [p.unsqueeze(axis) for p in pieces]
        return pieces
    sizes = sequences.split_sizes(ctx.static(split, "split"), dim, ctx.error)
    return list(torch.split(x, sizes, dim=axis))


@builtin("ConcatFromSequence", since=11, attrs={"axis": REQUIRED, "new_axis": 0})
def concat_from_sequence(ctx, seq, *, axis, new_axis):
    """ConcatFromSequence(input_sequence) -> concatenated (or stacked, new_axis=1) tensor."""
    seq = _sequence(ctx, seq)
    if not seq:
        raise ctx.error("cannot concatenate an empty sequence")
    rank = seq[0].ndim
    if new_axis:
        axis = axis % (rank + 1)
        seq = [np.expand_dims(s, axis) if is_numpy(s) else s.unsqueeze(axis) for s in seq]
    else:
        axis = axis % rank
    return concatenate(seq, axis)


@builtin("OptionalHasElement", since=15)
def optional_has_element(ctx, x=None):
    """OptionalHasElement(input?) -> bool scalar: whether the optional holds a value."""
    return torch.tensor(x is not None)
