"""PyTorch source templates for the string ops: StringConcat, StringNormalizer, StringSplit
and RegexFullMatch. torch has no string tensors: the written model computes them on numpy
object arrays with the helpers shared with the Flax source (``expressions_strings``), as the
torch runtime does, a numeric output as a tensor. Importing this module registers them in
``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_strings as exstr
from xconv.converters.torch.source.templates import registry, template

exstr.register(template, registry.helpers, "torch.from_numpy")
