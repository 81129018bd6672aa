"""String ops: StringConcat, StringNormalizer, StringSplit, RegexFullMatch.

JAX has no string arrays, so these run on numpy object arrays; the interpreter calls a
handler on numpy when all its inputs are numpy (constants, or string inputs passed in as
numpy arrays), which is the only way string data can reach them.
"""

from __future__ import annotations

import numpy as np

from xconv.converters.common import strings
from xconv.converters.jax.registry import builtin


def _strings(ctx, x, what: str = "X") -> np.ndarray:
    return strings.as_strings(x, what, ctx.error, "JAX")


@builtin("StringConcat", since=20)
def string_concat(ctx, x, y):
    """StringConcat(X, Y) -> X + Y elementwise, with broadcasting."""
    return strings.string_concat(_strings(ctx, x, "X"), _strings(ctx, y, "Y"))


@builtin(
    "StringNormalizer",
    since=10,
    attrs={"case_change_action": "NONE", "is_case_sensitive": 0, "locale": "", "stopwords": None},
)
def string_normalizer(ctx, x, *, case_change_action, is_case_sensitive, locale, stopwords):
    """StringNormalizer(X [C] or [1, C]) -> X without stop words, case changed."""
    return strings.string_normalizer(
        _strings(ctx, x),
        ctx.error,
        case_change_action=case_change_action,
        is_case_sensitive=is_case_sensitive,
        stopwords=stopwords,
    )


@builtin("StringSplit", since=20, attrs={"delimiter": "", "maxsplit": None})
def string_split(ctx, x, *, delimiter, maxsplit):
    """StringSplit(X) -> (Y: substrings padded with "" to the longest split, Z: counts)."""
    return strings.string_split(_strings(ctx, x), delimiter=delimiter, maxsplit=maxsplit)


@builtin("RegexFullMatch", since=20, attrs={"pattern": None})
def regex_full_match(ctx, x, *, pattern):
    """RegexFullMatch(X) -> bool: whether each string fully matches ``pattern`` (re2 syntax)."""
    return strings.regex_full_match(_strings(ctx, x), ctx.error, pattern=pattern)
