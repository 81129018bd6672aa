"""Flax source templates for the layers' ops: convolution and pooling, normalisation,
softmax and attention, recurrent layers (RNN / GRU / LSTM), losses. Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from xconv.converters import expressions as ex
from xconv.converters import expressions_structured as exs
from xconv.converters.codegen import scalar_literal
from xconv.converters.flax.source.attention import BSHD, bhsd_operands, dot_product_attention
from xconv.converters.flax.source.templates import (
    OpCall,
    dtype_expr,
    registry,
    template,
)
from xconv.converters.ops import formulation
from xconv.converters.ops.attention import ATTENTION_ATTRS
from xconv.converters.ops.rnn import COMMON_ATTRS
from xconv.converters.registry import REQUIRED

# ---------------------------------------------------------------- convolution and pooling


def _spatial_pads(c: OpCall, n: int) -> list[tuple[int, int]]:
    if c.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise c.fail(f"auto_pad={c.attrs['auto_pad']!r}; the importer should make pads explicit")
    pads = c.attrs.get("pads") or (0,) * (2 * n)
    return [(int(pads[i]), int(pads[i + n])) for i in range(n)]


@template("Conv", **ex.CONV_ATTRS)
def _conv(c: OpCall) -> str:
    w_shape = c.shapes[1]
    n = len(w_shape) - 2 if w_shape is not None else len(c.attrs["kernel_shape"])
    strides = tuple(c.attrs["strides"] or (1,) * n)
    dil = tuple(c.attrs["dilations"] or (1,) * n)
    spatial = "DHW"[-n:] if n <= 3 else None
    if spatial is None:
        raise c.fail("Conv with more than 3 spatial dims")
    dn = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    out = (
        f"lax.conv_general_dilated({c.args[0]}, {c.args[1]}, window_strides={strides}, "
        f"padding={_spatial_pads(c, n)}, rhs_dilation={dil}, dimension_numbers={dn}, "
        f"feature_group_count={c.attrs['group']})"
    )
    bias = c.consts[2] if len(c.consts) > 2 else None
    if c.has(2) and not (bias is not None and not bias.any()):  # exporters add zero biases
        out += f" + {c.args[2]}.reshape({_channel_shape(n)})"
    return out


@template("ConvInteger", **ex.CONV_ATTRS)
def _conv_integer(c: OpCall) -> str:
    """Conv of the zero-shifted int32 operands (int32 accumulation)."""
    c.helpers.add("zero_shifted")
    x, w = (f"_zero_shifted({', '.join(a for a in (c.args[i], c.args[i + 2]) if a)})" if c.has(i + 2)
            else f"_zero_shifted({c.args[i]})" for i in (0, 1))  # fmt: skip
    return _conv(replace(c, args=[x, w], consts=c.consts[:2], shapes=c.shapes[:2]))


@template("QLinearConv", **ex.CONV_ATTRS)
def _qlinear_conv(c: OpCall) -> str:
    """Conv of the zero-shifted int32 operands plus the int32 bias, requantized by x_scale *
    w_scale (per output channel) / y_scale into y's type."""
    if not all(c.has(i) for i in range(8)):
        raise c.fail("QLinearConv without y's zero point")
    c.helpers |= {"zero_shifted", "requantize"}
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = c.args[:8]
    bias = c.args[8:9] if c.has(8) else []
    shifted = [f"_zero_shifted({x}, {x_zp})", f"_zero_shifted({w}, {w_zp})", *bias]
    consts = [None, c.consts[3], *c.consts[8:9]]
    acc = _conv(replace(c, args=shifted, consts=consts, shapes=[c.shapes[0], c.shapes[3]]))
    n = len(c.shapes[3]) - 2 if c.shapes[3] is not None else len(c.attrs["kernel_shape"])
    factor = f"{x_scale} * jnp.reshape({w_scale}, {_channel_shape(n)}) / {y_scale}"
    return f"_requantize({acc}, {factor}, {y_zp})"


def _channel_shape(n: int) -> str:
    """``(-1, 1, 1)``: a per-channel vector broadcast over ``n`` spatial dims."""
    return "(" + ", ".join(["-1"] + ["1"] * n) + ("," if n == 0 else "") + ")"


