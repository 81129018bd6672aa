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
    # A table of a few rows (ops.indexing.SELECT_ROWS): the variables stay nn.Embed's.
    "embed_rows": '''
def _embed_rows(embed, ids):
    """``embed(ids)`` for an embedding of a few rows (token types), by ``jnp.where`` over
    its rows: the same values as the embedding's ``jnp.take``, and one sum per row as
    the gradient, where a take's is a scatter-add (slow on GPUs in bfloat16 when many
    positions hit few rows)."""
    vectors = embed.embedding[...]
    vectors = vectors.astype(embed.dtype or vectors.dtype)
    ids = jnp.where(ids < 0, ids + len(vectors), ids)
    out = jnp.broadcast_to(vectors[0], (*ids.shape, *vectors.shape[1:]))
    for row in range(1, len(vectors)):
        out = jnp.where((ids == row)[..., None], vectors[row], out)
    return out
''',
    # torch's nn.MultiheadAttention as one call on its packed weights (torch layout): the
    # variables stay the source's in_proj / out_proj, so the weights mapping is unchanged.
    "torch_mha": '''
def _torch_mha(m, x, heads, dtype=None):
    """torch's MultiheadAttention: self-attention on (B, T, E), no mask, packed q, k, v; with
    ``dtype``, computed in it on the float32 variables (the softmax in float32)."""
    b, t, e = x.shape
    cast = lambda v: v[...] if dtype is None else v[...].astype(dtype)  # noqa: E731
    # the projections as 2-D matmuls over (B * T, E) rows, whose weight gradients XLA:CPU
    # computes faster than those of 3-D products
    x = cast(x.reshape(b * t, e))
    qkv = (x @ cast(m.in_proj_kernel).T + cast(m.in_proj_bias)).reshape(b, t, 3, heads, -1)
    h = _dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    h = h.reshape(b * t, e) @ cast(m.out_proj_kernel).T + cast(m.out_proj_bias)
    return h.reshape(b, t, e)
''',
    # xconv.converters.ops.formulation "attention": XLA:CPU runs softmax attention on
    # head-major heads faster than jax.nn.dot_product_attention's sequence-major einsums.
    "dot_product_attention": '''
def _dot_product_attention(q, k, v, scale=None, is_causal=False):
    """jax.nn.dot_product_attention on (B, S, H, D) arrays; on the CPU as einsums over
    head-major (B, H, S, D) heads, which XLA:CPU runs faster. The scores and the softmax are
    in float32 (at least), as in jax.nn's."""
    if jax.default_backend() != "cpu":
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each k, v head serves a group
        k, v = (jnp.repeat(t, q.shape[1] // t.shape[1], axis=1) for t in (k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = jnp.promote_types(q.dtype, jnp.float32)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=acc) * scale
    if is_causal:
        causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(acc).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.swapaxes(jnp.einsum("bhqk,bhkd->bhqd", probs, v), 1, 2)
''',
    # xconv.converters.ops.formulation "conv": on the CPU, XLA runs a 1x1 convolution and a
    # small 2-D one with 64+ input channels faster as a matmul over its patches (as to_jax's).
    "matmul_conv": '''
def _matmul_conv(lhs, rhs, window_strides, padding, **kwargs):
    """On the CPU, a 1x1 convolution (no padding), or a 2-D one with 64+ input channels and at
    most 2**21 patch elements, as one matmul over its patches, which XLA runs faster than
    lax.conv_general_dilated; other backends and convolutions convolve."""
    k, c, strides = rhs.shape[:-2], rhs.shape[-2], tuple(window_strides)
    if isinstance(padding, str):
        padding = lax.padtype_to_pads(lhs.shape[1:-1], k, strides, padding)
    pads = [int(p) for pair in padding for p in pair]
    sizes = zip(lhs.shape[1:-1], padding, k, strides, strict=True)
    out = [(n + lo + hi - kk) // s + 1 for n, (lo, hi), kk, s in sizes]
    pointwise = set(k) <= {1} and not any(pads)
    small = len(k) == 2 and c >= 64 and len(lhs) * math.prod(out) * math.prod(k) * c <= 2**21
    plain = all(set(kwargs.get(a) or (1,)) <= {1} for a in ("lhs_dilation", "rhs_dilation"))
    plain = plain and kwargs.get("feature_group_count", 1) == 1 and min(pads) >= 0
    if jax.default_backend() != "cpu" or not plain or not (pointwise or small):
        return lax.conv_general_dilated(lhs, rhs, window_strides, padding, **kwargs)
    x = lax.pad(lhs, jnp.zeros((), lhs.dtype), ((0, 0, 0), *((*p, 0) for p in padding), (0, 0, 0)))
    views = []
    for o in itertools.product(*map(range, k)):
        end = (i + (n - 1) * s + 1 for i, n, s in zip(o, out, strides, strict=True))
        views.append(lax.slice(x, (0, *o, 0), (len(x), *end, c), (1, *strides, 1)))
    patches = views[0] if len(views) == 1 else jnp.concatenate(views, axis=-1)
    kernel = rhs.reshape(-1, rhs.shape[-1])
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return lax.dot_general(patches, kernel, dims, kwargs.get("precision"))
''',
    # xconv.converters.ops.formulation "dense": XLA:CPU computes the weight gradient of a Dense
    # on (..., in) inputs, a dot contracting the leading axes, slower than that of one 2-D
    # matmul over the flattened rows.
    "flat_dot": '''
def _flat_dot(lhs, rhs, dimension_numbers, out_sharding=None, **kwargs):
    """A dense layer's product on the CPU as one matmul over the flattened leading axes of its
    (..., in) input, which XLA:CPU trains faster; other backends contract as the layer does."""
    contract, batch = dimension_numbers
    plain = tuple(map(tuple, contract)) == ((lhs.ndim - 1,), (0,)) and not any(batch)
    unsharded_cpu = jax.default_backend() == "cpu" and out_sharding is None
    if not unsharded_cpu or lhs.ndim < 3 or rhs.ndim != 2 or not plain:
        return lax.dot_general(lhs, rhs, dimension_numbers, out_sharding=out_sharding, **kwargs)
    y = lax.dot_general(lhs.reshape(-1, lhs.shape[-1]), rhs, (((1,), (0,)), ((), ())), **kwargs)
    return y.reshape(*lhs.shape[:-1], rhs.shape[-1])
''',
    # The same in a bfloat16 model, whose products on the CPU are bfloat16 products accumulated
    # in float32 (xconv.converters.ops.formulation "bf16_dot"; to_jax's kernel.bf16_einsum).
    "flat_dot_bf16": '''
def _flat_dot(lhs, rhs, dimension_numbers, out_sharding=None, **kwargs):
    """A dense layer's product on the CPU as one matmul over the flattened leading axes of its
    (..., in) input, which XLA:CPU trains faster, and of bfloat16 operands as _bf16_einsum;
    other backends contract as the layer does."""
    contract, batch = dimension_numbers
    plain = tuple(map(tuple, contract)) == ((lhs.ndim - 1,), (0,)) and not any(batch)
    unsharded_cpu = jax.default_backend() == "cpu" and out_sharding is None
    if not unsharded_cpu or lhs.ndim < 2 or rhs.ndim != 2 or not plain:
        return lax.dot_general(lhs, rhs, dimension_numbers, out_sharding=out_sharding, **kwargs)
    flat = lhs.reshape(-1, lhs.shape[-1])
    if lhs.dtype == rhs.dtype == jnp.bfloat16 and kwargs.get("preferred_element_type") is None:
        y = _bf16_einsum("mk,kn->mn", flat, rhs)
    else:
        y = lax.dot_general(flat, rhs, (((1,), (0,)), ((), ())), **kwargs)
    return y.reshape(*lhs.shape[:-1], rhs.shape[-1])
''',
    "bf16_einsum": '''
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bf16_einsum(spec, a, b):
    """jnp.einsum(spec, a, b) of two bfloat16 arrays with the values XLA gives it: bfloat16
    products accumulated in float32 and rounded once. XLA:CPU converts the operands of a dot
    with a bfloat16 result to float32 first, and runs this one on them as they are
    (AVX512-BF16): about twice as fast. Its gradient's two products are computed the same way
    (JAX's own would run them in float32). ``spec`` names every index of each operand in the
    other or in the output, none twice in an operand."""
    (sa, sb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    if sa[0] == sb[0] and set(sa) & set(sb) - set(out) == {sa[0]}:
        # XLA:CPU computes a product contracting only the leading axis of both (a weight's
        # gradient) on float32 copies; with a unit axis contracted beside it, on these
        spec, a, b = f"z{sa},z{sb}->{out}", a[None], b[None]
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def _bf16_einsum_fwd(spec, a, b):
    return _bf16_einsum(spec, a, b), (a, b)


def _bf16_einsum_bwd(spec, res, g):
    (a, b), (operands, out) = res, spec.split("->")
    sa, sb = operands.split(",")
    return _bf16_einsum(f"{out},{sb}->{sa}", g, b), _bf16_einsum(f"{sa},{out}->{sb}", a, g)


_bf16_einsum.defvjp(_bf16_einsum_fwd, _bf16_einsum_bwd)
''',
    "bf16_conv": '''
def _bf16_conv(lhs, rhs, window_strides, padding, **kwargs):
    """lax.conv_general_dilated; of bfloat16 operands on the CPU, its forward is the float32
    convolution of their float32 copies rounded once (the same values), which XLA:CPU runs
    faster than the bfloat16 one, and its gradient the bfloat16 convolution's, which it runs
    faster than the float32 one's."""
    def conv(x, w):
        return lax.conv_general_dilated(x, w, window_strides, padding, **kwargs)

    if lhs.dtype != jnp.bfloat16 or rhs.dtype != jnp.bfloat16 or jax.default_backend() != "cpu":
        return conv(lhs, rhs)
    return _conv_in_float32(conv, lhs, rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv_in_float32(conv, x, w):
    return conv(x.astype(jnp.float32), w.astype(jnp.float32)).astype(x.dtype)


def _conv_in_float32_fwd(conv, x, w):
    return _conv_in_float32(conv, x, w), (x, w)


def _conv_in_float32_bwd(conv, res, g):
    x, w = res
    (dx,) = jax.linear_transpose(lambda v: conv(v, w), x)(g)
    (dw,) = jax.linear_transpose(lambda v: conv(x, v), w)(g)
    return dx, dw


_conv_in_float32.defvjp(_conv_in_float32_fwd, _conv_in_float32_bwd)
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
    # ONNX's and torch's exact GELU in their erf form: jax.nn.gelu(approximate=False) goes
    # through erfc, which XLA:CPU runs about 3x slower.
    "gelu": '''
