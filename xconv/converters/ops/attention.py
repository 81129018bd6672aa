"""Attention, RotaryEmbedding and the newer sequence-model ops written once against ``xp``.

``Attention`` follows the ONNX reference implementation step by step (the backend tests are
generated from it): Q and K are each scaled by ``sqrt(scale)`` in the input dtype, the causal
mask is bottom-right aligned with the cache offset, a fully-masked query row gives zeros (not
NaN), and ``qk_matmul_output`` exposes the scores at the stage ``qk_matmul_output_mode``
selects. A backend computes a node with its own fused kernel where it has one
(:meth:`AttentionKernel.fused` before the heads are split: JAX's formulation in the inputs'
layout; :meth:`AttentionKernel.sdpa` after the cache and GQA: torch's
``scaled_dot_product_attention``). Also here: ``SwiGLU``, ``TensorScatter`` (KV-cache writes),
``LinearAttention`` (a recurrence, run by the kernel's :meth:`AttentionKernel.scan`),
``CausalConvWithState`` and ``FlexAttention``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from xconv.converters.ops.arrays import astype

Fail = Callable[[str], Exception]

LINEAR_ATTENTION_RULES = ("linear", "gated", "delta", "gated_delta")

ATTENTION_ATTRS = {
    "is_causal": 0,
    "kv_num_heads": None,
    "q_num_heads": None,
    "qk_matmul_output_mode": 0,
    "scale": None,
    "softcap": 0.0,
    "softmax_precision": None,
    "left_window_size": -1,
    "right_window_size": -1,
}


class AttentionOptions(NamedTuple):
    """Attention's attributes (as the node gives them)."""

    is_causal: bool
    kv_num_heads: int | None
    q_num_heads: int | None
    qk_matmul_output_mode: int
    scale: float | None
    softcap: float
    softmax_precision: int | None
    left_window_size: int
    right_window_size: int


class AttentionKernel(Protocol):
    """What a backend provides for the attention ops."""

    xp: Any
    """The array namespace (``jax.numpy``; torch under numpy's names)."""

    def asarray(self, x: Any) -> Any:
        """A backend array (numpy inputs included)."""

    def scalar(self, value: Any, dtype: Any, like: Any) -> Any:
        """A 0-d array of ``dtype`` on ``like``'s device."""

    def zeros(self, shape: tuple[int, ...], dtype: Any, like: Any) -> Any: ...

    def arange(self, n: int, like: Any) -> Any:
        """``0..n-1`` (the backend's index type) on ``like``'s device."""

    def pad_last(self, x: Any, n: int, value: Any) -> Any:
        """``x`` with ``n`` elements of ``value`` appended along the last axis."""

    def stop_gradient(self, x: Any) -> Any: ...

    def reference_sum(self, x: Any) -> Any:
        """Sum over the last axis keeping it, accumulating as the ONNX reference does."""

    def dtype(self, ctx: Any, data_type: int) -> Any:
        """The backend dtype of an ONNX ``DataType`` number."""

    def sigmoid(self, x: Any) -> Any: ...

    def matmul(self, a: Any, b: Any) -> Any:
        """``xp.matmul(a, b)``, as the backend computes it fastest with the same values."""

    def take_rows(self, x: Any, index: Any) -> Any:
        """``x[index]`` along axis 0 (RotaryEmbedding's position ids)."""

    def indices(self, x: Any) -> Any:
        """An index array the backend scatters with."""

    def write_rows(self, cache: Any, pos: Any, update: Any) -> Any:
        """``cache[b, pos[b, s]] = update[b, s]``, writes past the end dropped (a copy)."""

    def scan(self, step: Callable[..., Any], state: Any, xs: tuple) -> tuple[Any, Any]:
        """``step(state, x_t) -> (state, y_t)`` over the leading axis of each of ``xs`` (None
        entries stay None); returns the last state and the ``y_t`` stacked on axis 0."""

    def fused(self, ctx: Any, q, k, v, attn_mask, past_key, nonpad, opts: AttentionOptions):
        """Y from the backend's fused kernel in the inputs' layout, or None to decline."""

    def sdpa(self, ctx: Any, q, k, v, opts: AttentionOptions, scale: float):
        """Y from the backend's fused kernel over (B, H, S, D) heads after the cache and
        GQA (no mask, causal only when square, float32/float64), or None to decline."""

    def wanted(self, ctx: Any, index: int) -> bool:
        """Whether the node's output ``index`` is read."""


