"""The JAX kernel of the classical ML ops (LabelEncoder, ArrayFeatureExtractor, Binarizer,
TreeEnsemble, TfIdfVectorizer), written once in :mod:`xconv.converters.ops.ml`.

Numeric data stays traceable; a tree ensemble and an n-gram count run as one compiled
computation (``jax.jit``), the tree's steps a ``lax.scan``. String data runs on numpy object
arrays.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.kernel import JaxKernel
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.ml import register_ml_ops


class _Kernel(JaxKernel):
    @staticmethod
    def fuse(fn):
        def fused(xp, *arrays):
            return fn(xp, *arrays) if xp is np else jax.jit(partial(fn, xp))(*arrays)

        return fused

    @staticmethod
    def repeat(xp, step, init, n):
        if xp is np:
            for _ in range(n):
                init = step(init)
            return init
        return jax.lax.scan(lambda c, _: (step(c), None), init, None, length=n)[0]

    @staticmethod
    def finfo(xp, dtype):
        return jnp.finfo(dtype)

    @staticmethod
    def erfinv(xp, x):
        out = jax.scipy.special.erfinv(x)
        return np.asarray(out) if xp is np else out


register_ml_ops(builtin, _Kernel(), REQUIRED)
