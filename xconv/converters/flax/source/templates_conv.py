"""Flax source templates for convolution and pooling: Conv (and ConvInteger, QLinearConv on
zero-shifted operands), ConvTranspose, MaxPool / AveragePool (dilated ones, and averages over
ceil_mode's padding, through the generated ``_window_pool``), the global pools and LpPool.
Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from dataclasses import replace

from xconv.converters import expressions as ex
from xconv.converters import expressions_structured as exs
from xconv.converters.codegen import scalar_literal
from xconv.converters.flax.source.templates import OpCall, registry, template


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
        f"padding={exs.conv_padding_of(c, n)}, rhs_dilation={dil}, dimension_numbers={dn}, "
        f"feature_group_count={c.attrs['group']})"
    )
    bias = c.consts[2] if len(c.consts) > 2 else None
    if c.has(2) and not (bias is not None and not bias.any()):  # exporters add zero biases
        out += f" + {c.args[2]}.reshape({channel_shape(n)})"
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
    factor = f"{x_scale} * jnp.reshape({w_scale}, {channel_shape(n)}) / {y_scale}"
    return f"_requantize({acc}, {factor}, {y_zp})"


def channel_shape(n: int) -> str:
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
        out += f" + {c.args[2]}.reshape({channel_shape(n)})"
    return out


def _pool_pads(c: OpCall) -> list[tuple[int, int]]:
    """The explicit pads (auto_pad SAME_* resolved over a static input), plus ceil_mode's."""
    return ex.ceil_pads(c, ex.pool_padding(c))


registry.helpers["max_pool_with_indices"] = '''
def _max_pool_with_indices(x, window, strides, pads, dilation, column_major=False):
    """ONNX MaxPool of channels-last x with its Indices: the maxima (channels-last) and the
    index of each, flat over the channels-first (N, C, *spatial) input, of the first input
    holding it; within each (n, c) plane column-major (the first spatial axis fastest) with
    ``column_major``."""
    dims = lambda v: (1, *v, 1)  # noqa: E731
    args = (dims(window), dims(strides), ((0, 0), *pads, (0, 0)))
    kw = {"window_dilation": dims(dilation)}
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    lowest = jnp.array(-jnp.inf if floating else jnp.iinfo(x.dtype).min, x.dtype)
    y = lax.reduce_window(x, lowest, lax.max, *args, **kw)
    spatial = x.shape[1:-1]
    position = jnp.broadcast_to(jnp.arange(math.prod(spatial)).reshape(1, *spatial, 1), x.shape)

    def first_max(a, b):  # the larger value; of equal ones, the first position
        take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    init = (lowest, jnp.array(jnp.iinfo(position.dtype).max, position.dtype))
    _, indices = lax.reduce_window((x, position), init, first_max, *args, **kw)
    if column_major:
        coords = jnp.unravel_index(indices, spatial)
        indices = sum(c * math.prod(spatial[:i]) for i, c in enumerate(coords))
    indices = jnp.moveaxis(indices, -1, 1)  # channels-first, as ONNX counts
    planes = jnp.arange(x.shape[0] * x.shape[-1]) * math.prod(spatial)
    return y, indices + planes.reshape(x.shape[0], x.shape[-1], *[1] * len(spatial))
'''


@template("MaxPool", layout="channels_last", **ex.MAX_POOL_ATTRS)
def _max_pool(c: OpCall) -> str:
    """``nn.max_pool`` (``_window_pool`` when dilated); a node with an Indices output is the
    generated ``_max_pool_with_indices`` (the indices channels-first, as ONNX counts them)."""
    k = tuple(c.attrs["kernel_shape"])
    n = len(k)
    s = tuple(c.attrs["strides"] or (1,) * n)
    pads = _pool_pads(c)
    if len(c.node.outputs) > 1:  # written as ``y, indices = ...`` (or ``y, _``)
        c.helpers.add("max_pool_with_indices")
        d = tuple(c.attrs["dilations"] or (1,) * n)
        order = ", column_major=True" if c.attrs["storage_order"] else ""
        pairs = tuple(tuple(p) for p in pads)
        return f"_max_pool_with_indices({c.args[0]}, {k}, {s}, {pairs}, {d}{order})"
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
