"""PyTorch handlers for the recurrent ops RNN, GRU and LSTM.

The input projection ``X W^T + Wb`` is computed for all steps at once; a Python loop over
time runs the recurrent part (differentiable, any device). ``sequence_lens`` freezes each
batch entry's state after its last step and zeroes its later outputs; the reverse direction
runs over each sequence's own length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from xconv.converters.torch.backend.registry import builtin
from xconv.errors import UnsupportedAttributeError

# name -> (function of (x, alpha, beta), default alpha, default beta); None: unused.
_ACTIVATIONS: dict[str, tuple[Callable, float | None, float | None]] = {
    "relu": (lambda x, a, b: torch.relu(x), None, None),
    "tanh": (lambda x, a, b: torch.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: torch.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: torch.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: torch.where(x > a, x, torch.zeros_like(x)), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * torch.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: torch.clamp(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: torch.where(x >= 0, x, a * torch.expm1(x)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + x.abs()), None, None),
    "softplus": (lambda x, a, b: F.softplus(x), None, None),
}

_COMMON_ATTRS = {
    "activation_alpha": None,
    "activation_beta": None,
    "activations": None,
    "clip": None,
    "direction": "forward",
    "hidden_size": None,
    "layout": 0,
}


def _activations(ctx, names, alphas, betas, defaults, num_dir):
    """The activation list as callables: ``num_dir`` lists of ``len(defaults)``."""
    names = list(names) if names else list(defaults) * num_dir
    if len(names) == len(defaults) and num_dir == 2:
        names = names * 2
    if len(names) != len(defaults) * num_dir:
        raise ctx.error(
            f"expected {len(defaults) * num_dir} activations for {num_dir} direction(s), "
            f"got {len(names)}"
        )
    alphas, betas = list(alphas or ()), list(betas or ())
    funcs = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise UnsupportedAttributeError(
                f"activation {name!r}; supported: {sorted(_ACTIVATIONS)}",
                op=ctx.node.op_type,
                node=ctx.node.name,
            )
        fn, a, b = _ACTIVATIONS[key]
        if a is not None and alphas:
            a = alphas.pop(0)
        if b is not None and betas:
            b = betas.pop(0)
        funcs.append(lambda x, fn=fn, a=a, b=b: fn(x, a, b))
    k = len(defaults)
    return [funcs[i * k : (i + 1) * k] for i in range(num_dir)]


def _directions(ctx, direction: str) -> tuple[bool, ...]:
    table = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}
    if direction not in table:
        raise ctx.error(f"direction={direction!r}; supported: forward, reverse, bidirectional")
    return table[direction]


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


def _finish(ys, finals, layout, n_out):
    y = torch.stack(ys, dim=1)  # (seq, num_dir, batch, hidden)
    finals = [torch.stack(f, dim=0) for f in finals]
    if layout:
        y = y.permute(2, 0, 1, 3)
        finals = [f.transpose(0, 1) for f in finals]
    outs = (y, *finals)
    return outs[:n_out] if n_out > 1 else outs[0]


def _clipper(clip):
    if clip is None:
        return lambda v: v
    return lambda v: torch.clamp(v, -clip, clip)


@builtin("RNN", attrs=_COMMON_ATTRS)
def rnn(
    ctx,
    x,
    w,
    r,
    b=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha,
    activation_beta,
    activations,
    clip,
    direction,
    hidden_size,
    layout,
):
    """RNN(X, W, R, B?, sequence_lens?, initial_h?) -> (Y, Y_h): H = f(X Wi^T + H Ri^T + b)."""
    dirs = _directions(ctx, direction)
    hidden = int(hidden_size or r.shape[-1])
    acts = _activations(ctx, activations, activation_alpha, activation_beta, ["Tanh"], len(dirs))
    x, (h0,), lens = _prepare(x, [initial_h], sequence_lens, layout, hidden, len(dirs))
    w, r = w.to(x.dtype), r.to(x.dtype)
    bias = x.new_zeros((len(dirs), 2 * hidden)) if b is None else b.to(x.dtype)
    cl = _clipper(clip)
    ys, hs = [], []
    for d, reverse in enumerate(dirs):
        (f,) = acts[d]
        xw = x @ w[d].T + bias[d, :hidden] + bias[d, hidden:]
        rt = r[d].T

        def step(carry, xt, f=f, rt=rt):
            h = f(cl(xt + carry[0] @ rt))
            return (h,), h

        y, (h,) = _run_direction(step, xw, (h0[d],), lens, reverse)
        ys.append(y)
        hs.append(h)
    return _finish(ys, [hs], layout, len(ctx.node.outputs))


@builtin("GRU", attrs={**_COMMON_ATTRS, "linear_before_reset": 0})
def gru(
    ctx,
    x,
    w,
    r,
    b=None,
    sequence_lens=None,
    initial_h=None,
    *,
    activation_alpha,
    activation_beta,
    activations,
    clip,
    direction,
    hidden_size,
    layout,
    linear_before_reset,
):
    """GRU(X, W, R, B?, sequence_lens?, initial_h?) -> (Y, Y_h); gates ordered z, r, h."""
    dirs = _directions(ctx, direction)
    hidden = int(hidden_size or r.shape[-1])
    acts = _activations(
        ctx, activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"], len(dirs)
    )
    lbr = bool(linear_before_reset)
    x, (h0,), lens = _prepare(x, [initial_h], sequence_lens, layout, hidden, len(dirs))
    w, r = w.to(x.dtype), r.to(x.dtype)
    bias = x.new_zeros((len(dirs), 6 * hidden)) if b is None else b.to(x.dtype)
    cl = _clipper(clip)
    ys, hs = [], []
    for d, reverse in enumerate(dirs):
        f, g = acts[d]
        xw = x @ w[d].T + bias[d, : 3 * hidden]
        rb = bias[d, 3 * hidden :]
        r_zr, r_h = r[d, : 2 * hidden].T, r[d, 2 * hidden :].T

        def step(carry, xt, f=f, g=g, rb=rb, r_zr=r_zr, r_h=r_h):
            h = carry[0]
            zr = f(cl(xt[:, : 2 * hidden] + h @ r_zr + rb[: 2 * hidden]))
            z, rr = zr[:, :hidden], zr[:, hidden:]
            if lbr:
                pre = xt[:, 2 * hidden :] + rr * (h @ r_h + rb[2 * hidden :])
            else:
                pre = xt[:, 2 * hidden :] + (rr * h) @ r_h + rb[2 * hidden :]
            h = (1 - z) * g(cl(pre)) + z * h
            return (h,), h

        y, (h,) = _run_direction(step, xw, (h0[d],), lens, reverse)
        ys.append(y)
        hs.append(h)
    return _finish(ys, [hs], layout, len(ctx.node.outputs))


@builtin("LSTM", attrs={**_COMMON_ATTRS, "input_forget": 0})
def lstm(
    ctx,
    x,
    w,
    r,
    b=None,
    sequence_lens=None,
    initial_h=None,
    initial_c=None,
    p=None,
    *,
    activation_alpha,
    activation_beta,
    activations,
    clip,
    direction,
    hidden_size,
    layout,
    input_forget,
):
    """LSTM(X, W, R, B?, sequence_lens?, initial_h?, initial_c?, P?) -> (Y, Y_h, Y_c).

    Gates are ordered i, o, f, c; peepholes P are ordered i, o, f.
    """
    dirs = _directions(ctx, direction)
    hidden = int(hidden_size or r.shape[-1])
    acts = _activations(
        ctx, activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh", "Tanh"], len(dirs)
    )
    x, (h0, c0), lens = _prepare(
        x, [initial_h, initial_c], sequence_lens, layout, hidden, len(dirs)
    )
    w, r = w.to(x.dtype), r.to(x.dtype)
    bias = x.new_zeros((len(dirs), 8 * hidden)) if b is None else b.to(x.dtype)
    peep = x.new_zeros((len(dirs), 3 * hidden)) if p is None else p.to(x.dtype)
    cl = _clipper(clip)
    ys, hs, cs = [], [], []
    for d, reverse in enumerate(dirs):
        f, g, hf = acts[d]
        xw = x @ w[d].T + bias[d, : 4 * hidden] + bias[d, 4 * hidden :]
        rt = r[d].T
        pi, po, pf = peep[d, :hidden], peep[d, hidden : 2 * hidden], peep[d, 2 * hidden :]

        def step(carry, xt, f=f, g=g, hf=hf, rt=rt, pi=pi, po=po, pf=pf):
            h, c = carry
            gates = xt + h @ rt
            gi, go = gates[:, :hidden], gates[:, hidden : 2 * hidden]
            gf, gc = gates[:, 2 * hidden : 3 * hidden], gates[:, 3 * hidden :]
            i = f(cl(gi + pi * c))
            fg = 1 - i if input_forget else f(cl(gf + pf * c))
            c = fg * c + i * g(cl(gc))
            o = f(cl(go + po * c))
            h = o * hf(c)
            return (h, c), h

        y, (h, c) = _run_direction(step, xw, (h0[d], c0[d]), lens, reverse)
        ys.append(y)
        hs.append(h)
        cs.append(c)
    return _finish(ys, [hs, cs], layout, len(ctx.node.outputs))
