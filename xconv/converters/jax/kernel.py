"""The JAX side of the shared op semantics (:mod:`xconv.converters.ops`): which namespace a
handler computes with, and the few primitives the array API lacks."""

from __future__ import annotations

import string
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xconv.converters.ops import formulation
from xconv.converters.ops.arrays import namespace, onnx_dtype
from xconv.converters.ops.indexing import SELECT_ROWS

# This module imports no handler module (they import it): importing any one handler module
# on its own then works (the registry imports the rest).


def index_dtype() -> np.dtype:
    """int64 when JAX runs with 64-bit types, else int32 (ONNX index outputs are int64)."""
    return jax.dtypes.canonicalize_dtype(np.int64)


def reference_sum(x, axis: int):
    """Sum along ``axis`` keeping the dimension, accumulating as the ONNX reference does.

    bfloat16 accumulates in bfloat16 (numpy's ml_dtypes loop rounds after every add), where
    ``jnp.sum`` would accumulate in float32 and round differently; other types use jnp.sum.
    """
    if x.dtype == jnp.bfloat16:
        out = lax.reduce(x, jnp.zeros((), x.dtype), lax.add, (axis % x.ndim,))
        return jnp.expand_dims(out, axis)
    return jnp.sum(x, axis=axis, keepdims=True)


def take(x, idx, axis: int):
    """Gather (on wrapped indices) for the shared op: ``jnp.take``, except from a float table
    of at most ``indexing.SELECT_ROWS`` rows along ``axis`` (a token-type embedding), which
    is a chain of ``jnp.where`` over its rows.

    Both give the table's values exactly. Their gradients differ: a take's is a scatter-add
    into the table, and on a GPU a bfloat16 scatter-add of many positions into few rows
    contends on the same addresses (BERT-base's 2-row token-type table, 16,384 positions at
    batch 128: 200 ms of a 243 ms bfloat16 training step on an H200, the step 30 ms without
    it); the selects' gradient is one masked sum per row. Indices outside the table (an
    error in ONNX) give its first row. A symbolic axis (``jax.export``'s shape polymorphism)
    is taken.
    """
    n = x.shape[axis]
    if not isinstance(n, int) or n > SELECT_ROWS or not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.take(x, idx, axis=axis)
    before, after = axis, x.ndim - axis - 1
    mask = jnp.reshape(idx, (1,) * before + tuple(idx.shape) + (1,) * after)

    def row(r):
        at = (slice(None),) * axis + (r,)
        return jnp.reshape(x[at], x.shape[:axis] + (1,) * idx.ndim + x.shape[axis + 1 :])

    shape = x.shape[:axis] + tuple(idx.shape) + x.shape[axis + 1 :]
    out = jnp.broadcast_to(row(0), shape)
    for r in range(1, n):
        out = jnp.where(mask == r, row(r), out)
    return out


class JaxKernel:
    """numpy when every input is static (folded at trace time), else ``jax.numpy``."""

    overrides: dict = {"Gather": take}

    @staticmethod
    def run(fn, *arrays):
        xp = namespace(jnp, *arrays)
        if xp is np:
            with np.errstate(all="ignore"):
                return fn(np, *(None if a is None else np.asarray(a) for a in arrays))
        return fn(jnp, *(None if a is None else jnp.asarray(a) for a in arrays))

    @staticmethod
    def index_dtype(xp):
        return index_dtype()

    @staticmethod
    def arange(xp, n, like):
        return xp.arange(n)

    @staticmethod
    def rsqrt(xp, x):
        return lax.rsqrt(x) if xp is jnp else 1 / np.sqrt(x)

    @staticmethod
    def constant(a, like=None):
        return a  # numpy: folded at trace time

    @staticmethod
    def pad(y, widths, mode, fill):
        """``y`` padded by non-negative widths (``fill``: a number or a 0-d array)."""
        scalar = isinstance(fill, float | int)
        xp = namespace(jnp, y, None if scalar else fill)
        if mode != "constant":
            return xp.pad(y, widths, mode=mode)
        if not scalar and np.ndim(fill):
            fill = fill.reshape(())
        if xp is np:
            return np.pad(y, widths, mode="constant", constant_values=np.asarray(fill))
        return jnp.pad(y, widths, mode="constant", constant_values=jnp.asarray(fill, y.dtype))

    @staticmethod
    def dtype(ctx, code, like=None):
        """The numpy dtype of ONNX type ``code`` (``like``'s when 0 or absent)."""
        if like is not None and not hasattr(like, "dtype"):
            like = np.asarray(like)
        return onnx_dtype(ctx, code, lambda t: np.dtype(t.numpy()), like)

    @staticmethod
    def materialize(xp, x):
        return x


