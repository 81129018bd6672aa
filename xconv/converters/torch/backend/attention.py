"""PyTorch handlers: Attention, RotaryEmbedding and the newer sequence-model ops.

``Attention`` follows the ONNX reference implementation (the backend tests are generated
from it): Q and K are each scaled by ``sqrt(scale)`` in the input dtype, the causal mask is
bottom-right aligned with the cache offset, a fully-masked query row gives zeros (not NaN),
and ``qk_matmul_output`` exposes the scores at the stage ``qk_matmul_output_mode`` selects.
When only ``Y`` is wanted and nothing but an optional top-left causal mask applies, it runs
``F.scaled_dot_product_attention`` (same math, torch's fused kernel). Also here: ``SwiGLU``,
``TensorScatter`` (KV-cache writes), ``LinearAttention`` and ``CausalConvWithState``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from xconv.converters.ops import attention as attention_attrs
from xconv.converters.torch.backend.linalg import reference_sum
from xconv.converters.torch.backend.registry import builtin


def _neg_inf_where(allowed, dtype):
    """0 where ``allowed``, -inf elsewhere (select, never multiply: 0 * -inf is NaN)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), -math.inf, dtype=dtype, device=zero.device))


def _split_heads(x, num_heads: int):
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, num_heads, hidden // num_heads).transpose(1, 2)


def _frontier(q_len: int, kv_len: int, offset, device):
    """``(i + offset) - j`` for query i and key j: (q, kv), or (B, 1, q, kv) per batch."""
    i = torch.arange(q_len, device=device).reshape(q_len, 1)
    j = torch.arange(kv_len, device=device).reshape(1, kv_len)
    if isinstance(offset, int):
        return (i + offset) - j
    return (i + offset.reshape(-1, 1, 1, 1).to(i.dtype)) - j


def _masked_softmax(x):
    """Softmax over the last axis; an all -inf row gives zeros (the reference's convention)."""
    mx = x.amax(dim=-1, keepdim=True)
    safe = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx).detach()
    e = torch.exp(x - safe)
    s = reference_sum(e)
    return e / torch.where(s == 0, torch.ones_like(s), s)


def _attention_bias(
    ctx, q_len, kv_len, dtype, device, attn_mask, is_causal, offset, window, nonpad
):
    """The additive bias of Attention (None when nothing masks), as the reference builds it."""
    left, right = window
    windowed = left >= 0 or right >= 0
    zeros = torch.zeros((q_len, kv_len), dtype=dtype, device=device)
    bias = None
    if attn_mask is not None:
        pad = kv_len - attn_mask.shape[-1]
        if pad < 0:
            raise ctx.error(
                f"attn_mask's last dimension {attn_mask.shape[-1]} is longer than the "
                f"total sequence length {kv_len}"
            )
        if pad > 0:
            fill = False if attn_mask.dtype == torch.bool else -math.inf
            attn_mask = F.pad(attn_mask, (0, pad), value=fill)
        if attn_mask.dtype == torch.bool:
            attn_mask = _neg_inf_where(attn_mask, dtype)
        bias = attn_mask
    if is_causal:
        base = zeros if bias is None else bias
        if windowed:
            base = zeros + base
        allowed = _frontier(q_len, kv_len, offset, device) >= 0
        bias = base + _neg_inf_where(allowed, base.dtype)
    if windowed:
        diff = _frontier(q_len, kv_len, offset, device)
        allowed = torch.ones(diff.shape, dtype=torch.bool, device=device)
        if left >= 0:
            allowed &= diff <= left
        if right >= 0:
            allowed &= -diff <= right
        bias = zeros + (zeros if bias is None else bias)
        bias = bias + _neg_inf_where(allowed, bias.dtype)
    if nonpad is not None:
        keep = torch.arange(kv_len, device=device)[None, :] < nonpad.reshape(-1, 1)
        bias_dtype = dtype if bias is None else bias.dtype
        padding = _neg_inf_where(keep, bias_dtype)[:, None, None, :]
        bias = padding if bias is None else bias + padding
    return bias


