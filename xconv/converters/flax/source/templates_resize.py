"""Flax source templates for GatherND and Resize (nearest / linear / cubic).

Each writes a call to a small generated helper (``_gather_nd``, ``_resize``) that follows the
ONNX definitions the JAX runtime implements (``indexing.gather_nd``, ``shape._resize``):
negative indices wrap; Resize maps output coordinates back by the node's
``coordinate_transformation_mode`` and rounds (nearest) or weighs the taps around it with
edge clamping (linear, cubic; antialias, exclude_outside), one axis at a time.
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