KERNEL = JaxKernel()


# ------------------------------------------------------------------ bfloat16 products


def bf16_dots(*operands) -> bool:
    """Whether a product of ``operands`` runs as :func:`bf16_einsum`: every operand is a
    bfloat16 array, the ``bf16_dot`` formulation is ``"auto"`` and JAX computes on the CPU
    (see :mod:`xconv.converters.ops.formulation`)."""
    return (
        all(getattr(x, "dtype", None) == jnp.bfloat16 for x in operands)
        and formulation.get("bf16_dot") == "auto"
        and jax.default_backend() == "cpu"
    )


def _fast_casts() -> bool:
    """Whether float32 <-> bfloat16 casts run as the bit operations below: the ``bf16_dot``
    formulation is ``"auto"`` and JAX computes on the CPU."""
    return formulation.get("bf16_dot") == "auto" and jax.default_backend() == "cpu"


@jax.jit  # one dispatch when called outside jit
def _bits_to_bf16(a):
    """Float32 ``a`` rounded to the nearest bfloat16 (ties to even; NaN stays NaN), by integer
    operations on its bits."""
    u = lax.bitcast_convert_type(a, jnp.uint32)
    rounded = u + (jnp.uint32(0x7FFF) + ((u >> 16) & jnp.uint32(1)))
    rounded = jnp.where(a != a, u | jnp.uint32(0x400000), rounded)  # NaN: keep it quiet
    return lax.bitcast_convert_type((rounded >> 16).astype(jnp.uint16), jnp.bfloat16)


@jax.jit
def _bits_to_f32(a):
    """Bfloat16 ``a`` as float32 (exact), by integer operations on its bits."""
    u = lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(u << 16, jnp.float32)


@jax.custom_vjp
def _cast_to_bf16(a):
    return _bits_to_bf16(a)


@jax.custom_vjp
def _cast_to_f32(a):
    return _bits_to_f32(a)


_cast_to_bf16.defvjp(lambda a: (_bits_to_bf16(a), None), lambda _, g: (_bits_to_f32(g),))
_cast_to_f32.defvjp(lambda a: (_bits_to_f32(a), None), lambda _, g: (_bits_to_bf16(g),))


def _traced(a, dtype) -> bool:
    return isinstance(a, jax.Array) and a.dtype == dtype


def to_bf16(a):
    """``jnp.asarray(a, jnp.bfloat16)``, the same values; on the CPU, of a float32 array
    computed at run time, by integer operations on its bits (gradient: the cotangent as
    float32, as the cast's). For convolution kernels: XLA:CPU fuses its own cast of a kernel
    with the kernel's transpose or reshape into a slow copy (one thread: a 3×3 kernel rounded
    to bfloat16 values and read as 512×4608 float32, 4.8 ms against 0.22 ms; the CNN
    benchmark's convolutions at batch 1, ONNX kernel layout, 2.29 against 0.95 ms a forward
    pass). Not for activations or matmul weights: there XLA's casts fuse into the ops beside
    them, and the bit operations made the transformer benchmark's forward pass at batch 1
    slower (4.59 and 4.57 ms against 4.26 ms). At BERT-base's batch 32 the products' barrier
    (:func:`_einsum_f32`), not bit casts, keeps XLA's casts out of one slow fusion."""
    if _traced(a, jnp.float32) and _fast_casts():
        return _cast_to_bf16(a)
    return jnp.asarray(a, jnp.bfloat16)


def to_f32(a):
    """``jnp.asarray(a, jnp.float32)`` of bfloat16 ``a``, as :func:`to_bf16` casts the other
    way (gradient: the cotangent rounded to bfloat16, as the cast's)."""
    if _traced(a, jnp.bfloat16) and _fast_casts():
        return _cast_to_f32(a)
    return jnp.asarray(a, jnp.float32)


