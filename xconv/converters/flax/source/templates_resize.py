"""Flax source templates for GatherND and Resize (nearest / linear / cubic).

Each writes a call to a small generated helper (``_gather_nd``, ``_resize``) that follows the
ONNX definitions the JAX runtime implements (``indexing.gather_nd``, ``shape._resize``):
negative indices wrap; Resize maps output coordinates back by the node's
``coordinate_transformation_mode`` and rounds (nearest) or weighs the taps around it with
edge clamping (linear, cubic; antialias, exclude_outside), one axis at a time.
"""

from __future__ import annotations

import numpy as np

from xconv.converters import expressions as ex
from xconv.converters.flax.source.templates import OpCall, registry, template
from xconv.converters.ops.resize import RESIZE_ATTRS

registry.helpers["gather_nd"] = '''
def _gather_nd(data, indices, batch_dims):
    """ONNX GatherND: slices of ``data`` addressed by the index tuples in ``indices``."""
    b, k = batch_dims, indices.shape[-1]
    nb = math.prod(data.shape[:b])
    inner = indices.shape[b:-1]
    flat = jnp.reshape(data, (nb, *data.shape[b:]))
    idx = jnp.reshape(indices, (nb, *inner, k))
    comps = tuple(
        jnp.where(idx[..., j] < 0, idx[..., j] + data.shape[b + j], idx[..., j]) for j in range(k)
    )
    batch = jnp.reshape(jnp.arange(nb), (nb,) + (1,) * len(inner))
    out = flat[(batch, *comps)]
    return jnp.reshape(out, data.shape[:b] + inner + data.shape[b + k :])
'''

registry.helpers["resize"] = """
def _resize(
    x, scales, sizes, mode, coord, nearest_mode="round_prefer_floor", cubic_a=-0.75,
    antialias=False, exclude_outside=False, axes=None, keep_aspect_ratio_policy="stretch",
):
    \"\"\"ONNX Resize to ``scales`` or ``sizes`` (over ``axes``), one axis at a time: each
    output index is mapped back to an input coordinate by ``coord`` (in float64 numpy, when
    tracing: the sizes are static), then takes the nearest input (``nearest_mode``) or the
    weighted linear / cubic taps around it, clamped into the axis. Integers and float16 /
    bfloat16 interpolate in float32.\"\"\"
    dtype, shape = x.dtype, x.shape
    axes = range(x.ndim) if axes is None else [a % x.ndim for a in axes]
    if scales is not None and len(scales):
        scale_of = dict(zip(axes, (float(s) for s in scales), strict=True))
        scales = [scale_of.get(a, 1.0) for a in range(x.ndim)]
        sizes = [n if s == 1.0 else int(s * n) for s, n in zip(scales, shape, strict=True)]  # n: symbolic
    else:
        size_of = dict(zip(axes, (int(s) for s in sizes), strict=True))
        sizes = [size_of.get(a, n) for a, n in enumerate(shape)]
        scales = [1.0 if s is n else s / n for s, n in zip(sizes, shape, strict=True)]
        if keep_aspect_ratio_policy != "stretch":  # one scale for every resized axis
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            common = pick(scales[a] for a in axes)
            scales = [common if a in axes else 1.0 for a in range(x.ndim)]
            sizes = [int(common * n + 0.5) if a in axes else n for a, n in enumerate(shape)]
    if mode != "nearest" and dtype not in (jnp.float32, jnp.float64):
        x = x.astype(jnp.float32)
    for axis, (out, scale) in enumerate(zip(sizes, scales, strict=True)):
        n = x.shape[axis]
        if scale == 1.0 and out == n:
            continue
        y, width = np.arange(out, dtype=np.float64), scale * n
        if coord == "align_corners":
            src = np.zeros_like(y) if width == 1 else y * (n - 1) / (width - 1)
        elif coord == "asymmetric":
            src = y / scale
        elif coord == "pytorch_half_pixel":
            src = np.full_like(y, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
        elif coord == "half_pixel_symmetric":
            src = n / 2 * (1 - out / width) + (y + 0.5) / scale - 0.5
        elif coord == "tf_half_pixel_for_nn":
            src = (y + 0.5) / scale
        else:  # half_pixel
            src = (y + 0.5) / scale - 0.5
        if mode == "nearest":
            low = np.floor(src)
            index = {
                "round_prefer_floor": np.where(src - low <= 0.5, low, low + 1),
                "round_prefer_ceil": np.where(src - low < 0.5, low, low + 1),
                "floor": low,
                "ceil": np.ceil(src),
            }[nearest_mode]
            x = jnp.take(x, np.clip(index, 0, n - 1).astype(np.int32), axis=axis)
            continue
        index, weights = _resize_taps(src, n, scale, mode, cubic_a, antialias, exclude_outside)
        taps = jnp.take(x, index.reshape(-1).astype(np.int32), axis=axis)
        taps = jnp.reshape(taps, (*x.shape[:axis], *index.shape, *x.shape[axis + 1 :]))
        weights = weights.reshape(weights.shape + (1,) * (x.ndim - axis - 1))
        x = jnp.sum(taps * weights.astype(x.dtype), axis=axis + 1)
    if x.dtype != dtype and jnp.issubdtype(dtype, jnp.integer):
        x = jnp.clip(jnp.rint(x), jnp.iinfo(dtype).min, jnp.iinfo(dtype).max)
    return x.astype(dtype)


def _resize_taps(src, n, scale, mode, cubic_a, antialias, exclude_outside):
    \"\"\"The (out, taps) input indices and weights of linear or cubic interpolation at the
    coordinates ``src``: the left neighbour first (an integer coordinate's is the one
    before it), the indices clamped into the axis (the edge padding ONNX asks for).\"\"\"
    low = np.floor(src)
    ratio = np.where(src == low, 1.0, src - low)
    if antialias and scale < 1:  # the kernel stretched over 1 / scale inputs
        start = int(np.floor(-(1.0 if mode == "linear" else 2.0) / scale) + 1)
        offsets = np.arange(start, 2 - start)
    else:
        scale, offsets = 1.0, np.arange(-1, 3) if mode == "cubic" else np.arange(0, 2)
    dist = (offsets[None, :] - ratio[:, None]) * scale
    if mode == "linear":
        weights = np.clip(1 - np.abs(dist), 0, 1)
    else:
        t, a = np.abs(dist), cubic_a
        near = ((a + 2) * t - (a + 3)) * t * t + 1
        far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
        weights = np.where(t <= 1, near, np.where(t < 2, far, 0.0))
    if antialias:
        weights = weights / weights.sum(axis=1, keepdims=True)
    index = np.where(src == low, low - 1, low).astype(np.int64)[:, None] + offsets[None, :]
    if exclude_outside:
        weights = np.where((index < 0) | (index >= n), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, n - 1), weights
"""


