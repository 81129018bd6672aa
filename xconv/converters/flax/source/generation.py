"""The generation section of model.py for a causal LM converted with ``generate=True``.

The section's code is :mod:`.generate_common` followed by the API's part,
:mod:`.generate_linen` or :mod:`.generate_nnx`, each read as text below its ``# model.py:``
marker (importing them would import JAX), with the constants set from the conversion's
description (``xconv.generate``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_HERE = Path(__file__).parent
_MARKER = "# model.py:\n"


def _part(name: str) -> str:
    return (_HERE / f"generate_{name}.py").read_text().split(_MARKER, 1)[1].strip("\n")


def section(metadata: dict[str, str], api: str) -> str | None:
    """The section's source for a model whose IR carries ``xconv.generate``, else ``None``."""
    raw = metadata.get("xconv.generate")
    if not raw:
        return None
    spec = json.loads(raw)
    layout = tuple(
        ((e["key_heads"], e["key_dim"]), (e["value_heads"], e["value_dim"])) for e in spec["layers"]
    )
    text = _part("common") + "\n\n\n" + _part(api)
    values = {
        "CACHE_LAYOUT": repr(layout),
        "MAX_LENGTH": repr(spec.get("max_length")),
        "EOS_TOKEN_ID": repr(spec.get("eos_token_id")),
        "PAD_TOKEN_ID": repr(spec.get("pad_token_id")),
    }
    for name, value in values.items():
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", text, count=1, flags=re.M)
        assert n == 1, name
    if spec.get("dtype") not in (None, "float32"):
        text = text.replace("dtype=jnp.float32", f"dtype=jnp.{spec['dtype']}")
    return text
