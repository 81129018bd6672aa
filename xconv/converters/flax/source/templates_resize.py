"""Flax source templates for GatherND and Resize (nearest / linear).

Each writes a call to a small generated helper (``_gather_nd``, ``_resize``) that follows the
ONNX definitions the JAX runtime implements (``indexing.gather_nd``, ``shape._resize``):
negative indices wrap; Resize maps output coordinates back by the node's
``coordinate_transformation_mode`` and rounds (nearest) or interpolates between the two
neighbours with edge clamping (linear), one axis at a time.
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
    flat = jnp.reshape(data, (nb, *data.shape[b:]))
    idx = jnp.reshape(indices, (nb, *inner, k))
    comps = tuple(
        jnp.where(idx[..., j] < 0, idx[..., j] + data.shape[b + j], idx[..., j]) for j in range(k)
    )
    batch = jnp.reshape(jnp.arange(nb), (nb,) + (1,) * len(inner))
    out = flat[(batch, *comps)]
    return jnp.reshape(out, data.shape[:b] + inner + data.shape[b + k :])
'''

registry.helpers["resize"] = '''
def _resize(x, sizes, scales, mode, coord, nearest_mode):
    """ONNX Resize (nearest or linear), axis by axis."""
    for axis, (out, scale) in enumerate(zip(sizes, scales, strict=True)):
        n = x.shape[axis]
        if scale == 1.0 and out in (None, n):  # None: an axis kept whole (a symbolic batch)
            continue
        i = jnp.arange(out, dtype=jnp.float32)
        if coord == "align_corners":
            src = i * ((n - 1) / (out - 1)) if out > 1 else jnp.zeros_like(i)
        elif coord == "asymmetric":
            src = i / scale
        elif coord == "pytorch_half_pixel" and out == 1:
            src = jnp.zeros_like(i)
        elif coord == "tf_half_pixel_for_nn":
            src = (i + 0.5) / scale
        else:
            src = (i + 0.5) / scale - 0.5
        if mode == "nearest":
            rounding = {
                "floor": jnp.floor(src),
                "ceil": jnp.ceil(src),
                "round_prefer_ceil": jnp.floor(src + 0.5),
                "round_prefer_floor": jnp.ceil(src - 0.5),
            }
            j = jnp.clip(rounding[nearest_mode], 0, n - 1).astype(jnp.int32)
            x = jnp.take(x, j, axis=axis)
            continue
        src = jnp.clip(src, 0, n - 1)
        lo = jnp.floor(src)
        w = jnp.reshape(src - lo, (-1,) + (1,) * (x.ndim - axis - 1)).astype(x.dtype)
        lo = lo.astype(jnp.int32)
        hi = jnp.minimum(lo + 1, n - 1)
        x = jnp.take(x, lo, axis=axis) * (1 - w) + jnp.take(x, hi, axis=axis) * w
    return x
'''


@template("GatherND", batch_dims=0)
def _gather_nd(c: OpCall) -> str:
    c.helpers.add("gather_nd")
    return f"_gather_nd({c.args[0]}, {c.args[1]}, {int(c.attrs['batch_dims'])})"


@template("Resize", **RESIZE_ATTRS)
def _resize(c: OpCall) -> str:
    a = c.attrs
    out, factors, _ = ex.resize_plan(c, ("nearest", "linear"), static=False)
    if any(f is None or (o is None and f != 1.0) for o, f in zip(out, factors, strict=True)):
        raise c.fail("Resize of an axis whose size is not static")
    c.helpers.add("resize")
    return (
        f"_resize({c.args[0]}, {tuple(out)}, {tuple(float(f) for f in factors)}, "
        f'"{a["mode"]}", "{a["coordinate_transformation_mode"]}", "{a["nearest_mode"]}")'
    )