def _onnx_dtype(ctx, data_type: int) -> torch.dtype:
    import onnx_ir as ir

    from xconv.converters.torch.backend.dtypes import torch_dtype

    try:
        return torch_dtype(ir.DataType(data_type))
    except KeyError as e:
        raise ctx.error(str(e.args[0])) from None


def _wanted(ctx, index: int) -> bool:
    outputs = ctx.node.outputs
    return len(outputs) > index and outputs[index].name != ""


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
    if rank == 3:
        if not q_num_heads or not kv_num_heads:
            raise ctx.error("3-D inputs need the q_num_heads and kv_num_heads attributes")
        q = _split_heads(q, q_num_heads)
        k = _split_heads(k, kv_num_heads)
        v = _split_heads(v, kv_num_heads)

    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    if past_key is not None:
        k = torch.cat([past_key.to(dtype), k], dim=2)
        v = torch.cat([past_value.to(dtype), v], dim=2)
    present_key, present_value = k, v

    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads:
        if q_heads % kv_heads:
            raise ctx.error(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
        # Interleave-repeat each KV head: h0, h0, h1, h1, ...
        k = torch.repeat_interleave(k, q_heads // kv_heads, dim=1)
        v = torch.repeat_interleave(v, q_heads // kv_heads, dim=1)

    q_len, kv_len = q.shape[2], k.shape[2]
    plain = (
        attn_mask is None
        and nonpad_kv_seqlen is None
        and left_window_size < 0
        and right_window_size < 0
        and softcap <= 0
        and softmax_precision is None
        and not _wanted(ctx, 3)
        and (not is_causal or q_len == kv_len)
        and dtype in (torch.float32, torch.float64)
    )
    if plain:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=bool(is_causal), scale=scale)
        qk_output = None
    else:
        if past_key is not None:
            offset = int(past_key.shape[2])
        elif nonpad_kv_seqlen is not None:
            offset = nonpad_kv_seqlen.reshape(-1) - q_len
        else:
            offset = 0
        bias = _attention_bias(
            ctx,
            q_len,
            kv_len,
            dtype,
            q.device,
            attn_mask,
            bool(is_causal),
            offset,
            (left_window_size, right_window_size),
            nonpad_kv_seqlen,
        )
        # The reference rounds sqrt(scale) to the input dtype before multiplying.
        root = torch.tensor(math.sqrt(scale), dtype=dtype, device=q.device)
        scores = torch.matmul(q * root, (k * root).transpose(-1, -2))
        if softcap > 0:
            cap = torch.tensor(softcap, dtype=dtype, device=q.device)
            scores = torch.tanh(scores / cap) * cap
        qk_output = scores
        biased = scores if bias is None else scores + bias
        if qk_matmul_output_mode == 2:
            qk_output = biased
        if softmax_precision is not None:
            biased = biased.to(_onnx_dtype(ctx, softmax_precision))
        probs = _masked_softmax(biased)
        if bias is not None:
            # A query row whose bias is all -inf attends nothing: its output is zero.
            fully_masked = torch.isneginf(bias.amax(dim=-1, keepdim=True))
            probs = torch.where(fully_masked, torch.zeros((), dtype=probs.dtype), probs)
        if qk_matmul_output_mode == 3:
            qk_output = probs
        y = torch.matmul(probs.to(dtype), v)
        qk_output = qk_output.to(dtype)
    if rank == 3:
        y = y.transpose(1, 2)
        y = y.reshape(y.shape[0], y.shape[1], -1)
    return y, present_key, present_value, qk_output


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
    if x.ndim == 4:
        h = x.transpose(1, 2)  # (B, S, H, D)
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
    cos, sin = cos_cache, sin_cache
    if position_ids is not None:
        cos = cos[position_ids.to(torch.int64)]
        sin = sin[position_ids.to(torch.int64)]
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ctx.error(
            f"cos/sin caches end in {cos.shape[-1]}/{sin.shape[-1]}, expected "
            f"rotary_embedding_dim / 2 = {half}"
        )
    cos = cos[:, :, None, :].to(h.dtype)
    sin = sin[:, :, None, :].to(h.dtype)
    rot, keep = h[..., :rdim], h[..., rdim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rot = torch.stack([real, imag], dim=-1).reshape(rot.shape)
    else:
        rot = torch.cat([real, imag], dim=-1)
    out = torch.cat([rot, keep], dim=-1)
    if x.ndim == 3:
        return out.reshape(x.shape)
    return out.transpose(1, 2)


@builtin("SwiGLU", since=28, attrs={"alpha": 1.0})
def swiglu(ctx, a, b, *, alpha):
    """SwiGLU(A, B) -> Y = A * sigmoid(alpha * A) * B (same shapes, no broadcasting)."""
    if a.shape != b.shape:
        raise ctx.error(f"A and B must have the same shape, got {a.shape} and {b.shape}")
    gate = torch.sigmoid(alpha * a).to(a.dtype)
    return (a * gate * b).to(a.dtype)


@builtin("TensorScatter", since=24, attrs={"axis": -2, "mode": "linear"})
def tensor_scatter(ctx, past_cache, update, write_indices=None, *, axis, mode):
    """TensorScatter(past_cache, update, write_indices?) -> present_cache: writes ``update``
    into the cache along ``axis`` starting at each batch's write index (``circular`` wraps)."""
    if mode not in ("linear", "circular"):
        raise ctx.error(f"mode must be 'linear' or 'circular', got {mode!r}")
    rank = past_cache.ndim
    ax = axis % rank if -rank <= axis < rank else None
    if ax is None or ax == 0:
        raise ctx.error(f"axis {axis} must name a sequence axis after the batch axis")
    batch, max_len, seq = past_cache.shape[0], past_cache.shape[ax], update.shape[ax]
    device = past_cache.device
    if write_indices is None:
        starts = torch.zeros((batch,), dtype=torch.int64, device=device)
    else:
        starts = write_indices.reshape(batch).to(torch.int64)
    pos = starts[:, None] + torch.arange(seq, device=device)[None, :]  # (B, seq)
    if mode == "circular":
        pos = pos % max_len
    cache = past_cache.movedim(ax, 1).clone()  # (B, max_len, ...)
    upd = update.movedim(ax, 1).to(cache.dtype)  # (B, seq, ...)
    rows = torch.arange(batch, device=device)[:, None].expand_as(pos)
    inside = pos < max_len  # writes past the end are dropped
    cache[rows[inside], pos[inside]] = upd[inside]
    return cache.movedim(1, ax)


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
    out_dtype = query.dtype
    b, t, _ = query.shape
    d_k = query.shape[-1] // q_num_heads
    d_v = value.shape[-1] // kv_num_heads
    group = q_num_heads // kv_num_heads
    f32 = torch.float32
    q4 = _split_heads(query, q_num_heads).to(f32)  # (B, H, T, D)
    k4 = _split_heads(key, kv_num_heads).to(f32)
    v4 = _split_heads(value, kv_num_heads).to(f32)
    g = None
    if gating:
        if decay.shape[-1] == kv_num_heads:
            g = decay.reshape(b, t, kv_num_heads, 1)
        elif decay.shape[-1] == kv_num_heads * d_k:
            g = decay.reshape(b, t, kv_num_heads, d_k)
        else:
            raise ctx.error(
                f"decay's last dimension {decay.shape[-1]} must be kv_num_heads or "
                "kv_num_heads * head_size"
            )
        g = g.to(f32)
    bt = None
    if delta:
        if beta.shape[-1] not in (kv_num_heads, 1):
            raise ctx.error(
                f"beta's last dimension must be kv_num_heads or 1, got {tuple(beta.shape)}"
            )
        bt = beta.reshape(b, t, beta.shape[-1], 1).to(f32)
    if past_state is not None:
        if tuple(past_state.shape) != (b, kv_num_heads, d_k, d_v):
            raise ctx.error(
                f"past_state has shape {tuple(past_state.shape)}, expected "
                f"{(b, kv_num_heads, d_k, d_v)}"
            )
        state_dtype = past_state.dtype
        state = past_state.to(f32)
    else:
        state_dtype = out_dtype
        state = torch.zeros((b, kv_num_heads, d_k, d_v), dtype=f32, device=query.device)
    scale_val = float(scale) if scale else 1.0 / math.sqrt(d_k)
    outs = []
    for step in range(t):
        q_t, k_t, v_t = q4[:, :, step], k4[:, :, step], v4[:, :, step]
        if gating:
            state = state * torch.exp(g[:, step])[..., None]
        if delta:
            retrieved = torch.einsum("bhdm,bhd->bhm", state, k_t)
            v_t = bt[:, step] * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        read = torch.repeat_interleave(state, group, dim=1) if group > 1 else state
        outs.append(scale_val * torch.einsum("bhd,bhdm->bhm", q_t, read))
    output = torch.stack(outs, dim=1).reshape(b, t, q_num_heads * d_v).to(out_dtype)
    return output, state.to(state_dtype)


_ACTIVATIONS = ("none", "silu", "swish")


@builtin("CausalConvWithState", since=27, attrs={"activation": "none"})
def causal_conv_with_state(ctx, x, weight, bias=None, past_state=None, *, activation):
    """CausalConvWithState(input, weight, bias?, past_state?) -> (output, present_state):
    depthwise causal 1-D conv over (B, C, L) with the last k-1 inputs carried as state,
    optionally followed by SiLU."""
    if activation not in _ACTIVATIONS:
        raise ctx.error(f"activation {activation!r} is not one of {list(_ACTIVATIONS)}")
    if x.ndim != 3 or weight.ndim != 3:
        raise ctx.error(f"input and weight must be rank 3, got {x.ndim} and {weight.ndim}")
    b, c, length = x.shape
    ksize = weight.shape[2]
    if past_state is None:
        pad = torch.zeros((b, c, ksize - 1), dtype=x.dtype, device=x.device)
    else:
        pad = past_state.to(x.dtype)
    padded = torch.cat([pad, x], dim=2)
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    w = weight[:, 0, :].to(acc)  # (C, k)
    out = torch.zeros((b, c, length), dtype=acc, device=x.device)
    for j in range(ksize):
        out = out + padded[:, :, j : j + length].to(acc) * w[None, :, j : j + 1]
    if bias is not None:
        out = out + bias.to(acc)[None, :, None]
    out = out.to(x.dtype)
    if activation != "none":
        f = out.to(torch.float32)
        out = (f * torch.sigmoid(f)).to(x.dtype)
    present = padded[:, :, padded.shape[2] - (ksize - 1) :]
    return out, present


def _flex_softmax_dtype(dtype, softmax_precision, ctx):
    if softmax_precision is not None:
        return _onnx_dtype(ctx, softmax_precision)
    if dtype.itemsize < 4:
        return torch.float32
    return dtype


def _run_modifier(ctx, graph, x, what: str):
    outs = ctx.run_subgraph(graph, [x])
    if len(outs) != 1:
        raise ctx.error(f"the {what} subgraph must produce exactly one output, got {len(outs)}")
    out = outs[0].to(x.dtype)
    if out.shape != x.shape:
        raise ctx.error(
            f"the {what} subgraph changed the shape {tuple(x.shape)} to {tuple(out.shape)}"
        )
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
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ctx.error(f"Q, K and V must be rank 4, got {q.ndim}, {k.ndim}, {v.ndim}")
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if q_heads != kv_heads:
        if q_heads % kv_heads:
            raise ctx.error(f"q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
        k = torch.repeat_interleave(k, q_heads // kv_heads, dim=1)
        v = torch.repeat_interleave(v, q_heads // kv_heads, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    root = torch.tensor(scale, dtype=torch.float32).sqrt().to(q.dtype)
    scores = torch.matmul(q * root, (k * root).transpose(-1, -2))
    compute = _flex_softmax_dtype(q.dtype, softmax_precision, ctx)
    scores = scores.to(compute)
    if score_mod is not None:
        scores = _run_modifier(ctx, score_mod, scores, "score_mod")
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True).detach())
    probs = e / reference_sum(e)
    if prob_mod is not None:
        probs = _run_modifier(ctx, prob_mod, probs, "prob_mod")
    return torch.matmul(probs, v.to(compute)).to(v.dtype)