@template("GatherND", batch_dims=0)
def _gather_nd(c: OpCall) -> str:
    c.helpers.add("gather_nd")
    return f"_gather_nd({c.args[0]}, {c.args[1]}, {int(c.attrs['batch_dims'])})"


@template("Resize", **RESIZE_ATTRS)
def _resize(c: OpCall) -> str:
    """A call of the generated _resize; scales or sizes the graph computes at run time are
    read eagerly (``_static``), as ``to_jax`` reads them."""
    a = c.attrs
    mode, coord, nearest = a["mode"], a["coordinate_transformation_mode"], a["nearest_mode"]
    if mode not in ("nearest", "linear", "cubic"):
        raise c.fail(f"Resize mode={mode!r}; the Flax emitter writes 'nearest', 'linear', 'cubic'")
    if coord not in _COORDS or nearest not in ex.RESIZE_NEAREST:
        raise c.fail(
            f"Resize coordinate_transformation_mode={coord!r} / nearest_mode={nearest!r}; "
            f"supported: {', '.join(_COORDS)} / {', '.join(ex.RESIZE_NEAREST)}"
        )
    if a["antialias"] and mode == "nearest":
        raise c.fail("Resize antialias of mode 'nearest' (ONNX defines it for linear, cubic)")
    if c.node.graph is not None and c.node.graph.opset_imports.get("", 11) < 11:
        raise c.fail("Resize-10 (scales as its second input)")
    scales, sizes = (_values(c, i, what) for i, what in ((2, "scales"), (3, "sizes")))
    if scales == sizes == "None":
        raise c.fail("Resize needs scales or sizes")
    extra = "".join(
        f", {name}={value!r}"
        for name, value, default in (
            ("cubic_a", float(a["cubic_coeff_a"]), -0.75),
            ("antialias", bool(a["antialias"]), False),
            ("exclude_outside", bool(a["exclude_outside"]), False),
            ("axes", None if a["axes"] is None else tuple(int(x) for x in a["axes"]), None),
            ("keep_aspect_ratio_policy", a["keep_aspect_ratio_policy"], "stretch"),
        )
        if value != default
    )
    c.helpers.add("resize")
    return f'_resize({c.args[0]}, {scales}, {sizes}, "{mode}", "{coord}", "{nearest}"{extra})'


#: The coordinate modes the generated _resize maps (tf_crop_and_resize, which needs roi and
#: an extrapolation value, is left to the runtime).
_COORDS = tuple(m for m in (*ex.RESIZE_COORDS, "half_pixel_symmetric") if m != "tf_crop_and_resize")


def _values(c: OpCall, i: int, what: str) -> str:
    """Resize's scales (``i`` 2) or sizes (3) as a literal, a ``_static(...)`` read of a
    value computed at run time, or ``None`` (absent or empty)."""
    if not c.has(i):
        return "None"
    if c.consts[i] is None:
        c.helpers.add("static_ints")
        return f'_static({c.args[i]}, "Resize {what}")'
    v = np.reshape(c.consts[i], -1)
    if not v.size:
        return "None"
    cast = float if i == 2 else int
    return repr(tuple(cast(x) for x in v))
