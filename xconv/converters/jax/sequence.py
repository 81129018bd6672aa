"""The JAX kernel of the sequence and optional ops (written once in
:mod:`xconv.converters.ops.sequence`).

An ONNX sequence is a Python list of arrays and an empty optional is None: both are JAX
pytrees, so they pass through ``jax.jit`` unchanged. Sequence positions and split sizes
must be known at trace time (they decide the list's structure), except a SequenceAt position
over elements of one shape and dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import sequence as sequences


class _Kernel:
    @staticmethod
    def constant(a):
        return a  # numpy: folded at trace time

    @staticmethod
    def split(x, sizes, axis):
        x = jnp.asarray(x)
        return jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis)

    @staticmethod
    def squeeze(x, axis):
        return jnp.squeeze(x, axis)

    @staticmethod
    def expand_dims(x, axis):
        return jnp.expand_dims(jnp.asarray(x), axis)

    @staticmethod
    def concat(xs, axis):
        return jnp.concatenate([jnp.asarray(x) for x in xs], axis=axis)

    @staticmethod
    def dynamic_at(ctx, seq, position):
        if not isinstance(position, jax.core.Tracer):
            return None
        # A run-time position still works when the elements are alike: index a stack.
        if not seq or len({(np.shape(s), jnp.asarray(s).dtype) for s in seq}) != 1:
            raise ctx.error(
                "under jax.jit a run-time SequenceAt position needs elements of one shape and dtype"
            )
        pos = jnp.reshape(position, (-1,))[0]
        return jnp.stack([jnp.asarray(s) for s in seq])[jnp.where(pos < 0, pos + len(seq), pos)]


sequences.register_list_ops(builtin, REQUIRED, _Kernel())
