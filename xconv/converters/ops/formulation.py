"""Which formulation the JAX runtime (``to_jax``) and the Flax emitter pick where several give
the same numbers at different speeds.

``attention``: ``"auto"`` (default) lets ``Attention`` choose per shape and backend: a fused
softmax attention in the inputs' own layout (head-major ``(B, H, S, D)`` for 4-D inputs,
sequence-major ``(B, S, H, D)`` for 3-D ones, so no transposes are added), masks and causal
masking applied as one select, and ``jax.nn.dot_product_attention(implementation="cudnn")``
on a GPU for float16/bfloat16 inputs; anything the fast form does not cover (KV cache,
softcap, windows, scores as an output, float16/bfloat16 on CPU) keeps the ONNX reference's
step-by-step form. ``"reference"`` always uses the step-by-step form.

``conv``: ``"auto"`` (default) runs a pointwise convolution (1×1 kernel, no padding, one
group) on the CPU as a matmul over the channel axis (a strided one reads every ``s``-th
pixel first): XLA:CPU runs ``lax.conv_general_dilated`` on such a kernel 1.3-2.2× slower
than the same product as ``lax.dot_general``, and its gradient 1.6-4.8× slower (ResNet-50's
1×1 layer shapes at batch 1 and 8, float32 and bfloat16, timed one layer at a time; the
throughput table has not been rerun with it). Other backends, and every other kernel, keep
``lax.conv_general_dilated``; ``"reference"`` always does (:func:`pointwise_conv`).

The environment variables ``XCONV_JAX_ATTENTION`` and ``XCONV_JAX_CONV`` set the defaults;
:func:`use` overrides them for a block (benchmarks compare both). The choice is read when a
function is traced (or when Flax source is written): a jitted function keeps the
formulation it was traced with.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_CHOICES = {"attention": ("auto", "reference"), "conv": ("auto", "reference")}
_current: dict[str, str] = {}


def _default(name: str) -> str:
    value = os.environ.get(f"XCONV_JAX_{name.upper()}", "auto").strip().lower()
    if value not in _CHOICES[name]:
        raise ValueError(f"XCONV_JAX_{name.upper()}={value!r}: expected one of {_CHOICES[name]}")
    return value


def get(name: str) -> str:
    """The formulation in force for ``name`` (``"attention"``, ``"conv"``)."""
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


def pointwise_conv(kernel, padding, groups) -> bool:
    """Whether the ``conv`` formulation runs a convolution of this ``kernel`` shape,
    ``(low, high)`` ``padding`` pairs and ``groups`` as a matmul (where the backend is the
    CPU: the caller checks that, at trace time or in the code it writes)."""
    return (
        get("conv") == "auto"
        and set(kernel) <= {1}
        and int(groups) == 1
        and all(int(x) == 0 for pair in padding for x in pair)
    )
