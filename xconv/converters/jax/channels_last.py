"""Channels-last execution for :func:`~xconv.converters.jax.interpreter.to_jax`.

The IR is channels-first (ONNX's ``N, C, spatial``); XLA's convolutions and the channel
broadcasts of batch norm run fastest channels-last. XLA's layout assignment recovers that
layout for a forward pass, but not for its gradient: a ResNet-50 training step traced
channels-first compiled to 260 transpose fusions around the convolutions' gradients. So the
interpreter holds activations physically channels-last from the first convolution on, the
way the Flax emitter writes its modules (:mod:`xconv.converters.ops.layout`):

* ``Conv`` reads its input channels-last and writes channels-last (its dimension numbers say
  so), and reads its kernel as stored: a weight of ``JaxFunction.kernel_perms`` is held in its
  stored permutation like an activation, so neither the forward pass nor the kernel's
  gradient transposes it (a ResNet-50 training step: 16 transposes and copies fewer); on
  the CPU a 1×1 kernel runs as a matmul over the channel axis (:func:`pointwise_matmul`)
  and a small 2-D one as a matmul over its patches (:func:`patch_matmul`), the ``conv``
  formulation of :mod:`xconv.converters.ops.formulation`;
* inference ``BatchNormalization`` and the elementwise ops keep the layout, their
  lower-rank operands (biases, per-channel constants) broadcast as the IR broadcasts them;
* pooling runs channels-last (the JAX pooling moves C last itself, so the transposes cancel);
  ``GlobalAveragePool`` / ``GlobalMaxPool`` reduce the spatial axes where they are;
* every other op, a graph output and a captured intermediate see the IR's layout: one
  transpose where the layout truly changes.

A value's physical array is ``source.transpose(perm)`` (``ChannelsLast.held``), as in
:mod:`xconv.converters.ops.layout`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
from jax import lax

from xconv.converters.jax.kernel import KERNEL, bf16_dots, bf16_einsum, to_f32
from xconv.converters.jax.kernel import conv as kernel_conv
from xconv.converters.ops import formulation, shapes
from xconv.converters.ops.arrays import is_static
from xconv.converters.ops.layout import channels_last, conversion
from xconv.converters.ops.normalization import apply_batch_norm
from xconv.converters.ops.reduce import mean
from xconv.ir.passes.layout import ELEMENTWISE

#: Ops whose JAX handler moves the channels last itself: called on the IR layout, their
#: outputs put back channels-last, and XLA cancels the transposes.
POOLS = frozenset({"MaxPool", "AveragePool", "LpPool"})
#: Ops with a channels-last implementation here.
NATIVE = frozenset({"Conv", "BatchNormalization", "GlobalAveragePool", "GlobalMaxPool"})

Perm = tuple[int, ...]


def _rank(a: Any) -> int:
    return len(getattr(a, "shape", ()))


def to_layout(a: Any, src: Perm | None, dst: Perm | None) -> Any:
    """``a`` (held in ``src``) in layout ``dst``."""
    if src == dst or a is None:
        return a
    return jnp.transpose(a, conversion(src, dst, _rank(a)))


def _broadcast_operand(a: Any, rank: int, perm: Perm) -> Any:
    """A lower-rank operand of an elementwise op (numpy broadcasting against the IR layout)
    made to broadcast against a channels-last operand of ``rank``."""
    r = _rank(a)
    if r == 0:
        return a
    xp = np if isinstance(a, np.ndarray | np.generic) else jnp
    full = xp.reshape(a, (1,) * (rank - r) + tuple(a.shape))
    return xp.transpose(full, perm)


class ChannelsLast:
    """The layout state of one run: which values are held channels-last."""

    def __init__(self) -> None:
        self.held: dict[ir.Value, Perm] = {}

    def perm_of(self, value: ir.Value | None) -> Perm | None:
        return None if value is None else self.held.get(value)

    def prepare(self, node: ir.Node, args: list[Any]) -> tuple[list[Any], Perm | None]:
        """The node's operands for the layout it will run in, and that layout (None: the
        IR's)."""
        op = node.op_type if node.domain in ("", "ai.onnx") else None
        perms = [self.perm_of(v) for v in node.inputs]
        first = next((p for p in perms if p is not None), None)
        x = args[0] if args else None
        if op == "Conv" and _rank(x) >= 3 and not is_static(x):
            perm = channels_last(_rank(x))
            # the kernel as held (native reads its layout); the bias in the IR's
            rest = [args[1], *self._source(args[2:], perms[2:])]
            return [to_layout(x, perms[0], perm), *rest], perm
        if first is None:
            return args, None
        # elementwise handlers are layout-free: run on the held operands as they are
        if op in ELEMENTWISE and _keeps(node, args, perms, first):
            rank = len(first)
            out = []
            for a, p in zip(args, perms, strict=False):
                if a is None or p is not None:
                    out.append(to_layout(a, p, first))
                elif _rank(a) == rank:
                    out.append(to_layout(a, None, first))
                else:
                    out.append(_broadcast_operand(a, rank, first))
            return out, first
        if op == "BatchNormalization" and perms[0] is not None and _inference(node):
            return [args[0], *self._source(args[1:], perms[1:])], perms[0]
        if op in POOLS | {"GlobalAveragePool", "GlobalMaxPool"} and perms[0] is not None:
            # pooling: the handler's own channels-last moves cancel these
            keep = op not in POOLS
            first_arg = args[0] if keep else to_layout(args[0], perms[0], None)
            return [first_arg, *self._source(args[1:], perms[1:])], perms[0]
        return self._source(args, perms), None

    def sources(self, node: ir.Node, args: list[Any]) -> list[Any]:
        """The node's operands in the IR's layout (a node folded at trace time: a held
        kernel given as a numpy param)."""
        return self._source(args, [self.perm_of(v) for v in node.inputs])

    def _source(self, args: list[Any], perms: list[Perm | None]) -> list[Any]:
        return [to_layout(a, p, None) for a, p in zip(args, perms, strict=False)]

    def native(self, node: ir.Node, args: list[Any], attrs: dict[str, Any], perm: Perm):
        """The channels-last implementation of ``node`` (None: run the handler)."""
        op = node.op_type
        if op == "Conv":
            return (_conv(node, *args, kernel_perm=self.perm_of(node.inputs[1]), **attrs),)
        if op == "BatchNormalization":
            return (apply_batch_norm(KERNEL, jnp, *args, attrs["epsilon"], axis=-1),)
        if op == "GlobalAveragePool":
            return (mean(jnp, args[0], tuple(range(1, len(perm) - 1)), True),)
        if op == "GlobalMaxPool":
            return (jnp.max(args[0], axis=tuple(range(1, len(perm) - 1)), keepdims=True),)
        return None

    def finish(self, node: ir.Node, outputs: tuple[Any, ...], perm: Perm | None) -> tuple:
        """Record which outputs are held in ``perm``; returns the outputs as held."""
        if perm is None:
            return outputs
        out = list(outputs)
        if node.op_type in POOLS:  # computed on the IR layout: Y back channels-last
            out[0] = to_layout(out[0], None, perm)
        value = node.outputs[0] if node.outputs else None
        if value is not None and _rank(out[0]) == len(perm):
            self.held[value] = perm
        else:  # not the rank it was held at: back to the IR's layout
            out[0] = to_layout(out[0], perm, None)
        return tuple(out)

    def source(self, value: ir.Value | None, a: Any) -> Any:
        """``a`` (the value as held) in the IR's layout."""
        return to_layout(a, self.perm_of(value), None)


