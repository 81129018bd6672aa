"""Flax source templates for the scatters: Col2Im, MaxUnpool and TensorScatter, each a call
(``expressions_structured``) of a generated helper. Importing this module registers them in
``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_structured as exs
from xconv.converters.flax.source.templates import registry, template
from xconv.converters.registry import REQUIRED

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
