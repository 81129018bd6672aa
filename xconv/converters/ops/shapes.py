"""Convolution and pooling geometry: auto_pad, explicit pads and output sizes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from xconv.errors import UnsupportedAttributeError

AUTO_PADS = ("NOTSET", "", "SAME_UPPER", "SAME_LOWER", "VALID")


def ints(value, n: int, default: int) -> tuple[int, ...]:
    """An n-int attribute (strides, dilations, pads) with its default when absent."""
    return tuple(int(v) for v in value) if value else (default,) * n


def check_auto_pad(node: ir.Node, auto_pad: str) -> None:
    """Reject an auto_pad value ONNX does not define."""
    if auto_pad not in AUTO_PADS:
        raise UnsupportedAttributeError(
            f"auto_pad={auto_pad!r}; supported: NOTSET, SAME_UPPER, SAME_LOWER, VALID",
            op=node.op_type,
            node=node.name,
        )


def same_split(total: int, auto_pad: str) -> tuple[int, int]:
    """Split a total padding: the odd element goes last for SAME_UPPER, first for SAME_LOWER."""
    small = total // 2
    return (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)


def conv_padding(node: ir.Node, auto_pad, spatial, kernel, strides, dilations, pads):
    """Per-dimension ``(low, high)`` padding of a convolution."""
    check_auto_pad(node, auto_pad)
    n = len(spatial)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = []
        for i, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
            o = -(-i // s)
            out.append(same_split(max(0, (o - 1) * s + (k - 1) * d + 1 - i), auto_pad))
        return out
    if auto_pad == "VALID" or not pads:
        return [(0, 0)] * n
    return [(int(pads[i]), int(pads[i + n])) for i in range(n)]


def conv_output(spatial, padding, kernel, strides, dilations=None) -> tuple[int, ...]:
    """Output spatial size of a convolution (or pooling window) over ``spatial`` with
    ``(low, high)`` ``padding`` (floor mode)."""
    dilations = dilations or (1,) * len(spatial)
    sizes = zip(spatial, padding, kernel, strides, dilations, strict=True)
    return tuple(
        (int(n) + int(lo) + int(hi) - int(d) * (int(k) - 1) - 1) // int(s) + 1
        for n, (lo, hi), k, s, d in sizes
    )


def conv_transpose_padding(
    node: ir.Node,
    auto_pad,
    spatial,
    kernel,
    strides,
    dilations,
    output_padding,
    output_shape,
    pads,
):
    """ConvTranspose as a stride-1 convolution of the stride-dilated input: per-dimension
    ``(low, high)`` padding of that convolution (negative crops)."""
    check_auto_pad(node, auto_pad)
    n = len(spatial)
    full = [
        s * (i - 1) + op + (k - 1) * d + 1
        for i, k, s, d, op in zip(spatial, kernel, strides, dilations, output_padding, strict=True)
    ]
    if output_shape:
        target = [int(v) for v in output_shape][-n:]
        if pads and auto_pad in ("NOTSET", ""):
            lo_hi = [
                (int(pads[i]), f - int(pads[i]) - t)
                for i, (f, t) in enumerate(zip(full, target, strict=True))
            ]
        else:
            mode = "SAME_UPPER" if auto_pad == "SAME_UPPER" else "SAME_LOWER"
            lo_hi = [same_split(f - t, mode) for f, t in zip(full, target, strict=True)]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        lo_hi = [
            same_split(f - i * s, auto_pad) for f, i, s in zip(full, spatial, strides, strict=True)
        ]
    elif auto_pad == "VALID" or not pads:
        lo_hi = [(0, 0)] * n
    else:
        lo_hi = [(int(pads[i]), int(pads[i + n])) for i in range(n)]
    return [
        ((k - 1) * d - lo, (k - 1) * d - hi + op)
        for k, d, (lo, hi), op in zip(kernel, dilations, lo_hi, output_padding, strict=True)
    ]


def pool_geometry(node: ir.Node, auto_pad, spatial, kernel, strides, dilations, pads, ceil_mode):
    """Output sizes, explicit ``(low, high)`` pads and the extra high padding of ceil mode."""
    check_auto_pad(node, auto_pad)
    n = len(spatial)
    eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-i // s) for i, s in zip(spatial, strides, strict=True)]
        lo_hi = [
            same_split(max(0, (o - 1) * s + e - i), auto_pad)
            for o, s, e, i in zip(out, strides, eff, spatial, strict=True)
        ]
    elif auto_pad == "VALID":
        out = [(i - e) // s + 1 for i, e, s in zip(spatial, eff, strides, strict=True)]
        lo_hi = [(0, 0)] * n
    else:
        lo_hi = [(int(pads[i]), int(pads[i + n])) for i in range(n)] if pads else [(0, 0)] * n
        out = []
        for i, e, s, (lo, hi) in zip(spatial, eff, strides, lo_hi, strict=True):
            span = i + lo + hi - e
            if ceil_mode:
                o = -(-span // s) + 1
                if (o - 1) * s >= i + lo:
                    o -= 1
            else:
                o = span // s + 1
            out.append(o)
    extra = [
        max(0, (o - 1) * s + e - (i + lo + hi))
        for o, s, e, i, (lo, hi) in zip(out, strides, eff, spatial, lo_hi, strict=True)
    ]
    return out, lo_hi, extra


def window_counts(spatial, kernel, strides, dilations, lo_hi, out, include_pad):
    """How many window elements count for an average: an (out...) numpy array."""
    counts = np.ones((), np.int64)
    for i, k, s, d, (lo, hi), o in zip(
        spatial, kernel, strides, dilations, lo_hi, out, strict=True
    ):
        pos = np.arange(o)[:, None] * s + np.arange(k)[None, :] * d
        ok = pos < i + lo + hi if include_pad else (pos >= lo) & (pos < lo + i)
        counts = np.multiply.outer(counts, ok.sum(1))
    return counts
