"""Flax source templates for GatherND, Resize (nearest / linear / cubic) and GridSample.

Each writes a call to a small generated helper (``_gather_nd``, ``_resize``, ``_grid_sample``)
that follows the ONNX definitions the JAX runtime implements (``indexing.gather_nd``,
``shape._resize``, the runtime's sampler): negative indices wrap; Resize maps output
coordinates back by the node's ``coordinate_transformation_mode`` and rounds (nearest) or
weighs the taps around it with edge clamping (linear, cubic; antialias, exclude_outside), one
axis at a time.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.flax.source.templates import OpCall, registry, template
from xconv.converters.ops.resize import RESIZE_ATTRS

registry.helpers["gather_nd"] = '''
def _gather_nd(data, indices, batch_dims):
    """ONNX GatherND: slices of ``data`` addressed by the index tuples in ``indices``."""
    b, k = batch_dims, indices.shape[-1]
    nb = math.prod(data.shape[:b])
    inner = indices.shape[b:-1]
    flat = jnp.reshape(jnp.asarray(data), (nb, *data.shape[b:]))  # numpy data: traced indices
    idx = jnp.reshape(indices, (nb, *inner, k))
    comps = tuple(
        jnp.where(idx[..., j] < 0, idx[..., j] + data.shape[b + j], idx[..., j]) for j in range(k)
    )
    batch = jnp.reshape(jnp.arange(nb), (nb,) + (1,) * len(inner))
    out = flat[(batch, *comps)]
    return jnp.reshape(out, data.shape[:b] + inner + data.shape[b + k :])
'''

registry.helpers["resize_plan"] = ex.RESIZE_PLAN
registry.helpers["resize"] = '''
def _resize(x, scales, sizes, mode, coord, nearest_mode="round_prefer_floor", **kw):
    """ONNX Resize (``_resize_plan``'s keywords): per axis that changes, a gather of the
    nearest inputs, or of the taps and their weighted sum. Integers and float16 / bfloat16
    interpolate in float32."""
    dtype = x.dtype
    if mode != "nearest" and dtype not in (jnp.float32, jnp.float64):
        x = x.astype(jnp.float32)
    for axis, index, weights in _resize_plan(x.shape, scales, sizes, mode, coord, nearest_mode, **kw):
        if weights is None:
            x = jnp.take(x, index.astype(np.int32), axis=axis)
            continue
        taps = jnp.take(x, index.reshape(-1).astype(np.int32), axis=axis)
        taps = jnp.reshape(taps, (*x.shape[:axis], *index.shape, *x.shape[axis + 1 :]))
        weights = weights.reshape(weights.shape + (1,) * (x.ndim - axis - 1))
        x = jnp.sum(taps * weights.astype(x.dtype), axis=axis + 1)
    if x.dtype != dtype and jnp.issubdtype(dtype, jnp.integer):
        x = jnp.clip(jnp.rint(x), jnp.iinfo(dtype).min, jnp.iinfo(dtype).max)
    return x.astype(dtype)
'''


@template("GatherND", batch_dims=0)
def _gather_nd(c: OpCall) -> str:
    c.helpers.add("gather_nd")
    return f"_gather_nd({c.args[0]}, {c.args[1]}, {int(c.attrs['batch_dims'])})"


@template("Resize", **RESIZE_ATTRS)
def _resize(c: OpCall) -> str:
    """A call of the generated _resize; scales or sizes the graph computes at run time are
    read eagerly (``_static``), as ``to_jax`` reads them."""

    def runtime(i: int, what: str) -> str:
        c.helpers.add("static_ints")
        return f'_static({c.args[i]}, "Resize {what}")'

    return ex.resize_call(c, runtime)


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
