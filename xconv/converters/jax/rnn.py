"""JAX handlers for the recurrent ops RNN, GRU and LSTM, built on ``jax.lax.scan``.

The input projection ``X W^T + Wb`` is computed for all steps at once; the scan carries only
the recurrent part. ``sequence_lens`` freezes each batch entry's state after its last step
and zeroes its later outputs; the reverse direction runs over each sequence's own length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xconv.converters.jax.registry import builtin
from xconv.errors import UnsupportedAttributeError

# name -> (function of (x, alpha, beta), default alpha, default beta); None: unused.
_ACTIVATIONS: dict[str, tuple[Callable, float | None, float | None]] = {
    "relu": (lambda x, a, b: jnp.maximum(x, 0), None, None),
    "tanh": (lambda x, a, b: jnp.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: jax.nn.sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: jnp.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: jnp.where(x > a, x, 0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * jnp.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: jnp.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: jnp.where(x >= 0, x, a * (jnp.exp(x) - 1)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + jnp.abs(x)), None, None),
    "softplus": (lambda x, a, b: jax.nn.softplus(x), None, None),
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
    """Resolve the activation list to callables: ``num_dir`` lists of ``len(defaults)``."""
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
        # alpha/beta values are consumed in order by the functions that take them.
        if a is not None and alphas:
            a = alphas.pop(0)
        if b is not None and betas:
            b = betas.pop(0)
        funcs.append((key, None if a is None else float(a), None if b is None else float(b)))
    k = len(defaults)
    return tuple(tuple(funcs[i * k : (i + 1) * k]) for i in range(num_dir))


def _callables(specs):
    """Activation specs ``(name, alpha, beta)`` -> functions of x."""
    return [lambda x, s=spec: _ACTIVATIONS[s[0]][0](x, s[1], s[2]) for spec in specs]


def _directions(ctx, direction: str) -> tuple[bool, ...]:
    """Per direction: True when it runs in reverse."""
    table = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}
    if direction not in table:
        raise ctx.error(f"direction={direction!r}; supported: forward, reverse, bidirectional")
    return table[direction]


def _run_direction(step, xw, carry, lens, reverse: bool):
    """Scan ``step(carry, x_t) -> (carry, h_t)`` over time; xw is (seq, batch, ...)."""
    seq = xw.shape[0]
    if lens is None:
        xs = jnp.flip(xw, 0) if reverse else xw
        carry, ys = lax.scan(step, carry, xs)
        return (jnp.flip(ys, 0) if reverse else ys), carry
    t = jnp.arange(seq)[:, None]
    valid = t < lens[None, :]  # (seq, batch)
    if reverse:
        # Reverse each sequence within its own length: an involution on the time axis.
        order = jnp.where(valid, lens[None, :] - 1 - t, t)
        xw = jnp.take_along_axis(xw, order[:, :, None], axis=0)

    def masked(carry, inp):
        x_t, ok = inp
        new, y = step(carry, x_t)
        keep = ok[:, None]
        new = jax.tree_util.tree_map(lambda n, o: jnp.where(keep, n, o), new, carry)
        return new, jnp.where(keep, y, jnp.zeros((), y.dtype))

    carry, ys = lax.scan(masked, carry, (xw, valid))
    if reverse:
        ys = jnp.take_along_axis(ys, order[:, :, None], axis=0)
    return ys, carry


def _prepare(ctx, x, initial_states, sequence_lens, layout, hidden, num_dir):
    x = jnp.asarray(x)
    if layout:
        x = jnp.swapaxes(x, 0, 1)
        initial_states = [
            None if s is None else jnp.swapaxes(jnp.asarray(s), 0, 1) for s in initial_states
        ]
    batch = x.shape[1]
    states = [
        jnp.zeros((num_dir, batch, hidden), x.dtype) if s is None else jnp.asarray(s, x.dtype)
        for s in initial_states
    ]
    lens = None if sequence_lens is None else jnp.asarray(sequence_lens).astype(jnp.int32)
    return x, states, lens


def _finish(ys, finals, layout):
    """ys: per direction (seq, batch, hidden) -> Y and the final states in the node's layout."""
    y = jnp.stack(ys, axis=1)  # (seq, num_dir, batch, hidden)
    finals = [jnp.stack(f, axis=0) for f in finals]  # (num_dir, batch, hidden)
    if layout:
        y = jnp.transpose(y, (2, 0, 1, 3))
        finals = [jnp.swapaxes(f, 0, 1) for f in finals]
    return (y, *finals)


def _clipper(clip):
    if clip is None:
        return lambda v: v
    return lambda v: jnp.clip(v, -clip, clip)


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
    hidden = int(hidden_size or np.shape(r)[-1])
    acts = _activations(ctx, activations, activation_alpha, activation_beta, ["Tanh"], len(dirs))
    return _rnn_impl(
        x,
        w,
        r,
        b,
        sequence_lens,
        initial_h,
        dirs=dirs,
        hidden=hidden,
        acts=acts,
        clip=clip,
        layout=int(layout),
    )


