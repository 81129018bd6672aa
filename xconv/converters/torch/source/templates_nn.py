"""PyTorch source templates for the layers' ops: convolution and pooling, normalisation,
attention, losses. Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx_ir as ir

from xconv.converters import expressions as ex
from xconv.converters import expressions_structured as exs
from xconv.converters.codegen import int_tuple, scalar_literal
from xconv.converters.ops.attention import ATTENTION_ATTRS
from xconv.converters.ops.resize import RESIZE_ATTRS
from xconv.converters.registry import REQUIRED
from xconv.converters.torch.source.templates import (
    OpCall,
    dtype_expr,
    registry,
    template,
)
from xconv.errors import UnsupportedAttributeError

# ---------------------------------------------------------------- convolution and pooling


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
    pads = c.attrs.get("pads") or [0] * (2 * n)
    if c.attrs.get("auto_pad", "NOTSET") == "NOTSET" and list(pads[:n]) != list(pads[n:]):
        # Asymmetric zero padding (TensorFlow's SAME with stride 2) has no conv argument:
        # pad explicitly (F.pad lists the last dim first), then convolve unpadded.
        order = [v for i in reversed(range(n)) for v in (pads[i], pads[n + i])]
        x, pad = f"F.pad({x}, {int_tuple(order)})", [0] * n
    else:
        pad = _sym_pads(c, n)
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


@template("MaxPool", **ex.MAX_POOL_ATTRS)
def _max_pool(c: OpCall) -> str:
    if len(c.node.outputs) > 1:
        raise c.fail("MaxPool with an Indices output is not supported")
    k = c.attrs["kernel_shape"]
    n = len(k)
    s = c.attrs["strides"] or [1] * n
    d = c.attrs["dilations"] or [1] * n
    x, pad = _pool_pads(c, n, [(ki - 1) * di + 1 for ki, di in zip(k, d, strict=True)])
    if pad is None:  # the window's padding reads as -inf: it never wins
        x, pad = f"F.pad({x}, {_pad_order(c, n)}, value=float('-inf'))", [0] * n
    args = [x, _compact(k)]
    args += [f"stride={_compact(s)}"] if list(s) != list(k) else []  # torch: stride = kernel
    args += [f"padding={_compact(pad)}"] if any(pad) else []
    args += [f"dilation={_compact(d)}"] if any(x != 1 for x in d) else []
    args += ["ceil_mode=True"] if c.attrs["ceil_mode"] else []
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


# ---------------------------------------------------------------- normalisation


@template("BatchNormalization", epsilon=1e-5, momentum=0.9, training_mode=0)
def _batch_norm(c: OpCall) -> str:
    if c.attrs["training_mode"] or len(c.node.outputs) > 1:
        raise c.fail("training-mode BatchNormalization nodes are not supported")
    x, s, b, m, v = c.args[:5]
    eps = scalar_literal(c.attrs["epsilon"])
    # eval mode: torch's training=False and momentum (unused then) are the defaults
    return (
        f"F.batch_norm({x}, {m}, {v}, {s}, {b}" + ("" if eps == "1e-05" else f", eps={eps}") + ")"
    )


def _norm_shape(c: OpCall, axis: int) -> str:
    r = c.need_rank()
    a = axis + r if axis < 0 else axis
    shape = c.shapes[1] if c.shapes[1] is not None and len(c.shapes[1]) == r - a else None
    if shape is not None and all(isinstance(d, int) for d in shape):
        return int_tuple(shape)
    return f"{c.args[0]}.shape[{a}:]"


registry.helpers["layer_norm_stats"] = '''
def _layer_norm_stats(x, weight, bias, axis, eps):
    """(Y, Mean, InvStdDev) of ONNX's LayerNormalization: the statistics in float32 over the
    dims from ``axis``, kept as size-1 dims."""
    xs = x.float()
    var, mean = torch.var_mean(xs, dim=tuple(range(axis % x.dim(), x.dim())), correction=0,
                               keepdim=True)
    inv = torch.rsqrt(var + eps)
    y = ((xs - mean) * inv).to(x.dtype) * weight
    return (y if bias is None else y + bias), mean, inv
'''


@template("LayerNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _layer_norm(c: OpCall) -> str:
    n = len(c.node.outputs)
    b = c.args[2] if c.has(2) else "None"
    eps = scalar_literal(c.attrs["epsilon"])
    if n > 1 and any(o.uses() or o.is_graph_output() for o in c.node.outputs[1:]):
        if c.attrs["stash_type"] != 1:
            raise c.fail(f"LayerNormalization statistics in stash_type={c.attrs['stash_type']}")
        c.helpers.add("layer_norm_stats")
        call = f"_layer_norm_stats({c.args[0]}, {c.args[1]}, {b}, {c.attrs['axis']}, {eps})"
        return call if n == 3 else f"{call}[:{n}]"
    call = f"F.layer_norm({c.args[0]}, {_norm_shape(c, c.attrs['axis'])}, {c.args[1]}, {b}, {eps})"
    return call if n == 1 else f"{call}, " + ", ".join(["None"] * (n - 1))


@template("RMSNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _rms_norm(c: OpCall) -> str:
    return (
        f"F.rms_norm({c.args[0]}, {_norm_shape(c, c.attrs['axis'])}, {c.args[1]}, "
        f"{scalar_literal(c.attrs['epsilon'])})"
    )


@template("GroupNormalization", epsilon=1e-5, num_groups=REQUIRED, stash_type=1)
def _group_norm(c: OpCall) -> str:
    return (
        f"F.group_norm({c.args[0]}, {c.attrs['num_groups']}, {c.args[1]}, {c.args[2]}, "
        f"{scalar_literal(c.attrs['epsilon'])})"
    )


@template("InstanceNormalization", epsilon=1e-5)
def _instance_norm(c: OpCall) -> str:
    x, scale, bias = c.args[:3]
    eps = scalar_literal(c.attrs["epsilon"])
    return f"F.instance_norm({x}, weight={scale}, bias={bias}, eps={eps})"


@template("LRN", alpha=0.0001, beta=0.75, bias=1.0, size=REQUIRED)
def _lrn(c: OpCall) -> str:
    before, after = ex.lrn_window(c)
    if before != after:  # F.local_response_norm puts the longer side before the channel
        raise c.fail(
            f"LRN of even size {c.attrs['size']} (F.local_response_norm centres it otherwise)"
        )
    a = ", ".join(scalar_literal(c.attrs[n]) for n in ("alpha", "beta", "bias"))
    return f"F.local_response_norm({c.args[0]}, {int(c.attrs['size'])}, {a})"


registry.helpers["mean_variance_normalization"] = '''
def _mean_variance_normalization(x, dims):
    """ONNX MeanVarianceNormalization: (x - E[x]) / (sqrt(E[x**2] - E[x]**2) + 1e-9)."""
    mean = torch.mean(x, dim=dims, keepdim=True)
    std = torch.sqrt(torch.mean(torch.square(x), dim=dims, keepdim=True) - torch.square(mean))
    return (x - mean) / (std + 1e-9)
'''


registry.builtin("MeanVarianceNormalization", attrs={"axes": (0, 2, 3)})(ex.mean_variance_call)


@template("Softmax", axis=-1)
def _softmax(c: OpCall) -> str:
    return f"torch.softmax({c.args[0]}, dim={c.attrs['axis']})"


@template("LogSoftmax", axis=-1)
def _log_softmax(c: OpCall) -> str:
    return f"torch.log_softmax({c.args[0]}, dim={c.attrs['axis']})"


@template("Hardmax", axis=-1)
def _hardmax(c: OpCall) -> str:
    """1 at the first maximum along ``axis``, 0 elsewhere (F.one_hot adds its axis last)."""
    x, a = c.args[0], c.attrs["axis"]
    hot = f"F.one_hot(torch.argmax({x}, dim={a}), {x}.shape[{a}])"
    if a not in (-1, c.need_rank() - 1):
        hot = f"torch.movedim({hot}, -1, {a})"
    return f"{hot}.to({x}.dtype)"


@template("LpNormalization", axis=-1, p=2)
def _lp_normalization(c: OpCall) -> str:
    """``F.normalize``: x over its L1 / L2 norm along ``axis`` (a norm under 1e-12 counted as
    1e-12, so a zero vector stays zero as ONNX's reference gives it)."""
    if c.attrs["p"] not in (1, 2):
        raise c.fail(f"p={c.attrs['p']}; ONNX defines 1, 2")
    return f"F.normalize({c.args[0]}, p={c.attrs['p']}, dim={c.attrs['axis']})"


#: ONNX GridSample's modes (opset 20 names, and opset 16's) as F.grid_sample's.
_GRID_MODES = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest",
               "cubic": "bicubic", "bicubic": "bicubic"}  # fmt: skip


