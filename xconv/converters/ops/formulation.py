"""Which formulation the JAX runtime (``to_jax``) and the Flax emitter pick where several give
the same numbers at different speeds.

``attention``: ``"auto"`` (default) lets ``Attention`` choose per shape and backend: a fused
softmax attention over head-major ``(B, H, S, D)`` heads (3-D inputs split and transposed
to it: XLA:CPU contracts head-major heads faster, the transposes included), masks and causal
masking applied as one select, and ``jax.nn.dot_product_attention(implementation="cudnn")``
on a GPU for float16/bfloat16 inputs; anything the fast form does not cover (KV cache,
softcap, windows, scores as an output, float16/bfloat16 on CPU) keeps the ONNX reference's
step-by-step form. The Flax emitter writes the unmasked (or causal) float32 case as the
module's ``_dot_product_attention`` helper: ``jax.nn.dot_product_attention`` off the CPU,
head-major einsums on it (``benchmarks/attention_core.md``). ``"reference"`` always uses the
step-by-step form (the ``_attention_reference`` helper in Flax source).

``conv``: ``"auto"`` (default) runs some convolutions on the CPU as one matmul over their
patches (:func:`matmul_conv`): a pointwise one (1×1 kernel, no padding) over the channel axis
(a strided one reads every ``s``-th pixel first), and a 2-D one with at least
``PATCH_MIN_CHANNELS`` input channels whose patches (``N·Ho·Wo·kh·kw·C`` elements) number at
most ``PATCH_LIMIT``, over its ``kh·kw`` shifted views concatenated on the channel axis. XLA:CPU
runs ``lax.conv_general_dilated`` on a 1×1 kernel 1.3-2.2× slower than the same product as
``lax.dot_general`` and its gradient 1.6-4.8× slower (ResNet-50's 1×1 layer shapes at batch 1
and 8, float32 and bfloat16, one layer at a time); on 3×3 kernels with 64-512 input channels
and small patches the matmul's gradient is 0.4-0.9× the convolution's and its forward
0.7-1.0× (ResNet-50's 7×7 and 14×14 layers), and on a 2×2 output 0.05-0.2× for both
(XLA:CPU's convolution runs such a layer at a few GFLOP/s). Larger patches, fewer channels,
grouped or dilated kernels, other backends, and every convolution under ``"reference"`` keep
``lax.conv_general_dilated``.

``dense``: ``"auto"`` (default) has the Flax emitter give an ``nn.Dense`` whose input has 3+
axes the module's ``_flat_dot`` as its product: on the CPU, one 2-D matmul over the flattened
leading axes. XLA:CPU computes the weight gradient of ``(..., in) @ (in, out)``, a dot
contracting the leading axes, slower than that of the 2-D product: the SGD step of pre-LN MLP
blocks (the transformer benchmark's and BERT-base's widths, batch 1 and 16) takes ×0.86-0.96 of
plain ``nn.Dense``'s, the forward ×1.01-1.09 (``benchmarks/dense_layout.md``). ``to_jax`` holds
a torch ``Linear``'s ``(out, in)`` weight and contracts ``x @ w.T``, whose gradient XLA:CPU
fuses already; over few rows it computes that product weight-major, ``(w @ x.T).T``
(:func:`xconv.converters.jax.kernel.weight_major`): a float32 ``MatMul(x, Transpose(w))`` on
the CPU whose ``x`` has 2-64 rows (its leading axes flattened), or up to 128 where ``in >=
2·out``. XLA:CPU packs a product's right operand on each call: as ``x @ w.T``, the whole
weight, as ``(w @ x.T).T`` only the rows. At 2-64 rows the product took ×0.4-0.9 the time of
``x @ w.T``, forward and SGD step; at 96-128 rows it gains only where the weight is at least
twice as wide on its input side (BERT-base's FFN down-projection at batch 1, 128 rows:
×0.9); beyond 128 rows, or at 96-128 rows with a narrower input side, its forward was up to
×1.2 slower (its SGD step ×0.89-0.97: the rule follows the forward) (``benchmarks/dense_layout.md``'s
second table). One row (a decode step's matrix-vector product) contracts the stored weight
directly (:func:`xconv.converters.jax.kernel.row_product`): as ``x @ w.T`` XLA:CPU fused the
weight's transpose and a preceding norm's scale into one loop, and a Llama-shape 0.8B decode
step took 496 ms against 140 ms (``benchmarks/generate.md``). Other
backends, other dtypes, a matrix multiplied as stored, and every product under
``"reference"`` keep ``lax.dot_general`` as written.

``bf16_dot``: ``"auto"`` (default) computes a product of two bfloat16 operands on the CPU as
``jnp.einsum(..., preferred_element_type=float32)`` rounded once to bfloat16, with a custom
gradient whose two products are computed the same way
(:func:`xconv.converters.jax.kernel.bf16_einsum`). ``to_jax`` does so for ``MatMul``,
``Gemm``, a two-operand ``Einsum``, the attention reference's matmuls and a convolution run as
a patch matmul; the Flax emitter of a bfloat16 model gives every ``nn.Dense`` its ``_flat_dot``
and writes ``_torch_mha``'s projections, ``_attention``'s products and ``_matmul_conv``'s patch
product with its ``_bf16_einsum`` helper. XLA:CPU computes a bfloat16 dot with a bfloat16
result by converting its operands to float32, a float32 dot and one rounding; a dot of bfloat16
operands with a float32 result it runs on the bfloat16 operands (AVX512-BF16): the same values
(products of bfloat16 numbers are exact in float32; both accumulate in float32) in about half
the time (a 4096×768 by 768×3072 product, one thread: 68 ms against 127 ms; in float32 124 ms).
JAX's own gradient of such a dot would take the float32 cotangent of the float32 accumulator
and run its two products in float32, hence the custom one; a product contracting only the
leading axis of both operands (a weight's gradient) is given a unit axis contracted beside it,
without which XLA:CPU computes it on float32 copies (2.2× slower). BERT-base and the
transformer in bfloat16: ``benchmarks/throughput.md``. Products in float32 or float16, other
backends, matmuls broadcasting a batch axis of size 1, and every product under ``"reference"``
are JAX's own. A bfloat16 convolution not run as a patch matmul runs its forward as the float32
convolution of its operands' float32 copies, rounded once (the same values), which XLA:CPU runs
faster than the bfloat16 one (3×3, 64 channels, 32×56×56, one thread: 37 ms against 63 ms),
and its gradient as the bfloat16 convolution's, which it runs faster than the float32 one's
(``kernel.conv``; the Flax emitter gives every convolution of a bfloat16 model its
``_matmul_conv``, which falls back to its ``_bf16_conv`` helper). A patch matmul whose
ONNX-layout kernel outweighs its patches (batch 1) stacks its views and runs in float32 on the
operands' float32 copies, rounded once (``channels_last.patch_matmul``). ``to_jax``'s casts of
convolution kernels between float32 and bfloat16 are integer operations on their bits
(``kernel.to_bf16`` / ``to_f32``): XLA:CPU fuses its own cast of a kernel with the kernel's
transpose or reshape into a slow copy; other casts are XLA's, which fuse into the ops beside
them.

The environment variables ``XCONV_JAX_ATTENTION``, ``XCONV_JAX_CONV``, ``XCONV_JAX_DENSE`` and
``XCONV_JAX_BF16_DOT`` set the defaults; :func:`use` overrides them for a block (benchmarks
compare both). The choice is read when a function is traced (or when Flax source is written): a
jitted function keeps the formulation it was traced with.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np

_CHOICES = {
    "attention": ("auto", "reference"),
    "conv": ("auto", "reference"),
    "dense": ("auto", "reference"),
    "bf16_dot": ("auto", "reference"),
}
_current: dict[str, str] = {}


def _default(name: str) -> str:
    value = os.environ.get(f"XCONV_JAX_{name.upper()}", "auto").strip().lower()
    if value not in _CHOICES[name]:
        raise ValueError(f"XCONV_JAX_{name.upper()}={value!r}: expected one of {_CHOICES[name]}")
    return value


def get(name: str) -> str:
    """The formulation in force for ``name`` (``"attention"``, ``"conv"``, ``"dense"``,
    ``"bf16_dot"``)."""
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


#: Patches of at most this many elements (8 MiB in float32) run as a matmul.
PATCH_LIMIT = 1 << 21
#: ... from this many input channels on (fewer: the concatenated views cost more than the
#: convolution saves).
PATCH_MIN_CHANNELS = 64


def matmul_conv(kernel, padding, groups, dilations=(), in_channels=None, positions=None):
    """How the ``conv`` formulation runs a convolution where the backend is the CPU (the
    caller checks that, at trace time or in the code it writes): ``"pointwise"`` (a 1×1 kernel
    with no padding, as a matmul over the channel axis), ``"patches"`` (as a matmul over its
    patches) or None (``lax.conv_general_dilated``). ``padding`` holds ``(low, high)`` pairs;
    ``positions`` is ``N·Ho·Wo``, the output pixels over the batch (None where it is not
    known yet, as when Flax source is written: the generated helper decides at trace time)."""
    if get("conv") != "auto" or int(groups) != 1:
        return None
    if any(int(x) < 0 for pair in padding for x in pair):
        return None
    if set(kernel) <= {1} and all(int(x) == 0 for pair in padding for x in pair):
        return "pointwise"
    if len(kernel) != 2 or any(int(d) != 1 for d in dilations):
        return None
    if in_channels is not None and int(in_channels) < PATCH_MIN_CHANNELS:
        return None
    patch = int(np.prod(kernel)) * int(in_channels or 0)
    if positions is not None and int(positions) * patch > PATCH_LIMIT:
        return None
    return "patches"