@functools.partial(jax.jit, static_argnames=("dirs", "hidden", "acts", "clip", "layout"))
def _rnn_impl(x, w, r, b, sequence_lens, initial_h, *, dirs, hidden, acts, clip, layout):
    x, (h0,), lens = _prepare(None, x, [initial_h], sequence_lens, layout, hidden, len(dirs))
    w, r = jnp.asarray(w, x.dtype), jnp.asarray(r, x.dtype)
    bias = jnp.zeros((len(dirs), 2 * hidden), x.dtype) if b is None else jnp.asarray(b, x.dtype)
    cl = _clipper(clip)
    ys, hs = [], []
    for d, reverse in enumerate(dirs):
        (f,) = _callables(acts[d])
        xw = x @ w[d].T + bias[d, :hidden] + bias[d, hidden:]
        rt = r[d].T

        def step(h, xt, f=f, rt=rt):
            h = f(cl(xt + h @ rt))
            return h, h

        y, h = _run_direction(step, xw, h0[d], lens, reverse)
        ys.append(y)
        hs.append(h)
    return _finish(ys, [hs], layout)


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
    hidden = int(hidden_size or np.shape(r)[-1])
    acts = _activations(
        ctx, activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"], len(dirs)
    )
    return _gru_impl(
        x,
        w,
        r,
        b,
        sequence_lens,
        initial_h,
        dirs=dirs,
        hidden=hidden,
        acts=acts,
        clip=clip,
        layout=int(layout),
        lbr=bool(linear_before_reset),
    )


@functools.partial(jax.jit, static_argnames=("dirs", "hidden", "acts", "clip", "layout", "lbr"))
def _gru_impl(x, w, r, b, sequence_lens, initial_h, *, dirs, hidden, acts, clip, layout, lbr):
    x, (h0,), lens = _prepare(None, x, [initial_h], sequence_lens, layout, hidden, len(dirs))
    w, r = jnp.asarray(w, x.dtype), jnp.asarray(r, x.dtype)
    bias = jnp.zeros((len(dirs), 6 * hidden), x.dtype) if b is None else jnp.asarray(b, x.dtype)
    cl = _clipper(clip)
    ys, hs = [], []
    for d, reverse in enumerate(dirs):
        f, g = _callables(acts[d])
        xw = x @ w[d].T + bias[d, : 3 * hidden]
        rb = bias[d, 3 * hidden :]
        r_zr, r_h = r[d, : 2 * hidden].T, r[d, 2 * hidden :].T

        def step(h, xt, f=f, g=g, rb=rb, r_zr=r_zr, r_h=r_h):
            zr = f(cl(xt[:, : 2 * hidden] + h @ r_zr + rb[: 2 * hidden]))
            z, rr = zr[:, :hidden], zr[:, hidden:]
            if lbr:
                pre = xt[:, 2 * hidden :] + rr * (h @ r_h + rb[2 * hidden :])
            else:
                pre = xt[:, 2 * hidden :] + (rr * h) @ r_h + rb[2 * hidden :]
            h = (1 - z) * g(cl(pre)) + z * h
            return h, h

        y, h = _run_direction(step, xw, h0[d], lens, reverse)
        ys.append(y)
        hs.append(h)
    return _finish(ys, [hs], layout)


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
    hidden = int(hidden_size or np.shape(r)[-1])
    acts = _activations(
        ctx, activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh", "Tanh"], len(dirs)
    )
    return _lstm_impl(
        x,
        w,
        r,
        b,
        sequence_lens,
        initial_h,
        initial_c,
        p,
        dirs=dirs,
        hidden=hidden,
        acts=acts,
        clip=clip,
        layout=int(layout),
        input_forget=bool(input_forget),
    )


@functools.partial(
    jax.jit, static_argnames=("dirs", "hidden", "acts", "clip", "layout", "input_forget")
)
def _lstm_impl(
    x,
    w,
    r,
    b,
    sequence_lens,
    initial_h,
    initial_c,
    p,
    *,
    dirs,
    hidden,
    acts,
    clip,
    layout,
    input_forget,
):
    x, (h0, c0), lens = _prepare(
        None, x, [initial_h, initial_c], sequence_lens, layout, hidden, len(dirs)
    )
    w, r = jnp.asarray(w, x.dtype), jnp.asarray(r, x.dtype)
    bias = jnp.zeros((len(dirs), 8 * hidden), x.dtype) if b is None else jnp.asarray(b, x.dtype)
    peep = jnp.zeros((len(dirs), 3 * hidden), x.dtype) if p is None else jnp.asarray(p, x.dtype)
    cl = _clipper(clip)
    ys, hs, cs = [], [], []
    for d, reverse in enumerate(dirs):
        f, g, hf = _callables(acts[d])
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
    return _finish(ys, [hs, cs], layout)