@template("GridSample", align_corners=0, mode="linear", padding_mode="zeros")
def _grid_sample(c: OpCall) -> str:
    """``F.grid_sample``, which ONNX's GridSample follows (modes, padding, align_corners)."""
    a = c.attrs
    mode = _GRID_MODES.get(a["mode"])
    if mode is None or a["padding_mode"] not in ("zeros", "border", "reflection"):
        raise c.fail(f"GridSample mode={a['mode']!r}, padding_mode={a['padding_mode']!r}")
    if mode == "bicubic" and c.need_rank() != 4:
        raise c.fail("GridSample cubic of a 5-D input (F.grid_sample's bicubic is 2-D)")
    return (
        f'F.grid_sample({c.args[0]}, {c.args[1]}, mode="{mode}", '
        f'padding_mode="{a["padding_mode"]}", align_corners={bool(a["align_corners"])})'
    )


@template("AffineGrid", align_corners=0)
def _affine_grid(c: OpCall) -> str:
    """``F.affine_grid``, which ONNX's AffineGrid follows."""
    corners = bool(c.attrs["align_corners"])
    return f"F.affine_grid({c.args[0]}, {c.ints(1)}, align_corners={corners})"


# ---------------------------------------------------------------- attention


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


# ---------------------------------------------------------------- resampling

