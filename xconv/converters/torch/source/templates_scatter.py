"""PyTorch source templates for the scatters: Col2Im, MaxUnpool and TensorScatter, each a call
(``expressions_structured``) of a generated helper. Importing this module registers them in
``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_structured as exs
from xconv.converters.registry import REQUIRED
from xconv.converters.torch.source.templates import registry, template

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