registry.helpers["conv_transpose_kernel"] = '''
def _conv_transpose_kernel(w, groups):
    """A grouped ConvTranspose's (C_in, C_out / groups, *k) kernel as the spatially flipped
    (C_out, C_in / groups, *k) kernel of the convolution it runs as."""
    c_in, c_out_g, *k = w.shape
    w = jnp.reshape(w, (groups, c_in // groups, c_out_g, *k))
    w = jnp.reshape(jnp.swapaxes(w, 1, 2), (groups * c_out_g, c_in // groups, *k))
    return jnp.flip(w, tuple(range(2, w.ndim)))
'''


@template("ConvTranspose", **ex.CONV_TRANSPOSE_ATTRS)
def _conv_transpose(c: OpCall) -> str:
    w_shape = c.shapes[1]
    if w_shape is None:
        raise c.fail("ConvTranspose with a kernel of unknown shape")
    n = len(w_shape) - 2
    if n > 3:
        raise c.fail(f"a {n}-d ConvTranspose; supported: 1-d to 3-d")
    k = [int(d) for d in w_shape[2:]]
    strides = tuple(c.attrs["strides"] or (1,) * n)
    dil = tuple(c.attrs["dilations"] or (1,) * n)
    group = int(c.attrs["group"])
    # The gradient of a convolution: dilate the input by the strides, convolve with the
    # spatially flipped kernel whose in/out channels are swapped (within each group).
    padding = exs.conv_transpose_padding_of(c, n, k)
    spatial = "DHW"[-n:]
    dn = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    if group == 1:
        flip = ", ".join([":", ":"] + ["::-1"] * n)
        w = f"jnp.swapaxes({c.args[1]}, 0, 1)[{flip}]"
    else:
        c.helpers.add("conv_transpose_kernel")
        w = f"_conv_transpose_kernel({c.args[1]}, {group})"
    groups = f", feature_group_count={group}" if group != 1 else ""
    out = (
        f"lax.conv_general_dilated({c.args[0]}, {w}, window_strides={(1,) * n}, "
        f"padding={padding}, lhs_dilation={strides}, rhs_dilation={dil}, "
        f"dimension_numbers={dn}{groups})"
    )
    if c.has(2):
        out += f" + {c.args[2]}.reshape({_channel_shape(n)})"
    return out


def _pool_pads(c: OpCall) -> list[tuple[int, int]]:
    """The explicit pads (auto_pad SAME_* resolved over a static input), plus ceil_mode's."""
    return ex.ceil_pads(c, ex.pool_padding(c))


@template("MaxPool", layout="channels_last", **ex.MAX_POOL_ATTRS)
def _max_pool(c: OpCall) -> str:
    indices = c.node.outputs[1] if len(c.node.outputs) > 1 else None
    if indices is not None and (indices.uses() or indices.is_graph_output()):
        raise c.fail("MaxPool indices output")
    k = tuple(c.attrs["kernel_shape"])
    n = len(k)
    s = tuple(c.attrs["strides"] or (1,) * n)
    pads = _pool_pads(c)
    if any(d != 1 for d in (c.attrs["dilations"] or ())):
        return _window_pool(c, k, s, pads)
    return f"nn.max_pool({c.args[0]}, {_pool_args(k, s, pads)})"


registry.helpers["window_pool"] = '''
def _window_pool(x, window, strides, pads, dilation, average=False, counted=None):
    """Max (or average) pooling of channels-last x over a (dilated) window, ``pads`` per
    spatial axis, by lax.reduce_window. An average divides each window's sum by the inputs it covers, plus the padding in
    ``counted`` (count_include_pad: the explicit pads, not ceil_mode's extra)."""
    dims = lambda v: (1, *v, 1)  # noqa: E731
    padding = ((0, 0), *pads, (0, 0))
    op, init = (lax.add, 0.0) if average else (lax.max, -jnp.inf)
    kw = {"window_dilation": dims(dilation)}
    y = lax.reduce_window(x, init, op, dims(window), dims(strides), padding, **kw)
    if not average:
        return y
    ones, rest = jnp.ones((1, *x.shape[1:-1], 1), x.dtype), padding
    if counted is not None:
        ones = jnp.pad(ones, ((0, 0), *counted, (0, 0)), constant_values=1)
        extra = [(lo - a, hi - b) for (lo, hi), (a, b) in zip(pads, counted, strict=True)]
        rest = ((0, 0), *extra, (0, 0))
    return y / lax.reduce_window(ones, 0.0, lax.add, dims(window), dims(strides), rest, **kw)
'''


