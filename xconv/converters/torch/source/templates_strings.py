"""PyTorch source templates for the string ops: StringConcat, StringNormalizer, StringSplit
and RegexFullMatch. torch has no string tensors: the written model computes them on numpy
object arrays with the helpers shared with the Flax source (``expressions_strings``), as the
torch runtime does, a numeric output as a tensor. Importing this module registers them in
``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_strings as exstr
from xconv.converters.torch.source.templates import OpCall, registry, template

registry.helpers.update(exstr.HELPERS)


@template("StringConcat")
def _string_concat(c: OpCall) -> str:
    return exstr.string_concat_call(c)


@template(
    "StringNormalizer",
    case_change_action="NONE",
    is_case_sensitive=0,
    locale="",
    stopwords=None,
)
def _string_normalizer(c: OpCall) -> str:
    return exstr.string_normalizer_call(c)


@template("StringSplit", delimiter="", maxsplit=None)
def _string_split(c: OpCall) -> str:
    """(parts, counts): the counts an int64 tensor."""
    return f"(lambda y, n: (y, torch.from_numpy(n)))(*{exstr.string_split_call(c)})"


@template("RegexFullMatch", pattern=None)
def _regex_full_match(c: OpCall) -> str:
    return f"torch.from_numpy({exstr.regex_full_match_call(c)})"