def linear_attention_rule(
    update_rule: str,
    q_num_heads: int,
    kv_num_heads: int,
    *,
    has_decay: bool,
    has_beta: bool,
    fail: Fail,
) -> tuple[bool, bool]:
    """Check LinearAttention's attributes and inputs; return (gating, delta) of the rule."""
    if update_rule not in LINEAR_ATTENTION_RULES:
        raise fail(f"update_rule {update_rule!r} is not one of {list(LINEAR_ATTENTION_RULES)}")
    if q_num_heads <= 0 or kv_num_heads <= 0 or q_num_heads % kv_num_heads:
        raise fail(
            f"q_num_heads ({q_num_heads}) must be a positive multiple of kv_num_heads "
            f"({kv_num_heads})"
        )
    gating = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    if gating != has_decay:
        raise fail(f"update_rule {update_rule!r} {'needs' if gating else 'forbids'} decay")
    if delta != has_beta:
        raise fail(f"update_rule {update_rule!r} {'needs' if delta else 'forbids'} beta")
    return gating, delta


# ------------------------------------------------------------------------------- helpers


def split_heads(xp, x, num_heads: int):
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hidden = x.shape
    return xp.transpose(xp.reshape(x, (b, s, num_heads, hidden // num_heads)), (0, 2, 1, 3))


def repeat_kv(ctx, xp, q, k, v, axis: int = 1):
    """GQA/MQA: interleave-repeat each KV head (h0, h0, h1, h1, ...) to Q's head count."""
    q_heads, kv_heads = q.shape[axis], k.shape[axis]
    if q_heads == kv_heads:
        return k, v
    if q_heads % kv_heads:
        raise ctx.error(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    n = q_heads // kv_heads
    return xp.repeat(k, n, axis=axis), xp.repeat(v, n, axis=axis)


def frontier(kern: AttentionKernel, q_len: int, kv_len: int, offset, like):
    """``(i + offset) - j`` for query i and key j: (q, kv), or (B, 1, q, kv) per batch."""
    xp = kern.xp
    i = xp.reshape(kern.arange(q_len, like), (q_len, 1))
    j = xp.reshape(kern.arange(kv_len, like), (1, kv_len))
    if isinstance(offset, int):
        return (i + offset) - j
    return (i + astype(xp, xp.reshape(offset, (-1, 1, 1, 1)), i.dtype)) - j


def _neg_inf_where(kern: AttentionKernel, allowed, dtype):
    """0 where ``allowed``, -inf elsewhere (select, never multiply: 0 * -inf is NaN)."""
    zero = kern.scalar(0, dtype, allowed)
    return kern.xp.where(allowed, zero, kern.scalar(-np.inf, dtype, allowed))


def _masked_softmax(kern: AttentionKernel, x):
    """Softmax over the last axis; an all -inf row gives zeros (the reference's convention)."""
    xp = kern.xp
    mx = xp.max(x, axis=-1, keepdims=True)
    safe = kern.stop_gradient(xp.where(xp.isneginf(mx), kern.scalar(0, x.dtype, x), mx))
    e = xp.exp(x - safe)
    s = kern.reference_sum(e)
    return e / xp.where(s == 0, kern.scalar(1, s.dtype, s), s)


def _attention_bias(ctx, kern, like, q_len, kv_len, dtype, attn_mask, opts, offset, nonpad):
    """The additive bias of Attention (None when nothing masks), as the reference builds it."""
    xp = kern.xp
    left, right = opts.left_window_size, opts.right_window_size
    windowed = left >= 0 or right >= 0
    bias = None
    if attn_mask is not None:
        attn_mask = kern.asarray(attn_mask)
        pad = kv_len - attn_mask.shape[-1]
        if pad < 0:
            raise ctx.error(
                f"attn_mask's last dimension {attn_mask.shape[-1]} is longer than the "
                f"total sequence length {kv_len}"
            )
        boolean = attn_mask.dtype == xp.bool_
        if pad > 0:
            attn_mask = kern.pad_last(attn_mask, pad, False if boolean else -np.inf)
        if boolean:
            attn_mask = _neg_inf_where(kern, attn_mask, dtype)
        bias = attn_mask
    if opts.is_causal:
        base = kern.zeros((q_len, kv_len), dtype, like) if bias is None else bias
        if windowed:
            base = kern.zeros((q_len, kv_len), dtype, like) + base
        allowed = frontier(kern, q_len, kv_len, offset, like) >= 0
        bias = base + _neg_inf_where(kern, allowed, base.dtype)
    if windowed:
        diff = frontier(kern, q_len, kv_len, offset, like)
        allowed = None
        if left >= 0:
            allowed = diff <= left
        if right >= 0:
            allowed = -diff <= right if allowed is None else allowed & (-diff <= right)
        zeros = kern.zeros((q_len, kv_len), dtype, like)
        bias = zeros + (zeros if bias is None else bias)
        bias = bias + _neg_inf_where(kern, allowed, bias.dtype)
    if nonpad is not None:
        keep = kern.arange(kv_len, like)[None, :] < xp.reshape(nonpad, (-1, 1))
        bias_dtype = dtype if bias is None else bias.dtype
        padding = _neg_inf_where(kern, keep, bias_dtype)[:, None, None, :]
        bias = padding if bias is None else bias + padding
    return bias


# ------------------------------------------------------------------------------- Attention


def _check_attention(ctx, q, k, v, past_key, past_value, nonpad, opts: AttentionOptions):
    rank = q.ndim
    if rank not in (3, 4) or k.ndim != rank or v.ndim != rank:
        raise ctx.error(f"Q, K and V must all be 3-D or all 4-D, got {q.ndim}, {k.ndim}, {v.ndim}")
    if (past_key is None) != (past_value is None):
        raise ctx.error("past_key and past_value must be given together")
    if nonpad is not None and past_key is not None:
        raise ctx.error("nonpad_kv_seqlen cannot be combined with past_key / past_value")
    if opts.qk_matmul_output_mode not in (0, 1, 2, 3):
        raise ctx.error(f"qk_matmul_output_mode must be 0..3, got {opts.qk_matmul_output_mode}")
    if rank == 3 and (not opts.q_num_heads or not opts.kv_num_heads):
        raise ctx.error("3-D inputs need the q_num_heads and kv_num_heads attributes")


def _plain(kern, ctx, attn_mask, nonpad, opts: AttentionOptions, q_len, kv_len, dtype) -> bool:
    """Whether nothing but an optional top-left causal mask applies and only Y is read: a
    fused scaled-dot-product kernel computes the same."""
    xp = kern.xp
    return (
        attn_mask is None
        and nonpad is None
        and opts.left_window_size < 0
        and opts.right_window_size < 0
        and opts.softcap <= 0
        and opts.softmax_precision is None
        and not kern.wanted(ctx, 3)
        and (not opts.is_causal or q_len == kv_len)
        and dtype in (xp.float32, xp.float64)
    )


def attention(kern: AttentionKernel, ctx, q, k, v, attn_mask, past_key, past_value, nonpad, opts):
    """Attention(Q, K, V, attn_mask?, past_key?, past_value?, nonpad_kv_seqlen?) ->
    (Y, present_key, present_value, qk_matmul_output)."""
    xp = kern.xp
    q, k, v = kern.asarray(q), kern.asarray(k), kern.asarray(v)
    _check_attention(ctx, q, k, v, past_key, past_value, nonpad, opts)
    y = kern.fused(ctx, q, k, v, attn_mask, past_key, nonpad, opts)
    if y is not None:
        return y, k, v, None
    dtype, rank = q.dtype, q.ndim
    if rank == 3:
        q = split_heads(xp, q, opts.q_num_heads)
        k = split_heads(xp, k, opts.kv_num_heads)
        v = split_heads(xp, v, opts.kv_num_heads)
    scale = opts.scale if opts.scale is not None else 1.0 / np.sqrt(q.shape[-1])
    if past_key is not None:
        k = xp.concatenate([astype(xp, kern.asarray(past_key), dtype), k], axis=2)
        v = xp.concatenate([astype(xp, kern.asarray(past_value), dtype), v], axis=2)
    present_key, present_value = k, v
    k, v = repeat_kv(ctx, xp, q, k, v)
    q_len, kv_len = q.shape[2], k.shape[2]
    y = None
    if _plain(kern, ctx, attn_mask, nonpad, opts, q_len, kv_len, dtype):
        y = kern.sdpa(ctx, q, k, v, opts, scale)
    qk_output = None
    if y is None:
        y, qk_output = _reference(kern, ctx, q, k, v, attn_mask, past_key, nonpad, opts, scale)
    if rank == 3:
        y = xp.transpose(y, (0, 2, 1, 3))
        y = xp.reshape(y, (y.shape[0], y.shape[1], -1))
    return y, present_key, present_value, qk_output


def _reference(kern, ctx, q, k, v, attn_mask, past_key, nonpad, opts, scale):
    """The reference's steps over (B, H, S, D) heads: Y and the chosen scores."""
    xp = kern.xp
    dtype = q.dtype
    q_len, kv_len = q.shape[2], k.shape[2]
    if past_key is not None:
        offset = int(past_key.shape[2])
    elif nonpad is not None:
        nonpad = kern.asarray(nonpad)
        offset = xp.reshape(nonpad, (-1,)) - q_len
    else:
        offset = 0
    bias = _attention_bias(ctx, kern, q, q_len, kv_len, dtype, attn_mask, opts, offset, nonpad)
    # The reference rounds sqrt(scale) to the input dtype before multiplying.
    root = kern.scalar(np.sqrt(scale), dtype, q)
    scores = kern.matmul(q * root, xp.swapaxes(k * root, -1, -2))
    if opts.softcap > 0:
        cap = kern.scalar(opts.softcap, dtype, q)
        scores = xp.tanh(scores / cap) * cap
    qk_output = scores
    biased = scores if bias is None else scores + bias
    if opts.qk_matmul_output_mode == 2:
        qk_output = biased
    if opts.softmax_precision is not None:
        biased = astype(xp, biased, kern.dtype(ctx, opts.softmax_precision))
    probs = _masked_softmax(kern, biased)
    if bias is not None:
        # A query row whose bias is all -inf attends nothing: its output is zero.
        fully_masked = xp.isneginf(xp.max(bias, axis=-1, keepdims=True))
        probs = xp.where(fully_masked, kern.scalar(0, probs.dtype, probs), probs)
    if opts.qk_matmul_output_mode == 3:
        qk_output = probs
    y = kern.matmul(astype(xp, probs, dtype), v)
    return y, astype(xp, qk_output, dtype)


# ------------------------------------------------------------------------ the other ops


def rotary_embedding(kern, ctx, x, cos, sin, position_ids, interleaved, num_heads, rdim):
    """RotaryEmbedding(X, cos_cache, sin_cache, position_ids?) -> Y: rotates the first
    ``rotary_embedding_dim`` features of each head (halves, or interleaved pairs)."""
    xp = kern.xp
    x = kern.asarray(x)
    if x.ndim == 4:
        h = xp.transpose(x, (0, 2, 1, 3))  # (B, S, H, D)
    elif x.ndim == 3:
        if not num_heads:
            raise ctx.error("a 3-D input needs the num_heads attribute")
        b, s, hidden = x.shape
        h = xp.reshape(x, (b, s, num_heads, hidden // num_heads))
    else:
        raise ctx.error(f"X must be 3-D or 4-D, got rank {x.ndim}")
    rdim = rdim or h.shape[-1]
    half = rdim // 2
    cos, sin = kern.asarray(cos), kern.asarray(sin)
    if position_ids is not None:
        cos = kern.take_rows(cos, position_ids)
        sin = kern.take_rows(sin, position_ids)
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ctx.error(
            f"cos/sin caches end in {cos.shape[-1]}/{sin.shape[-1]}, expected "
            f"rotary_embedding_dim / 2 = {half}"
        )
    cos = astype(xp, cos[:, :, None, :], h.dtype)
    sin = astype(xp, sin[:, :, None, :], h.dtype)
    rot, keep = h[..., :rdim], h[..., rdim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rot = xp.reshape(xp.stack([real, imag], axis=-1), tuple(rot.shape))
    else:
        rot = xp.concatenate([real, imag], axis=-1)
    out = xp.concatenate([rot, keep], axis=-1)
    if x.ndim == 3:
        return xp.reshape(out, tuple(x.shape))
    return xp.transpose(out, (0, 2, 1, 3))


def swiglu(kern, ctx, a, b, alpha):
    """SwiGLU(A, B) -> Y = A * sigmoid(alpha * A) * B (same shapes, no broadcasting)."""
    xp = kern.xp
    a, b = kern.asarray(a), kern.asarray(b)
    if a.shape != b.shape:
        raise ctx.error(
            f"A and B must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    gate = astype(xp, kern.sigmoid(kern.scalar(alpha, a.dtype, a) * a), a.dtype)
    return astype(xp, a * gate * b, a.dtype)


def tensor_scatter(kern, ctx, past_cache, update, write_indices, axis, mode):
    """TensorScatter(past_cache, update, write_indices?) -> present_cache: writes ``update``
    into the cache along ``axis`` starting at each batch's write index (``circular`` wraps)."""
    xp = kern.xp
    if mode not in ("linear", "circular"):
        raise ctx.error(f"mode must be 'linear' or 'circular', got {mode!r}")
    past_cache, update = kern.asarray(past_cache), kern.asarray(update)
    rank = past_cache.ndim
    ax = axis % rank if -rank <= axis < rank else None
    if ax is None or ax == 0:
        raise ctx.error(f"axis {axis} must name a sequence axis after the batch axis")
    batch, max_len, seq = past_cache.shape[0], past_cache.shape[ax], update.shape[ax]
    if write_indices is None:
        starts = kern.indices(kern.arange(batch, past_cache) * 0)
    else:
        starts = kern.indices(xp.reshape(kern.asarray(write_indices), (batch,)))
    pos = starts[:, None] + astype(xp, kern.arange(seq, past_cache), starts.dtype)[None, :]
    if mode == "circular":
        pos = pos % max_len
    cache = xp.moveaxis(past_cache, ax, 1)  # (B, max_len, ...)
    upd = astype(xp, xp.moveaxis(update, ax, 1), cache.dtype)  # (B, seq, ...)
    return xp.moveaxis(kern.write_rows(cache, pos, upd), 1, ax)


LINEAR_ATTENTION_ATTRS = {
    "chunk_size": 64,
    "kv_num_heads": 0,
    "q_num_heads": 0,
    "scale": 0.0,
    "update_rule": "gated_delta",
}


def linear_attention(kern, ctx, query, key, value, past_state, decay, beta, attrs):
    """LinearAttention(query, key, value, past_state?, decay?, beta?) ->
    (output, present_state): the recurrent state S += k v^T (with optional exp(decay)
    gating and beta delta correction), read as scale * q S; float32 internally."""
    xp = kern.xp
    q_heads, kv_heads = attrs["q_num_heads"], attrs["kv_num_heads"]
    gating, delta = linear_attention_rule(
        attrs["update_rule"],
        q_heads,
        kv_heads,
        has_decay=decay is not None,
        has_beta=beta is not None,
        fail=ctx.error,
    )
    query, key, value = kern.asarray(query), kern.asarray(key), kern.asarray(value)
    out_dtype = query.dtype
    b, t, _ = query.shape
    d_k = query.shape[-1] // q_heads
    d_v = value.shape[-1] // kv_heads
    group = q_heads // kv_heads
    f32 = xp.float32

    def time_major(x, heads):  # (B, T, H*D) -> (T, B, H, D) in float32
        return xp.transpose(astype(xp, split_heads(xp, x, heads), f32), (2, 0, 1, 3))

    g = bt = None
    if gating:
        decay = kern.asarray(decay)
        if decay.shape[-1] == kv_heads:
            g = xp.reshape(decay, (b, t, kv_heads, 1))
        elif decay.shape[-1] == kv_heads * d_k:
            g = xp.reshape(decay, (b, t, kv_heads, d_k))
        else:
            raise ctx.error(
                f"decay's last dimension {decay.shape[-1]} must be kv_num_heads or "
                "kv_num_heads * head_size"
            )
        g = xp.transpose(astype(xp, g, f32), (1, 0, 2, 3))
    if delta:
        beta = kern.asarray(beta)
        if beta.shape[-1] not in (kv_heads, 1):
            raise ctx.error(
                f"beta's last dimension must be kv_num_heads or 1, got {tuple(beta.shape)}"
            )
        bt = xp.reshape(beta, (b, t, beta.shape[-1], 1))
        bt = xp.transpose(astype(xp, bt, f32), (1, 0, 2, 3))
    if past_state is not None:
        past_state = kern.asarray(past_state)
        if tuple(past_state.shape) != (b, kv_heads, d_k, d_v):
            raise ctx.error(
                f"past_state has shape {tuple(past_state.shape)}, expected "
                f"{(b, kv_heads, d_k, d_v)}"
            )
        state_dtype = past_state.dtype
        state0 = astype(xp, past_state, f32)
    else:
        state_dtype = out_dtype
        state0 = kern.zeros((b, kv_heads, d_k, d_v), f32, query)
    scale = float(attrs["scale"]) if attrs["scale"] else 1.0 / float(np.sqrt(d_k))

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        if gating:
            state = state * xp.exp(g_t)[..., None]
        if delta:
            retrieved = xp.einsum("bhdm,bhd->bhm", state, k_t)
            v_t = b_t * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        read = xp.repeat(state, group, axis=1) if group > 1 else state
        return state, scale * xp.einsum("bhd,bhdm->bhm", q_t, read)

    xs = (time_major(query, q_heads), time_major(key, kv_heads), time_major(value, kv_heads))
    state, outs = kern.scan(step, state0, (*xs, g, bt))  # outs: (T, B, Hq, d_v)
    output = xp.reshape(xp.transpose(outs, (1, 0, 2, 3)), (b, t, q_heads * d_v))
    return astype(xp, output, out_dtype), astype(xp, state, state_dtype)


CAUSAL_CONV_ACTIVATIONS = ("none", "silu", "swish")


def causal_conv_with_state(kern, ctx, x, weight, bias, past_state, activation):
    """CausalConvWithState(input, weight, bias?, past_state?) -> (output, present_state):
    depthwise causal 1-D conv over (B, C, L) with the last k-1 inputs carried as state,
    optionally followed by SiLU."""
    xp = kern.xp
    if activation not in CAUSAL_CONV_ACTIVATIONS:
        raise ctx.error(f"activation {activation!r} is not one of {list(CAUSAL_CONV_ACTIVATIONS)}")
    x, weight = kern.asarray(x), kern.asarray(weight)
    if x.ndim != 3 or weight.ndim != 3:
        raise ctx.error(f"input and weight must be rank 3, got {x.ndim} and {weight.ndim}")
    b, c, length = x.shape
    ksize = weight.shape[2]
    if past_state is None:
        pad = kern.zeros((b, c, ksize - 1), x.dtype, x)
    else:
        pad = astype(xp, kern.asarray(past_state), x.dtype)
    padded = xp.concatenate([pad, x], axis=2)
    acc = xp.float32 if x.dtype in (xp.float16, xp.bfloat16) else x.dtype
    w = astype(xp, weight[:, 0, :], acc)  # (C, k)
    out = kern.zeros((b, c, length), acc, x)
    for j in range(ksize):
        out = out + astype(xp, padded[:, :, j : j + length], acc) * w[None, :, j : j + 1]
    if bias is not None:
        out = out + astype(xp, kern.asarray(bias), acc)[None, :, None]
    out = astype(xp, out, x.dtype)
    if activation != "none":
        f = astype(xp, out, xp.float32)
        out = astype(xp, f * kern.sigmoid(f), x.dtype)
    present = padded[:, :, padded.shape[2] - (ksize - 1) :]
    return out, present


def _run_modifier(kern, ctx, graph, x, what: str):
    outs = ctx.run_subgraph(graph, [x])
    if len(outs) != 1:
        raise ctx.error(f"the {what} subgraph must produce exactly one output, got {len(outs)}")
    out = astype(kern.xp, kern.asarray(outs[0]), x.dtype)
    if tuple(out.shape) != tuple(x.shape):
        raise ctx.error(
            f"the {what} subgraph changed the shape {tuple(x.shape)} to {tuple(out.shape)}"
        )
    return out


def flex_attention(kern, ctx, q, k, v, scale, score_mod, prob_mod, softmax_precision):
    """FlexAttention(Q, K, V) -> Y (ai.onnx.preview): rank-4 scaled dot-product attention
    with optional ``score_mod`` (after Q K^T) and ``prob_mod`` (after softmax) subgraphs,
    computed at ``softmax_precision`` (float32 for narrower inputs)."""
    xp = kern.xp
    q, k, v = kern.asarray(q), kern.asarray(k), kern.asarray(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ctx.error(f"Q, K and V must be rank 4, got {q.ndim}, {k.ndim}, {v.ndim}")
    k, v = repeat_kv(ctx, xp, q, k, v)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    root = kern.scalar(np.sqrt(np.float32(scale)), q.dtype, q)
    scores = kern.matmul(q * root, xp.swapaxes(k * root, -1, -2))
    if softmax_precision is not None:
        compute = kern.dtype(ctx, softmax_precision)
    else:
        compute = xp.float32 if q.dtype.itemsize < 4 else q.dtype
    scores = astype(xp, scores, compute)
    if score_mod is not None:
        scores = _run_modifier(kern, ctx, score_mod, scores, "score_mod")
    e = xp.exp(scores - kern.stop_gradient(xp.max(scores, axis=-1, keepdims=True)))
    probs = e / kern.reference_sum(e)
    if prob_mod is not None:
        probs = _run_modifier(kern, ctx, prob_mod, probs, "prob_mod")
    return astype(xp, kern.matmul(probs, astype(xp, v, compute)), v.dtype)


# ---------------------------------------------------------------------------- registration


def register_attention_ops(builtin: Callable[..., Any], kern: AttentionKernel) -> None:
    """Register the attention family with a backend's ``builtin`` and kernel ``kern``."""

    @builtin("Attention", since=23, attrs=ATTENTION_ATTRS)
    def attention_op(
        ctx, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, **a
    ):
        """Attention(Q, K, V, attn_mask?, past_key?, past_value?, nonpad_kv_seqlen?) ->
        (Y, present_key?, present_value?, qk_matmul_output?): scaled dot-product attention
        with MHA/GQA/MQA heads, boolean or additive masks, causal and sliding-window masking,
        softcap and an in-op KV cache."""
        opts = AttentionOptions(**{**a, "is_causal": bool(a["is_causal"])})
        return attention(
            kern, ctx, q, k, v, attn_mask, past_key, past_value, nonpad_kv_seqlen, opts
        )

    @builtin(
        "RotaryEmbedding",
        since=23,
        attrs={"interleaved": 0, "num_heads": 0, "rotary_embedding_dim": 0},
    )
    def rotary_embedding_op(
        ctx, x, cos_cache, sin_cache, position_ids=None, *, interleaved, num_heads,
        rotary_embedding_dim,
    ):  # fmt: skip
        """RotaryEmbedding(X, cos_cache, sin_cache, position_ids?) -> Y."""
        return rotary_embedding(
            kern, ctx, x, cos_cache, sin_cache, position_ids, interleaved, num_heads,
            rotary_embedding_dim,
        )  # fmt: skip

    @builtin("SwiGLU", since=28, attrs={"alpha": 1.0})
    def swiglu_op(ctx, a, b, *, alpha):
        """SwiGLU(A, B) -> Y = A * sigmoid(alpha * A) * B (same shapes, no broadcasting)."""
        return swiglu(kern, ctx, a, b, alpha)

    @builtin("TensorScatter", since=24, attrs={"axis": -2, "mode": "linear"})
    def tensor_scatter_op(ctx, past_cache, update, write_indices=None, *, axis, mode):
        """TensorScatter(past_cache, update, write_indices?) -> present_cache."""
        return tensor_scatter(kern, ctx, past_cache, update, write_indices, axis, mode)

    @builtin("LinearAttention", since=27, attrs=LINEAR_ATTENTION_ATTRS)
    def linear_attention_op(
        ctx, query, key, value, past_state=None, decay=None, beta=None, **attrs
    ):
        """LinearAttention(query, key, value, past_state?, decay?, beta?) ->
        (output, present_state); ``chunk_size`` is a tiling hint that does not change the
        result."""
        return linear_attention(kern, ctx, query, key, value, past_state, decay, beta, attrs)

    @builtin("CausalConvWithState", since=27, attrs={"activation": "none"})
    def causal_conv_with_state_op(ctx, x, weight, bias=None, past_state=None, *, activation):
        """CausalConvWithState(input, weight, bias?, past_state?) -> (output, present_state)."""
        return causal_conv_with_state(kern, ctx, x, weight, bias, past_state, activation)

    @builtin(
        "FlexAttention",
        domain="ai.onnx.preview",
        since=1,
        attrs={"scale": None, "score_mod": None, "prob_mod": None, "softmax_precision": None},
    )
    def flex_attention_op(ctx, q, k, v, *, scale, score_mod, prob_mod, softmax_precision):
        """FlexAttention(Q, K, V) -> Y (ai.onnx.preview)."""
        return flex_attention(kern, ctx, q, k, v, scale, score_mod, prob_mod, softmax_precision)
