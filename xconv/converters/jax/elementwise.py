"""JAX handlers: the dtype conversions Cast, CastLike, BitCast, and the JAX kernel of the
activations, Gelu, PRelu and Clip (written once in :mod:`xconv.converters.ops.elementwise`).

Cast covers every ONNX
tensor type JAX holds through ``ml_dtypes`` (bfloat16, the float8 family, float8e8m0, int4,
uint4, int2, uint2, float4e2m1); casts to or from strings need static (numpy) inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx_ir as ir

from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.arrays import is_static
from xconv.converters.ops.elementwise import (
    FLOAT8,
    SUB_BYTE_INTS,
    data_type,
    register_cast_ops,
    register_elementwise_ops,
    sub_byte_values,
    to_e8m0,
)

#: From this many elements on, the exact Gelu on the CPU is kept out of the products' fusions
#: (:meth:`_Kernel.gelu`); BERT-base's has 1.6·10⁶ at batch 4, 0.4·10⁶ at batch 1.
GELU_SPLIT = 1 << 20


class _Kernel:
    """The JAX side of :mod:`xconv.converters.ops.elementwise`: everything in ``jax.numpy``."""

    overrides: dict = {}

    @staticmethod
    def run(fn, *arrays):
        return fn(jnp, *(None if a is None else jnp.asarray(a) for a in arrays))

    @staticmethod
    def sigmoid(x):
        return jax.nn.sigmoid(jnp.asarray(x))

    @staticmethod
    def gelu(x, tanh):
        """The tanh form is ``jax.nn.gelu``'s; the exact one is written as ONNX and torch write
        it, ``x/2 · (1 + erf(x/√2))``: ``jax.nn.gelu(approximate=False)`` goes through erfc,
        which XLA:CPU runs about 3x slower (and which a GELU-heavy transformer feels).

        On the CPU, the exact form of a large input (:data:`GELU_SPLIT` elements or more) ends
        in ``where(x == x, y, x)``, the same values (``y`` is NaN where ``x`` is): XLA:CPU
        puts no select in a YNNPACK fusion, so the GELU stays out of the products beside it.
        Without it XLA:CPU merged each of BERT-base's layers from the attention's output
        projection to the second LayerNorm (three products, the GELU, two LayerNorms) into one
        fusion, the GELU's constants written out at full size, and ran it slower: float32
        inference, one thread, ms a step, interleaved, 5,172 -> 3,950 at batch 32 and
        24,506 -> 20,232 at batch 128 (the other core busy); batch 4 419.1 -> 414.7; training
        at batch 1 and 32, the transformer benchmark (batch 1 and 16) and BERT-base in bfloat16
        within ±1.5 %. At batch 1 (0.4·10⁶ elements) the GELU was apart already and the
        select only cost time (123.4 -> 125.8 ms), hence the size."""
        x = jnp.asarray(x)
        if tanh:
            return jax.nn.gelu(x, approximate=True).astype(x.dtype)
        y = x * 0.5 * (1 + jax.lax.erf(x * 0.7071067811865476))
        # a symbolic (jax.export) size counts as large
        large = not isinstance(x.size, int) or x.size >= GELU_SPLIT
        if jax.default_backend() == "cpu" and large:
            y = jnp.where(x == x, y, x)
        return y

    @staticmethod
    def float32_bits(x):
        return jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.uint32)

    @staticmethod
    def e8m0(exponent):
        return jax.lax.bitcast_convert_type(exponent.astype(jnp.uint8), ml_dtypes.float8_e8m0fnu)


_KERNEL = _Kernel()
register_elementwise_ops(builtin, _KERNEL)


# ------------------------------------------------------------------------- dtype casts


def _is_builtin_numpy(dtype: np.dtype) -> bool:
    """A dtype numpy itself implements (not one of ml_dtypes' extension types)."""
    return dtype.kind in "biuf" and dtype.type.__module__ == "numpy"


def cast_array(ctx, x, to: ir.DataType, saturate: int, round_mode: str):
    """Cast ``x`` to ONNX type ``to``; static inputs give numpy (strings need numpy)."""
    if to == ir.DataType.STRING:
        return np.asarray(ctx.static(x, "Cast input (to string)")).astype(np.str_)
    target = np.dtype(to.numpy())
    if is_static(x):
        x = np.asarray(x)
        if x.dtype.kind in "OSUT":
            x = x.astype(target if _is_builtin_numpy(target) else np.float32)
        if _is_builtin_numpy(target) and _is_builtin_numpy(x.dtype):
            with np.errstate(all="ignore"):
                return x.astype(target)
    x = jnp.asarray(x)
    if to == ir.DataType.FLOAT8E8M0:
        return to_e8m0(jnp, _KERNEL, x, bool(saturate), round_mode)
    if to in FLOAT8 and saturate and jnp.issubdtype(x.dtype, jnp.floating):
        info = ml_dtypes.finfo(target)
        x = jnp.clip(x, float(info.min), float(info.max))
    if x.dtype == _FLOAT4 and not jnp.issubdtype(target, jnp.floating):
        # XLA converts float4's largest value (6) to an integer type's maximum: via float32.
        x = x.astype(jnp.float32)
    if to in SUB_BYTE_INTS:
        return sub_byte_values(jnp, x, to).astype(target)
    if to == ir.DataType.FLOAT4E2M1 and jnp.issubdtype(x.dtype, jnp.floating):
        # ml_dtypes (and so ONNX's reference) gives NaN, which float4 lacks, the zero of the
        # opposite sign; XLA gives -0 to both.
        wide = x if x.dtype.itemsize >= 2 else x.astype(jnp.float32)  # signbit's types
        zero = jnp.where(jnp.signbit(wide), 0.0, -0.0).astype(target)
        return jnp.where(jnp.isnan(wide), zero, x.astype(target))
    return x.astype(target)


_FLOAT4 = np.dtype(ml_dtypes.float4_e2m1fn)


def _type_of(a) -> ir.DataType:
    dtype = np.dtype(a.dtype)
    return ir.DataType.STRING if dtype.kind in "OSUT" else ir.DataType.from_numpy(dtype)


register_cast_ops(builtin, REQUIRED, cast_array, _type_of)


@builtin("BitCast", since=26, attrs={"to": REQUIRED})
def bit_cast(ctx, x, *, to):
    """BitCast(input) -> output: the same bits reinterpreted as type ``to`` (same width)."""
    target = data_type(ctx, to)
    if target == ir.DataType.STRING or np.dtype(x.dtype).kind in "OSUT":
        raise ctx.error("BitCast supports numeric and bool types, not strings")
    source = np.dtype(x.dtype)
    dtype = np.dtype(target.numpy())
    if source.itemsize != dtype.itemsize:
        raise ctx.error(
            f"BitCast needs types of one width; {source} is {source.itemsize * 8} bits, "
            f"{dtype} is {dtype.itemsize * 8}"
        )
    if is_static(x):
        return np.asarray(x).view(dtype)
    if source == np.bool_:
        return jnp.asarray(x).astype(dtype)
    if dtype == np.bool_:
        return jnp.asarray(x) != 0
    return jax.lax.bitcast_convert_type(x, dtype)