#: F.interpolate's mode per rank for ONNX's linear and cubic modes.
_INTERPOLATE = {"linear": {3: "linear", 4: "bilinear", 5: "trilinear"}, "cubic": {4: "bicubic"}}


# ---------------------------------------------------------------- scatters: Col2Im, MaxUnpool,
# TensorScatter

registry.helpers["col2im_index"] = exs.COL2IM_INDEX
registry.helpers["col2im"] = '''
def _col2im(x, image_shape, block_shape, strides, dilations, pads):
    """ONNX Col2Im: the sliding blocks of x (N, C * prod(block), L) summed into an image
    (N, C, *image_shape); image_shape and block_shape read from their values."""
    image = [int(v) for v in torch.as_tensor(image_shape).reshape(-1).tolist()]
    block = [int(v) for v in torch.as_tensor(block_shape).reshape(-1).tolist()]
    index = torch.as_tensor(_col2im_index(image, block, strides, dilations, pads), device=x.device)
    nb, ck, _ = x.shape
    c, total = ck // math.prod(block), math.prod(image)
    out = x.new_zeros((nb, c, total + 1)).index_add(2, index, x.reshape(nb, c, -1))
    return out[:, :, :total].reshape(nb, c, *image)
'''
template("Col2Im", dilations=None, pads=None, strides=None)(exs.col2im_call)

