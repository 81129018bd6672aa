"""Helper functions the Flax emitter's templates may call, written once into the module.

A template that needs one adds its name to ``call.helpers``; the emitter writes the source of
each helper used (``registry.helpers``) once, after the imports.
"""

from __future__ import annotations

from xconv.converters.flax.source.templates import registry

_BUILTIN: dict[str, str] = {
    # torch updates running_var with the unbiased batch variance (n / (n - 1)), Flax's
    # BatchNorm with the biased one; a torch source's BatchNorm keeps torch's statistics.
    "torch_batch_norm_linen": '''
def _torch_batch_norm(bn, x, train):
    """Flax BatchNorm with torch's running-variance update (unbiased batch variance)."""
    y = bn(x, use_running_average=not train)
    if train and not bn.is_initializing():
        x = x.reshape(-1, x.shape[-1])
        var = bn.get_variable("batch_stats", "var") + (1 - bn.momentum) * x.var(0) / (len(x) - 1)
        bn.put_variable("batch_stats", "var", var)
    return y
''',
    "torch_batch_norm_nnx": '''
def _torch_batch_norm(bn, x, train):
    """Flax BatchNorm with torch's running-variance update (unbiased batch variance)."""
    y = bn(x, use_running_average=not train)
    if train:
        x = x.reshape(-1, x.shape[-1])
        bn.var.value += (1 - bn.momentum) * x.var(0) / (len(x) - 1)
    return y
''',
    # torch's nn.MultiheadAttention as one call on its packed weights (torch layout): the
    # variables stay the source's in_proj / out_proj, so the weights mapping is unchanged.
    "torch_mha": '''
def _torch_mha(m, x, heads, dtype=None):
    """torch's MultiheadAttention: self-attention on (B, T, E), no mask, packed q, k, v; with
    ``dtype``, computed in it on the float32 variables (the softmax in float32)."""
    b, t, e = x.shape
    cast = lambda v: v[...] if dtype is None else v[...].astype(dtype)  # noqa: E731
    qkv = cast(x) @ cast(m.in_proj_kernel).T + cast(m.in_proj_bias)
    q, k, v = jnp.split(qkv.reshape(b, t, 3 * heads, -1), 3, axis=2)
    h = jax.nn.dot_product_attention(q, k, v).reshape(b, t, e)
    return h @ cast(m.out_proj_kernel).T + cast(m.out_proj_bias)
''',
    # xconv.converters.ops.reduce.mean: XLA:CPU sums all the reduced elements of an output in
    # one running sum, whose rounding error on a near-constant map grows with their count.
    "mean": '''
def _mean(x, axis, keepdims=False):
    """jnp.mean over the axes ``axis``, one axis at a time: the same mean, with each axis's
    values summed on their own, which XLA:CPU rounds less on a near-constant map."""
    for a in sorted(axis, reverse=True):
        x = jnp.mean(x, axis=a, keepdims=True)
    return x if keepdims else jnp.squeeze(x, axis)
''',
    # NegativeLogLikelihoodLoss (xconv.converters.ops.linalg): torch's F.nll_loss.
    "nll_loss": '''
def _nll_loss(logp, target, weight=None, reduction="mean", ignore_index=None):
    """-logp[n, target[n, ...], ...] times weight[target] (entries equal to ``ignore_index``
    left out), summed, averaged over the weights ("mean") or kept ("none"): torch's
    F.nll_loss for logp (N, C, ...) and target (N, ...)."""
    valid = None if ignore_index is None else target != ignore_index
    safe = target if valid is None else jnp.where(valid, target, 0)
    safe = jnp.clip(safe, 0, logp.shape[1] - 1)
    loss = -jnp.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    w = None if weight is None else weight.astype(loss.dtype)[safe]
    if valid is not None:
        w = jnp.where(valid, jnp.ones_like(loss) if w is None else w, 0).astype(loss.dtype)
        loss = jnp.where(valid, loss, 0)
    if w is not None:
        loss = loss * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (loss.size if w is None else w.sum())
''',
    "softmax_cross_entropy": '''
def _softmax_cross_entropy(scores, labels, weight=None, reduction="mean", ignore_index=None):
    """(loss, log_prob): _nll_loss of the log-softmax over the classes (axis 1), and it."""
    log_prob = jax.nn.log_softmax(scores, axis=1)
    return _nll_loss(log_prob, labels, weight, reduction, ignore_index), log_prob
''',
    "reshape": '''
def _reshape(x, shape):
    """ONNX Reshape: 0 copies the input dimension, -1 is inferred."""
    dims = [x.shape[i] if int(d) == 0 else int(d) for i, d in enumerate(shape)]
    return jnp.reshape(x, dims)
''',
    "layer_norm": """
def _layer_norm(x, scale, bias, axis, epsilon):
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) * lax.rsqrt(var + epsilon) * scale
    return y if bias is None else y + bias
""",
    # LayerNormalization with its Mean / InvStdDev outputs (xconv.converters.ops.normalization)
    "layer_norm_stats": """
def _layer_norm_stats(x, scale, bias, axis, epsilon):
    \"\"\"(Y, Mean, InvStdDev) of ONNX's LayerNormalization: the statistics in float32 over the
    axes from ``axis``, kept as size-1 axes.\"\"\"
    axes = tuple(range(axis % x.ndim, x.ndim))
    xs = x.astype(jnp.float32)
    mean = jnp.mean(xs, axis=axes, keepdims=True)
    inv = lax.rsqrt(jnp.mean(jnp.square(xs - mean), axis=axes, keepdims=True) + epsilon)
    y = ((xs - mean) * inv).astype(x.dtype) * scale
    return (y if bias is None else y + bias), mean, inv
""",
    "rms_norm": """
def _rms_norm(x, scale, axis, epsilon):
    axes = tuple(range(axis % x.ndim, x.ndim))
    return x * lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + epsilon) * scale
""",
    "group_norm": """
def _group_norm(x, scale, bias, num_groups, epsilon):
    n, c = x.shape[:2]
    g = jnp.reshape(x, (n, num_groups, -1))
    mean = jnp.mean(g, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(g - mean), axis=-1, keepdims=True)
    y = jnp.reshape((g - mean) * lax.rsqrt(var + epsilon), x.shape)
    bshape = (1, c) + (1,) * (x.ndim - 2)
    return y * jnp.reshape(scale, bshape) + jnp.reshape(bias, bshape)
""",
    "attention": '''
def _attention(q, k, v, mask=None, is_causal=False, scale=None, q_num_heads=0, kv_num_heads=0):
    """ONNX Attention (opset 23) without past key/value: 4-D (B, H, S, D) or 3-D (B, S, H*D)
    inputs, computed in their own layout (head- or sequence-major, no transposes). A query
    row nothing may attend gives zeros."""
    three_d = q.ndim == 3
    if three_d:
        b = q.shape[0]
        q = jnp.reshape(q, (b, q.shape[1], q_num_heads, -1))
        k = jnp.reshape(k, (b, k.shape[1], kv_num_heads, -1))
        v = jnp.reshape(v, (b, v.shape[1], kv_num_heads, -1))
    head, seq = (2, 1) if three_d else (1, 2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    groups = q.shape[head] // k.shape[head]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=head)
        v = jnp.repeat(v, groups, axis=head)
    lhs = "bqhd,bkhd->bhqk" if three_d else "bhqd,bhkd->bhqk"
    scores = jnp.einsum(lhs, q, k) * jnp.asarray(scale, q.dtype)
    lowest = jnp.finfo(scores.dtype).min
    allowed = empty = None
    if is_causal:
        allowed = jnp.tril(jnp.ones((q.shape[seq], k.shape[seq]), dtype=bool))
    if mask is not None and mask.dtype == bool:
        allowed = mask if allowed is None else mask & allowed
        empty = ~jnp.any(allowed, axis=-1, keepdims=True)
    elif mask is not None:
        scores = scores + jnp.maximum(mask, lowest)
        dead = jnp.isneginf(mask) if allowed is None else jnp.isneginf(mask) | ~allowed
        empty = jnp.all(dead, axis=-1, keepdims=True)
    if allowed is not None:
        scores = jnp.where(allowed, scores, lowest)
    probs = jax.nn.softmax(scores, axis=-1)
    if empty is not None:
        probs = jnp.where(empty, 0, probs)
    rhs = "bhqk,bkhd->bqhd" if three_d else "bhqk,bhkd->bhqd"
    out = jnp.einsum(rhs, probs, v)
    return jnp.reshape(out, (b, out.shape[1], -1)) if three_d else out
''',
    # ONNX Attention with past key / value inputs or present key / value outputs: the cache
    # as ONNX keeps it, (B, H, S, D), around the module's attention helper.
    "cached_attention": '''
def _cached_attention(
    attend, q, k, v, past_key=None, past_value=None, mask=None, is_causal=False, scale=None,
    q_num_heads=0, kv_num_heads=0,
):
    """(Y, present_key, present_value) of ONNX Attention: ``attend`` (the module's attention
    helper) of q over the cached keys and values followed by the new ones, all (B, H, S, D),
    a causal mask aligned to the last query. 3-D inputs (B, S, H*D) are split into heads
    first and Y merged back."""
    b, three_d = q.shape[0], q.ndim == 3
    if three_d:
        def heads(t, n):
            return jnp.swapaxes(jnp.reshape(t, (b, t.shape[1], n, -1)), 1, 2)

        q, k, v = heads(q, q_num_heads), heads(k, kv_num_heads), heads(v, kv_num_heads)
    past = 0
    if past_key is not None:
        past = past_key.shape[2]
        k = jnp.concatenate([past_key.astype(k.dtype), k], axis=2)
        v = jnp.concatenate([past_value.astype(v.dtype), v], axis=2)
    if is_causal:
        causal = jnp.tril(jnp.ones((q.shape[2], k.shape[2]), dtype=bool), past)
        if mask is None or mask.dtype == bool:
            mask = causal if mask is None else mask & causal
        else:
            mask = jnp.where(causal, mask, -jnp.inf)
    y = attend(q, k, v, mask, scale=scale)
    if three_d:
        y = jnp.reshape(jnp.swapaxes(y, 1, 2), (b, y.shape[2], -1))
    return y, k, v
''',
    "attention_reference": '''
def _attention_reference(
    q, k, v, mask=None, is_causal=False, scale=None, q_num_heads=0, kv_num_heads=0
):
    """ONNX Attention (opset 23) without past key/value: 4-D (B, H, S, D) or 3-D inputs."""
    three_d = q.ndim == 3
    if three_d:
        b = q.shape[0]
        q = jnp.transpose(jnp.reshape(q, (b, q.shape[1], q_num_heads, -1)), (0, 2, 1, 3))
        k = jnp.transpose(jnp.reshape(k, (b, k.shape[1], kv_num_heads, -1)), (0, 2, 1, 3))
        v = jnp.transpose(jnp.reshape(v, (b, v.shape[1], kv_num_heads, -1)), (0, 2, 1, 3))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=1)
        v = jnp.repeat(v, groups, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if is_causal:
        causal = jnp.tril(jnp.ones((q.shape[2], k.shape[2]), dtype=bool))
        scores = jnp.where(causal, scores, -jnp.inf)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf) if mask.dtype == bool else scores + mask
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
    if three_d:
        out = jnp.reshape(jnp.transpose(out, (0, 2, 1, 3)), (out.shape[0], out.shape[2], -1))
    return out
''',
    "rnn_scan": """
def _rnn_scan(step, xs, carry, lens, reverse):
    \"\"\"Scan ``step(carry, x_t) -> (carry, y_t)`` over time (axis 0).

    With ``lens`` each batch entry stops at its own length: its state is frozen and its
    later outputs are zero; in reverse it starts from its own last step.
    \"\"\"
    if lens is None:
        carry, ys = lax.scan(step, carry, xs, reverse=reverse)
        return ys, carry
    t = jnp.arange(xs.shape[0])[:, None]
    valid = t < lens[None, :]
    if reverse:
        order = jnp.where(valid, lens[None, :] - 1 - t, t)
        xs = jnp.take_along_axis(xs, order[:, :, None], axis=0)

    def masked(carry, inp):
        x_t, ok = inp
        new, y = step(carry, x_t)
        keep = ok[:, None]
        new = jax.tree_util.tree_map(lambda n, o: jnp.where(keep, n, o), new, carry)
        return new, jnp.where(keep, y, 0)

    carry, ys = lax.scan(masked, carry, (xs, valid))
    if reverse:
        ys = jnp.take_along_axis(ys, order[:, :, None], axis=0)
    return ys, carry
""",
    "rnn": """
def _rnn(x, w, r, b, lens, h0, *, reverse, batch_first):
    \"\"\"ONNX RNN (tanh): weights (directions, hidden, in); returns (Y, Y_h).\"\"\"
    if batch_first:
        x, h0 = jnp.swapaxes(x, 0, 1), None if h0 is None else jnp.swapaxes(h0, 0, 1)
    ys, hs = [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        if b is not None:
            wb, rb = jnp.split(b[d], 2)
            xw = xw + wb + rb
        h = jnp.zeros((x.shape[1], r.shape[-1]), x.dtype) if h0 is None else h0[d]

        def step(h, xw_t, r_d=r[d]):
            h = jnp.tanh(xw_t + h @ r_d.T)
            return h, h

        y, h = _rnn_scan(step, xw, h, lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
    y, h = jnp.stack(ys, 1), jnp.stack(hs)
    if batch_first:
        return jnp.transpose(y, (2, 0, 1, 3)), jnp.swapaxes(h, 0, 1)
    return y, h
""",
    "gru": """
def _gru(x, w, r, b, lens, h0, *, reverse, batch_first, linear_before_reset):
    \"\"\"ONNX GRU, gates z, r, h: weights (directions, 3 * hidden, in); returns (Y, Y_h).\"\"\"
    if batch_first:
        x, h0 = jnp.swapaxes(x, 0, 1), None if h0 is None else jnp.swapaxes(h0, 0, 1)
    hidden = r.shape[-1]
    ys, hs = [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        rb = jnp.zeros((3 * hidden,), x.dtype)
        if b is not None:
            wb, rb = jnp.split(b[d], 2)
            xw = xw + wb
        h = jnp.zeros((x.shape[1], hidden), x.dtype) if h0 is None else h0[d]

        def step(h, xw_t, r_d=r[d], rb=rb):
            xz, xr, xh = jnp.split(xw_t, 3, axis=-1)
            rz, rr, rh = jnp.split(r_d, 3)
            bz, br, bh = jnp.split(rb, 3)
            z = jax.nn.sigmoid(xz + h @ rz.T + bz)
            reset = jax.nn.sigmoid(xr + h @ rr.T + br)
            if linear_before_reset:
                n = jnp.tanh(xh + reset * (h @ rh.T + bh))
            else:
                n = jnp.tanh(xh + (reset * h) @ rh.T + bh)
            h = (1 - z) * n + z * h
            return h, h

        y, h = _rnn_scan(step, xw, h, lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
    y, h = jnp.stack(ys, 1), jnp.stack(hs)
    if batch_first:
        return jnp.transpose(y, (2, 0, 1, 3)), jnp.swapaxes(h, 0, 1)
    return y, h
""",
    "lstm": """
def _lstm(x, w, r, b, lens, h0, c0, p, *, reverse, batch_first):
    \"\"\"ONNX LSTM, gates i, o, f, c: weights (directions, 4 * hidden, in); (Y, Y_h, Y_c).\"\"\"
    if batch_first:
        x = jnp.swapaxes(x, 0, 1)
        h0 = None if h0 is None else jnp.swapaxes(h0, 0, 1)
        c0 = None if c0 is None else jnp.swapaxes(c0, 0, 1)
    hidden = r.shape[-1]
    ys, hs, cs = [], [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        if b is not None:
            wb, rb = jnp.split(b[d], 2)
            xw = xw + wb + rb
        zeros = jnp.zeros((x.shape[1], hidden), x.dtype)
        h = zeros if h0 is None else h0[d]
        c = zeros if c0 is None else c0[d]
        pi, po, pf = (0, 0, 0) if p is None else jnp.split(p[d], 3)

        def step(carry, xw_t, r_d=r[d], pi=pi, po=po, pf=pf):
            h, c = carry
            i, o, f, g = jnp.split(xw_t + h @ r_d.T, 4, axis=-1)
            i = jax.nn.sigmoid(i + pi * c)
            f = jax.nn.sigmoid(f + pf * c)
            c = f * c + i * jnp.tanh(g)
            h = jax.nn.sigmoid(o + po * c) * jnp.tanh(c)
            return (h, c), h

        y, (h, c) = _rnn_scan(step, xw, (h, c), lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
        cs.append(c)
    y, h, c = jnp.stack(ys, 1), jnp.stack(hs), jnp.stack(cs)
    if batch_first:
        return jnp.transpose(y, (2, 0, 1, 3)), jnp.swapaxes(h, 0, 1), jnp.swapaxes(c, 0, 1)
    return y, h, c
""",
}


registry.helpers.update(_BUILTIN)
