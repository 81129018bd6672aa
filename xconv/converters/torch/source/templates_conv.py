"""PyTorch source templates for convolution and pooling: Conv (and ConvInteger, QLinearConv on
zero-shifted operands), ConvTranspose (cropped or padded where output_shape, auto_pad SAME_*
or asymmetric pads ask), MaxPool / AveragePool (``F.pad`` for the pads torch's ``padding``
cannot take; the generated ``_dilated_avg_pool``), the global pools and LpPool. Importing this
module registers them in ``templates.registry``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from xconv.converters import expressions as ex
from xconv.converters import expressions_structured as exs
from xconv.converters.codegen import int_tuple, scalar_literal
from xconv.converters.torch.source.templates import OpCall, registry, template


def _sym_pads(c: OpCall, n: int) -> list[int]:
    pads = c.attrs.get("pads") or [0] * (2 * n)
    if c.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise c.fail("auto_pad SAME_* is not supported; canonicalise to explicit pads")
    lo, hi = list(pads[:n]), list(pads[n:])
    if lo != hi:
        raise c.fail(f"asymmetric pads {list(pads)} have no torch padding argument")
    return lo


@template("Conv", **ex.CONV_ATTRS)
def _conv(c: OpCall) -> str:
    n = c.need_rank() - 2
    x = c.args[0]
    pairs = exs.conv_padding_of(c, n)  # auto_pad SAME_* resolved over the static sizes
    pad = [lo for lo, _ in pairs]
    if any(lo != hi for lo, hi in pairs):
        # Asymmetric zero padding (TensorFlow's SAME with stride 2) has no conv argument:
        # pad explicitly (F.pad lists the last dim first), then convolve unpadded.
        x, pad = f"F.pad({x}, {_pad_order(c, n, pairs)})", [0] * n
    s = c.attrs["strides"] or [1] * n
    d = c.attrs["dilations"] or [1] * n
    b = c.args[2] if c.has(2) else "None"
    return (
        f"F.conv{n}d({x}, {c.args[1]}, {b}, stride={int_tuple(s)}, "
        f"padding={int_tuple(pad)}, dilation={int_tuple(d)}, groups={c.attrs['group']})"
    )


@template("ConvInteger", **ex.CONV_ATTRS)
def _conv_integer(c: OpCall) -> str:
    """The convolution of the zero-shifted operands in float64 (exact for 8-bit data), as
    int32."""
    c.helpers.add("zero_shifted")
    x, w = (f"_zero_shifted({c.args[i]}, {c.args[i + 2]})" if c.has(i + 2)
            else f"_zero_shifted({c.args[i]})" for i in (0, 1))  # fmt: skip
    return f"{_conv(replace(c, args=[x, w], consts=c.consts[:2], shapes=c.shapes[:2]))}.to(torch.int32)"


@template("QLinearConv", **ex.CONV_ATTRS)
def _qlinear_conv(c: OpCall) -> str:
    """The convolution of the zero-shifted operands plus the int32 bias (float64, exact for
    8-bit data), requantized by x_scale * w_scale (per output channel) / y_scale."""
    if not all(c.has(i) for i in range(8)):
        raise c.fail("QLinearConv without y's zero point")
    c.helpers |= {"zero_shifted", "requantize"}
    x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp = c.args[:8]
    bias = [f"{c.args[8]}.to(torch.float64)"] if c.has(8) else []
    shifted = [f"_zero_shifted({x}, {x_zp})", f"_zero_shifted({w}, {w_zp})", *bias]
    consts = [None, c.consts[3], *c.consts[8:9]]
    acc = _conv(replace(c, args=shifted, consts=consts, shapes=[c.shapes[0], c.shapes[3]]))
    n = c.need_rank() - 2
    shape = "(-1" + ", 1" * n + ")"
    return f"_requantize({acc}, {x_scale} * {w_scale}.reshape({shape}) / {y_scale}, {y_zp})"


@template("ConvTranspose", **ex.CONV_TRANSPOSE_ATTRS)
def _conv_transpose(c: OpCall) -> str:
    n = c.need_rank() - 2
    if c.attrs["output_shape"] is not None or c.attrs["auto_pad"] in ("SAME_UPPER", "SAME_LOWER"):
        return _conv_transpose_cropped(c, n)
    pads = c.attrs.get("pads") or [0] * (2 * n)
    crop = None
    if c.attrs.get("auto_pad", "NOTSET") == "NOTSET" and list(pads[:n]) != list(pads[n:]):
        # Asymmetric pads crop the output unevenly: pad the common part, slice the rest off.
        pad = [min(lo, hi) for lo, hi in zip(pads[:n], pads[n:], strict=True)]
        crop = [(lo - m, hi - m) for lo, hi, m in zip(pads[:n], pads[n:], pad, strict=True)]
    else:
        pad = _sym_pads(c, n)
    s = c.attrs["strides"] or [1] * n
    d = c.attrs["dilations"] or [1] * n
    op = c.attrs["output_padding"] or [0] * n
    b = c.args[2] if c.has(2) else "None"
    expr = (
        f"F.conv_transpose{n}d({c.args[0]}, {c.args[1]}, {b}, stride={int_tuple(s)}, "
        f"padding={int_tuple(pad)}, output_padding={int_tuple(op)}, "
        f"groups={c.attrs['group']}, dilation={int_tuple(d)})"
    )
    if crop is None:
        return expr
    index = [":", ":"] + [f"{lo or ''}:{-hi if hi else ''}" for lo, hi in crop]
    return f"{expr}[{', '.join(index)}]"


def _conv_transpose_cropped(c: OpCall, n: int) -> str:
    """ConvTranspose sized by output_shape or auto_pad SAME_*: the full transposed
    convolution, cropped (or zero-padded, by negative pads) to the runtimes' padding
    (``exs.conv_transpose_padding_of``), then the bias."""
    if c.shapes[1] is None or any(d is None for d in c.shapes[1][2:]):
        raise c.fail("ConvTranspose with a kernel of unknown shape")
    k = [int(v) for v in c.shapes[1][2:]]
    d = c.attrs["dilations"] or [1] * n
    padding = exs.conv_transpose_padding_of(c, n, k)
    crops = [((k[i] - 1) * d[i] - lo, (k[i] - 1) * d[i] - hi) for i, (lo, hi) in enumerate(padding)]
    pad = tuple(-v for lo, hi in reversed(crops) for v in (lo, hi))
    s = c.attrs["strides"] or [1] * n
    expr = (
        f"F.conv_transpose{n}d({c.args[0]}, {c.args[1]}, stride={int_tuple(s)}, "
        f"groups={c.attrs['group']}, dilation={int_tuple(d)})"
    )
    if any(pad):
        expr = f"F.pad({expr}, {pad})"
    if c.has(2):
        expr += f" + {c.args[2]}.reshape({(-1,) + (1,) * n})"
    return expr


registry.helpers["max_pool_with_indices"] = '''
def _max_pool_with_indices(x, kernel, column_major=False, **kwargs):
    """ONNX MaxPool with its Indices: F.max_pool*d's values and indices, the indices (row-major
    within each (n, c) plane) made flat over the whole (N, C, *spatial) input; within the
    plane column-major (the first spatial axis fastest) with ``column_major``."""
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[x.dim() - 3]
    y, indices = pool(x, kernel, return_indices=True, **kwargs)
    spatial = x.shape[2:]
    if column_major:
        coords = torch.unravel_index(indices, spatial)
        indices = sum(c * math.prod(spatial[:i]) for i, c in enumerate(coords))
    planes = torch.arange(x.shape[0] * x.shape[1], device=x.device) * math.prod(spatial)
    return y, indices + planes.reshape(*x.shape[:2], *[1] * len(spatial))
'''


@template("MaxPool", **ex.MAX_POOL_ATTRS)
def _max_pool(c: OpCall) -> str:
    """``F.max_pool{n}d``; with an Indices output read, the generated
    ``_max_pool_with_indices`` (torch's indices count within each (n, c) plane, ONNX's over
    the whole input)."""
    k = c.attrs["kernel_shape"]
    n = len(k)
    s = c.attrs["strides"] or [1] * n
    d = c.attrs["dilations"] or [1] * n
    second = c.node.outputs[1] if len(c.node.outputs) > 1 else None
    indices = second is not None and bool(second.uses() or second.is_graph_output())
    x, pad = _pool_pads(c, n, [(ki - 1) * di + 1 for ki, di in zip(k, d, strict=True)])
    if pad is None:  # the window's padding reads as -inf: it never wins
        if indices:
            pairs = [tuple(int(v) for v in p) for p in ex.pool_padding(c)]
            raise c.fail(f"MaxPool Indices with pads torch's padding cannot take ({pairs})")
        x, pad = f"F.pad({x}, {_pad_order(c, n)}, value=float('-inf'))", [0] * n
    args = [x, _compact(k)]
    args += [f"stride={_compact(s)}"] if list(s) != list(k) else []  # torch: stride = kernel
    args += [f"padding={_compact(pad)}"] if any(pad) else []
    args += [f"dilation={_compact(d)}"] if any(x != 1 for x in d) else []
    args += ["ceil_mode=True"] if c.attrs["ceil_mode"] else []
    if indices:
        c.helpers.add("max_pool_with_indices")
        args += ["column_major=True"] if c.attrs["storage_order"] else []
        return f"_max_pool_with_indices({', '.join(args)})"
    if second is not None:  # written as ``y, _ = ...``
        args.append("return_indices=True")
    return f"F.max_pool{n}d({', '.join(args)})"


def _pool_pads(c: OpCall, n: int, window: list[int]) -> tuple[str, list[int] | None]:
    """``(input, pads)`` of a pooling: its symmetric pads where torch's ``padding`` takes
    them (at most half the window), else ``None``: asymmetric pads (TensorFlow's SAME) or
    wider ones are written with ``F.pad`` (:func:`_pad_order`). Not with ``ceil_mode``:
    torch then drops a last window that starts in the padding, ONNX keeps it."""
    pairs = ex.pool_padding(c)  # auto_pad SAME_* resolved over a static input
    lo, hi = [int(p[0]) for p in pairs], [int(p[1]) for p in pairs]
    if lo == hi and all(p <= w // 2 for p, w in zip(lo, window, strict=True)):
        return c.args[0], lo
    if c.attrs["ceil_mode"]:
        raise c.fail(f"pads {[*lo, *hi]} with ceil_mode have no torch padding argument")
    return c.args[0], None


def _pad_order(c: OpCall, n: int, pairs=None) -> str:
    """The pads (``pairs``, by default the node's, SAME_* resolved) as ``F.pad`` lists them:
    the last dimension first, low then high."""
    pairs = ex.pool_padding(c) if pairs is None else pairs
    return int_tuple([int(v) for lo_hi in reversed(pairs) for v in lo_hi])


def _compact(values) -> str:
    """``3`` for ``(3, 3)``: torch's pooling functions take one int for all dimensions."""
    values = [int(v) for v in values]
    return str(values[0]) if len(set(values)) == 1 else int_tuple(values)


@template("LpPool", **ex.LP_POOL_ATTRS)
def _lp_pool(c: OpCall) -> str:
    """(sum of |x|**p over each window) ** (1/p): an average pool of the zero-padded powers
    times the window's size (every window whole: F.lp_pool takes no padding, nor |x|)."""
    k, pw = c.attrs["kernel_shape"], c.attrs["p"]
    n = len(k)
    if c.attrs["dilations"] and any(x != 1 for x in c.attrs["dilations"]):
        raise c.fail("dilated LpPool has no torch counterpart")
    if c.attrs["ceil_mode"]:
        raise c.fail("LpPool ceil_mode")
    pairs = ex.pool_padding(c)
    s = c.attrs["strides"] or [1] * n
    power = f"torch.square({c.args[0]})" if pw == 2 else f"torch.abs({c.args[0]}) ** {pw}"
    stride = [f"stride={_compact(s)}"] if list(s) != list(k) else []
    order = [v for lo_hi in reversed(pairs) for v in lo_hi]  # F.pad: the last axis first
    x = f"F.pad({power}, {int_tuple(order)})" if any(order) else power
    total = f"F.avg_pool{n}d({', '.join([x, _compact(k), *stride])}) * {int(np.prod(k))}"
    return f"torch.sqrt({total})" if pw == 2 else f"({total}) ** {scalar_literal(1 / pw)}"


registry.helpers["dilated_avg_pool"] = '''
def _dilated_avg_pool(x, kernel, stride, dilation, pads, extra, count_include_pad):
    """ONNX AveragePool over a dilated window (torch's avg_pool has no dilation): each
    window's sum by a depthwise convolution with ones, over the inputs it covers (plus the
    ``pads`` with count_include_pad; ceil_mode's ``extra`` padding never counts)."""
    conv = (F.conv1d, F.conv2d, F.conv3d)[len(kernel) - 1]
    ones = torch.ones((x.shape[1], 1, *kernel), dtype=x.dtype, device=x.device)
    padded = F.pad(F.pad(x, pads), extra)
    sums = conv(padded, ones, stride=stride, dilation=dilation, groups=x.shape[1])
    cover = F.pad(F.pad(torch.ones_like(x[:1, :1]), pads, value=float(count_include_pad)), extra)
    return sums / conv(cover, ones[:1], stride=stride, dilation=dilation)
'''


@template("AveragePool", **ex.AVERAGE_POOL_ATTRS)
def _avg_pool(c: OpCall) -> str:
    k = c.attrs["kernel_shape"]
    n = len(k)
    s = c.attrs["strides"] or [1] * n
    if c.attrs["dilations"] and any(x != 1 for x in c.attrs["dilations"]):
        c.helpers.add("dilated_avg_pool")
        pads = ex.pool_padding(c)
        extra = [(0, hi - b) for (_, hi), (_, b) in zip(ex.ceil_pads(c, pads), pads, strict=True)]
        return (
            f"_dilated_avg_pool({c.args[0]}, {int_tuple(k)}, {int_tuple(s)}, "
            f"{int_tuple(c.attrs['dilations'])}, {_pad_order(c, n, pads)}, "
            f"{_pad_order(c, n, extra)}, {bool(c.attrs['count_include_pad'])})"
        )
    x, pad = _pool_pads(c, n, list(k))
    stride = [f"stride={_compact(s)}"] if list(s) != list(k) else []  # torch: stride = kernel
    if pad is None:  # zeros in the window; without count_include_pad, divide by the count
        order = _pad_order(c, n)
        mean = f"F.avg_pool{n}d(F.pad({x}, {order}), {', '.join([_compact(k), *stride])})"
        if c.attrs["count_include_pad"]:
            return mean
        ones = f"torch.ones_like({x}[:1, :1])"
        share = f"F.avg_pool{n}d(F.pad({ones}, {order}), {', '.join([_compact(k), *stride])})"
        return f"{mean} / {share}"
    args = [x, _compact(k), *stride]
    args += [f"padding={_compact(pad)}"] if any(pad) else []
    args += ["ceil_mode=True"] if c.attrs["ceil_mode"] else []
    if any(pad) and not c.attrs["count_include_pad"]:  # ONNX's default, not torch's
        args.append("count_include_pad=False")
    return f"F.avg_pool{n}d({', '.join(args)})"


@template("GlobalAveragePool")
def _gap(c: OpCall) -> str:
    dims = tuple(range(2, c.need_rank()))
    return f"{c.args[0]}.mean(dim={dims}, keepdim=True)"


@template("GlobalMaxPool")
def _gmp(c: OpCall) -> str:
    dims = tuple(range(2, c.need_rank()))
    return f"{c.args[0]}.amax(dim={dims}, keepdim=True)"
