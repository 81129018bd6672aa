"""Which formulation the JAX runtime (``to_jax``) and the Flax emitter pick where several give
the same numbers at different speeds.

``attention``: ``"auto"`` (default) lets ``Attention`` choose per shape and backend: a fused
softmax attention in the inputs' own layout (head-major ``(B, H, S, D)`` for 4-D inputs,
sequence-major ``(B, S, H, D)`` for 3-D ones, so no transposes are added), masks and causal
masking applied as one select, and ``jax.nn.dot_product_attention(implementation="cudnn")``
on a GPU for float16/bfloat16 inputs; anything the fast form does not cover (KV cache,
softcap, windows, scores as an output, float16/bfloat16 on CPU) keeps the ONNX reference's
step-by-step form. ``"reference"`` always uses the step-by-step form.

The environment variable ``XCONV_JAX_ATTENTION`` sets the default;
:func:`use` overrides them for a block (benchmarks compare both). The choice is read when a
function is traced (or when Flax source is written): a jitted function keeps the
formulation it was traced with.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_CHOICES = {"attention": ("auto", "reference")}
_current: dict[str, str] = {}


def _default(name: str) -> str:
    value = os.environ.get(f"XCONV_JAX_{name.upper()}", "auto").strip().lower()
    if value not in _CHOICES[name]:
        raise ValueError(f"XCONV_JAX_{name.upper()}={value!r}: expected one of {_CHOICES[name]}")
    return value


def get(name: str) -> str:
    """The formulation in force for ``name`` (``"attention"``)."""
    return _current.get(name) or _default(name)


@contextlib.contextmanager
def use(**choices: str) -> Iterator[None]:
    """``with use(attention="reference"): ...`` for the block."""
    for name, value in choices.items():
        if name not in _CHOICES or value not in _CHOICES[name]:
            raise ValueError(f"{name}={value!r}: expected one of {_CHOICES.get(name)}")
    saved = dict(_current)
    _current.update(choices)
    try:
        yield
    finally:
        _current.clear()
        _current.update(saved)
