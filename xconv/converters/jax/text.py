"""String ops: StringConcat, StringNormalizer, StringSplit, RegexFullMatch.

JAX has no string arrays, so these run on numpy object arrays; the interpreter calls a
handler on numpy when all its inputs are numpy (constants, or string inputs passed in as
numpy arrays), which is the only way string data can reach them.
"""

from __future__ import annotations

import re

import numpy as np

from xconv.converters.jax.registry import builtin


def _strings(ctx, x, what: str = "X") -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype.kind not in "OUS":
        raise ctx.error(
            f"{what} must be a numpy string array (JAX has no strings), got "
            f"{getattr(x, 'dtype', type(x).__name__)}"
        )
    if x.dtype.kind == "S":
        return np.vectorize(lambda b: b.decode("utf-8"), otypes=[object])(x)
    return x.astype(object)


@builtin("StringConcat", since=20)
def string_concat(ctx, x, y):
    """StringConcat(X, Y) -> X + Y elementwise, with broadcasting."""
    x, y = _strings(ctx, x, "X"), _strings(ctx, y, "Y")
    return np.char.add(x.astype(np.str_), y.astype(np.str_)).astype(object)


@builtin(
    "StringNormalizer",
    since=10,
    attrs={"case_change_action": "NONE", "is_case_sensitive": 0, "locale": "", "stopwords": None},
)
def string_normalizer(ctx, x, *, case_change_action, is_case_sensitive, locale, stopwords):
    """StringNormalizer(X [C] or [1, C]) -> X without stop words, case changed."""
    x = _strings(ctx, x)
    if x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
        raise ctx.error(f"X must have shape [C] or [1, C], got {x.shape}")
    if case_change_action not in ("NONE", "LOWER", "UPPER"):
        raise ctx.error(
            f"case_change_action must be NONE, LOWER or UPPER, got {case_change_action!r}"
        )
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


@builtin("StringSplit", since=20, attrs={"delimiter": "", "maxsplit": None})
def string_split(ctx, x, *, delimiter, maxsplit):
    """StringSplit(X) -> (Y: substrings padded with "" to the longest split, Z: counts)."""
    x = _strings(ctx, x)
    sep = delimiter or None
    limit = -1 if maxsplit is None else int(maxsplit)
    parts = [str(s).split(sep, limit) for s in x.reshape(-1)]
    counts = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
    width = max((len(p) for p in parts), default=0)
    y = np.array([p + [""] * (width - len(p)) for p in parts], dtype=object)
    return y.reshape(*x.shape, width), counts


@builtin("RegexFullMatch", since=20, attrs={"pattern": None})
def regex_full_match(ctx, x, *, pattern):
    """RegexFullMatch(X) -> bool: whether each string fully matches ``pattern`` (re2 syntax)."""
    x = _strings(ctx, x)
    if pattern is None:
        raise ctx.error("the pattern attribute is required")
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ctx.error(f"invalid regular expression {pattern!r}: {e}") from e
    return np.vectorize(lambda s: regex.fullmatch(str(s)) is not None, otypes=[np.bool_])(x)
