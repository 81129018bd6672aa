"""The JAX kernel of the recurrent ops RNN, GRU and LSTM (written once in
:mod:`xconv.converters.ops.rnn`): ``jax.lax.scan`` over time, each op compiled once per
static configuration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from xconv.converters.jax.registry import builtin
from xconv.converters.ops.rnn import register_rnn_ops


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


def _prepare(x, initial_states, sequence_lens, layout, hidden, num_dir):
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


@functools.cache
def _jitted(body):
    return jax.jit(functools.partial(body, jnp, KERNEL), static_argnames=("opts",))


class _RnnKernel:
    """The JAX side of :mod:`xconv.converters.ops.rnn`."""

    sigmoid = staticmethod(jax.nn.sigmoid)
    softplus = staticmethod(jax.nn.softplus)
    prepare = staticmethod(_prepare)
    scan = staticmethod(_run_direction)
    finish = staticmethod(_finish)

    @staticmethod
    def call(body, *arrays, opts):
        return _jitted(body)(*arrays, opts=opts)

    @staticmethod
    def zeros(like, shape):
        return jnp.zeros(shape, like.dtype)


KERNEL = _RnnKernel()
register_rnn_ops(builtin, KERNEL)
