"""The PyTorch kernel of the attention family (written once in
:mod:`xconv.converters.ops.attention`).

When only ``Y`` is wanted and nothing but an optional top-left causal mask applies,
``Attention`` runs ``F.scaled_dot_product_attention`` (same math, torch's fused kernel);
``LinearAttention``'s recurrence is a Python loop over time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xconv.converters.ops.attention import register_attention_ops
from xconv.converters.torch.runtime import xp
from xconv.converters.torch.runtime.linalg import reference_sum
from xconv.converters.torch.runtime.registry import builtin


def _onnx_dtype(ctx, data_type: int) -> torch.dtype:
    import onnx_ir as ir

    from xconv.converters.torch.runtime.dtypes import torch_dtype

    try:
        return torch_dtype(ir.DataType(data_type))
    except KeyError as e:
        raise ctx.error(str(e.args[0])) from None


def _scan(step, state, xs):
    ys = []
    for t in range(xs[0].shape[0]):
        state, y = step(state, tuple(None if a is None else a[t] for a in xs))
        ys.append(y)
    return state, torch.stack(ys)


def _write_rows(cache, pos, update):
    cache = cache.clone()
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None].expand_as(pos)
    inside = pos < cache.shape[1]  # writes past the end are dropped
    cache[rows[inside], pos[inside]] = update[inside]
    return cache


class TorchAttentionKernel(xp.TensorConstructors):
    """The torch side of :mod:`xconv.converters.ops.attention` (``asarray``, ``scalar``,
    ``zeros``: :class:`~xconv.converters.torch.runtime.xp.TensorConstructors`)."""

    xp = xp
    sigmoid = staticmethod(torch.sigmoid)
    matmul = staticmethod(torch.matmul)
    reference_sum = staticmethod(reference_sum)
    dtype = staticmethod(_onnx_dtype)
    scan = staticmethod(_scan)
    write_rows = staticmethod(_write_rows)

    @staticmethod
    def arange(n, like):
        return torch.arange(n, device=like.device)

    @staticmethod
    def pad_last(x, n, value):
        return F.pad(x, (0, n), value=value)

    @staticmethod
    def stop_gradient(x):
        return x.detach()

    @staticmethod
    def take_rows(x, index):
        return x[index.to(torch.int64)]

    @staticmethod
    def indices(x):
        return x.to(torch.int64)

    @staticmethod
    def fused(ctx, q, k, v, attn_mask, past_key, nonpad, opts):
        return None  # torch's fused kernel takes (B, H, S, D) heads: sdpa below

    @staticmethod
    def sdpa(ctx, q, k, v, opts, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=opts.is_causal, scale=scale)

    @staticmethod
    def wanted(ctx, index):
        outputs = ctx.node.outputs
        return len(outputs) > index and outputs[index].name != ""


KERNEL = TorchAttentionKernel()

register_attention_ops(builtin, KERNEL)