def _einsum_f32(spec: str, a, b):
    """``spec`` on two bfloat16 arrays, products accumulated in float32, rounded once.

    A product contracting only the leading axis of both (a weight's gradient, ``mk,mn->kn``)
    XLA:CPU computes on float32 copies, 2.2× slower (4096×3072 by 4096×768, one thread); with a
    unit axis contracted beside it, on the bfloat16 operands, so it is given one.

    The rounded product passes an ``optimization_barrier``: without it XLA:CPU merged each of
    BERT-base's layers at batch 32 (three products, their float32 weights and casts, the
    LayerNorm) into one YNNPACK fusion, ~150 ms a layer; behind it, the fusions are the
    products' own. In one process, one thread, interleaved (bfloat16, ms a step): BERT-base
    inference at batch 32 2,518 -> 2,074 (-18 %), training 9,019 -> 8,710; at batch 1
    inference 165.2 -> 165.3, training 539 -> 564 in one run and 502 -> 504 in a second; the
    transformer (batch 1, 16), the CNN and ResNet-50 (batch 1, 32) within ±1 % or faster
    (ResNet-50 at batch 1: 75.6 -> 72.6 inference, 229.9 -> 222.2 training). The generated
    Flax's ``_bf16_einsum`` has no barrier: there it measured no gain (BERT-base inference at
    batch 32, 2,365 / 2,433 ms without, 2,401 / 2,373 with, alternating processes).
    """
    (sa, sb), out = spec.split("->")[0].split(","), spec.split("->")[1]
    if sa[:1] == sb[:1] != "" and set(sa) & set(sb) - set(out) == {sa[0]}:
        unit = next(c for c in string.ascii_letters if c not in spec)
        spec, a, b = f"{unit}{sa},{unit}{sb}->{out}", a[None], b[None]
    y = jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return lax.optimization_barrier(y)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def bf16_einsum(spec: str, a, b):
    """The two-operand einsum ``spec`` (``"ab,bc->ac"``: no ellipsis, no index repeated
    within an operand, every index of one operand in the other or in the output) of bfloat16
    ``a`` and ``b``, as bfloat16 products accumulated in float32 and rounded once to
    bfloat16: the values XLA gives ``a @ b`` (on the CPU it computes a bfloat16 dot in
    float32), by a dot that XLA:CPU runs on bfloat16 operands (AVX512-BF16) instead of
    converting them to float32 first. Its gradient is the two transposed products, computed
    the same way: JAX's own would take the float32 cotangent of the float32 accumulator and
    compute the transposed dots in float32."""
    return _einsum_f32(spec, a, b)


def _bf16_einsum_fwd(spec, a, b):
    return _einsum_f32(spec, a, b), (a, b)


def _bf16_einsum_bwd(spec, res, g):
    a, b = res
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    return _einsum_f32(f"{out},{sb}->{sa}", g, b), _einsum_f32(f"{sa},{out}->{sb}", a, g)


bf16_einsum.defvjp(_bf16_einsum_fwd, _bf16_einsum_bwd)


def _same_dim(a, b) -> bool:
    """Whether two dimensions are known to be equal (symbolic ones may not compare)."""
    try:
        return bool(a == b)
    except Exception:  # jax.export's InconclusiveDimensionOperation
        return False


def matmul_spec(a_shape, b_shape) -> str | None:
    """``numpy.matmul(a, b)`` as an einsum for :func:`bf16_einsum`, or None where it
    broadcasts a batch axis of size 1 against a longer one (or cannot tell)."""
    letters = iter(string.ascii_lowercase.replace("m", "").replace("k", "").replace("n", ""))
    a_batch, b_batch = a_shape[:-2], b_shape[:-2]
    width = max(len(a_batch), len(b_batch))
    sa = sb = so = ""
    for i in range(width):
        da = a_batch[i - width + len(a_batch)] if i >= width - len(a_batch) else None
        db = b_batch[i - width + len(b_batch)] if i >= width - len(b_batch) else None
        if da is not None and db is not None and not _same_dim(da, db):
            return None
        c = next(letters)
        sa += c if da is not None else ""
        sb += c if db is not None else ""
        so += c
    sa += "mk" if len(a_shape) > 1 else "k"
    sb += "kn" if len(b_shape) > 1 else "k"
    so += ("m" if len(a_shape) > 1 else "") + ("n" if len(b_shape) > 1 else "")
    return f"{sa},{sb}->{so}"


def matmul(a, b):
    """``jnp.matmul(a, b)``; two bfloat16 operands on the CPU through :func:`bf16_einsum`."""
    if bf16_dots(a, b) and (spec := matmul_spec(a.shape, b.shape)) is not None:
        return bf16_einsum(spec, a, b)
    return jnp.matmul(a, b)


