"""PyTorch source templates for ONNX's RNN, GRU and LSTM: a call of a generated helper
(``_rnn`` / ``_gru`` / ``_lstm``, written once each above the classes) that runs the cell over
time as the ONNX definitions say, with the node's W / R / B as they are (gates ``i, o, f, c``
for LSTM, ``z, r, h`` for GRU). The call is the Flax emitter's
(:func:`~xconv.converters.expressions.recurrent_call`); these are the torch helpers. Importing
this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.ops.rnn import COMMON_ATTRS
from xconv.converters.torch.source.templates import registry

registry.helpers["rnn_scan"] = '''
def _rnn_scan(step, xs, carry, lens, reverse):
    """Run ``step(carry, x_t) -> (carry, y_t)`` over time (axis 0) and stack the outputs.

    With ``lens`` each batch entry stops at its own length: its state is frozen and its
    later outputs are zero; in reverse it starts from its own last step.
    """
    steps = xs.shape[0]
    valid = order = None
    if lens is not None:
        t = torch.arange(steps, device=xs.device)[:, None]
        valid = t < lens.to(torch.int64)[None, :]
        if reverse:
            order = torch.where(valid, lens.to(torch.int64)[None, :] - 1 - t, t)
            xs = torch.gather(xs, 0, order[:, :, None].expand_as(xs))
    backward = reverse and lens is None
    ys = []
    for i in range(steps - 1, -1, -1) if backward else range(steps):
        new, y = step(carry, xs[i])
        if valid is not None:
            keep = valid[i][:, None]
            new = tuple(torch.where(keep, n, o) for n, o in zip(new, carry, strict=True))
            y = torch.where(keep, y, torch.zeros_like(y))
        carry = new
        ys.append(y)
    ys = torch.stack(ys[::-1] if backward else ys)
    if order is not None:
        ys = torch.gather(ys, 0, order[:, :, None].expand_as(ys))
    return ys, carry
'''

registry.helpers["rnn"] = '''
def _rnn(x, w, r, b, lens, h0, *, reverse, batch_first):
    """ONNX RNN (tanh): weights (directions, hidden, in); returns (Y, Y_h)."""
    if batch_first:
        x, h0 = x.transpose(0, 1), None if h0 is None else h0.transpose(0, 1)
    ys, hs = [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        if b is not None:
            wb, rb = torch.chunk(b[d], 2)
            xw = xw + wb + rb
        h = x.new_zeros((x.shape[1], r.shape[-1])) if h0 is None else h0[d]

        def step(carry, xw_t, r_d=r[d]):
            (h,) = carry
            h = torch.tanh(xw_t + h @ r_d.T)
            return (h,), h

        y, (h,) = _rnn_scan(step, xw, (h,), lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
    y, h = torch.stack(ys, 1), torch.stack(hs)
    if batch_first:
        return y.permute(2, 0, 1, 3), h.transpose(0, 1)
    return y, h
'''

registry.helpers["gru"] = '''
def _gru(x, w, r, b, lens, h0, *, reverse, batch_first, linear_before_reset):
    """ONNX GRU, gates z, r, h: weights (directions, 3 * hidden, in); returns (Y, Y_h)."""
    if batch_first:
        x, h0 = x.transpose(0, 1), None if h0 is None else h0.transpose(0, 1)
    hidden = r.shape[-1]
    ys, hs = [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        rb = x.new_zeros((3 * hidden,))
        if b is not None:
            wb, rb = torch.chunk(b[d], 2)
            xw = xw + wb
        h = x.new_zeros((x.shape[1], hidden)) if h0 is None else h0[d]

        def step(carry, xw_t, r_d=r[d], rb=rb):
            (h,) = carry
            xz, xr, xh = torch.chunk(xw_t, 3, dim=-1)
            rz, rr, rh = torch.chunk(r_d, 3)
            bz, br, bh = torch.chunk(rb, 3)
            z = torch.sigmoid(xz + h @ rz.T + bz)
            reset = torch.sigmoid(xr + h @ rr.T + br)
            if linear_before_reset:
                n = torch.tanh(xh + reset * (h @ rh.T + bh))
            else:
                n = torch.tanh(xh + (reset * h) @ rh.T + bh)
            h = (1 - z) * n + z * h
            return (h,), h

        y, (h,) = _rnn_scan(step, xw, (h,), lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
    y, h = torch.stack(ys, 1), torch.stack(hs)
    if batch_first:
        return y.permute(2, 0, 1, 3), h.transpose(0, 1)
    return y, h
'''

registry.helpers["lstm"] = '''
def _lstm(x, w, r, b, lens, h0, c0, p, *, reverse, batch_first):
    """ONNX LSTM, gates i, o, f, c: weights (directions, 4 * hidden, in); (Y, Y_h, Y_c)."""
    if batch_first:
        x = x.transpose(0, 1)
        h0 = None if h0 is None else h0.transpose(0, 1)
        c0 = None if c0 is None else c0.transpose(0, 1)
    hidden = r.shape[-1]
    ys, hs, cs = [], [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        if b is not None:
            wb, rb = torch.chunk(b[d], 2)
            xw = xw + wb + rb
        zeros = x.new_zeros((x.shape[1], hidden))
        h = zeros if h0 is None else h0[d]
        c = zeros if c0 is None else c0[d]
        pi, po, pf = (0, 0, 0) if p is None else torch.chunk(p[d], 3)

        def step(carry, xw_t, r_d=r[d], pi=pi, po=po, pf=pf):
            h, c = carry
            i, o, f, g = torch.chunk(xw_t + h @ r_d.T, 4, dim=-1)
            i = torch.sigmoid(i + pi * c)
            f = torch.sigmoid(f + pf * c)
            c = f * c + i * torch.tanh(g)
            h = torch.sigmoid(o + po * c) * torch.tanh(c)
            return (h, c), h

        y, (h, c) = _rnn_scan(step, xw, (h, c), lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
        cs.append(c)
    y, h, c = torch.stack(ys, 1), torch.stack(hs), torch.stack(cs)
    if batch_first:
        return y.permute(2, 0, 1, 3), h.transpose(0, 1), c.transpose(0, 1)
    return y, h, c
'''

registry.builtin("RNN", attrs=COMMON_ATTRS)(ex.recurrent_call)
registry.builtin("GRU", attrs={**COMMON_ATTRS, "linear_before_reset": 0})(ex.recurrent_call)
registry.builtin("LSTM", attrs={**COMMON_ATTRS, "input_forget": 0})(ex.recurrent_call)
