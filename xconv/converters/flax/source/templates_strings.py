"""Flax source templates for the string ops: StringConcat, StringNormalizer, StringSplit and
RegexFullMatch. JAX has no string arrays: the written model computes them on numpy object
arrays with the helpers shared with the torch source (``expressions_strings``), eagerly (not
under ``jax.jit``, as ``to_jax``), a numeric output as a jax array. Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_strings as exstr
from xconv.converters.flax.source.templates import registry, template

exstr.register(template, registry.helpers, "jnp.asarray")