def _window_pool(c: OpCall, k, s, pads, counted=None) -> str:
    """MaxPool / AveragePool with dilations (or an average over ceil_mode's extra padding that
    counts the explicit pads): the generated ``_window_pool``."""
    c.helpers.add("window_pool")
    d = tuple(c.attrs["dilations"] or (1,) * len(k))
    pads = tuple(tuple(p) for p in pads)
    if c.node.op_type == "MaxPool":
        return f"_window_pool({c.args[0]}, {k}, {s}, {pads}, {d})"
    tail = "" if counted is None else f", counted={tuple(tuple(p) for p in counted)}"
    return f"_window_pool({c.args[0]}, {k}, {s}, {pads}, {d}, average=True{tail})"


def _pool_args(k, s, pads, include: bool = True) -> str:
    """``window_shape=...`` and the strides / padding / count_include_pad that differ from
    Flax's defaults (strides 1, ``"VALID"``, ``count_include_pad=True``)."""
    out = [f"window_shape={k}"]
    if any(v != 1 for v in s):
        out.append(f"strides={s}")
    if any(p != (0, 0) for p in pads):
        out.append(f"padding={tuple(tuple(p) for p in pads)}")
        if not include:
            out.append("count_include_pad=False")
    return ", ".join(out)


@template("AveragePool", layout="channels_last", **ex.AVERAGE_POOL_ATTRS)
def _avg_pool(c: OpCall) -> str:
    k = tuple(c.attrs["kernel_shape"])
    n = len(k)
    s = tuple(c.attrs["strides"] or (1,) * n)
    pads = _pool_pads(c)
    include = bool(c.attrs["count_include_pad"])
    if any(d != 1 for d in (c.attrs["dilations"] or ())):
        return _window_pool(c, k, s, pads, counted=ex.pool_padding(c) if include else None)
    if c.attrs["ceil_mode"] and include:  # counting the explicit pads, not ceil_mode's
        return _window_pool(c, k, s, pads, counted=ex.pool_padding(c))
    return f"nn.avg_pool({c.args[0]}, {_pool_args(k, s, pads, include)})"


@template("GlobalAveragePool", layout="channels_last")
def _global_avg_pool(c: OpCall) -> str:
    n = c.need_rank() - 2
    if n > 1 and c.float_output():
        c.helpers.add("mean")
        return f"_mean({c.args[0]}, axis={tuple(range(1, n + 1))}, keepdims=True)"
    return f"jnp.mean({c.args[0]}, axis={tuple(range(1, n + 1))}, keepdims=True)"


@template("GlobalMaxPool", layout="channels_last")
def _global_max_pool(c: OpCall) -> str:
    n = c.need_rank() - 2
    return f"jnp.max({c.args[0]}, axis={tuple(range(1, n + 1))}, keepdims=True)"


@template("LpPool", **ex.LP_POOL_ATTRS)
def _lp_pool(c: OpCall) -> str:
    """(sum of |x|**p over each window) ** (1/p), a lax.reduce_window sum over the
    zero-padded input (NC... layout)."""
    k, pw = [int(v) for v in c.attrs["kernel_shape"]], c.attrs["p"]
    n = len(k)
    if c.attrs["ceil_mode"]:
        raise c.fail("LpPool ceil_mode")
    s = [int(v) for v in c.attrs["strides"] or [1] * n]
    d = [int(v) for v in c.attrs["dilations"] or [1] * n]
    pairs = ((0, 0), (0, 0), *(tuple(int(v) for v in p) for p in ex.pool_padding(c)))
    x = c.args[0]
    power = f"jnp.square({x})" if pw == 2 else f"jnp.abs({x}) ** {pw}"
    total = (
        f"lax.reduce_window({power}, 0.0, lax.add, {(1, 1, *k)}, {(1, 1, *s)}, {pairs}, "
        f"window_dilation={(1, 1, *d)})"
    )
    return f"jnp.sqrt({total})" if pw == 2 else f"{total} ** {scalar_literal(1 / pw)}"


