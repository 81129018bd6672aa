"""The recurrent ops RNN, GRU and LSTM written once against ``xp``.

The input projection ``X W^T + Wb`` is computed for all steps at once; the backend's
:meth:`RnnKernel.scan` runs the recurrent part (``jax.lax.scan``, or a Python loop over time on
torch). ``sequence_lens`` freezes each batch entry's state after its last step and zeroes its
later outputs; the reverse direction runs over each sequence's own length (both in the
kernel's scan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from xconv.converters.ops.arrays import astype
from xconv.errors import UnsupportedAttributeError

COMMON_ATTRS = {
    "activation_alpha": None,
    "activation_beta": None,
    "activations": None,
    "clip": None,
    "direction": "forward",
    "hidden_size": None,
    "layout": 0,
}

# name -> (function of (xp, k, x, alpha, beta), default alpha, default beta); None: unused.
ACTIVATIONS: dict[str, tuple[Callable[..., Any], float | None, float | None]] = {
    "relu": (lambda xp, k, x, a, b: xp.maximum(x, xp.zeros_like(x)), None, None),
    "tanh": (lambda xp, k, x, a, b: xp.tanh(x), None, None),
    "sigmoid": (lambda xp, k, x, a, b: k.sigmoid(x), None, None),
    "affine": (lambda xp, k, x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda xp, k, x, a, b: xp.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda xp, k, x, a, b: xp.where(x > a, x, xp.zeros_like(x)), 1.0, None),
    "scaledtanh": (lambda xp, k, x, a, b: a * xp.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda xp, k, x, a, b: xp.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda xp, k, x, a, b: xp.where(x >= 0, x, a * xp.expm1(x)), 1.0, None),
    "softsign": (lambda xp, k, x, a, b: x / (1 + xp.abs(x)), None, None),
    "softplus": (lambda xp, k, x, a, b: k.softplus(x), None, None),
}


class RnnKernel(Protocol):
    """What a backend provides for the recurrent ops."""

    def call(self, body: Callable[..., Any], *arrays: Any, opts: RnnOptions) -> tuple:
        """``body(xp, k, *arrays, opts)`` in the backend's namespace (JAX: jitted, ``opts``
        static)."""

    def sigmoid(self, x: Any) -> Any: ...

    def softplus(self, x: Any) -> Any: ...

    def zeros(self, like: Any, shape: tuple[int, ...]) -> Any:
        """Zeros of ``like``'s dtype (and device)."""

    def prepare(self, x, initial_states, sequence_lens, layout, hidden, num_dir) -> tuple:
        """``x`` as (seq, batch, input), the initial states as (num_dir, batch, hidden) in
        x's dtype (zeros when absent) and the lengths as integers (or None)."""

    def scan(self, step, xw, carry, lens, reverse: bool) -> tuple[Any, Any]:
        """Run ``step(carry, x_t) -> (carry, y_t)`` over time (xw is (seq, batch, ...)),
        honouring ``lens``: returns the stacked outputs and the final carry."""

    def finish(self, ys, finals, layout) -> tuple:
        """Y and the final states (per direction lists) stacked in the node's layout."""


class RnnOptions(NamedTuple):
    """The static part of a recurrent node (hashable: JAX compiles once per value)."""

    dirs: tuple[bool, ...]
    hidden: int
    acts: tuple
    clip: float | None
    layout: int
    flag: bool = False  # GRU: linear_before_reset; LSTM: input_forget


def activation_specs(ctx, names, alphas, betas, defaults, num_dir) -> tuple:
    """The activation list as ``num_dir`` tuples of ``(name, alpha, beta)``."""
    names = list(names) if names else list(defaults) * num_dir
    if len(names) == len(defaults) and num_dir == 2:
        names = names * 2
    if len(names) != len(defaults) * num_dir:
        raise ctx.error(
            f"expected {len(defaults) * num_dir} activations for {num_dir} direction(s), "
            f"got {len(names)}"
        )
    alphas, betas = list(alphas or ()), list(betas or ())
    specs = []
    for name in names:
        key = name.lower()
        if key not in ACTIVATIONS:
            raise UnsupportedAttributeError(
                f"activation {name!r}; supported: {sorted(ACTIVATIONS)}",
                op=ctx.node.op_type,
                node=ctx.node.name,
            )
        _, a, b = ACTIVATIONS[key]
        # alpha/beta values are consumed in order by the functions that take them.
        if a is not None and alphas:
            a = alphas.pop(0)
        if b is not None and betas:
            b = betas.pop(0)
        specs.append((key, None if a is None else float(a), None if b is None else float(b)))
    n = len(defaults)
    return tuple(tuple(specs[i * n : (i + 1) * n]) for i in range(num_dir))