registry.helpers["max_unpool"] = '''
def _max_unpool(x, indices, kernel, strides, pads, output_shape=None):
    """ONNX MaxUnpool: x's values set at their flat positions ``indices`` in zeros of the
    pooled input's shape (indices out of range dropped); with output_shape, zero-padded at the
    end or cropped to it."""
    n = x.dim() - 2
    shape = list(x.shape[:2]) + [
        (x.shape[i + 2] - 1) * strides[i] - (pads[i] + pads[i + n]) + kernel[i] for i in range(n)
    ]
    size = math.prod(shape)
    idx = indices.reshape(-1).to(torch.int64)
    keep = (idx >= 0) & (idx < size)
    flat = x.new_zeros((size,)).index_put((idx[keep],), x.reshape(-1)[keep])
    y = flat.reshape(shape)
    if output_shape is None:
        return y
    target = [int(v) for v in torch.as_tensor(output_shape).reshape(-1).tolist()]
    pad = [q for t, i in zip(target[::-1], y.shape[::-1], strict=True) for q in (0, max(0, t - i))]
    y = F.pad(y, pad) if any(pad) else y
    return y[tuple(slice(0, t) for t in target)]
'''
template("MaxUnpool", kernel_shape=REQUIRED, pads=None, strides=None)(exs.max_unpool_call)

registry.helpers["tensor_scatter"] = '''
def _tensor_scatter(cache, update, write_indices=None, axis=-2, circular=False):
    """ONNX TensorScatter (a KV-cache write): ``update`` written into ``cache`` along ``axis``
    from each batch entry's write index (0 without them), wrapping around when ``circular``;
    writes past the end are dropped."""
    batch, max_len, seq = cache.shape[0], cache.shape[axis], update.shape[axis]
    if write_indices is None:
        starts = torch.zeros(batch, dtype=torch.int64, device=cache.device)
    else:
        starts = write_indices.reshape(batch).to(torch.int64)
    pos = starts[:, None] + torch.arange(seq, device=cache.device)[None, :]
    if circular:
        pos = pos % max_len
    rows = torch.arange(batch, device=cache.device)[:, None].expand_as(pos)
    inside = pos < max_len
    moved = cache.movedim(axis, 1).clone()
    moved[rows[inside], pos[inside]] = update.movedim(axis, 1).to(cache.dtype)[inside]
    return moved.movedim(1, axis)
'''
template("TensorScatter", axis=-2, mode="linear")(exs.tensor_scatter_call)


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


registry.helpers["resize_plan"] = ex.RESIZE_PLAN
registry.helpers["resize"] = '''
def _resize(x, scales, sizes, mode, coord, nearest_mode="round_prefer_floor", **kw):
    """ONNX Resize (``_resize_plan``'s keywords) where F.interpolate computes it otherwise: per
    axis that changes, a gather of the nearest inputs, or of the taps and their weighted sum.
    Integers and float16 / bfloat16 interpolate in float32."""
    dtype = x.dtype
    if mode != "nearest" and dtype not in (torch.float32, torch.float64):
        x = x.float()
    scales = None if scales is None else [float(s) for s in scales]
    sizes = None if sizes is None else [int(s) for s in sizes]
    shape = tuple(x.shape)
    for axis, index, weights in _resize_plan(shape, scales, sizes, mode, coord, nearest_mode, **kw):
        index = torch.as_tensor(index, device=x.device)
        if weights is None:
            x = torch.index_select(x, axis, index)
            continue
        taps = torch.index_select(x, axis, index.reshape(-1))
        taps = taps.reshape(*x.shape[:axis], *index.shape, *x.shape[axis + 1 :])
        weights = torch.as_tensor(weights, dtype=x.dtype, device=x.device)
        x = (taps * weights.reshape(weights.shape + (1,) * (x.dim() - axis - 1))).sum(axis + 1)
    if x.dtype != dtype and not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.clamp(torch.round(x), info.min, info.max)
    return x.to(dtype)
'''


@template("Resize", **RESIZE_ATTRS)
def _resize(c: OpCall) -> str:
    """``F.interpolate`` where it computes ONNX's Resize exactly, else the generated
    ``_resize`` (which plans each axis as the runtimes do: other modes and coordinates,
    antialias, axes, scales or sizes the graph computes)."""
    try:
        return _interpolate_call(c)
    except UnsupportedAttributeError:
        return ex.resize_call(c, lambda i, what: c.args[i])