# ---------------------------------------------------------------- normalisation


@template("BatchNormalization", epsilon=1e-5, momentum=0.9, training_mode=0)
def _batch_norm(c: OpCall) -> str:
    if c.attrs["training_mode"]:
        raise c.fail("training_mode=1 outside a recognised batch_norm layer")
    x, scale, bias, mean, var = c.args[:5]
    r = c.rank()
    shape = _channel_shape(r - 2) if r is not None else f"(-1,) + (1,) * ({x}.ndim - 2)"
    eps = scalar_literal(c.attrs["epsilon"])
    return (
        f"({x} - {mean}.reshape({shape})) * lax.rsqrt({var}.reshape({shape}) + {eps}) "
        f"* {scale}.reshape({shape}) + {bias}.reshape({shape})"
    )


@template("LayerNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _layer_norm(c: OpCall) -> str:
    n = len(c.node.outputs)
    stats = n > 1 and any(o.uses() or o.is_graph_output() for o in c.node.outputs[1:])
    if stats and c.attrs["stash_type"] != 1:
        raise c.fail(f"LayerNormalization statistics in stash_type={c.attrs['stash_type']}")
    name = "layer_norm_stats" if stats else "layer_norm"
    c.helpers.add(name)
    bias = c.args[2] if c.has(2) else "None"
    call = (
        f"_{name}({c.args[0]}, {c.args[1]}, {bias}, axis={c.attrs['axis']}, "
        f"epsilon={scalar_literal(c.attrs['epsilon'])})"
    )
    if not stats:
        return call if n == 1 else f"({call},) + (None,) * {n - 1}"
    return call if n == 3 else f"{call}[:{n}]"


@template("RMSNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _rms_norm(c: OpCall) -> str:
    c.helpers.add("rms_norm")
    return (
        f"_rms_norm({c.args[0]}, {c.args[1]}, axis={c.attrs['axis']}, "
        f"epsilon={scalar_literal(c.attrs['epsilon'])})"
    )


@template("GroupNormalization", epsilon=1e-5, num_groups=REQUIRED, stash_type=1)
def _group_norm(c: OpCall) -> str:
    c.helpers.add("group_norm")
    return (
        f"_group_norm({c.args[0]}, {c.args[1]}, {c.args[2]}, "
        f"num_groups={c.attrs['num_groups']}, epsilon={scalar_literal(c.attrs['epsilon'])})"
    )


@template("InstanceNormalization", epsilon=1e-5)
def _instance_norm(c: OpCall) -> str:
    """GroupNormalization with a group per channel."""
    c.helpers.add("group_norm")
    x, scale, bias = c.args[:3]
    eps = scalar_literal(c.attrs["epsilon"])
    return f"_group_norm({x}, {scale}, {bias}, num_groups={x}.shape[1], epsilon={eps})"


registry.helpers["lrn"] = '''
def _lrn(x, size, alpha, beta, bias, before, after):
    """ONNX LRN on (N, C, ...): x / (bias + alpha / size * the sum of x**2 over channels
    c - before .. c + after) ** beta."""
    pads = [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2)
    window = (1, size) + (1,) * (x.ndim - 2)
    squares = jnp.pad(jnp.square(x), pads)
    sums = lax.reduce_window(squares, 0.0, lax.add, window, (1,) * x.ndim, "VALID")
    return x / (bias + alpha / size * sums) ** beta
'''


@template("LRN", alpha=0.0001, beta=0.75, bias=1.0, size=REQUIRED)
def _lrn(c: OpCall) -> str:
    c.helpers.add("lrn")
    before, after = ex.lrn_window(c)
    a = ", ".join(scalar_literal(c.attrs[n]) for n in ("alpha", "beta", "bias"))
    return f"_lrn({c.args[0]}, {int(c.attrs['size'])}, {a}, {before}, {after})"


registry.helpers["mean_variance_normalization"] = '''
def _mean_variance_normalization(x, axes):
    """ONNX MeanVarianceNormalization: (x - E[x]) / (sqrt(E[x**2] - E[x]**2) + 1e-9)."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) - jnp.square(mean))
    return (x - mean) / (std + 1e-9)
'''


registry.builtin("MeanVarianceNormalization", attrs={"axes": (0, 2, 3)})(ex.mean_variance_call)


registry.helpers["grid_sample"] = """
def _grid_sample(x, grid, mode="linear", padding_mode="zeros", align_corners=False):
    \"\"\"ONNX GridSample (torch's F.grid_sample): x (N, C, *D) sampled at the grid's (N, *O, n)
    points in [-1, 1], whose last axis lists the innermost dimension first; "linear",
    "nearest" (half to even) or "cubic" (a = -0.75) over every dimension, reading 0 outside
    ("zeros"), the nearest border value ("border") or the reflected point ("reflection").\"\"\"
    n, (nb, c), dims = x.ndim - 2, x.shape[:2], x.shape[2:]
    g = jnp.reshape(grid, (nb, -1, n)).astype(x.dtype)
    coords, borders = [], []
    for i, size in enumerate(dims):
        u = g[:, :, n - 1 - i]
        if align_corners:
            coords.append((u + 1) / 2 * (size - 1))
            borders.append((0.0, size - 1.0))
        else:
            coords.append(((u + 1) * size - 1) / 2)
            borders.append((-0.5, size - 0.5))
    if mode == "nearest":
        coords = [jnp.rint(q) for q in coords]
    if padding_mode == "border":
        coords = [jnp.clip(q, 0, size - 1) for q, size in zip(coords, dims, strict=True)]
    elif padding_mode == "reflection":
        coords = [_reflect(q, *b) for q, b in zip(coords, borders, strict=True)]
    data = jnp.reshape(x, (nb, c, -1))

    def fetch(index):  # the values at integer points, (N, M) per dimension -> (N, C, M)
        flat, inside = 0, True
        for q, size, b in zip(index, dims, borders, strict=True):
            if padding_mode == "reflection":
                q = jnp.trunc(_reflect(q.astype(x.dtype), *b)).astype(jnp.int32)
            if padding_mode != "zeros":
                q = jnp.clip(q, 0, size - 1)
            inside = inside & (q >= 0) & (q < size)
            flat = flat * size + jnp.clip(q, 0, size - 1)
        values = jnp.take_along_axis(data, flat[:, None, :], axis=2)
        return jnp.where(inside[:, None, :], values, jnp.zeros((), x.dtype))

    if mode == "nearest":
        y = fetch([q.astype(jnp.int32) for q in coords])
    else:
        taps = (0, 1) if mode == "linear" else (-1, 0, 1, 2)
        base = [jnp.floor(q) for q in coords]
        frac = [q - b for q, b in zip(coords, base, strict=True)]
        weights = [[1 - f, f] if mode == "linear" else _cubic_weights(f) for f in frac]
        base = [b.astype(jnp.int32) for b in base]
        y = 0
        for combo in itertools.product(range(len(taps)), repeat=n):
            w = math.prod(weights[i][t] for i, t in enumerate(combo))
            y = y + w[:, None, :] * fetch([b + taps[t] for b, t in zip(base, combo, strict=True)])
    return jnp.reshape(y, (nb, c, *grid.shape[1:-1])).astype(x.dtype)


def _reflect(q, lo, hi):
    \"\"\"Coordinates reflected into [lo, hi] by the nearer border, repeatedly.\"\"\"
    span = hi - lo
    if span <= 0:
        return jnp.full_like(q, lo)
    below, above = lo - q, q - hi
    nb, na = jnp.floor(below / span), jnp.floor(above / span)
    rb, ra = below - nb * span, above - na * span
    low = jnp.where(jnp.remainder(nb, 2) == 0, lo + rb, hi - rb)
    high = jnp.where(jnp.remainder(na, 2) == 0, hi - ra, lo + ra)
    return jnp.where(q < lo, low, jnp.where(q > hi, high, q))


def _cubic_weights(t, a=-0.75):
    \"\"\"Cubic convolution's weights of the taps -1, 0, 1, 2 at fraction t.\"\"\"
    t1, t2, t3 = t + 1, 1 - t, 2 - t
    return [
        ((a * t1 - 5 * a) * t1 + 8 * a) * t1 - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * t2 - (a + 3)) * t2 * t2 + 1,
        ((a * t3 - 5 * a) * t3 + 8 * a) * t3 - 4 * a,
    ]
"""

#: ONNX GridSample's modes (opset 20 names, and opset 16's).
_GRID_MODES = {"linear": "linear", "bilinear": "linear", "nearest": "nearest",
               "cubic": "cubic", "bicubic": "cubic"}  # fmt: skip


@template("GridSample", align_corners=0, mode="linear", padding_mode="zeros")
def _grid_sample(c: OpCall) -> str:
    a = c.attrs
    mode = _GRID_MODES.get(a["mode"])
    if mode is None or a["padding_mode"] not in ("zeros", "border", "reflection"):
        raise c.fail(f"GridSample mode={a['mode']!r}, padding_mode={a['padding_mode']!r}")
    c.helpers.add("grid_sample")
    return (
        f'_grid_sample({c.args[0]}, {c.args[1]}, mode="{mode}", '
        f'padding_mode="{a["padding_mode"]}", align_corners={bool(a["align_corners"])})'
    )


@template("Softmax", layout="axis", axis=-1)
def _softmax(c: OpCall) -> str:
    return f"jax.nn.softmax({c.args[0]}, axis={c.axis(c.attrs['axis'])})"


@template("LogSoftmax", layout="axis", axis=-1)
def _log_softmax(c: OpCall) -> str:
    return f"jax.nn.log_softmax({c.args[0]}, axis={c.axis(c.attrs['axis'])})"


@template("LpNormalization", layout="axis", axis=-1, p=2)
def _lp_normalization(c: OpCall) -> str:
    """x over its L1 / L2 norm along ``axis`` (torch's F.normalize: a norm under 1e-12
    counted as 1e-12, so a zero vector stays zero as ONNX's reference gives it)."""
    if c.attrs["p"] not in (1, 2):
        raise c.fail(f"p={c.attrs['p']}; ONNX defines 1, 2")
    x, a = c.args[0], c.axis(c.attrs["axis"])
    norm = f"jnp.linalg.norm({x}, ord={c.attrs['p']}, axis={a}, keepdims=True)"
    return f"{x} / jnp.maximum({norm}, 1e-12)"


@template("Hardmax", layout="axis", axis=-1)
def _hardmax(c: OpCall) -> str:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    x, a = c.args[0], c.axis(c.attrs["axis"])
    return f"jax.nn.one_hot(jnp.argmax({x}, axis={a}), {x}.shape[{a}], dtype={x}.dtype, axis={a})"


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


def _attention_helpers(c: OpCall, name: str) -> None:
    """The attention helper ``_<name>`` (in a bfloat16 model on the CPU, its variant of
    bfloat16 products accumulated in float32)."""
    if name == "attention" and c.low and formulation.get("bf16_dot") == "auto":
        c.helpers |= {"attention_bf16", "bf16_einsum"}
    else:
        c.helpers.add(name)


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
        _attention_helpers(c, name)
        c.helpers.add("cached_attention")
        return ex.cached_attention_call(c, f"_cached_attention(_{name}, ")
    mask = c.args[3] if c.has(3) else "None"
    causal = bool(c.attrs["is_causal"])
    if c.has(3) and _causal_mask(c.consts[3]):
        mask, causal = "None", True  # the mask a causal model builds: is_causal says it
    direct = dot_product_attention(c, mask, causal) if name == "attention" else None
    if direct is not None:
        return direct
    _attention_helpers(c, name)
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


# ---------------------------------------------------------------- scatters: Col2Im, MaxUnpool,
# TensorScatter

registry.helpers["col2im_index"] = exs.COL2IM_INDEX
registry.helpers["col2im"] = '''
def _col2im(x, image_shape, block_shape, strides, dilations, pads):
    """ONNX Col2Im: the sliding blocks of x (N, C * prod(block), L) summed into an image
    (N, C, *image_shape); image_shape and block_shape read from their values (eagerly)."""
    image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
    block = [int(v) for v in np.asarray(block_shape).reshape(-1)]
    index = _col2im_index(image, block, strides, dilations, pads)
    nb, ck, _ = x.shape
    c, total = ck // int(np.prod(block)), int(np.prod(image))
    out = jnp.zeros((nb, c, total + 1), x.dtype).at[:, :, index].add(jnp.reshape(x, (nb, c, -1)))
    return jnp.reshape(out[:, :, :total], (nb, c, *image))
'''
template("Col2Im", dilations=None, pads=None, strides=None)(exs.col2im_call)

registry.helpers["max_unpool"] = '''
def _max_unpool(x, indices, kernel, strides, pads, output_shape=None):
    """ONNX MaxUnpool: x's values set at their flat positions ``indices`` in zeros of the
    pooled input's shape; with output_shape, zero-padded at the end or cropped to it."""
    n = x.ndim - 2
    shape = list(x.shape[:2]) + [
        (x.shape[i + 2] - 1) * strides[i] - (pads[i] + pads[i + n]) + kernel[i] for i in range(n)
    ]
    flat = jnp.zeros((int(np.prod(shape)),), x.dtype)
    flat = flat.at[jnp.reshape(indices, (-1,))].set(jnp.reshape(x, (-1,)), mode="drop")
    y = jnp.reshape(flat, shape)
    if output_shape is None:
        return y
    target = [int(v) for v in np.asarray(output_shape).reshape(-1)]
    pad = [(0, max(0, t - i)) for t, i in zip(target, y.shape, strict=True)]
    return jnp.pad(y, pad)[tuple(slice(0, t) for t in target)]
'''
template("MaxUnpool", kernel_shape=REQUIRED, pads=None, strides=None)(exs.max_unpool_call)

registry.helpers["tensor_scatter"] = '''
def _tensor_scatter(cache, update, write_indices=None, axis=-2, circular=False):
    """ONNX TensorScatter (a KV-cache write): ``update`` written into ``cache`` along ``axis``
    from each batch entry's write index (0 without them), wrapping around when ``circular``;
    writes past the end are dropped."""
    batch, max_len, seq = cache.shape[0], cache.shape[axis], update.shape[axis]
    if write_indices is None:
        starts = jnp.zeros((batch,), jnp.arange(1).dtype)
    else:
        starts = jnp.reshape(write_indices, (batch,))
    pos = starts[:, None] + jnp.arange(seq).astype(starts.dtype)[None, :]
    if circular:
        pos = pos % max_len
    rows = jnp.arange(batch)[:, None]
    moved, upd = jnp.moveaxis(cache, axis, 1), jnp.moveaxis(update, axis, 1).astype(cache.dtype)
    return jnp.moveaxis(moved.at[rows, pos].set(upd, mode="drop"), 1, axis)
'''
template("TensorScatter", axis=-2, mode="linear")(exs.tensor_scatter_call)


# ---------------------------------------------------------------- recurrent layers

_RNN_ATTRS = COMMON_ATTRS

registry.builtin("RNN", attrs=_RNN_ATTRS)(ex.recurrent_call)
registry.builtin("GRU", attrs={**_RNN_ATTRS, "linear_before_reset": 0})(ex.recurrent_call)
registry.builtin("LSTM", attrs={**_RNN_ATTRS, "input_forget": 0})(ex.recurrent_call)


# ---------------------------------------------------------------- losses


@template("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", **ex.LOSS_ATTRS)
def _loss(c: OpCall) -> str:
    """``_nll_loss`` (torch's ``F.nll_loss``, written in jnp) of the log-probabilities; for
    SoftmaxCrossEntropyLoss of ``jax.nn.log_softmax`` over the classes, and with its
    log_prob output ``_softmax_cross_entropy``, which returns both."""
    kw = ex.loss_keywords(c)
    args = [c.args[0], c.args[1], *([c.args[2]] if c.has(2) else [])]
    c.helpers.add("nll_loss")
    if c.node.op_type == "NegativeLogLikelihoodLoss":
        return f"_nll_loss({', '.join(args + kw)})"
    if len(c.node.outputs) > 1:
        c.helpers.add("softmax_cross_entropy")
        return f"_softmax_cross_entropy({', '.join(args + kw)})"
    args[0] = f"jax.nn.log_softmax({args[0]}, axis=1)"
    return f"_nll_loss({', '.join(args + kw)})"
