"""JAX handlers: Attention, RotaryEmbedding and the newer sequence-model ops.

``Attention`` follows the ONNX reference implementation step by step (the backend tests are
generated from it): Q and K are each scaled by ``sqrt(scale)`` in the input dtype, the causal
mask is bottom-right aligned with the cache offset, a fully-masked query row gives zeros (not
NaN), and ``qk_matmul_output`` exposes the scores at the stage ``qk_matmul_output_mode``
selects. Also here: ``SwiGLU``, ``TensorScatter`` (KV-cache writes), ``LinearAttention`` (a
recurrence, run with ``lax.scan``) and ``CausalConvWithState``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
from jax import lax

from xconv.converters.jax import formulation
from xconv.converters.jax.kernel import reference_sum
from xconv.converters.jax.registry import builtin
from xconv.converters.ops import attention as attention_attrs

_NEG_INF = -np.inf


def _neg_inf_where(allowed, dtype):
    """0 where ``allowed``, -inf elsewhere (select, never multiply: 0 * -inf is NaN)."""
    return jnp.where(allowed, jnp.zeros((), dtype), jnp.full((), _NEG_INF, dtype))


def _split_heads(x, num_heads: int):
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _frontier(q_len: int, kv_len: int, offset):
    """``(i + offset) - j`` for query i and key j: (q, kv), or (B, 1, q, kv) per batch."""
    i = jnp.arange(q_len).reshape(q_len, 1)
    j = jnp.arange(kv_len).reshape(1, kv_len)
    if isinstance(offset, int):
        return (i + offset) - j
    off = jnp.reshape(offset, (-1, 1, 1, 1)).astype(i.dtype)
    return (i + off) - j


def _masked_softmax(x):
    """Softmax over the last axis; an all -inf row gives zeros (the reference's convention)."""
    mx = jnp.max(x, axis=-1, keepdims=True)
    safe = lax.stop_gradient(jnp.where(jnp.isneginf(mx), jnp.zeros((), x.dtype), mx))
    e = jnp.exp(x - safe)
    s = reference_sum(e, -1)
    return e / jnp.where(s == 0, jnp.ones((), s.dtype), s)


def _attention_bias(ctx, q_len, kv_len, dtype, attn_mask, is_causal, offset, window, nonpad):
    """The additive bias of Attention (None when nothing masks), as the reference builds it."""
    left, right = window
    windowed = left >= 0 or right >= 0
    bias = None
    if attn_mask is not None:
        attn_mask = jnp.asarray(attn_mask)
        pad = kv_len - attn_mask.shape[-1]
        if pad < 0:
            raise ctx.error(
                f"attn_mask's last dimension {attn_mask.shape[-1]} is longer than the "
                f"total sequence length {kv_len}"
            )
        if pad > 0:
            fill = False if attn_mask.dtype == jnp.bool_ else _NEG_INF
            widths = [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)]
            attn_mask = jnp.pad(attn_mask, widths, constant_values=fill)
        if attn_mask.dtype == jnp.bool_:
            attn_mask = _neg_inf_where(attn_mask, dtype)
        bias = attn_mask
    if is_causal:
        base = jnp.zeros((q_len, kv_len), dtype) if bias is None else bias
        if windowed:
            base = jnp.zeros((q_len, kv_len), dtype) + base
        bias = base + _neg_inf_where(_frontier(q_len, kv_len, offset) >= 0, base.dtype)
    if windowed:
        diff = _frontier(q_len, kv_len, offset)
        allowed = jnp.ones(diff.shape, bool)
        if left >= 0:
            allowed &= diff <= left
        if right >= 0:
            allowed &= -diff <= right
        bias = jnp.zeros((q_len, kv_len), dtype) if bias is None else bias
        bias = jnp.zeros((q_len, kv_len), dtype) + bias
        bias = bias + _neg_inf_where(allowed, bias.dtype)
    if nonpad is not None:
        keep = jnp.arange(kv_len)[None, :] < jnp.reshape(nonpad, (-1, 1))
        bias_dtype = dtype if bias is None else bias.dtype
        padding = _neg_inf_where(keep, bias_dtype)[:, None, None, :]
        bias = padding if bias is None else bias + padding
    return bias


# ------------------------------------------------------------------ the fast formulation