def _interpolate_call(c: OpCall) -> str:
    """``F.interpolate`` where it computes ONNX's Resize exactly: over the spatial axes only;
    ``nearest`` rounded down from ``asymmetric`` coordinates (torch's ``"nearest"``) or from
    ``tf_half_pixel_for_nn`` ones (its ``"nearest-exact"``: Keras' ``Resizing``);
    ``linear`` (and 4-D ``cubic`` at ``a = -0.75``, torch's) with ``align_corners``, or half
    pixel coordinates where no output axis has one element (there ``half_pixel`` and
    ``pytorch_half_pixel`` both differ from torch 2.x, which samples the middle). The scales
    are passed as given (torch then maps coordinates by them, as ONNX does), else the
    sizes."""
    a = c.attrs
    modes = ("nearest", "linear", "cubic")
    out, factors, from_scales = ex.resize_plan(c, modes)
    mode, coord, rank = a["mode"], a["coordinate_transformation_mode"], len(out)
    if not 3 <= rank <= 5 or factors[:2] != [1.0, 1.0]:
        raise c.fail("Resize of the batch or channel axis has no F.interpolate counterpart")
    if mode == "nearest":
        torch_mode = {"asymmetric": "nearest", "tf_half_pixel_for_nn": "nearest-exact"}
        if coord not in torch_mode or a["nearest_mode"] != "floor":
            raise c.fail(
                f"Resize nearest with {coord} / {a['nearest_mode']}: F.interpolate's "
                "'nearest' is asymmetric / floor, its 'nearest-exact' tf_half_pixel_for_nn / floor"
            )
        mode, extra = torch_mode[coord], ""
    else:
        torch_mode = _INTERPOLATE[mode].get(rank)
        wide = all(
            f is not None and f >= 2 if o is None else o > 1
            for o, f in zip(out[2:], factors[2:], strict=True)
        )
        half = coord in ("half_pixel", "pytorch_half_pixel") and wide
        if torch_mode is None or not (half or coord == "align_corners"):
            raise c.fail(f"Resize {mode} of rank {rank} with {coord} has no F.interpolate mode")
        if mode == "cubic" and a["cubic_coeff_a"] != -0.75:
            raise c.fail(f"Resize cubic_coeff_a={a['cubic_coeff_a']} (torch's bicubic: -0.75)")
        fractional = [
            n is not None and f is not None and n * f != int(n * f)
            for n, f in zip(c.shapes[0][2:], factors[2:], strict=True)
        ]
        if coord == "align_corners" and from_scales and any(fractional):
            # ONNX maps by the unrounded size (in * scale - 1), torch by the output's
            raise c.fail("Resize align_corners with a scale that gives a fractional size")
        mode = torch_mode
        extra = f", align_corners={coord == 'align_corners'}"
    if from_scales:
        spatial = [float(f) for f in factors[2:]]
        arg = f"scale_factor={spatial[0] if len(set(spatial)) == 1 else tuple(spatial)}"
    else:
        spatial = [int(o) for o in out[2:]]
        arg = f"size={spatial[0] if len(set(spatial)) == 1 else tuple(spatial)}"
    return f'F.interpolate({c.args[0]}, {arg}, mode="{mode}"{extra})'


# ---------------------------------------------------------------- losses


@template("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", **ex.LOSS_ATTRS)
def _loss(c: OpCall) -> str:
    """``F.nll_loss`` / ``F.cross_entropy``: ONNX defined both after them (the mean over the
    weights of the targets kept; torch wants int64 targets); SoftmaxCrossEntropyLoss's
    log_prob output is ``F.log_softmax`` over the classes."""
    kw = ex.loss_keywords(c)
    target = c.args[1]
    if c.node.inputs[1].dtype != ir.DataType.INT64:
        target = f"{target}.long()"
    if c.has(2):
        kw.insert(0, f"weight={c.args[2]}")
    nll = c.node.op_type == "NegativeLogLikelihoodLoss"
    call = f"F.{'nll_loss' if nll else 'cross_entropy'}({', '.join([c.args[0], target, *kw])})"
    if len(c.node.outputs) > 1:
        return f"{call}, F.log_softmax({c.args[0]}, dim=1)"
    return call
