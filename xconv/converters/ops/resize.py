"""Resize and Upsample coordinate and weight computation on numpy.

Resize is separable: each axis whose size, scale or roi changes becomes one static gather
(nearest) or one gather of n taps per output followed by their weighted sum (linear, cubic).
:func:`resize_steps` computes those indices and weights; a backend only applies them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xconv.converters.ops.arrays import normalize_axis

Fail = Callable[[str], Exception]


def source_coords(
    mode: str, y: np.ndarray, scale: float, in_size: int, out_size: int, roi: Sequence[float] | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Output pixel indices -> input coordinates (float64), and the extrapolated mask."""
    out_width = scale * in_size
    outside = None
    if mode == "align_corners":
        x = np.zeros_like(y) if out_width == 1 else y * (in_size - 1) / (out_width - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        lo, hi = roi
        if out_width == 1:
            x = np.full_like(y, (hi - lo) * (in_size - 1) / 2)
        else:
            x = y * (hi - lo) * (in_size - 1) / (out_width - 1)
        x = x + lo * (in_size - 1)
        outside = (x < 0) | (x > in_size - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full_like(y, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_size / out_width)
        x = offset + (y + 0.5) / scale - 0.5
    elif mode == "tf_half_pixel_for_nn":  # opset 11's; tf2onnx still writes it (Keras Resizing)
        x = (y + 0.5) / scale
    else:
        raise ValueError(mode)
    return x, outside


def nearest_index(x: np.ndarray, mode: str, downsample: bool) -> np.ndarray:
    fl = np.floor(x)
    frac = x - fl
    if mode == "round_prefer_floor":
        idx = np.where(frac <= 0.5, fl, fl + 1)
    elif mode == "round_prefer_ceil":
        idx = np.where(frac < 0.5, fl, fl + 1)
    elif mode == "floor":
        idx = fl
    elif mode == "ceil":
        idx = np.ceil(x)
    elif mode == "simple":  # Upsample and Resize-10: floor when upsampling, ceil when down.
        idx = np.ceil(x) if downsample else fl
    else:
        raise ValueError(mode)
    return idx.astype(np.int32)


def cubic_kernel(t: np.ndarray, a: float) -> np.ndarray:
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def interp_weights(
    x: np.ndarray,
    in_size: int,
    scale: float,
    mode: str,
    cubic_a: float,
    antialias: bool,
    exclude_outside: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Taps of 1-D linear or cubic interpolation at coordinates x: (out, n) indices, weights.

    Indices are clamped into the axis, which is the edge padding the spec asks for.
    """
    fl = np.floor(x)
    # The left neighbour is preferred: an integer coordinate has ratio 1, not 0.
    ratio = np.where(x == fl, 1.0, x - fl)
    if antialias and scale < 1:
        support = 1.0 if mode == "linear" else 2.0
        start = int(np.floor(-support / scale) + 1)
        taps = np.arange(start, 2 - start)
    else:
        scale = 1.0
        taps = np.arange(-1, 3) if mode == "cubic" else np.arange(0, 2)
    # Offsets from the left neighbour floor(x) (or x-1 when x is an integer).
    left = np.where(x == fl, fl - 1, fl)
    dist = (taps[None, :] - ratio[:, None]) * scale
    coeffs = np.clip(1 - np.abs(dist), 0, 1) if mode == "linear" else cubic_kernel(dist, cubic_a)
    if antialias:
        coeffs = coeffs / coeffs.sum(axis=1, keepdims=True)
    idx = left[:, None].astype(np.int64) + taps[None, :]
    if exclude_outside:
        coeffs = np.where((idx < 0) | (idx >= in_size), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, in_size - 1), coeffs


def resize_steps(
    in_shape: Sequence[int],
    *,
    scales: list[float],
    sizes: list[int],
    roi: list[float] | None,
    mode: str,
    coord_mode: str,
    nearest_mode: str,
    cubic_a: float,
    antialias: bool,
    exclude_outside: bool,
    fail: Fail,
) -> tuple[list[tuple[int, np.ndarray, np.ndarray | None]], np.ndarray | None]:
    """Per changed axis ``(axis, idx, coeffs)``: ``idx`` [out] for nearest (``coeffs`` None),
    or [out, n] tap indices with [out, n] weights; and the extrapolation mask (broadcastable
    to the output, True where tf_crop_and_resize samples outside the input) or None.
    """
    rank = len(in_shape)
    steps = []
    outside_any = None
    for axis in range(rank):
        in_size, out_size, scale = in_shape[axis], sizes[axis], scales[axis]
        axis_roi = None if roi is None else (roi[axis], roi[axis + rank])
        identity_roi = axis_roi is None or (
            math.isclose(axis_roi[0], 0.0) and math.isclose(axis_roi[1], 1.0)
        )
        if math.isclose(scale, 1.0) and out_size == in_size and identity_roi:
            continue
        if coord_mode == "tf_crop_and_resize" and axis_roi is None:
            raise fail("coordinate_transformation_mode 'tf_crop_and_resize' needs roi")
        pos = np.arange(out_size, dtype=np.float64)
        coords, outside = source_coords(coord_mode, pos, scale, in_size, out_size, axis_roi)
        if mode == "nearest":
            idx = np.clip(nearest_index(coords, nearest_mode, scale < 1), 0, in_size - 1)
            steps.append((axis, idx, None))
        else:
            idx, coeffs = interp_weights(
                coords, in_size, scale, mode, cubic_a, antialias, exclude_outside
            )
            steps.append((axis, idx, coeffs))
        if outside is not None and outside.any():
            mask = outside.reshape((1,) * axis + (-1,) + (1,) * (rank - axis - 1))
            outside_any = mask if outside_any is None else (outside_any | mask)
    return steps, outside_any


def resize_sizes(
    in_shape: Sequence[int],
    axes: list[int],
    *,
    roi: list | None,
    scales: list[float] | None,
    sizes: list[int] | None,
    keep_aspect_ratio_policy: str,
) -> tuple[list[float], list[int], list | None]:
    """Resize-11+ inputs over ``axes`` -> full-rank (scales, sizes, roi).

    Exactly one of ``scales`` and ``sizes`` is given; ``roi`` (starts then ends over
    ``axes``) is kept in its own dtype: the reference does roi arithmetic in it.
    """
    rank = len(in_shape)
    roi_v = None
    if roi is not None:
        roi_v = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            roi_v[a] = roi[i]
            roi_v[rank + a] = roi[len(axes) + i]
    if scales is not None:
        scale_v = [1.0] * rank
        for i, a in enumerate(axes):
            scale_v[a] = scales[i]
        size_v = [int(s * d) for s, d in zip(scale_v, in_shape, strict=True)]
    else:
        size_v = list(in_shape)
        for i, a in enumerate(axes):
            size_v[a] = sizes[i]
        scale_v = [s / d for s, d in zip(size_v, in_shape, strict=True)]
        if keep_aspect_ratio_policy != "stretch":
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            common = pick(scale_v[a] for a in axes)
            scale_v = [common if i in axes else 1.0 for i in range(rank)]
            size_v = [
                int(common * in_shape[i] + 0.5) if i in axes else in_shape[i] for i in range(rank)
            ]
    return scale_v, size_v, roi_v


_RESIZE_MODES = ("nearest", "linear", "cubic")
_COORD_MODES = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
    "tf_half_pixel_for_nn",
)
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")

#: Resize's attributes with their spec defaults (every opset from 10 on).
RESIZE_ATTRS = {
    "antialias": 0,
    "axes": None,
    "coordinate_transformation_mode": "half_pixel",
    "cubic_coeff_a": -0.75,
    "exclude_outside": 0,
    "extrapolation_value": 0.0,
    "keep_aspect_ratio_policy": "stretch",
    "mode": "nearest",
    "nearest_mode": "round_prefer_floor",
}


def resize_arguments(
    ctx,
    in_shape: Sequence[int],
    roi,
    scales,
    sizes,
    attrs: dict,
    *,
    present: Callable[[Any], bool],
) -> dict:
    """Validate a Resize node and resolve its per-axis scales, sizes and roi.

    Returns the keyword arguments of a backend's resampling function: ``scales``, ``sizes``,
    ``roi``, ``mode``, ``coord_mode``, ``nearest_mode``, ``cubic_a``, ``antialias``,
    ``exclude_outside``, ``extrapolation_value``. ``present(v)`` says whether an optional
    input holds data (an empty tensor means absent).
    """
    from xconv.converters.ops.attrs import check_choice, static_ints, unsupported

    mode = attrs["mode"]
    coord_mode = attrs["coordinate_transformation_mode"]
    nearest_mode = attrs["nearest_mode"]
    policy = attrs["keep_aspect_ratio_policy"]
    if ctx.opset < 11:  # Resize-10 is Resize(X, scales) with asymmetric coordinates.
        roi, scales = None, roi
        coord_mode, nearest_mode = "asymmetric", "simple"
    else:
        check_choice(ctx, "coordinate_transformation_mode", coord_mode, _COORD_MODES)
        check_choice(ctx, "nearest_mode", nearest_mode, _NEAREST_MODES)
    check_choice(ctx, "mode", mode, _RESIZE_MODES)
    check_choice(ctx, "keep_aspect_ratio_policy", policy, ("stretch", "not_larger", "not_smaller"))
    if attrs["antialias"] and mode == "nearest":
        raise unsupported(ctx, "antialias is only defined for linear and cubic modes")
    rank = len(in_shape)
    axes = attrs["axes"]
    ax = [normalize_axis(ctx, a, rank) for a in axes] if axes is not None else list(range(rank))
    roi_v = None
    if roi is not None and present(roi):
        roi_v = list(np.asarray(ctx.static(roi, "roi")).reshape(-1))
    has_scales = scales is not None and present(scales)
    has_sizes = sizes is not None and present(sizes)
    if has_scales == has_sizes:
        raise ctx.error("Resize needs exactly one of 'scales' and 'sizes'")
    scale_v, size_v, roi_v = resize_sizes(
        in_shape,
        ax,
        roi=roi_v,
        scales=(
            [float(v) for v in np.asarray(ctx.static(scales, "scales")).reshape(-1)]
            if has_scales
            else None
        ),
        sizes=None if has_scales else static_ints(ctx, sizes, "sizes"),
        keep_aspect_ratio_policy=policy,
    )
    return {
        "scales": scale_v,
        "sizes": size_v,
        "roi": roi_v,
        "mode": mode,
        "coord_mode": coord_mode,
        "nearest_mode": nearest_mode,
        "cubic_a": attrs["cubic_coeff_a"],
        "antialias": bool(attrs["antialias"]),
        "exclude_outside": bool(attrs["exclude_outside"]),
        "extrapolation_value": attrs["extrapolation_value"],
    }


def _apply(xp, k, x, steps, outside_any, extrapolation_value: float, mode: str):
    """Apply :func:`resize_steps`' plan to ``x`` in namespace ``xp``."""
    from xconv.converters.ops.arrays import astype, is_integer

    def const(a):  # numpy plan data in the namespace of the data
        return a if xp is np else k.constant(a, y)

    dtype = x.dtype
    y = x
    if mode != "nearest":
        y = astype(xp, x, dtype if dtype in (xp.float32, xp.float64) else xp.float32)
    for axis, idx, coeffs in steps:
        if coeffs is None:
            y = xp.take(y, idx.astype(np.int32), axis=axis)
            continue
        # A static gather of n taps per output, then their weighted sum: O(out * n).
        taps = xp.take(y, idx.reshape(-1).astype(np.int32), axis=axis)
        lead, trail = tuple(y.shape[:axis]), tuple(y.shape[axis + 1 :])
        taps = xp.reshape(taps, (*lead, *idx.shape, *trail))
        w = coeffs.reshape((1,) * axis + coeffs.shape + (1,) * len(trail))
        y = xp.sum(taps * astype(xp, const(w), y.dtype), axis=axis + 1)
    if outside_any is not None:
        fill = xp.full_like(y, extrapolation_value)
        y = xp.where(const(outside_any), fill, y)
    if y.dtype != dtype:
        if is_integer(dtype):
            info = xp.iinfo(dtype)
            y = xp.clip(xp.rint(y), info.min, info.max)
        y = astype(xp, y, dtype)
    return y


def register_resize_ops(builtin: Callable[..., Any], k: Any) -> None:
    """Resize and Upsample: the plan of :func:`resize_steps` applied through ``k.run`` (the
    backend's namespace; ``k.constant(a, like)`` brings numpy indices' masks and weights)."""
    from xconv.converters.ops.attrs import check_choice

    def resample(ctx, x, *, extrapolation_value: float, **plan):
        steps, outside_any = resize_steps(np.shape(x), **plan, fail=ctx.error)
        return k.run(
            lambda xp, x: _apply(xp, k, x, steps, outside_any, extrapolation_value, plan["mode"]),
            x,
        )

    @builtin("Resize", since=10, attrs=RESIZE_ATTRS)
    def resize(ctx, x, roi=None, scales=None, sizes=None, **attrs):
        """Resize(X, roi?, scales?, sizes?) -> Y: nearest, linear or cubic resampling."""
        kwargs = resize_arguments(
            ctx,
            np.shape(x),
            roi,
            scales,
            sizes,
            attrs,
            present=lambda v: math.prod(np.shape(v)) > 0,
        )
        return resample(ctx, x, **kwargs)

    @builtin(
        "Upsample",
        since=1,
        attrs={"mode": "nearest", "scales": None, "height_scale": None, "width_scale": None},
    )
    def upsample(ctx, x, scales_in=None, *, mode, scales, height_scale, width_scale):
        """Upsample(X, scales) -> Y: nearest or (bi)linear upsampling, asymmetric
        coordinates."""
        check_choice(ctx, "mode", mode, ("nearest", "linear", "bilinear"))
        src = scales_in if scales_in is not None else scales
        if src is None and height_scale is not None and width_scale is not None:
            src = (1.0, 1.0, height_scale, width_scale)  # Upsample-1: NCHW only.
        if src is None:
            raise ctx.error("Upsample needs scales")
        scale_v = [float(v) for v in np.asarray(ctx.static(src, "scales")).reshape(-1)]
        return resample(
            ctx,
            x,
            scales=scale_v,
            sizes=[int(s * d) for s, d in zip(scale_v, np.shape(x), strict=True)],
            roi=None,
            mode="nearest" if mode == "nearest" else "linear",
            coord_mode="asymmetric",
            nearest_mode="simple",
            cubic_a=-0.75,
            antialias=False,
            exclude_outside=False,
            extrapolation_value=0.0,
        )