def _gelu(x, approximate):
    """GELU: x/2 (1 + erf(x/sqrt(2))), or jax.nn.gelu's tanh approximation. On the CPU the
    exact form of 2**20 elements or more ends in a select of the same values (y is NaN where
    x is): XLA:CPU fuses no select with a product, and fused with the products beside it the
    GELU ran slower (BERT-base's float32 inference at batch 32: 16 % a step)."""
    if approximate:
        return jax.nn.gelu(x, approximate=True)
    y = x * 0.5 * (1 + lax.erf(x * 0.7071067811865476))
    large = isinstance(x.size, int) and x.size >= 1 << 20  # not a symbolic (exported) shape
    if jax.default_backend() == "cpu" and large:
        return jnp.where(x == x, y, x)
    return y
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
    inputs, computed in their own layout (head- or sequence-major, no transposes); cuDNN's
    fused kernel on a GPU for float16/bfloat16 without a mask. A query row nothing may attend
    gives zeros."""
    three_d = q.ndim == 3
    if three_d:
        b = q.shape[0]
        q = jnp.reshape(q, (b, q.shape[1], q_num_heads, -1))
        k = jnp.reshape(k, (b, k.shape[1], kv_num_heads, -1))
        v = jnp.reshape(v, (b, v.shape[1], kv_num_heads, -1))
    head, seq = (2, 1) if three_d else (1, 2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if (
        mask is None
        and q.dtype in (jnp.float16, jnp.bfloat16)
        and jax.default_backend() in ("gpu", "cuda")
    ):
        swap = (lambda t: t) if three_d else (lambda t: jnp.swapaxes(t, 1, 2))
        out = swap(jax.nn.dot_product_attention(
            swap(q), swap(k), swap(v), scale=scale, is_causal=is_causal, implementation="cudnn"
        ))
        return jnp.reshape(out, (b, out.shape[1], -1)) if three_d else out
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


def _edited(name: str, *edits: tuple[str, str]) -> str:
    """Helper ``name``'s source with each ``(old, new)`` edit made; each ``old`` must occur
    exactly once (a float32 helper rewritten so that a bfloat16 variant no longer matches
    fails at import, not in a generated module)."""
    text = _BUILTIN[name]
    for old, new in edits:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    return text


# In a bfloat16 model, torch's MultiheadAttention's projections on the CPU as _bf16_einsum.
_BUILTIN["torch_mha_bf16"] = _edited(
    "torch_mha",
    (
        "    x = cast(x.reshape(b * t, e))\n",
        "    x = cast(x.reshape(b * t, e))\n"
        "    # on the CPU, bfloat16 products accumulated in float32 (see _bf16_einsum)\n"
        '    cpu = jax.default_backend() == "cpu"\n'
        '    mm = lambda a, w: _bf16_einsum("mk,nk->mn", a, w) if cpu else a @ w.T  # noqa: E731\n',
    ),
    ("(x @ cast(m.in_proj_kernel).T", "(mm(x, cast(m.in_proj_kernel))"),
    (
        "h.reshape(b * t, e) @ cast(m.out_proj_kernel).T",
        "mm(h.reshape(b * t, e), cast(m.out_proj_kernel))",
    ),
)
assert _BUILTIN["torch_mha_bf16"].count("mm(") == 2

# In a bfloat16 model, ONNX Attention's two products on the CPU as _bf16_einsum.
_BUILTIN["attention_bf16"] = _edited(
    "attention",
    (
        "    groups = q.shape[head] // k.shape[head]\n",
        "    # on the CPU, bfloat16 products accumulated in float32 (see _bf16_einsum)\n"
        '    einsum = _bf16_einsum if jax.default_backend() == "cpu" else jnp.einsum\n'
        "    groups = q.shape[head] // k.shape[head]\n",
    ),
    ("jnp.einsum(lhs, q, k)", "einsum(lhs, q, k)"),
    ("jnp.einsum(rhs, probs, v)", "einsum(rhs, probs, v)"),
)
assert _BUILTIN["attention_bf16"].count(" einsum(") == 2

# In a bfloat16 model, the patches' product on the CPU as _bf16_einsum, and a convolution as
# _bf16_conv (every convolution of such a model is given _matmul_conv).
_BUILTIN["matmul_conv_bf16"] = _edited(
    "matmul_conv",
    (
        '    return lax.dot_general(patches, kernel, dims, kwargs.get("precision"))\n',
        "    if patches.dtype == kernel.dtype == jnp.bfloat16:  # see _bf16_einsum\n"
        '        rows = "abcdefgh"[: x.ndim - 1]\n'
        '        return _bf16_einsum(f"{rows}k,kn->{rows}n", patches, kernel)\n'
        '    return lax.dot_general(patches, kernel, dims, kwargs.get("precision"))\n',
    ),
    (
        "        return lax.conv_general_dilated(lhs, rhs, window_strides, padding, **kwargs)\n",
        "        return _bf16_conv(lhs, rhs, window_strides, padding, **kwargs)\n",
    ),
)
assert _BUILTIN["matmul_conv_bf16"].count("_bf16_") == 3

registry.helpers.update(_BUILTIN)
