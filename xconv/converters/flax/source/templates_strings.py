"""Flax source templates for the string ops: StringConcat, StringNormalizer, StringSplit and
RegexFullMatch. JAX has no string arrays: the written model computes them on numpy object
arrays with the helpers shared with the torch source (``expressions_strings``), eagerly (not
under ``jax.jit``, as ``to_jax``), a numeric output as a jax array. Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_strings as exstr
from xconv.converters.flax.source.templates import OpCall, registry, template

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
    """(parts, counts): the counts an int64 jax array."""
    return f"(lambda y, n: (y, jnp.asarray(n)))(*{exstr.string_split_call(c)})"


@template("RegexFullMatch", pattern=None)
def _regex_full_match(c: OpCall) -> str:
    return f"jnp.asarray({exstr.regex_full_match_call(c)})"
