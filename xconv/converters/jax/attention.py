"""The JAX kernel of the attention family (written once in :mod:`xconv.converters.ops.attention`)
and its fused formulation.

Where :mod:`xconv.converters.ops.formulation` allows (``"auto"``), ``Attention`` runs a fused
softmax attention in the inputs' own layout (:func:`_fast_attention`; cuDNN's
``jax.nn.dot_product_attention`` on a GPU for float16/bfloat16) instead of the reference's
step-by-step form; ``LinearAttention``'s recurrence runs under ``lax.scan``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
from jax import lax

from xconv.converters.jax.kernel import matmul, reference_sum
from xconv.converters.jax.registry import builtin
from xconv.converters.ops import attention as ops_attention
from xconv.converters.ops import formulation
from xconv.converters.ops.attention import AttentionOptions, register_attention_ops

_NEG_INF = -np.inf


# ------------------------------------------------------------------ the fast formulation


def _fast_applies(ctx, q, past_key, nonpad, opts: AttentionOptions) -> bool:
    """Whether the fused formulation computes this node: no KV cache, padding lengths,
    softcap or windows, nothing reads the present key/value or the scores, and the softmax
    runs in the inputs' dtype, one whose softmax the fused form rounds as the reference does
    (float32/float64; float16 and bfloat16 only on a GPU, through cuDNN). Under
    ``dtype="bfloat16"`` (a float32 softmax) the reference's form runs on the CPU: a fused
    form with float32 scores measured 0.8-1.1x its time on the transformer benchmark."""
    if formulation.get("attention") != "auto":
        return False
    if past_key is not None or nonpad is not None or opts.softcap > 0:
        return False
    if opts.left_window_size >= 0 or opts.right_window_size >= 0:
        return False
    if any(o.uses() or o.is_graph_output() for o in ctx.output_values[1:] if o is not None):
        return False
    precision = opts.softmax_precision
    if precision is not None and ir.DataType(precision).numpy() != q.dtype:
        return False
    return q.dtype in (jnp.float32, jnp.float64) or _cudnn_backend()


def _cudnn_backend() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def _fast_attention(ctx, q, k, v, attn_mask, opts: AttentionOptions):
    """Scaled dot-product attention over head-major ``(B, H, S, D)`` heads, one select for
    every mask.

    4-D inputs are head-major already; 3-D ones are split into ``(B, S, H, D)`` and
    transposed: XLA:CPU contracts head-major heads faster than sequence-major ones, the
    transposes included (``benchmarks/attention_layout.md``). The scores are scaled once
    (not ``sqrt(scale)`` on both ``Q`` and ``K``); the causal frontier and a boolean mask are
    one ``where`` with the lowest finite value, a float mask is added (its ``-inf`` clamped to
    that value) and a query row nothing may attend gives zeros, as in the reference. Returns
    None when the shapes are not ones it handles.
    """
    rank, dtype = q.ndim, q.dtype
    if rank == 3:
        b = q.shape[0]
        q = q.reshape(b, q.shape[1], opts.q_num_heads, -1).swapaxes(1, 2)
        k = k.reshape(b, k.shape[1], opts.kv_num_heads, -1).swapaxes(1, 2)
        v = v.reshape(b, v.shape[1], opts.kv_num_heads, -1).swapaxes(1, 2)
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads and q_heads % kv_heads:
        raise ctx.error(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    q_len, kv_len = q.shape[2], k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if opts.scale is None else opts.scale

    mask = bias = None
    if _masks_nothing(attn_mask, kv_len):
        attn_mask = None
    if attn_mask is not None:
        attn_mask = attn_mask if isinstance(attn_mask, np.ndarray) else jnp.asarray(attn_mask)
        if attn_mask.ndim > 4 or attn_mask.shape[-1] > kv_len:
            return None
        mask, bias = _mask_or_bias(attn_mask, kv_len, dtype)
    causal = None
    if opts.is_causal:
        causal = ops_attention.frontier(KERNEL, q_len, kv_len, 0, q) >= 0

    y = None
    if (
        _cudnn_backend()
        and dtype in (jnp.float16, jnp.bfloat16)
        and mask is None
        and bias is None
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 128
    ):
        y = _cudnn_attention(q, k, v, scale, opts.is_causal)
    if y is None:
        if dtype not in (jnp.float32, jnp.float64):
            return None  # cuDNN rejected a float16/bfloat16 call: the reference rounds it
        if q_heads != kv_heads:
            k = jnp.repeat(k, q_heads // kv_heads, axis=1)
            v = jnp.repeat(v, q_heads // kv_heads, axis=1)
        # The scale multiplies the scores, not Q: with Q pre-scaled the transformer row of
        # benchmarks/bench_attention_layout.py ran 2x slower at batch 1 on CPU (an
        # elementwise producer fused into the dot's operand is the likely cause).
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        probs = _masked_softmax(scores * jnp.asarray(scale, dtype), mask, bias, causal, dtype)
        y = jnp.einsum("bhqk,bhkd->bhqd", probs, v)
    if rank == 3:
        return y.swapaxes(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return y


def _masks_nothing(attn_mask, kv_len: int) -> bool:
    """A static mask over every key, all True (boolean) or all 0 (float): no mask (how
    exporters write the mask of an input without padding)."""
    if not isinstance(attn_mask, np.ndarray) or not attn_mask.size or attn_mask.ndim == 0:
        return False
    if attn_mask.shape[-1] != kv_len:
        return False
    return bool(attn_mask.all()) if attn_mask.dtype == np.bool_ else not attn_mask.any()


def _mask_or_bias(attn_mask, kv_len: int, dtype):
    """``(mask, bias)``: a boolean mask (padded with False to ``kv_len`` keys) or a float
    bias in ``dtype`` (padded with -inf); the other is None."""
    pad = kv_len - attn_mask.shape[-1]
    if attn_mask.dtype == np.bool_:
        if pad:
            widths = [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)]
            attn_mask = jnp.pad(attn_mask, widths, constant_values=False)
        return attn_mask, None
    if pad:
        widths = [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)]
        attn_mask = jnp.pad(attn_mask, widths, constant_values=_NEG_INF)
    return None, attn_mask.astype(dtype)


def _cudnn_attention(q, k, v, scale, is_causal):
    """cuDNN's fused attention on head-major heads, or None where cuDNN rejects the shapes
    or dtypes (the XLA form runs instead)."""
    try:
        y = jax.nn.dot_product_attention(
            *(jnp.swapaxes(t, 1, 2) for t in (q, k, v)),
            scale=float(scale),
            is_causal=bool(is_causal),
            implementation="cudnn",
        )
    except Exception:  # noqa: BLE001 - shapes/dtypes cuDNN rejects: the XLA form below
        return None
    return jnp.swapaxes(y, 1, 2)


def _masked_softmax(scores, mask, bias, causal, dtype):
    """Softmax over keys after the bias, the boolean mask and the causal frontier (one
    ``where`` with the dtype's lowest finite value); a query row nothing may attend gives
    zeros."""
    lowest = jnp.asarray(np.finfo(dtype).min, dtype)
    empty = None  # query rows nothing may attend (their output is zero)
    if bias is not None:
        scores = scores + jnp.maximum(bias, lowest)
        dead = jnp.isneginf(bias)
        if causal is not None:
            dead = dead | ~causal
        empty = jnp.all(dead, axis=-1, keepdims=True)
    allowed = causal
    if mask is not None:
        allowed = mask if allowed is None else mask & allowed
        none_left = ~jnp.any(allowed, axis=-1, keepdims=True)
        empty = none_left if empty is None else empty | none_left
    if allowed is not None:
        scores = jnp.where(allowed, scores, lowest)
    probs = jax.nn.softmax(scores, axis=-1)
    if empty is not None:
        probs = jnp.where(empty, jnp.zeros((), dtype), probs)
    return probs


class JaxAttentionKernel:
    """The JAX side of :mod:`xconv.converters.ops.attention`."""

    xp = jnp
    asarray = staticmethod(jnp.asarray)
    stop_gradient = staticmethod(lax.stop_gradient)
    sigmoid = staticmethod(jax.nn.sigmoid)
    matmul = staticmethod(matmul)
    scan = staticmethod(lax.scan)

    @staticmethod
    def scalar(value, dtype, like):
        return jnp.asarray(value, dtype)

    @staticmethod
    def zeros(shape, dtype, like):
        return jnp.zeros(shape, dtype)

    @staticmethod
    def arange(n, like):
        return jnp.arange(n)

    @staticmethod
    def pad_last(x, n, value):
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n)], constant_values=value)

    @staticmethod
    def reference_sum(x):
        return reference_sum(x, -1)

    @staticmethod
    def dtype(ctx, data_type):
        return ir.DataType(data_type).numpy()

    @staticmethod
    def take_rows(x, index):
        return jnp.take(x, jnp.asarray(index), axis=0)

    @staticmethod
    def indices(x):
        return x

    @staticmethod
    def write_rows(cache, pos, update):
        rows = jnp.arange(cache.shape[0])[:, None]
        return cache.at[rows, pos].set(update, mode="drop")

    @staticmethod
    def fused(ctx, q, k, v, attn_mask, past_key, nonpad, opts):
        if not _fast_applies(ctx, q, past_key, nonpad, opts):
            return None
        return _fast_attention(ctx, q, k, v, attn_mask, opts)

    @staticmethod
    def sdpa(ctx, q, k, v, opts, scale):
        return None  # the fused formulation runs before the heads are split

    @staticmethod
    def wanted(ctx, index):
        outs = ctx.output_values
        return (
            len(outs) > index
            and outs[index] is not None
            and (bool(outs[index].uses()) or outs[index].is_graph_output())
        )


KERNEL = JaxAttentionKernel()

register_attention_ops(builtin, KERNEL)
