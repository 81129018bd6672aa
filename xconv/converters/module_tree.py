"""Framework-free helpers shared by the source emitters that rebuild the source module tree
(the Flax emitter's ``flax_classes`` and the PyTorch emitter's ``source_tree``)."""

from __future__ import annotations

import re
from typing import Any


def class_attrs(text: str) -> list[str]:
    """Attributes a generated class's ``__init__``/``setup`` assigns (``self.name = ...``)."""
    return re.findall(r"^ {8}self\.(\w+) =", text, flags=re.M)


def variant_name(base: str, skeleton: str, others: list[Any]) -> str:
    """``BasicBlock`` + what this structure adds over the first group of the class.

    ``others`` are the groups already made (objects with ``name`` and ``skeleton``)."""
    if not others:
        return base
    others = [g for g in others if g.name == base] or others
    extra = [a for a in class_attrs(skeleton) if a not in set(class_attrs(others[0].skeleton))]
    stem = extra[0].split("_")[0] if extra else ""
    return base + stem[:1].upper() + stem[1:] if stem.isidentifier() else base
