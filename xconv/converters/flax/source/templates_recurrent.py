"""Flax source templates: LinearAttention and CausalConvWithState.

Each is a call (``expressions.linear_attention_call``, ``causal_conv_call``) of a generated
helper written in ``jnp`` as the runtimes compute the op (``ops/attention``): LinearAttention's
recurrence under ``lax.scan``, the causal convolution's taps as a Python loop (the kernel size
is static).
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.flax.source.templates import registry, template
from xconv.converters.ops.attention import LINEAR_ATTENTION_ATTRS

registry.helpers["linear_attention"] = '''
def _linear_attention(
    query, key, value, past_state=None, decay=None, beta=None, *, q_num_heads, kv_num_heads,
    scale=0.0,
):
    """ONNX LinearAttention, in float32: per key/value head a state S (d_k, d_v) scaled by
    exp(decay) (gated rules), v corrected by beta * (v - S^T k) (delta rules), then S += k v^T
    and the output scale * q S (query heads share their key/value head), step by step under
    lax.scan. Returns (output, present_state)."""
    (b, t, _), f32 = query.shape, jnp.float32
    d_k, d_v = query.shape[-1] // q_num_heads, value.shape[-1] // kv_num_heads
    group = q_num_heads // kv_num_heads
    scale = scale or 1 / math.sqrt(d_k)

    def time_major(x, heads):  # (B, T, heads * D) -> (T, B, heads, D)
        return jnp.transpose(jnp.reshape(x, (b, t, heads, -1)), (1, 0, 2, 3)).astype(f32)

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        if g_t is not None:
            state = state * jnp.exp(g_t)[..., None]
        if b_t is not None:
            v_t = b_t * (v_t - jnp.einsum("bhdm,bhd->bhm", state, k_t))
        state = state + k_t[..., :, None] * v_t[..., None, :]
        read = jnp.repeat(state, group, axis=1) if group > 1 else state
        return state, scale * jnp.einsum("bhd,bhdm->bhm", q_t, read)

    xs = (
        time_major(query, q_num_heads),
        time_major(key, kv_num_heads),
        time_major(value, kv_num_heads),
        None if decay is None else time_major(decay, kv_num_heads),
        None if beta is None else time_major(beta, beta.shape[-1]),
    )
    if past_state is None:
        state, state_dtype = jnp.zeros((b, kv_num_heads, d_k, d_v), f32), query.dtype
    else:
        state, state_dtype = past_state.astype(f32), past_state.dtype
    state, outs = lax.scan(step, state, xs)  # outs: (T, B, q_num_heads, d_v)
    output = jnp.reshape(jnp.transpose(outs, (1, 0, 2, 3)), (b, t, -1))
    return output.astype(query.dtype), state.astype(state_dtype)
'''

template("LinearAttention", **LINEAR_ATTENTION_ATTRS)(ex.linear_attention_call)


registry.helpers["causal_conv_with_state"] = '''
def _causal_conv_with_state(x, weight, bias=None, past_state=None, silu=False):
    """ONNX CausalConvWithState: a depthwise causal 1-D convolution of x (B, C, L) whose left
    context is past_state (zeros without it), summed in float32 for 16-bit floats, then SiLU
    when asked. Returns (output, present_state: the last kernel_size - 1 inputs)."""
    b, c, length = x.shape
    k = weight.shape[2]
    if past_state is None:
        past_state = jnp.zeros((b, c, k - 1), x.dtype)
    padded = jnp.concatenate([past_state.astype(x.dtype), x], axis=2)
    acc = jnp.float32 if x.dtype in (jnp.float16, jnp.bfloat16) else x.dtype
    w = weight[:, 0, :].astype(acc)  # (C, k)
    out = jnp.zeros((b, c, length), acc)
    for j in range(k):
        out = out + padded[:, :, j : j + length].astype(acc) * w[None, :, j : j + 1]
    if bias is not None:
        out = out + bias.astype(acc)[None, :, None]
    out = out.astype(x.dtype)
    if silu:
        f = out.astype(jnp.float32)
        out = (f * jax.nn.sigmoid(f)).astype(x.dtype)
    return out, padded[:, :, padded.shape[2] - (k - 1) :]
'''

template("CausalConvWithState", activation="none")(ex.causal_conv_call)
