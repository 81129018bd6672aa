"""The generation section of model.py for a causal LM converted with ``generate=True``.

The section's code is :mod:`.generate_linen`, read as text (importing it would import JAX),
with its constants set from the conversion's description (``xconv.generate``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from xconv.errors import UsageError

_TEMPLATE = Path(__file__).with_name("generate_linen.py")
_MARKER = "# model.py:\n"


def section(metadata: dict[str, str], api: str) -> str | None:
    """The section's source for a model whose IR carries ``xconv.generate``, else ``None``."""
    raw = metadata.get("xconv.generate")
    if not raw:
        return None
    if api != "linen":
        raise UsageError(
            "generate=True writes a linen model.py; nnx is not written yet. Next step: "
            "convert with api='linen'"
        )
    spec = json.loads(raw)
    layout = tuple(
        ((e["key_heads"], e["key_dim"]), (e["value_heads"], e["value_dim"])) for e in spec["layers"]
    )
    text = _TEMPLATE.read_text().split(_MARKER, 1)[1]
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
    return text.strip("\n")