def _fast_applies(ctx, q, past_key, nonpad, softcap, softmax_precision, left, right) -> bool:
    """Whether the fused formulation computes this node: no KV cache, padding lengths,
    softcap or windows, nothing reads the present key/value or the scores, and the dtype is
    one whose softmax the fused form rounds as the reference does (float32/float64; float16
    and bfloat16 only on a GPU, through cuDNN)."""
    if formulation.get("attention") != "auto":
        return False
    if past_key is not None or nonpad is not None or softcap > 0 or left >= 0 or right >= 0:
        return False
    if any(o.uses() or o.is_graph_output() for o in ctx.output_values[1:] if o is not None):
        return False
    if softmax_precision is not None and ir.DataType(softmax_precision).numpy() != q.dtype:
        return False
    return q.dtype in (jnp.float32, jnp.float64) or _cudnn_backend()


def _cudnn_backend() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def _fast_attention(ctx, q, k, v, attn_mask, is_causal, scale, q_num_heads, kv_num_heads):
    """Scaled dot-product attention in the inputs' own layout, one select for every mask.

    4-D inputs stay head-major ``(B, H, S, D)``; 3-D inputs are viewed sequence-major
    ``(B, S, H, D)`` (a reshape, no transpose) and contracted as such. The scores are scaled
    once (not ``sqrt(scale)`` on both ``Q`` and ``K``); the causal frontier and a
    boolean mask are one ``where`` with the dtype's lowest finite value, a float mask is
    added (its ``-inf`` clamped to that value) and a query row nothing may attend gives
    zeros, as in the reference. Returns None when the shapes are not ones it handles.
    """
    rank = q.ndim
    dtype = q.dtype
    if rank == 3:
        b = q.shape[0]
        q = q.reshape(b, q.shape[1], q_num_heads, -1)
        k = k.reshape(b, k.shape[1], kv_num_heads, -1)
        v = v.reshape(b, v.shape[1], kv_num_heads, -1)
        head_ax, seq_ax = 2, 1
    else:
        head_ax, seq_ax = 1, 2
    q_heads, kv_heads = q.shape[head_ax], k.shape[head_ax]
    if q_heads != kv_heads and q_heads % kv_heads:
        raise ctx.error(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    q_len, kv_len = q.shape[seq_ax], k.shape[seq_ax]
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])

    mask = bias = None
    if attn_mask is not None:
        attn_mask = attn_mask if isinstance(attn_mask, np.ndarray) else jnp.asarray(attn_mask)
        if attn_mask.ndim > 4 or attn_mask.shape[-1] > kv_len:
            return None
        pad = kv_len - attn_mask.shape[-1]
        if attn_mask.dtype == np.bool_:
            if pad:
                widths = [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)]
                attn_mask = jnp.pad(attn_mask, widths, constant_values=False)
            mask = attn_mask
        else:
            if pad:
                widths = [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)]
                attn_mask = jnp.pad(attn_mask, widths, constant_values=_NEG_INF)
            bias = attn_mask.astype(dtype)
    causal = None
    if is_causal:
        causal = _frontier(q_len, kv_len, 0) >= 0

    if (
        _cudnn_backend()
        and dtype in (jnp.float16, jnp.bfloat16)
        and mask is None
        and bias is None
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 128
    ):
        to_btnh = (lambda x: x) if rank == 3 else (lambda x: jnp.swapaxes(x, 1, 2))
        try:
            y = jax.nn.dot_product_attention(
                to_btnh(q),
                to_btnh(k),
                to_btnh(v),
                scale=float(scale),
                is_causal=bool(is_causal),
                implementation="cudnn",
            )
        except Exception:  # noqa: BLE001 - shapes/dtypes cuDNN rejects: the XLA form below
            y = None
        if y is not None:
            return y.reshape(y.shape[0], y.shape[1], -1) if rank == 3 else jnp.swapaxes(y, 1, 2)
    if dtype not in (jnp.float32, jnp.float64):
        return None

    if q_heads != kv_heads:
        k = jnp.repeat(k, q_heads // kv_heads, axis=head_ax)
        v = jnp.repeat(v, q_heads // kv_heads, axis=head_ax)
    # The scale multiplies the scores, not Q: with Q pre-scaled the transformer row of
    # benchmarks/bench_attention_layout.py ran 2x slower at batch 1 on CPU (an elementwise
    # producer fused into the dot's operand is the likely cause).
    spec = "bqhd,bkhd->bhqk" if rank == 3 else "bhqd,bhkd->bhqk"
    scores = jnp.einsum(spec, q, k) * jnp.asarray(scale, dtype)
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
    if rank == 3:
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return y.reshape(y.shape[0], y.shape[1], -1)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v)


@builtin(
    "Attention",
    since=23,
    attrs={
        "is_causal": 0,
        "kv_num_heads": None,
        "q_num_heads": None,
        "qk_matmul_output_mode": 0,
        "scale": None,
        "softcap": 0.0,
        "softmax_precision": None,
        "left_window_size": -1,
        "right_window_size": -1,
    },
)
def attention(
    ctx,
    q,
    k,
    v,
    attn_mask=None,
    past_key=None,
    past_value=None,
    nonpad_kv_seqlen=None,
    *,
    is_causal,
    kv_num_heads,
    q_num_heads,
    qk_matmul_output_mode,
    scale,
    softcap,
    softmax_precision,
    left_window_size,
    right_window_size,
):
    """Attention(Q, K, V, attn_mask?, past_key?, past_value?, nonpad_kv_seqlen?) ->
    (Y, present_key?, present_value?, qk_matmul_output?): scaled dot-product attention with
    MHA/GQA/MQA heads, boolean or additive masks, causal and sliding-window masking, softcap
    and an in-op KV cache."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    dtype = q.dtype
    rank = q.ndim
    if rank not in (3, 4) or k.ndim != rank or v.ndim != rank:
        raise ctx.error(f"Q, K and V must all be 3-D or all 4-D, got {q.ndim}, {k.ndim}, {v.ndim}")
    if (past_key is None) != (past_value is None):
        raise ctx.error("past_key and past_value must be given together")
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise ctx.error("nonpad_kv_seqlen cannot be combined with past_key / past_value")
    if qk_matmul_output_mode not in (0, 1, 2, 3):
        raise ctx.error(f"qk_matmul_output_mode must be 0..3, got {qk_matmul_output_mode}")
    if rank == 3 and (not q_num_heads or not kv_num_heads):
        raise ctx.error("3-D inputs need the q_num_heads and kv_num_heads attributes")
    if _fast_applies(
        ctx,
        q,
        past_key,
        nonpad_kv_seqlen,
        softcap,
        softmax_precision,
        left_window_size,
        right_window_size,
    ):
        y = _fast_attention(
            ctx, q, k, v, attn_mask, bool(is_causal), scale, q_num_heads, kv_num_heads
        )
        if y is not None:
            return y, k, v, None
    if rank == 3:
        q = _split_heads(q, q_num_heads)
        k = _split_heads(k, kv_num_heads)
        v = _split_heads(v, kv_num_heads)

    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    root = jnp.asarray(np.sqrt(scale), dtype)

    if past_key is not None:
        k = jnp.concatenate([jnp.asarray(past_key, dtype), k], axis=2)
        v = jnp.concatenate([jnp.asarray(past_value, dtype), v], axis=2)
    present_key, present_value = k, v

    q_len, kv_len = q.shape[2], k.shape[2]
    if past_key is not None:
        offset = int(past_key.shape[2])
    elif nonpad_kv_seqlen is not None:
        offset = jnp.reshape(jnp.asarray(nonpad_kv_seqlen), (-1,)) - q_len
    else:
        offset = 0
    bias = _attention_bias(
        ctx,
        q_len,
        kv_len,
        dtype,
        attn_mask,
        bool(is_causal),
        offset,
        (left_window_size, right_window_size),
        nonpad_kv_seqlen,
    )

    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads:
        if q_heads % kv_heads:
            raise ctx.error(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
        # Interleave-repeat each KV head: h0, h0, h1, h1, ...
        k = jnp.repeat(k, q_heads // kv_heads, axis=1)
        v = jnp.repeat(v, q_heads // kv_heads, axis=1)

    scores = jnp.matmul(q * root, jnp.swapaxes(k * root, -1, -2))
    if softcap > 0:
        cap = jnp.asarray(softcap, dtype)
        scores = jnp.tanh(scores / cap) * cap
    qk_output = scores
    biased = scores if bias is None else scores + bias
    if qk_matmul_output_mode == 2:
        qk_output = biased
    if softmax_precision is not None:
        biased = biased.astype(ir.DataType(softmax_precision).numpy())
    probs = _masked_softmax(biased)
    if bias is not None:
        # A query row whose bias is all -inf attends nothing: its output is zero.
        fully_masked = jnp.isneginf(jnp.max(bias, axis=-1, keepdims=True))
        probs = jnp.where(fully_masked, jnp.zeros((), probs.dtype), probs)
    if qk_matmul_output_mode == 3:
        qk_output = probs
    y = jnp.matmul(probs.astype(dtype), v)
    if rank == 3:
        y = y.transpose(0, 2, 1, 3)
        y = y.reshape(y.shape[0], y.shape[1], -1)
    return y, present_key, present_value, qk_output.astype(dtype)


@builtin(
    "RotaryEmbedding",
    since=23,
    attrs={"interleaved": 0, "num_heads": 0, "rotary_embedding_dim": 0},
)
def rotary_embedding(
    ctx,
    x,
    cos_cache,
    sin_cache,
    position_ids=None,
    *,
    interleaved,
    num_heads,
    rotary_embedding_dim,
):
    """RotaryEmbedding(X, cos_cache, sin_cache, position_ids?) -> Y: rotates the first
    ``rotary_embedding_dim`` features of each head (halves, or interleaved pairs)."""
    x = jnp.asarray(x)
    if x.ndim == 4:
        h = jnp.transpose(x, (0, 2, 1, 3))  # (B, S, H, D)
    elif x.ndim == 3:
        if not num_heads:
            raise ctx.error("a 3-D input needs the num_heads attribute")
        b, s, hidden = x.shape
        h = x.reshape(b, s, num_heads, hidden // num_heads)
    else:
        raise ctx.error(f"X must be 3-D or 4-D, got rank {x.ndim}")
    head = h.shape[-1]
    rdim = rotary_embedding_dim or head
    half = rdim // 2
    cos, sin = jnp.asarray(cos_cache), jnp.asarray(sin_cache)
    if position_ids is not None:
        cos = jnp.take(cos, jnp.asarray(position_ids), axis=0)
        sin = jnp.take(sin, jnp.asarray(position_ids), axis=0)
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ctx.error(
            f"cos/sin caches end in {cos.shape[-1]}/{sin.shape[-1]}, expected "
            f"rotary_embedding_dim / 2 = {half}"
        )
    cos = cos[:, :, None, :].astype(h.dtype)
    sin = sin[:, :, None, :].astype(h.dtype)
    rot, keep = h[..., :rdim], h[..., rdim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rot = jnp.stack([real, imag], axis=-1).reshape(rot.shape)
    else:
        rot = jnp.concatenate([real, imag], axis=-1)
    out = jnp.concatenate([rot, keep], axis=-1)
    if x.ndim == 3:
        return out.reshape(x.shape)
    return jnp.transpose(out, (0, 2, 1, 3))


@builtin("SwiGLU", since=28, attrs={"alpha": 1.0})
def swiglu(ctx, a, b, *, alpha):
    """SwiGLU(A, B) -> Y = A * sigmoid(alpha * A) * B (same shapes, no broadcasting)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape:
        raise ctx.error(f"A and B must have the same shape, got {a.shape} and {b.shape}")
    gate = jax.nn.sigmoid(jnp.asarray(alpha, a.dtype) * a).astype(a.dtype)
    return (a * gate * b).astype(a.dtype)


@builtin("TensorScatter", since=24, attrs={"axis": -2, "mode": "linear"})
def tensor_scatter(ctx, past_cache, update, write_indices=None, *, axis, mode):
    """TensorScatter(past_cache, update, write_indices?) -> present_cache: writes ``update``
    into the cache along ``axis`` starting at each batch's write index (``circular`` wraps)."""
    if mode not in ("linear", "circular"):
        raise ctx.error(f"mode must be 'linear' or 'circular', got {mode!r}")
    past_cache, update = jnp.asarray(past_cache), jnp.asarray(update)
    rank = past_cache.ndim
    ax = axis % rank if -rank <= axis < rank else None
    if ax is None or ax == 0:
        raise ctx.error(f"axis {axis} must name a sequence axis after the batch axis")
    batch, max_len, seq = past_cache.shape[0], past_cache.shape[ax], update.shape[ax]
    if write_indices is None:
        starts = jnp.zeros((batch,), jnp.int32)
    else:
        starts = jnp.asarray(write_indices).reshape(batch)
    pos = starts[:, None] + jnp.arange(seq, dtype=starts.dtype)[None, :]  # (B, seq)
    if mode == "circular":
        pos = pos % max_len
    cache = jnp.moveaxis(past_cache, ax, 1)  # (B, max_len, ...)
    upd = jnp.moveaxis(update, ax, 1)  # (B, seq, ...)
    rows = jnp.arange(batch)[:, None]
    cache = cache.at[rows, pos].set(upd.astype(cache.dtype), mode="drop")
    return jnp.moveaxis(cache, 1, ax)


@builtin(
    "LinearAttention",
    since=27,
    attrs={
        "chunk_size": 64,
        "kv_num_heads": 0,
        "q_num_heads": 0,
        "scale": 0.0,
        "update_rule": "gated_delta",
    },
)
def linear_attention(
    ctx,
    query,
    key,
    value,
    past_state=None,
    decay=None,
    beta=None,
    *,
    chunk_size,
    kv_num_heads,
    q_num_heads,
    scale,
    update_rule,
):
    """LinearAttention(query, key, value, past_state?, decay?, beta?) ->
    (output, present_state): the recurrent state S += k v^T (with optional exp(decay)
    gating and beta delta correction), read as scale * q S; float32 internally."""
    del chunk_size  # a kernel tiling hint; it does not change the result
    gating, delta = attention_attrs.linear_attention_rule(
        update_rule,
        q_num_heads,
        kv_num_heads,
        has_decay=decay is not None,
        has_beta=beta is not None,
        fail=ctx.error,
    )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    out_dtype = query.dtype
    b, t, _ = query.shape
    d_k = query.shape[-1] // q_num_heads
    d_v = value.shape[-1] // kv_num_heads
    group = q_num_heads // kv_num_heads
    f32 = jnp.float32
    # Time-major, head-split: (T, B, H, D).
    q4 = _split_heads(query, q_num_heads).astype(f32).transpose(2, 0, 1, 3)
    k4 = _split_heads(key, kv_num_heads).astype(f32).transpose(2, 0, 1, 3)
    v4 = _split_heads(value, kv_num_heads).astype(f32).transpose(2, 0, 1, 3)
    zeros_t = jnp.zeros((t, b, kv_num_heads, 1), f32)
    if gating:
        decay = jnp.asarray(decay)
        if decay.shape[-1] == kv_num_heads:
            g = decay.reshape(b, t, kv_num_heads, 1)
        elif decay.shape[-1] == kv_num_heads * d_k:
            g = decay.reshape(b, t, kv_num_heads, d_k)
        else:
            raise ctx.error(
                f"decay's last dimension {decay.shape[-1]} must be kv_num_heads or "
                "kv_num_heads * head_size"
            )
        g = g.astype(f32).transpose(1, 0, 2, 3)
    else:
        g = zeros_t
    if delta:
        beta = jnp.asarray(beta)
        if beta.shape[-1] not in (kv_num_heads, 1):
            raise ctx.error(f"beta's last dimension must be kv_num_heads or 1, got {beta.shape}")
        bt = beta.reshape(b, t, beta.shape[-1], 1).astype(f32).transpose(1, 0, 2, 3)
    else:
        bt = zeros_t
    if past_state is not None:
        past_state = jnp.asarray(past_state)
        if past_state.shape != (b, kv_num_heads, d_k, d_v):
            raise ctx.error(
                f"past_state has shape {past_state.shape}, expected {(b, kv_num_heads, d_k, d_v)}"
            )
        state_dtype = past_state.dtype
        state0 = past_state.astype(f32)
    else:
        state_dtype = out_dtype
        state0 = jnp.zeros((b, kv_num_heads, d_k, d_v), f32)
    scale_val = float(scale) if scale else 1.0 / float(np.sqrt(d_k))

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        if gating:
            state = state * jnp.exp(g_t)[..., None]
        if delta:
            retrieved = jnp.einsum("bhdm,bhd->bhm", state, k_t)
            v_t = b_t * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        read = jnp.repeat(state, group, axis=1) if group > 1 else state
        return state, scale_val * jnp.einsum("bhd,bhdm->bhm", q_t, read)

    state, outs = lax.scan(step, state0, (q4, k4, v4, g, bt))  # outs: (T, B, Hq, d_v)
    output = outs.transpose(1, 0, 2, 3).reshape(b, t, q_num_heads * d_v).astype(out_dtype)
    return output, state.astype(state_dtype)


_ACTIVATIONS = ("none", "silu", "swish")


@builtin("CausalConvWithState", since=27, attrs={"activation": "none"})
def causal_conv_with_state(ctx, x, weight, bias=None, past_state=None, *, activation):
    """CausalConvWithState(input, weight, bias?, past_state?) -> (output, present_state):
    depthwise causal 1-D conv over (B, C, L) with the last k-1 inputs carried as state,
    optionally followed by SiLU."""
    if activation not in _ACTIVATIONS:
        raise ctx.error(f"activation {activation!r} is not one of {list(_ACTIVATIONS)}")
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    if x.ndim != 3 or weight.ndim != 3:
        raise ctx.error(f"input and weight must be rank 3, got {x.ndim} and {weight.ndim}")
    b, c, length = x.shape
    ksize = weight.shape[2]
    if past_state is None:
        pad = jnp.zeros((b, c, ksize - 1), x.dtype)
    else:
        pad = jnp.asarray(past_state, x.dtype)
    padded = jnp.concatenate([pad, x], axis=2)
    acc = jnp.float32 if x.dtype in (jnp.float16, jnp.bfloat16) else x.dtype
    w = weight[:, 0, :].astype(acc)  # (C, k)
    out = jnp.zeros((b, c, length), acc)
    for j in range(ksize):
        out = out + padded[:, :, j : j + length].astype(acc) * w[None, :, j : j + 1]
    if bias is not None:
        out = out + jnp.asarray(bias).astype(acc)[None, :, None]
    out = out.astype(x.dtype)
    if activation != "none":
        f = out.astype(jnp.float32)
        out = (f * jax.nn.sigmoid(f)).astype(x.dtype)
    present = padded[:, :, padded.shape[2] - (ksize - 1) :]
    return out, present


def _flex_softmax_dtype(dtype, softmax_precision):
    if softmax_precision is not None:
        return ir.DataType(softmax_precision).numpy()
    if np.dtype(dtype).itemsize < 4:
        return np.dtype(np.float32)
    return np.dtype(dtype)


def _run_modifier(ctx, graph, x, what: str):
    outs = ctx.run_subgraph(graph, [x])
    if len(outs) != 1:
        raise ctx.error(f"the {what} subgraph must produce exactly one output, got {len(outs)}")
    out = jnp.asarray(outs[0]).astype(x.dtype)
    if out.shape != x.shape:
        raise ctx.error(f"the {what} subgraph changed the shape {x.shape} to {out.shape}")
    return out


@builtin(
    "FlexAttention",
    domain="ai.onnx.preview",
    since=1,
    attrs={"scale": None, "score_mod": None, "prob_mod": None, "softmax_precision": None},
)
def flex_attention(ctx, q, k, v, *, scale, score_mod, prob_mod, softmax_precision):
    """FlexAttention(Q, K, V) -> Y (ai.onnx.preview): rank-4 scaled dot-product attention
    with optional ``score_mod`` (after Q K^T) and ``prob_mod`` (after softmax) subgraphs,
    computed at ``softmax_precision`` (float32 for narrower inputs)."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ctx.error(f"Q, K and V must be rank 4, got {q.ndim}, {k.ndim}, {v.ndim}")
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads:
        if q_heads % kv_heads:
            raise ctx.error(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
        k = jnp.repeat(k, q_heads // kv_heads, axis=1)
        v = jnp.repeat(v, q_heads // kv_heads, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    root = jnp.asarray(np.sqrt(np.float32(scale)), q.dtype)
    scores = jnp.matmul(q * root, jnp.swapaxes(k * root, -1, -2))
    compute = _flex_softmax_dtype(q.dtype, softmax_precision)
    scores = scores.astype(compute)
    if score_mod is not None:
        scores = _run_modifier(ctx, score_mod, scores, "score_mod")
    e = jnp.exp(scores - lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    probs = e / reference_sum(e, -1)
    if prob_mod is not None:
        probs = _run_modifier(ctx, prob_mod, probs, "prob_mod")
    return jnp.matmul(probs, v.astype(compute)).astype(v.dtype)
