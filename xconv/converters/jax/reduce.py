"""The JAX kernel of the Reduce* family and ArgMax / ArgMin (written once in
:mod:`xconv.converters.ops.reduce`): ``jax.numpy``, or numpy when the input is static."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.linalg import index_dtype
from xconv.converters.jax.registry import builtin
from xconv.converters.ops.arrays import namespace
from xconv.converters.ops.reduce import register_reduce_ops


class _Kernel:
    overrides: dict = {}

    @staticmethod
    def run(fn, *arrays):
        xp = namespace(jnp, *arrays)
        if xp is np:
            with np.errstate(all="ignore"):
                return fn(np, *(np.asarray(a) for a in arrays))
        return fn(jnp, *(jnp.asarray(a) for a in arrays))

    @staticmethod
    def index_dtype(xp):
        return index_dtype()


register_reduce_ops(builtin, _Kernel())