def _product_rows(a, w_t) -> int | None:
    """The rows of ``a @ w_t`` (``a``'s leading axes, flattened) where a product with a 2-D
    transposed ``(out, in)`` weight may take a CPU form (:func:`weight_major`,
    :func:`one_row`): the ``dense`` formulation is ``"auto"``, JAX computes on the CPU, both
    are float32 and the rows are known when traced; else None."""
    if formulation.get("dense") != "auto" or jax.default_backend() != "cpu":
        return None
    if a.dtype != jnp.float32 or w_t.dtype != jnp.float32 or w_t.ndim != 2 or a.ndim < 2:
        return None
    if not all(isinstance(d, int) for d in a.shape):
        return None
    return int(np.prod(a.shape[:-1]))


def weight_major(a, w_t) -> bool:
    """Whether ``a @ w_t``, where ``w_t`` is the transpose of a 2-D ``(out, in)`` array (a
    torch ``Linear`` weight), runs as :func:`weight_product`: the ``dense`` formulation is
    ``"auto"``, JAX computes on the CPU, both are float32, and ``a`` has ``m`` rows (its
    leading axes, known when traced) with ``2 <= m <= 64``, or ``m <= 128`` where ``in >=
    2·out``. There XLA:CPU runs ``a @ w.T`` packing the whole weight on each call; as ``(w @
    a.T).T`` it packs the rows instead, in less time, forward and SGD step
    (``benchmarks/dense_layout.md``). One row is :func:`one_row`'s; more rows run as they
    are."""
    m = _product_rows(a, w_t)
    if m is None:
        return False
    k, n = w_t.shape
    return m >= 2 and (m <= 64 or (m <= 128 and k >= 2 * n))


def one_row(a, w_t) -> bool:
    """Whether ``a @ w_t`` (``w_t`` the transpose of a 2-D ``(out, in)`` weight) is one
    float32 row on the CPU under the ``"auto"`` ``dense`` formulation: a decode step's
    matrix-vector product, run as :func:`row_product`."""
    return _product_rows(a, w_t) == 1


def row_product(a, w_t):
    """``a @ w_t`` for one row as a product against the stored ``(out, in)`` weight
    (``w_t.T``, which XLA folds into the weight itself). Written as ``a @ w_t``, XLA:CPU
    fuses the weight's transpose and a preceding elementwise op (a norm's scale) into one
    loop that recomputes them per output element: a Llama-shape 0.8B decode step on 2
    cores took 496 ms against 140 ms (``benchmarks/generate.md``)."""
    return lax.dot_general(a, w_t.T, (((a.ndim - 1,), (1,)), ((), ())))


def weight_product(a, w_t):
    """``a @ w_t`` (``w_t`` the transpose of an ``(out, in)`` weight ``w``) as ``(w @
    a.T).T`` over ``a``'s rows flattened: the weight the left operand (see
    :func:`weight_major`). The product passes an ``optimization_barrier``; without it XLA's
    simplifier turns the transposed product back into ``a @ w.T``."""
    rows = a.reshape(-1, a.shape[-1])
    y_t = lax.dot_general(w_t, rows, (((0,), (1,)), ((), ())))
    return lax.optimization_barrier(y_t).T.reshape(*a.shape[:-1], w_t.shape[1])


def _conv_f32(conv, x, w):
    return conv(x.astype(jnp.float32), _bits_to_f32(w)).astype(jnp.bfloat16)  # see to_bf16


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bf16_conv(conv, x, w):
    return _conv_f32(conv, x, w)


def _bf16_conv_fwd(conv, x, w):
    return _conv_f32(conv, x, w), (x, w)


def _bf16_conv_bwd(conv, res, g):
    x, w = res
    (dx,) = jax.linear_transpose(lambda v: conv(v, w), x)(g)
    (dw,) = jax.linear_transpose(lambda v: conv(x, v), w)(g)
    return dx, dw


_bf16_conv.defvjp(_bf16_conv_fwd, _bf16_conv_bwd)


def conv(x, w, *args, **kwargs):
    """``lax.conv_general_dilated(x, w, ...)``. On the CPU, for bfloat16 ``x`` and ``w``, its
    forward is the float32 convolution of their float32 copies rounded once, the same values:
    XLA:CPU runs a bfloat16 convolution slower than the float32 one (a 3×3 kernel, 64 channels,
    32×56×56, one thread: 63 ms against 37 ms). Its gradient is the bfloat16 convolution's,
    which XLA:CPU runs faster than the float32 one's (89 ms against 139 ms there)."""

    def fn(x, w):
        return lax.conv_general_dilated(x, w, *args, **kwargs)

    if bf16_dots(x, w):
        return _bf16_conv(fn, x, w)
    return fn(x, w)