def _keeps(node: ir.Node, args: list[Any], perms: list[Perm | None], first: Perm) -> bool:
    """Whether an elementwise node can run on ``first``-held operands: one output, every
    operand at most the held rank, and no other channels-last layout among them."""
    if len(node.outputs) != 1:
        return False
    rank = len(first)
    return all(
        (p is None or p == first) and _rank(a) <= rank
        for a, p in zip(args, perms, strict=False)
        if a is not None
    )


def _inference(node: ir.Node) -> bool:
    """A BatchNormalization that normalises with its inputs' statistics (one output)."""
    outputs = [v for v in node.outputs if v.name]
    mode = node.attributes.get("training_mode")
    return len(outputs) == 1 and not (mode is not None and mode.value)


def _conv(
    node, x, w, b=None, *, kernel_perm, auto_pad, dilations, group, kernel_shape, pads, strides
):
    """ONNX Conv on a channels-last ``x`` (``N, *spatial, C``), writing channels-last; the
    kernel ``w`` is held in ``kernel_perm`` (None: the IR's ``(O, I, *k)``)."""
    n = x.ndim - 2
    # where the kernel's O, I and spatial axes are as held
    rhs = (
        tuple(range(n + 2))
        if kernel_perm is None
        else tuple(int(i) for i in np.argsort(kernel_perm))
    )
    kernel = tuple(w.shape[i] for i in rhs[2:])
    s, d = shapes.ints(strides, n, 1), shapes.ints(dilations, n, 1)
    padding = shapes.conv_padding(node, auto_pad, tuple(x.shape[1:-1]), kernel, s, d, pads)
    w = jnp.asarray(w).astype(x.dtype)
    how = None
    if jax.default_backend() == "cpu":
        out = shapes.conv_output(x.shape[1:-1], padding, kernel, s, d)
        positions = int(x.shape[0]) * int(np.prod(out))
        how = formulation.matmul_conv(kernel, padding, group, d, x.shape[-1], positions)
    if how is not None:
        y = patch_matmul(x, w, s, padding, out_axis=rhs[0], in_axis=rhs[1])
    else:
        last = (0, n + 1, *range(1, n + 1))
        dn = lax.ConvDimensionNumbers(lhs_spec=last, rhs_spec=rhs, out_spec=last)
        y = kernel_conv(
            x,
            w,
            tuple(s),
            padding,
            rhs_dilation=tuple(d),
            dimension_numbers=dn,
            feature_group_count=int(group),
        )
    return y if b is None else y + jnp.asarray(b).astype(y.dtype)


