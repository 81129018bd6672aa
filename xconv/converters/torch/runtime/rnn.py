"""The PyTorch kernel of the recurrent ops RNN, GRU and LSTM (written once in
:mod:`xconv.converters.ops.rnn`): a Python loop over time runs the recurrent part
(differentiable, any device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xconv.converters.ops.rnn import register_rnn_ops
from xconv.converters.torch.runtime import xp
from xconv.converters.torch.runtime.registry import builtin


def _run_direction(step, xw, carry, lens, reverse: bool):
    """Run ``step(carry, x_t) -> (carry, h_t)`` over time; xw is (seq, batch, ...)."""
    seq = xw.shape[0]
    order = None
    valid = None
    if lens is not None:
        t = torch.arange(seq, device=xw.device)[:, None]
        valid = t < lens[None, :]
        if reverse:
            order = torch.where(valid, lens[None, :] - 1 - t, t)
            xw = torch.gather(xw, 0, order[:, :, None].expand(xw.shape))
    elif reverse:
        xw = torch.flip(xw, (0,))
    ys = []
    for t in range(seq):
        new, y = step(carry, xw[t])
        if valid is not None:
            keep = valid[t][:, None]
            new = tuple(torch.where(keep, n, o) for n, o in zip(new, carry, strict=True))
            y = torch.where(keep, y, torch.zeros((), dtype=y.dtype))
        carry = new
        ys.append(y)
    ys = torch.stack(ys) if ys else xw.new_zeros((0, xw.shape[1], carry[0].shape[-1]))
    if order is not None:
        ys = torch.gather(ys, 0, order[:, :, None].expand(ys.shape))
    elif reverse:
        ys = torch.flip(ys, (0,))
    return ys, carry


def _prepare(x, initial_states, sequence_lens, layout, hidden, num_dir):
    if layout:
        x = x.transpose(0, 1)
        initial_states = [None if s is None else s.transpose(0, 1) for s in initial_states]
    batch = x.shape[1]
    states = [
        x.new_zeros((num_dir, batch, hidden)) if s is None else s.to(x.dtype)
        for s in initial_states
    ]
    lens = None if sequence_lens is None else sequence_lens.to(torch.int64)
    return x, states, lens


def _finish(ys, finals, layout):
    y = torch.stack(ys, dim=1)  # (seq, num_dir, batch, hidden)
    finals = [torch.stack(f, dim=0) for f in finals]
    if layout:
        y = y.permute(2, 0, 1, 3)
        finals = [f.transpose(0, 1) for f in finals]
    return (y, *finals)


class _RnnKernel:
    """The torch side of :mod:`xconv.converters.ops.rnn`."""

    sigmoid = staticmethod(torch.sigmoid)
    softplus = staticmethod(F.softplus)
    prepare = staticmethod(_prepare)
    scan = staticmethod(_run_direction)
    finish = staticmethod(_finish)

    def call(self, body, *arrays, opts):
        return body(xp, self, *arrays, opts)

    @staticmethod
    def zeros(like, shape):
        return like.new_zeros(shape)


register_rnn_ops(builtin, _RnnKernel())