def _callables(xp, k, specs) -> list[Callable[[Any], Any]]:
    return [lambda x, s=spec: ACTIVATIONS[s[0]][0](xp, k, x, s[1], s[2]) for spec in specs]


def directions(ctx, direction: str) -> tuple[bool, ...]:
    """Per direction: True when it runs in reverse."""
    table = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}
    if direction not in table:
        raise ctx.error(f"direction={direction!r}; supported: forward, reverse, bidirectional")
    return table[direction]


def _clipper(xp, clip):
    if clip is None:
        return lambda v: v
    return lambda v: xp.clip(v, -clip, clip)


def _weights(xp, k, x, w, r, b, width: int, n: int):
    """W and R in x's dtype, and the bias (zeros when absent)."""
    w, r = astype(xp, w, x.dtype), astype(xp, r, x.dtype)
    bias = k.zeros(x, (n, width)) if b is None else astype(xp, b, x.dtype)
    return w, r, bias


def _rnn(xp, k, x, w, r, b, sequence_lens, initial_h, initial_c, p, opts):
    hidden, n = opts.hidden, len(opts.dirs)
    x, (h0,), lens = k.prepare(x, [initial_h], sequence_lens, opts.layout, hidden, n)
    w, r, bias = _weights(xp, k, x, w, r, b, 2 * hidden, n)
    cl = _clipper(xp, opts.clip)
    ys, hs = [], []
    for d, reverse in enumerate(opts.dirs):
        (f,) = _callables(xp, k, opts.acts[d])
        xw = x @ w[d].T + bias[d, :hidden] + bias[d, hidden:]
        rt = r[d].T

        def step(carry, xt, f=f, rt=rt):
            h = f(cl(xt + carry[0] @ rt))
            return (h,), h

        y, (h,) = k.scan(step, xw, (h0[d],), lens, reverse)
        ys.append(y)
        hs.append(h)
    return k.finish(ys, [hs], opts.layout)


def _gru(xp, k, x, w, r, b, sequence_lens, initial_h, initial_c, p, opts):
    hidden, n = opts.hidden, len(opts.dirs)
    x, (h0,), lens = k.prepare(x, [initial_h], sequence_lens, opts.layout, hidden, n)
    w, r, bias = _weights(xp, k, x, w, r, b, 6 * hidden, n)
    cl = _clipper(xp, opts.clip)
    ys, hs = [], []
    for d, reverse in enumerate(opts.dirs):
        f, g = _callables(xp, k, opts.acts[d])
        xw = x @ w[d].T + bias[d, : 3 * hidden]
        rb = bias[d, 3 * hidden :]
        r_zr, r_h = r[d, : 2 * hidden].T, r[d, 2 * hidden :].T

        def step(carry, xt, f=f, g=g, rb=rb, r_zr=r_zr, r_h=r_h):
            h = carry[0]
            zr = f(cl(xt[:, : 2 * hidden] + h @ r_zr + rb[: 2 * hidden]))
            z, rr = zr[:, :hidden], zr[:, hidden:]
            if opts.flag:  # linear_before_reset
                pre = xt[:, 2 * hidden :] + rr * (h @ r_h + rb[2 * hidden :])
            else:
                pre = xt[:, 2 * hidden :] + (rr * h) @ r_h + rb[2 * hidden :]
            h = (1 - z) * g(cl(pre)) + z * h
            return (h,), h

        y, (h,) = k.scan(step, xw, (h0[d],), lens, reverse)
        ys.append(y)
        hs.append(h)
    return k.finish(ys, [hs], opts.layout)