#: A kernel held (O, I, *k) stays so where it holds this many times its patches' elements.
STACK_RATIO = 2


def patch_matmul(x, w, strides, padding, *, out_axis: int, in_axis: int):
    """A convolution of a channels-last ``x`` as one matmul over its patches: the ``kh·kw``
    (strided) shifted views of the padded input (one view for a 1×1 kernel), times the kernel
    ``w`` flattened over its ``I`` and spatial axes (the same products as
    ``lax.conv_general_dilated``; see :func:`xconv.converters.ops.formulation.matmul_conv`
    for where XLA:CPU runs it faster). ``w``'s O and I axes are ``out_axis`` / ``in_axis``.

    A kernel held ``(*k, I, O)`` (HWIO) is only reshaped, the views concatenated on the
    channel axis. One held ``(O, I, *k)`` (ONNX's) is too where it outweighs its patches
    ``STACK_RATIO``-fold, the views then stacked after the channel axis (I-major, as the
    kernel); otherwise it is transposed to HWIO, as is a kernel held any other way. XLA:CPU
    transposes a kernel at a few GB/s and interleaves stacked views slowly, so each pays
    where the other is the larger (a 3×3 kernel, float32, batch 1: on 7×7×512 inputs the
    transpose took 61 % of the forward pass's time, on 56×56×64 the stacking 65 %). XLA:CPU
    stacks bfloat16 views slower still, so a bfloat16 product that stacks runs in float32 on
    the operands' float32 copies, rounded once: the same values (products of bfloat16
    numbers are exact in float32, and both accumulate in float32), and its gradient that of
    the casts and a float32 product (on 7×7×512 inputs, batch 1, one thread: 2.4 ms against
    5.3 ms transposing the kernel, the gradient 5.7 ms against 15.3 ms)."""
    n = x.ndim - 2
    spatial = [a for a in range(w.ndim) if a not in (out_axis, in_axis)]
    kernel = tuple(w.shape[a] for a in spatial)
    out = shapes.conv_output(x.shape[1:-1], padding, kernel, strides)
    patch_size = int(x.shape[0]) * int(np.prod(out)) * int(np.prod(kernel)) * int(x.shape[-1])
    onnx = (out_axis, in_axis) == (0, 1) and spatial == list(range(2, n + 2))
    low = bf16_dots(x, w)
    stackable = (x.dtype == jnp.float32 or low) and w.size >= STACK_RATIO * patch_size
    f32_products = False
    if onnx and (stackable or set(kernel) <= {1}):
        stack, w2, w_axis = True, w.reshape(w.shape[0], -1), 1  # (O, I·kh·kw)
        if low and stackable and not set(kernel) <= {1}:
            f32_products = True
            x, w2 = x.astype(jnp.float32), to_f32(w2)
    else:
        if (in_axis, out_axis) != (n, n + 1) or spatial != list(range(n)):
            w = jnp.transpose(w, (*spatial, in_axis, out_axis))
        stack, w2, w_axis = False, w.reshape(-1, w.shape[-1]), 0  # (kh·kw·I, O)
    pads = ((0, 0, 0), *((int(lo), int(hi), 0) for lo, hi in padding), (0, 0, 0))
    if any(p for pair in pads for p in pair):
        x = lax.pad(x, jnp.zeros((), x.dtype), pads)
    strides = tuple(int(st) for st in strides)
    views = []
    for offset in np.ndindex(*kernel):
        end = (o + (m - 1) * st + 1 for o, m, st in zip(offset, out, strides, strict=True))
        views.append(
            lax.slice(x, (0, *offset, 0), (x.shape[0], *end, x.shape[-1]), (1, *strides, 1))
        )
    if len(views) == 1:
        patches = views[0]
    elif stack:  # (..., I, kh·kw) flattened: I-major, as the (O, I, *k) kernel
        patches = jnp.stack(views, axis=-1).reshape(*views[0].shape[:-1], -1)
    else:  # (..., kh·kw, I): offset-major, as the (*k, I, O) kernel
        patches = jnp.concatenate(views, axis=-1)
    if bf16_dots(patches, w2):
        rows = "abcdefgh"[: patches.ndim - 1]
        return bf16_einsum(f"{rows}k,{'nk' if w_axis else 'kn'}->{rows}n", patches, w2)
    y = lax.dot_general(patches, w2, (((patches.ndim - 1,), (w_axis,)), ((), ())))
    return y.astype(jnp.bfloat16) if f32_products else y
