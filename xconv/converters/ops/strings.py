"""String ops on numpy object arrays: StringConcat, StringNormalizer, StringSplit,
RegexFullMatch. Neither JAX nor torch has string arrays, so both backends run these here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

Fail = Callable[[str], Exception]


def as_strings(x, what: str, fail: Fail, framework: str) -> np.ndarray:
    """``x`` as a numpy object array of str; bytes are decoded as UTF-8."""
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "OUS":
        raise fail(
            f"{what} must be a numpy string array ({framework} has no strings), got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.dtype.kind == "S":
        return np.vectorize(lambda b: b.decode("utf-8"), otypes=[object])(x)
    return x.astype(object)


def string_concat(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """StringConcat: X + Y elementwise, with broadcasting."""
    return np.char.add(x.astype(np.str_), y.astype(np.str_)).astype(object)


def string_normalizer(
    x: np.ndarray, fail: Fail, *, case_change_action: str, is_case_sensitive: int, stopwords
) -> np.ndarray:
    """StringNormalizer(X [C] or [1, C]) -> X without stop words, case changed."""
    if x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
        raise fail(f"X must have shape [C] or [1, C], got {x.shape}")
    if case_change_action not in ("NONE", "LOWER", "UPPER"):
        raise fail(f"case_change_action must be NONE, LOWER or UPPER, got {case_change_action!r}")
    words = [str(w) for w in x.reshape(-1)]
    if stopwords:
        if is_case_sensitive:
            stops = set(stopwords)
            words = [w for w in words if w not in stops]
        else:
            stops = {s.lower() for s in stopwords}
            words = [w for w in words if w.lower() not in stops]
    if case_change_action == "LOWER":
        words = [w.lower() for w in words]
    elif case_change_action == "UPPER":
        words = [w.upper() for w in words]
    if not words:
        words = [""]
    out = np.array(words, dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out


def string_split(x: np.ndarray, *, delimiter: str, maxsplit) -> tuple[np.ndarray, np.ndarray]:
    """StringSplit(X) -> (Y: substrings padded with "" to the longest split, Z: int64 counts)."""
    sep = delimiter or None
    limit = -1 if maxsplit is None else int(maxsplit)
    parts = [str(s).split(sep, limit) for s in x.reshape(-1)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in parts), default=0)
    y = np.array([p + [""] * (width - len(p)) for p in parts], dtype=object)
    return y.reshape(*x.shape, width), counts


def regex_full_match(x: np.ndarray, fail: Fail, *, pattern) -> np.ndarray:
    """RegexFullMatch(X) -> bool array: whether each string fully matches ``pattern``."""
    if pattern is None:
        raise fail("the pattern attribute is required")
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise fail(f"invalid regular expression {pattern!r}: {e}") from e
    match = np.vectorize(lambda s: regex.fullmatch(str(s)) is not None, otypes=[np.bool_])
    return np.asarray(match(x), dtype=np.bool_)


def register_string_ops(
    builtin: Callable[..., Any], framework: str, to_backend: Callable[[np.ndarray], Any]
) -> None:
    """Register StringConcat, StringNormalizer, StringSplit and RegexFullMatch with a backend
    registry's ``builtin``. No backend has string arrays: they compute on numpy object arrays;
    ``to_backend`` turns their numeric outputs (counts, matches) into the backend's arrays."""

    def strings_of(ctx, x, what: str = "X") -> np.ndarray:
        return as_strings(x, what, ctx.error, framework)

    @builtin("StringConcat", since=20)
    def string_concat_(ctx, x, y):
        """StringConcat(X, Y) -> X + Y elementwise, with broadcasting."""
        return string_concat(strings_of(ctx, x, "X"), strings_of(ctx, y, "Y"))

    @builtin(
        "StringNormalizer",
        since=10,
        attrs={
            "case_change_action": "NONE",
            "is_case_sensitive": 0,
            "locale": "",
            "stopwords": None,
        },
    )
    def string_normalizer_(ctx, x, *, case_change_action, is_case_sensitive, locale, stopwords):
        """StringNormalizer(X [C] or [1, C]) -> X without stop words, case changed."""
        return string_normalizer(
            strings_of(ctx, x),
            ctx.error,
            case_change_action=case_change_action,
            is_case_sensitive=is_case_sensitive,
            stopwords=stopwords,
        )

    @builtin("StringSplit", since=20, attrs={"delimiter": "", "maxsplit": None})
    def string_split_(ctx, x, *, delimiter, maxsplit):
        """StringSplit(X) -> (Y: substrings padded with "" to the longest split, Z: counts)."""
        y, counts = string_split(strings_of(ctx, x), delimiter=delimiter, maxsplit=maxsplit)
        return y, to_backend(counts)

    @builtin("RegexFullMatch", since=20, attrs={"pattern": None})
    def regex_full_match_(ctx, x, *, pattern):
        """RegexFullMatch(X) -> bool: whether each string fully matches ``pattern`` (re2)."""
        return to_backend(regex_full_match(strings_of(ctx, x), ctx.error, pattern=pattern))
