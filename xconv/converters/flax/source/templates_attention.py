"""Flax source templates for attention: ONNX's Attention (the generated
``jax.nn.dot_product_attention``, ``_attention``, ``_cached_attention`` or ``_attention_steps``),
RotaryEmbedding and FlexAttention. Importing this module registers them in
``templates.registry``.
"""

from __future__ import annotations

import numpy as np

from xconv.converters import expressions as ex
from xconv.converters import expressions_structured as exs
from xconv.converters.flax.source.attention import BSHD, bhsd_operands, dot_product_attention
from xconv.converters.flax.source.templates import (
    OpCall,
    dtype_expr,
    registry,
    template,
)
from xconv.converters.ops import formulation
from xconv.converters.ops.attention import ATTENTION_ATTRS


def _causal_mask(mask: np.ndarray | None) -> bool:
    """A constant mask that allows exactly what ``is_causal`` allows: a square lower triangle
    (bool, or additive 0 / -inf), the same for every batch and head."""
    if mask is None or mask.ndim < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    n = mask.shape[-1]
    tril = np.broadcast_to(np.tril(np.ones((n, n), dtype=bool)), mask.shape)
    if mask.dtype == np.bool_:
        return bool(np.array_equal(mask, tril))
    if mask.dtype.kind != "f":
        return False
    return bool(np.all(np.where(tril, mask == 0, np.isneginf(mask))))


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
    three_d, dtype = q.ndim == 3, q.dtype
    if three_d:  # (B, S, H*D) -> (B, H, S, D)
        q, k, v = (
            jnp.swapaxes(jnp.reshape(t, (*t.shape[:2], h, -1)), 1, 2)
            for t, h in ((q, q_num_heads), (k, kv_num_heads), (v, kv_num_heads))
        )
    if past_key is not None:
        k = jnp.concatenate([past_key.astype(dtype), k], axis=2)
        v = jnp.concatenate([past_value.astype(dtype), v], axis=2)
    present_key, present_value = k, v
    k, v = (jnp.repeat(t, q.shape[1] // t.shape[1], axis=1) for t in (k, v))
    q_len, kv_len = q.shape[2], k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    offset = 0 if past_key is None else past_key.shape[2]
    if nonpad_kv_seqlen is not None:
        offset = jnp.reshape(nonpad_kv_seqlen, (-1, 1, 1, 1)) - q_len
    ahead = jnp.arange(q_len)[:, None] + offset - jnp.arange(kv_len)  # i + offset - j
    allowed, bias = None, None
    if mask is not None:
        fill = False if mask.dtype == bool else -jnp.inf
        widths = [(0, 0)] * (mask.ndim - 1) + [(0, kv_len - mask.shape[-1])]
        mask = jnp.pad(mask, widths, constant_values=fill)
        allowed, bias = (mask, None) if mask.dtype == bool else (None, mask.astype(dtype))
    rules = [ahead >= 0] if is_causal else []
    if left_window_size >= 0:
        rules.append(ahead <= left_window_size)
    if right_window_size >= 0:
        rules.append(-ahead <= right_window_size)
    if nonpad_kv_seqlen is not None:
        keys = jnp.arange(kv_len) < jnp.reshape(nonpad_kv_seqlen, (-1, 1))
        rules.append(keys[:, None, None, :])
    for rule in rules:
        allowed = rule if allowed is None else allowed & rule
    if allowed is not None:
        blocked = jnp.where(allowed, jnp.zeros((), dtype), -jnp.inf).astype(dtype)
        bias = blocked if bias is None else bias + blocked
    root = jnp.asarray(math.sqrt(scale), dtype)
    scores = (q * root) @ jnp.swapaxes(k * root, -1, -2)
    if softcap > 0:
        cap = jnp.asarray(softcap, dtype)
        scores = jnp.tanh(scores / cap) * cap
    qk = biased = scores if bias is None else scores + bias
    if qk_matmul_output_mode != 2:
        qk = scores
    if softmax_dtype is not None:
        biased = biased.astype(softmax_dtype)
    top = jnp.max(biased, axis=-1, keepdims=True)
    e = jnp.exp(biased - lax.stop_gradient(jnp.where(jnp.isneginf(top), 0, top)))
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total == 0, 1, total)
    if bias is not None:  # a query that may attend nothing gives zeros
        probs = jnp.where(jnp.isneginf(jnp.max(bias, axis=-1, keepdims=True)), 0, probs)
    if qk_matmul_output_mode == 3:
        qk = probs
    y = probs.astype(dtype) @ v
    if three_d:
        y = jnp.reshape(jnp.swapaxes(y, 1, 2), (y.shape[0], q_len, -1))
    return y, present_key, present_value, qk.astype(dtype)
"""


@template("Attention", **ATTENTION_ATTRS)
def _attention(c: OpCall) -> str:
    steps = ex.attention_steps_call(c, dtype_expr)
    if steps is not None:
        return steps
    cached = ex.attention_cache(c)
    # "reference" (xconv.converters.ops.formulation) writes the older einsum-softmax helper.
    name = "attention" if formulation.get("attention") == "auto" else "attention_reference"
    if cached:
        c.helpers.add(name)
        c.helpers.add("cached_attention")
        return ex.cached_attention_call(c, f"_cached_attention(_{name}, ")
    mask = c.args[3] if c.has(3) else "None"
    causal = bool(c.attrs["is_causal"])
    if c.has(3) and _causal_mask(c.consts[3]):
        mask, causal = "None", True  # the mask a causal model builds: is_causal says it
    direct = dot_product_attention(c, mask, causal) if name == "attention" else None
    if direct is not None:
        return direct
    c.helpers.add(name)
    # the helper's defaults (no mask, not causal, 1/sqrt(d), 4-D inputs) are not spelled out
    args = bhsd_operands(c) + ([mask] if mask != "None" else [])
    out = f"_{name}({', '.join(args + ex.attention_keywords(c, causal))})"
    return f"jnp.swapaxes({out}, 1, 2)" if c.node.metadata_props.get(BSHD) else out


registry.helpers["rotary_embedding"] = '''
def _rotary_embedding(
    x, cos, sin, position_ids=None, interleaved=False, num_heads=0, rotary_embedding_dim=0
):
    """ONNX RotaryEmbedding: the first ``rotary_embedding_dim`` features of each head rotated
    by the cos / sin caches (their rows at ``position_ids`` when given), as halves or as
    interleaved pairs; x is (B, H, S, D), or (B, S, H*D) with ``num_heads``."""
    four_d = x.ndim == 4
    h = jnp.swapaxes(x, 1, 2) if four_d else jnp.reshape(x, (*x.shape[:2], num_heads, -1))
    rdim = rotary_embedding_dim or h.shape[-1]
    half = rdim // 2
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos[:, :, None, :].astype(h.dtype), sin[:, :, None, :].astype(h.dtype)
    rot, keep = h[..., :rdim], h[..., rdim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rot = jnp.reshape(jnp.stack([real, imag], axis=-1), rot.shape)
    else:
        rot = jnp.concatenate([real, imag], axis=-1)
    out = jnp.concatenate([rot, keep], axis=-1)
    return jnp.swapaxes(out, 1, 2) if four_d else jnp.reshape(out, x.shape)
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
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    root = jnp.asarray(np.sqrt(np.float32(scale)), q.dtype)
    scores = jnp.matmul(q * root, jnp.swapaxes(k * root, -1, -2))
    if compute is None:
        compute = jnp.float32 if q.dtype.itemsize < 4 else q.dtype
    scores = scores.astype(compute)
    if score_mod is not None:
        scores = jnp.asarray(score_mod(scores)[0]).astype(compute)
    e = jnp.exp(scores - lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    if prob_mod is not None:
        probs = jnp.asarray(prob_mod(probs)[0]).astype(compute)
    return jnp.matmul(probs, v.astype(compute)).astype(v.dtype)
'''


@registry.builtin("FlexAttention", domain="ai.onnx.preview", attrs=exs.FLEX_ATTENTION_ATTRS)
def _flex_attention(c: OpCall) -> str:
    return exs.flex_attention_call(c, dtype_expr)