def _lstm(xp, k, x, w, r, b, sequence_lens, initial_h, initial_c, p, opts):
    hidden, n = opts.hidden, len(opts.dirs)
    x, (h0, c0), lens = k.prepare(x, [initial_h, initial_c], sequence_lens, opts.layout, hidden, n)
    w, r, bias = _weights(xp, k, x, w, r, b, 8 * hidden, n)
    peep = k.zeros(x, (n, 3 * hidden)) if p is None else astype(xp, p, x.dtype)
    cl = _clipper(xp, opts.clip)
    ys, hs, cs = [], [], []
    for d, reverse in enumerate(opts.dirs):
        f, g, hf = _callables(xp, k, opts.acts[d])
        xw = x @ w[d].T + bias[d, : 4 * hidden] + bias[d, 4 * hidden :]
        rt = r[d].T
        pi, po, pf = peep[d, :hidden], peep[d, hidden : 2 * hidden], peep[d, 2 * hidden :]

        def step(carry, xt, f=f, g=g, hf=hf, rt=rt, pi=pi, po=po, pf=pf):
            h, c = carry
            gates = xt + h @ rt
            gi, go = gates[:, :hidden], gates[:, hidden : 2 * hidden]
            gf, gc = gates[:, 2 * hidden : 3 * hidden], gates[:, 3 * hidden :]
            i = f(cl(gi + pi * c))
            fg = 1 - i if opts.flag else f(cl(gf + pf * c))  # input_forget couples i and f
            c = fg * c + i * g(cl(gc))
            o = f(cl(go + po * c))
            h = o * hf(c)
            return (h, c), h

        y, (h, c) = k.scan(step, xw, (h0[d], c0[d]), lens, reverse)
        ys.append(y)
        hs.append(h)
        cs.append(c)
    return k.finish(ys, [hs, cs], opts.layout)


#: op -> (body, default activations, extra attributes with their defaults).
_OPS = {
    "RNN": (_rnn, ("Tanh",), {}),
    "GRU": (_gru, ("Sigmoid", "Tanh"), {"linear_before_reset": 0}),
    "LSTM": (_lstm, ("Sigmoid", "Tanh", "Tanh"), {"input_forget": 0}),
}

_DOCS = {
    "RNN": "RNN(X, W, R, B?, sequence_lens?, initial_h?) -> (Y, Y_h): H = f(X Wi^T + H Ri^T + b).",
    "GRU": "GRU(X, W, R, B?, sequence_lens?, initial_h?) -> (Y, Y_h); gates ordered z, r, h.",
    "LSTM": "LSTM(X, W, R, B?, sequence_lens?, initial_h?, initial_c?, P?) -> (Y, Y_h, Y_c).\n\n"
    "Gates are ordered i, o, f, c; peepholes P are ordered i, o, f.",
}


def _register(builtin, k: RnnKernel, op_type: str) -> None:
    body, defaults, extra = _OPS[op_type]

    def handler(
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
        **flag,
    ):
        dirs = directions(ctx, direction)
        acts = activation_specs(
            ctx, activations, activation_alpha, activation_beta, defaults, len(dirs)
        )
        opts = RnnOptions(
            dirs=dirs,
            hidden=int(hidden_size or np.shape(r)[-1]),
            acts=acts,
            clip=clip,
            layout=int(layout),
            flag=bool(next(iter(flag.values()), 0)),
        )
        outs = k.call(body, x, w, r, b, sequence_lens, initial_h, initial_c, p, opts=opts)
        n_out = len(ctx.node.outputs)
        return outs[:n_out] if n_out > 1 else outs[0]

    handler.__name__ = op_type.lower()
    handler.__doc__ = _DOCS[op_type]
    builtin(op_type, attrs={**COMMON_ATTRS, **extra})(handler)


def register_rnn_ops(builtin: Callable[..., Any], k: RnnKernel) -> None:
    """Register RNN, GRU and LSTM with a backend's ``builtin`` and kernel ``k``."""
    for op_type in _OPS:
        _register(builtin, k, op_type)
