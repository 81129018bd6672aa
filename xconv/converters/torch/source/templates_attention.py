"""PyTorch source templates for attention: ONNX's Attention (``F.scaled_dot_product_attention``,
or the generated ``_cached_attention`` or ``_attention_steps``), RotaryEmbedding and
FlexAttention. Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters import expressions_structured as exs
from xconv.converters.ops.attention import ATTENTION_ATTRS
from xconv.converters.torch.source.templates import (
    OpCall,
    dtype_expr,
    registry,
    template,
)

registry.helpers["cached_attention"] = '''
def _cached_attention(
    q, k, v, past_key=None, past_value=None, mask=None, is_causal=False, scale=None,
    q_num_heads=0, kv_num_heads=0,
):
    """(Y, present_key, present_value) of ONNX Attention: F.scaled_dot_product_attention of
    q over the cached keys and values followed by the new ones, all (B, H, S, D), a causal
    mask aligned to the last query (and combined with ``mask``). 3-D inputs (B, S, H*D) are
    split into heads first and Y merged back."""
    b, three_d = q.shape[0], q.dim() == 3
    if three_d:
        q, k, v = (
            t.reshape(b, t.shape[1], n, -1).transpose(1, 2)
            for t, n in ((q, q_num_heads), (k, kv_num_heads), (v, kv_num_heads))
        )
    past = 0
    if past_key is not None:
        past = past_key.shape[2]
        k = torch.cat([past_key.to(k.dtype), k], dim=2)
        v = torch.cat([past_value.to(v.dtype), v], dim=2)
    if is_causal:
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        causal = causal.tril(past)
        if mask is None or mask.dtype == torch.bool:
            mask = causal if mask is None else mask & causal
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    if three_d:
        y = y.transpose(1, 2).reshape(b, y.shape[2], -1)
    return y, k, v
'''


registry.helpers["attention_steps"] = """
def _attention_steps(
    q, k, v, mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
    is_causal=False, scale=None, q_num_heads=0, kv_num_heads=0, softcap=0.0,
    qk_matmul_output_mode=0, softmax_dtype=None, left_window_size=-1, right_window_size=-1,
):
    \"\"\"ONNX Attention step by step, as its reference computes it: q and k each scaled by
    sqrt(scale), softcap, the mask, the causal frontier (after the cache, or each batch's
    nonpad_kv_seqlen keys) and the sliding window as -inf biases, a softmax whose fully
    masked rows are zero. Returns (Y, present_key, present_value, the scores at
    qk_matmul_output_mode's stage).\"\"\"
    three_d, dtype = q.dim() == 3, q.dtype
    if three_d:  # (B, S, H*D) -> (B, H, S, D)
        q, k, v = (
            t.reshape(*t.shape[:2], h, -1).transpose(1, 2)
            for t, h in ((q, q_num_heads), (k, kv_num_heads), (v, kv_num_heads))
        )
    if past_key is not None:
        k = torch.cat([past_key.to(dtype), k], dim=2)
        v = torch.cat([past_value.to(dtype), v], dim=2)
    present_key, present_value = k, v
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    q_len, kv_len = q.shape[2], k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    positions = torch.arange(kv_len, device=q.device)
    offset = 0 if past_key is None else past_key.shape[2]
    if nonpad_kv_seqlen is not None:
        offset = nonpad_kv_seqlen.reshape(-1, 1, 1, 1) - q_len
    ahead = torch.arange(q_len, device=q.device)[:, None] + offset - positions  # i + offset - j
    allowed, bias = None, None
    if mask is not None:
        fill = False if mask.dtype == torch.bool else float("-inf")
        mask = F.pad(mask, (0, kv_len - mask.shape[-1]), value=fill)
        allowed, bias = (mask, None) if mask.dtype == torch.bool else (None, mask.to(dtype))
    rules = [ahead >= 0] if is_causal else []
    if left_window_size >= 0:
        rules.append(ahead <= left_window_size)
    if right_window_size >= 0:
        rules.append(-ahead <= right_window_size)
    if nonpad_kv_seqlen is not None:
        rules.append((positions < nonpad_kv_seqlen.reshape(-1, 1))[:, None, None, :])
    for rule in rules:
        allowed = rule if allowed is None else allowed & rule
    if allowed is not None:
        blocked = torch.zeros((), dtype=dtype).masked_fill(~allowed, float("-inf"))
        bias = blocked if bias is None else bias + blocked
    root = torch.tensor(math.sqrt(scale), dtype=dtype)
    scores = (q * root) @ (k * root).transpose(-1, -2)
    if softcap > 0:
        cap = torch.tensor(softcap, dtype=dtype)
        scores = torch.tanh(scores / cap) * cap
    qk = biased = scores if bias is None else scores + bias
    if qk_matmul_output_mode != 2:
        qk = scores
    if softmax_dtype is not None:
        biased = biased.to(softmax_dtype)
    top = biased.amax(dim=-1, keepdim=True)
    e = torch.exp(biased - torch.where(torch.isneginf(top), 0, top).detach())
    total = e.sum(dim=-1, keepdim=True)
    probs = e / torch.where(total == 0, 1, total)
    if bias is not None:  # a query that may attend nothing gives zeros
        probs = torch.where(torch.isneginf(bias.amax(dim=-1, keepdim=True)), 0, probs)
    if qk_matmul_output_mode == 3:
        qk = probs
    y = probs.to(dtype) @ v
    if three_d:
        y = y.transpose(1, 2).reshape(y.shape[0], q_len, -1)
    return y, present_key, present_value, qk.to(dtype)
"""


@template("Attention", **ATTENTION_ATTRS)
def _attention(c: OpCall) -> str:
    """``F.scaled_dot_product_attention`` on 4-D heads; the generated ``_cached_attention``
    where ONNX's Attention does more: a key/value cache (past inputs, present outputs), 3-D
    inputs, a mask together with is_causal."""
    steps = ex.attention_steps_call(c, dtype_expr)
    if steps is not None:
        return steps
    cached = ex.attention_cache(c)
    rank = c.need_rank(0)
    if rank not in (3, 4):
        raise c.fail(f"Attention inputs of rank {rank}; ONNX defines 3-D and 4-D")
    if cached or rank == 3 or (c.has(3) and c.attrs["is_causal"]):
        c.helpers.add("cached_attention")
        return ex.cached_attention_call(c, "_cached_attention(")
    q, k, v = c.args[:3]
    extra = [f"attn_mask={c.args[3]}"] if c.has(3) else []
    extra += ex.attention_keywords(c, bool(c.attrs["is_causal"]), heads=False)
    hq, hk = c.shapes[0][1] if c.shapes[0] else None, c.shapes[1][1] if c.shapes[1] else None
    if isinstance(hq, int) and isinstance(hk, int) and hq != hk:
        extra.append("enable_gqa=True")
    tail = "".join(f", {e}" for e in extra)
    return f"F.scaled_dot_product_attention({q}, {k}, {v}{tail})"


registry.helpers["rotary_embedding"] = '''
def _rotary_embedding(
    x, cos, sin, position_ids=None, interleaved=False, num_heads=0, rotary_embedding_dim=0
):
    """ONNX RotaryEmbedding: the first ``rotary_embedding_dim`` features of each head rotated
    by the cos / sin caches (their rows at ``position_ids`` when given), as halves or as
    interleaved pairs; x is (B, H, S, D), or (B, S, H*D) with ``num_heads``."""
    four_d = x.ndim == 4
    h = x.transpose(1, 2) if four_d else x.reshape(*x.shape[:2], num_heads, -1)
    rdim = rotary_embedding_dim or h.shape[-1]
    half = rdim // 2
    if position_ids is not None:
        cos, sin = cos[position_ids.long()], sin[position_ids.long()]
    cos, sin = cos[:, :, None, :].to(h.dtype), sin[:, :, None, :].to(h.dtype)
    rot, keep = h[..., :rdim], h[..., rdim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rot = torch.stack([real, imag], dim=-1).reshape(rot.shape)
    else:
        rot = torch.cat([real, imag], dim=-1)
    out = torch.cat([rot, keep], dim=-1)
    return out.transpose(1, 2) if four_d else out.reshape(x.shape)
'''


@template("RotaryEmbedding", interleaved=0, num_heads=0, rotary_embedding_dim=0)
def _rotary_embedding(c: OpCall) -> str:
    c.helpers.add("rotary_embedding")
    return ex.rotary_call(c)


registry.helpers["flex_attention"] = '''
def _flex_attention(q, k, v, scale=None, score_mod=None, prob_mod=None, compute=None):
    """ONNX FlexAttention (ai.onnx.preview) of (B, H, S, D) heads: Q K^T (each scaled by
    sqrt(scale)), in ``compute`` (float32 for narrower inputs), then score_mod, a softmax over
    the keys, prob_mod, and the product with V; K / V heads repeated for grouped queries."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    root = torch.tensor(scale, dtype=torch.float32).sqrt().to(q.dtype)
    scores = torch.matmul(q * root, (k * root).transpose(-1, -2))
    if compute is None:
        compute = torch.float32 if q.dtype.itemsize < 4 else q.dtype
    scores = scores.to(compute)
    if score_mod is not None:
        scores = torch.as_tensor(score_mod(scores)[0]).to(compute)
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True).detach())
    probs = e / e.sum(dim=-1, keepdim=True)
    if prob_mod is not None:
        probs = torch.as_tensor(prob_mod(probs)[0]).to(compute)
    return torch.matmul(probs, v.to(compute)).to(v.dtype)
'''


@registry.builtin("FlexAttention", domain="ai.onnx.preview", attrs=exs.FLEX_ATTENTION_ATTRS)
def _flex_attention(c: OpCall) -> str:
    return exs.flex_attention_call(c, dtype_expr)
