"""PyTorch source templates: LinearAttention and CausalConvWithState.

Each is a call (``expressions.linear_attention_call``, ``causal_conv_call``) of a generated
helper written in torch as the runtimes compute the op (``ops/attention``): LinearAttention's
recurrence as a loop over time, the causal convolution's taps as a loop over the kernel.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.ops.attention import LINEAR_ATTENTION_ATTRS
from xconv.converters.torch.source.templates import registry, template

registry.helpers["linear_attention"] = '''
def _linear_attention(
    query, key, value, past_state=None, decay=None, beta=None, *, q_num_heads, kv_num_heads,
    scale=0.0,
):
    """ONNX LinearAttention, in float32: per key/value head a state S (d_k, d_v) scaled by
    exp(decay) (gated rules), v corrected by beta * (v - S^T k) (delta rules), then S += k v^T
    and the output scale * q S (query heads share their key/value head), step by step.
    Returns (output, present_state)."""
    (b, t, _), f32 = query.shape, torch.float32
    d_k, d_v = query.shape[-1] // q_num_heads, value.shape[-1] // kv_num_heads
    group = q_num_heads // kv_num_heads
    scale = scale or 1 / math.sqrt(d_k)

    def time_major(x, heads):  # (B, T, heads * D) -> (T, B, heads, D)
        return x.reshape(b, t, heads, -1).permute(1, 0, 2, 3).to(f32)

    q, k, v = (
        time_major(query, q_num_heads),
        time_major(key, kv_num_heads),
        time_major(value, kv_num_heads),
    )
    g = None if decay is None else time_major(decay, kv_num_heads)
    beta = None if beta is None else time_major(beta, beta.shape[-1])
    if past_state is None:
        state = query.new_zeros((b, kv_num_heads, d_k, d_v), dtype=f32)
        state_dtype = query.dtype
    else:
        state, state_dtype = past_state.to(f32), past_state.dtype
    outs = []
    for i in range(t):
        v_i = v[i]
        if g is not None:
            state = state * torch.exp(g[i])[..., None]
        if beta is not None:
            v_i = beta[i] * (v_i - torch.einsum("bhdm,bhd->bhm", state, k[i]))
        state = state + k[i][..., :, None] * v_i[..., None, :]
        read = state.repeat_interleave(group, dim=1) if group > 1 else state
        outs.append(scale * torch.einsum("bhd,bhdm->bhm", q[i], read))
    output = torch.stack(outs).permute(1, 0, 2, 3).reshape(b, t, -1)
    return output.to(query.dtype), state.to(state_dtype)
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
        past_state = x.new_zeros((b, c, k - 1))
    padded = torch.cat([past_state.to(x.dtype), x], dim=2)
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    w = weight[:, 0, :].to(acc)  # (C, k)
    out = x.new_zeros((b, c, length), dtype=acc)
    for j in range(k):
        out = out + padded[:, :, j : j + length].to(acc) * w[None, :, j : j + 1]
    if bias is not None:
        out = out + bias.to(acc)[None, :, None]
    out = out.to(x.dtype)
    if silu:
        f = out.to(torch.float32)
        out = (f * torch.sigmoid(f)).to(x.dtype)
    return out, padded[:, :, padded.shape[2] - (k - 1) :]
'''

template("CausalConvWithState", activation="none")(ex.causal_conv_call)
