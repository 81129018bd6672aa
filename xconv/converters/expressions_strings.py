"""The string ops (StringConcat, StringNormalizer, StringSplit, RegexFullMatch) as both source
emitters write them: numpy helper text on object arrays of ``str`` (neither JAX nor torch has
string arrays), computed as ``ops/strings`` computes them for the runtimes, and the calls of
those helpers, registered by each emitter (``templates_strings``: :func:`register`). The
attributes are checked when writing, so the written helpers take only valid ones. A numeric
output (StringSplit's counts, RegexFullMatch's matches) becomes the framework's array.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from xconv.converters.codegen import TemplateCall

STRINGS = '''
def _strings(x):
    """``x`` as a numpy object array of str, bytes decoded as UTF-8."""
    x = np.asarray(x)
    if x.dtype.kind == "S":
        return np.vectorize(lambda b: b.decode("utf-8"), otypes=[object])(x)
    return x.astype(object)
'''

STRING_CONCAT = '''
def _string_concat(x, y):
    """ONNX StringConcat: x + y elementwise, with broadcasting."""
    return np.char.add(_strings(x).astype(np.str_), _strings(y).astype(np.str_)).astype(object)
'''

STRING_NORMALIZER = '''
def _string_normalizer(x, case="NONE", case_sensitive=False, stopwords=()):
    """ONNX StringNormalizer of x ([C] or [1, C]): its words without the stop words
    (compared case-insensitively unless ``case_sensitive``), then lower- or upper-cased by
    ``case``; [""] where no word is left."""
    x = _strings(x)
    words = [str(w) for w in x.reshape(-1)]
    if case_sensitive:
        words = [w for w in words if w not in set(stopwords)]
    else:
        stops = {s.lower() for s in stopwords}
        words = [w for w in words if w.lower() not in stops]
    if case == "LOWER":
        words = [w.lower() for w in words]
    elif case == "UPPER":
        words = [w.upper() for w in words]
    out = np.array(words or [""], dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out
'''

STRING_SPLIT = '''
def _string_split(x, delimiter=None, maxsplit=-1):
    """ONNX StringSplit: each string's parts (split at ``delimiter``, at runs of whitespace
    when None, at most ``maxsplit`` times unless -1), padded with "" to the most parts of
    any, and the int64 number of parts of each."""
    x = _strings(x)
    parts = [str(s).split(delimiter, maxsplit) for s in x.reshape(-1)]
    width = max((len(p) for p in parts), default=0)
    y = np.empty((len(parts), width), dtype=object)
    for i, p in enumerate(parts):
        y[i] = p + [""] * (width - len(p))
    counts = np.array([len(p) for p in parts], dtype=np.int64)
    return y.reshape(*x.shape, width), counts.reshape(x.shape)
'''

REGEX_FULL_MATCH = '''
def _regex_full_match(x, pattern):
    """ONNX RegexFullMatch: whether each string matches ``pattern`` as a whole."""
    regex = re.compile(pattern)
    return np.vectorize(lambda s: regex.fullmatch(str(s)) is not None, otypes=[bool])(_strings(x))
'''

#: registry.helpers name -> text, each emitter registering all of them.
HELPERS = {
    "strings": STRINGS,
    "string_concat": STRING_CONCAT,
    "string_normalizer": STRING_NORMALIZER,
    "string_split": STRING_SPLIT,
    "regex_full_match": REGEX_FULL_MATCH,
}


def _use(c: TemplateCall, name: str) -> None:
    c.helpers |= {"strings", name}


def string_concat_call(c: TemplateCall) -> str:
    _use(c, "string_concat")
    return f"_string_concat({c.args[0]}, {c.args[1]})"


def string_normalizer_call(c: TemplateCall) -> str:
    """``_string_normalizer(x, ...)``; a case_change_action other than NONE / LOWER / UPPER
    is refused when writing."""
    _use(c, "string_normalizer")
    case = c.attrs["case_change_action"]
    if case not in ("NONE", "LOWER", "UPPER"):
        raise c.fail(f"case_change_action={case!r}; expected NONE, LOWER or UPPER")
    shape = c.shapes[0]
    if shape is not None and (len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] != 1)):
        raise c.fail(f"X of shape {list(shape)}; StringNormalizer takes [C] or [1, C]")
    args = [c.args[0]]
    if case != "NONE":
        args.append(f'case="{case}"')
    if c.attrs["is_case_sensitive"]:
        args.append("case_sensitive=True")
    if c.attrs["stopwords"]:
        args.append(f"stopwords={tuple(str(s) for s in c.attrs['stopwords'])!r}")
    return f"_string_normalizer({', '.join(args)})"


def string_split_call(c: TemplateCall) -> str:
    """``_string_split(x, ...)``: (parts, counts), the counts a numpy int64 array."""
    _use(c, "string_split")
    args = [c.args[0]]
    if c.attrs["delimiter"]:
        args.append(f"delimiter={str(c.attrs['delimiter'])!r}")
    if c.attrs["maxsplit"] is not None:
        args.append(f"maxsplit={int(c.attrs['maxsplit'])}")
    return f"_string_split({', '.join(args)})"


def regex_full_match_call(c: TemplateCall) -> str:
    """``_regex_full_match(x, pattern)``, the pattern compiled when writing to check it."""
    _use(c, "regex_full_match")
    pattern = c.attrs["pattern"]
    if pattern is None:
        raise c.fail("RegexFullMatch needs its pattern attribute")
    try:
        re.compile(pattern)
    except re.error as e:
        raise c.fail(f"pattern {pattern!r} is not a valid regular expression: {e}") from e
    return f"_regex_full_match({c.args[0]}, {str(pattern)!r})"


def register(template: Callable[..., Any], helpers: dict[str, str], array: str) -> None:
    """Register the four templates with an emitter's ``template`` decorator and its helper
    texts with ``helpers``; ``array`` names the call that makes a numpy result the
    framework's array (``jnp.asarray``, ``torch.from_numpy``)."""
    helpers.update(HELPERS)
    template("StringConcat")(string_concat_call)
    template(
        "StringNormalizer",
        case_change_action="NONE",
        is_case_sensitive=0,
        locale="",
        stopwords=None,
    )(string_normalizer_call)

    @template("StringSplit", delimiter="", maxsplit=None)
    def _string_split(c: TemplateCall) -> str:
        """(parts, counts): the counts an int64 array of the framework."""
        return f"(lambda y, n: (y, {array}(n)))(*{string_split_call(c)})"

    @template("RegexFullMatch", pattern=None)
    def _regex_full_match(c: TemplateCall) -> str:
        return f"{array}({regex_full_match_call(c)})"
