"""Sequence ops on Python lists: an ONNX sequence is a list of arrays in every backend.

``static`` turns a position input into a numpy array (a backend passes ``ctx.static``);
``fail`` turns a message into the exception to raise (``ctx.error``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
