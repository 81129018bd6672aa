"""jaxpr handlers for math ONNX has no single op for: special functions, bit counting and
shifts, cumulative reductions, total-order comparisons, multi-key sort, min pooling.

- ``erf_inv``: Giles' single-precision polynomial (the one XLA uses for f32), plus two
  Newton steps on ``Erf`` for f64; ``erf_inv(+-1) = +-inf``.
- ``erfc``: ``1 - erf(x)`` (absolute error ~1 ulp of 1; tiny tails round to 0).
- ``lgamma`` / ``digamma``: the Lanczos (g=7) approximation with Euler's reflection below
  0.5, as XLA computes them (measured: relative error <= 1.1e-6 in f32 on [-4.7, 100]).
- ``cbrt``: ``sign(x) * |x| ** (1/3)``. ``atan2``: ``atan(y/x)`` with quadrant fixes (signed
  zeros and infinite pairs are not distinguished).
- ``clz`` / ``population_count`` / shifts: on the unsigned type of the same width (16-bit
  values widen to 32 bits, which onnxruntime's ``BitShift`` needs); jax's rule for shift
  amounts outside ``[0, bits)`` (0, or the sign for arithmetic right shifts) is kept.
- ``cumprod`` / ``cummax`` / ``cummin`` / ``cumlogsumexp``: an ``n x n`` triangular mask and
  one reduction, exact but O(n^2) in the scanned axis.
- ``lt_to`` / ``le_to`` / ``eq_to`` (total order, used by ``searchsorted``): ``-0 < +0`` and
  NaN above everything; negative NaNs are treated like positive ones.
- ``sort``: several keys sort stably from the last key to the first (one ``TopK`` each);
  keys TopK has no kernel for are widened first (bool and small ints to int32, f16 to f32,
  uint32 to int64, uint64 to float64, which orders values above 2**53 approximately).

Some wrappers also extend handlers of ``primitives.py`` (see the last section).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.flax.importer.primitives import builtin, handler
from xconv.converters.flax.importer.symbolic import dims, require_static
from xconv.errors import ConversionError


def _dtype(var: Any) -> np.dtype:
    return np.dtype(var.aval.dtype)


def _shape(var: Any) -> tuple[Any, ...]:
    return dims(var)


def _c(ctx, value, dtype):
    return ctx.const(np.asarray(value, dtype))


# --- special functions -------------------------------------------------------------------

_ERFINV_SMALL = (
    2.81022636e-08,
    3.43273939e-07,
    -3.5233877e-06,
    -4.39150654e-06,
    0.00021858087,
    -0.00125372503,
    -0.00417768164,
    0.246640727,
    1.50140941,
)
_ERFINV_LARGE = (
    -0.000200214257,
    0.000100950558,
    0.00134934322,
    -0.00367342844,
    0.00573950773,
    -0.0076224613,
    0.00943887047,
    1.00167406,
    2.83297682,
)


@builtin("erf_inv")
def _erf_inv(ctx, eqn, inputs):
    dt = _dtype(eqn.invars[0])
    (x,) = inputs
    one = _c(ctx, 1, dt)
    # w = -log((1 - x)(1 + x)): more accurate near |x| -> 1 than -log(1 - x^2).
    w = ctx.op(
        "Neg",
        [ctx.op("Log", [ctx.op("Mul", [ctx.op("Sub", [one, x]), ctx.op("Add", [one, x])])])],
    )
    small = ctx.op("Less", [w, _c(ctx, 5, dt)])
    w_small = ctx.op("Sub", [w, _c(ctx, 2.5, dt)])
    w_large = ctx.op("Sub", [ctx.op("Sqrt", [w]), _c(ctx, 3, dt)])
    t = ctx.op("Where", [small, w_small, w_large])

    def coef(i):
        return ctx.op(
            "Where", [small, _c(ctx, _ERFINV_SMALL[i], dt), _c(ctx, _ERFINV_LARGE[i], dt)]
        )

    poly = coef(0)
    for i in range(1, len(_ERFINV_SMALL)):
        poly = ctx.op("Add", [coef(i), ctx.op("Mul", [poly, t])])
    y = ctx.op("Mul", [poly, x])
    if dt == np.float64:  # Newton on erf(y) = x: each step doubles the correct digits
        k = _c(ctx, 2 / np.sqrt(np.pi), dt)
        for _ in range(2):
            err = ctx.op("Sub", [ctx.op("Erf", [y]), x])
            slope = ctx.op("Mul", [k, ctx.op("Exp", [ctx.op("Neg", [ctx.op("Mul", [y, y])])])])
            y = ctx.op("Sub", [y, ctx.op("Div", [err, slope])])
    edge = ctx.op("Equal", [ctx.op("Abs", [x]), one])
    return [ctx.op("Where", [edge, ctx.op("Mul", [x, _c(ctx, np.inf, dt)]), y])]


@builtin("erfc")
def _erfc(ctx, eqn, inputs):
    one = _c(ctx, 1, _dtype(eqn.invars[0]))
    return [ctx.op("Sub", [one, ctx.op("Erf", inputs)])]


@builtin("cbrt")
def _cbrt(ctx, eqn, inputs):
    dt = _dtype(eqn.invars[0])
    mag = ctx.op("Pow", [ctx.op("Abs", inputs), _c(ctx, 1 / 3, dt)])
    return [ctx.op("Mul", [ctx.op("Sign", inputs), mag])]


@builtin("atan2")
def _atan2(ctx, eqn, inputs):
    y, x = inputs
    dt = _dtype(eqn.invars[0])
    zero, pi = _c(ctx, 0, dt), _c(ctx, np.pi, dt)
    base = ctx.op("Atan", [ctx.op("Div", [y, x])])
    upper = ctx.op("GreaterOrEqual", [y, zero])
    left = ctx.op("Where", [upper, ctx.op("Add", [base, pi]), ctx.op("Sub", [base, pi])])
    half = _c(ctx, np.pi / 2, dt)
    on_axis = ctx.op(
        "Where",
        [
            ctx.op("Greater", [y, zero]),
            half,
            ctx.op("Where", [ctx.op("Less", [y, zero]), ctx.op("Neg", [half]), zero]),
        ],
    )
    right = ctx.op("Greater", [x, zero])
    out = ctx.op("Where", [ctx.op("Less", [x, zero]), left, on_axis])
    return [ctx.op("Where", [right, base, out])]


_LANCZOS_G = 7.0
_LANCZOS_BASE = 0.99999999999980993227684700473478
_LANCZOS = (
    676.520368121885098567009190444019,
    -1259.13921672240287047156078755283,
    771.3234287776530788486528258894,
    -176.61502916214059906584551354,
    12.507343278686904814458936853,
    -0.13857109526572011689554707,
    9.984369578019570859563e-6,
    1.50563273514931155834e-7,
)


def _lanczos_parts(ctx, x, dt, derivative: bool):
    """Shared Lanczos (g=7) terms: z, the series, its derivative series, t and log t."""
    one, half = _c(ctx, 1, dt), _c(ctx, 0.5, dt)
    reflect = ctx.op("Less", [x, half])
    z = ctx.op("Where", [reflect, ctx.op("Neg", [x]), ctx.op("Sub", [x, one])])
    series = _c(ctx, _LANCZOS_BASE, dt)
    slope = _c(ctx, 0, dt)
    for i, coef in enumerate(_LANCZOS):
        denom = ctx.op("Add", [z, _c(ctx, i + 1, dt)])
        series = ctx.op("Add", [series, ctx.op("Div", [_c(ctx, coef, dt), denom])])
        if derivative:
            sq = ctx.op("Mul", [denom, denom])
            slope = ctx.op("Sub", [slope, ctx.op("Div", [_c(ctx, coef, dt), sq])])
    t = ctx.op("Add", [z, _c(ctx, _LANCZOS_G + 0.5, dt)])
    log_t = ctx.op("Log", [t])
    return reflect, z, series, slope, t, log_t


@builtin("lgamma")
def _lgamma(ctx, eqn, inputs):
    """log|gamma(x)|: Lanczos for x >= 0.5, Euler's reflection below (XLA's formula)."""
    dt = _dtype(eqn.invars[0])
    (x,) = inputs
    reflect, z, series, _, t, log_t = _lanczos_parts(ctx, x, dt, derivative=False)
    half = _c(ctx, 0.5, dt)
    # (z + 1/2 - t / log t) * log t avoids overflowing (z + 1/2) * log t - t.
    body = ctx.op(
        "Mul", [ctx.op("Sub", [ctx.op("Add", [z, half]), ctx.op("Div", [t, log_t])]), log_t]
    )
    log_y = ctx.op(
        "Add",
        [ctx.op("Add", [_c(ctx, 0.5 * np.log(2 * np.pi), dt), body]), ctx.op("Log", [series])],
    )
    # Reflection: log(pi) - lgamma(1 - x) - log|sin(pi x)|, with sin taken on frac(|x|).
    mag = ctx.op("Abs", [x])
    frac = ctx.op("Sub", [mag, ctx.op("Floor", [mag])])
    frac = ctx.op(
        "Where", [ctx.op("Greater", [frac, half]), ctx.op("Sub", [_c(ctx, 1, dt), frac]), frac]
    )
    denom = ctx.op("Log", [ctx.op("Sin", [ctx.op("Mul", [_c(ctx, np.pi, dt), frac])])])
    finite = ctx.op("Not", [ctx.op("Or", [ctx.op("IsInf", [denom]), ctx.op("IsNaN", [denom])])])
    reflected = ctx.op("Sub", [ctx.op("Sub", [_c(ctx, np.log(np.pi), dt), denom]), log_y])
    reflected = ctx.op("Where", [finite, reflected, ctx.op("Neg", [denom])])
    out = ctx.op("Where", [reflect, reflected, log_y])
    return [ctx.op("Where", [ctx.op("IsInf", [x]), _c(ctx, np.inf, dt), out])]


@builtin("digamma")
def _digamma(ctx, eqn, inputs):
    """d/dx log gamma(x): the Lanczos series' log-derivative, reflected below 0.5."""
    dt = _dtype(eqn.invars[0])
    (x,) = inputs
    reflect, _, series, slope, t, log_t = _lanczos_parts(ctx, x, dt, derivative=True)
    y = ctx.op("Add", [log_t, ctx.op("Div", [slope, series])])
    y = ctx.op("Sub", [y, ctx.op("Div", [_c(ctx, _LANCZOS_G, dt), t])])
    # Reflection: digamma(x) = digamma(1 - x) - pi / tan(pi x), with x shifted by a whole
    # number of periods towards 0 for an accurate tan.
    shift = ctx.op("Abs", [ctx.op("Floor", [ctx.op("Add", [x, _c(ctx, 0.5, dt)])])])
    reduced = ctx.op("Mul", [_c(ctx, np.pi, dt), ctx.op("Add", [x, shift])])
    cot = ctx.op("Div", [ctx.op("Cos", [reduced]), ctx.op("Sin", [reduced])])
    reflected = ctx.op("Sub", [y, ctx.op("Mul", [_c(ctx, np.pi, dt), cot])])
    out = ctx.op("Where", [reflect, reflected, y])
    pole = ctx.op(
        "And",
        [ctx.op("LessOrEqual", [x, _c(ctx, 0, dt)]), ctx.op("Equal", [x, ctx.op("Floor", [x])])],
    )
    return [ctx.op("Where", [pole, _c(ctx, np.nan, dt), out])]


# --- bits --------------------------------------------------------------------------------

_UNSIGNED = {1: np.uint8, 2: np.uint32, 4: np.uint32, 8: np.uint64}


def _as_unsigned(ctx, x, dt: np.dtype):
    """``x`` reinterpreted as unsigned (two's complement), in a type BitShift supports."""
    if dt.kind not in "iu":
        raise ConversionError(f"bit operation on non-integer dtype {dt}")
    ut = np.dtype(_UNSIGNED[dt.itemsize])
    same = np.dtype(f"u{dt.itemsize}")
    if dt != same:
        x = ctx.op("Cast", [x], {"to": ir.DataType.from_numpy(same)})
    if same != ut:
        x = ctx.op("Cast", [x], {"to": ir.DataType.from_numpy(ut)})
    return x, ut


def _back(ctx, x, dt: np.dtype):
    """Wrap an unsigned result back to ``dt`` (truncate to its width, then reinterpret)."""
    same = np.dtype(f"u{dt.itemsize}")
    x = ctx.op("Cast", [x], {"to": ir.DataType.from_numpy(same)})
    return x if dt == same else ctx.op("Cast", [x], {"to": ir.DataType.from_numpy(dt)})


def _shift(ctx, x, amount: int | Any, ut, direction: str):
    if isinstance(amount, int):
        amount = _c(ctx, amount, ut)
    return ctx.op("BitShift", [x, amount], {"direction": direction})


@builtin("clz")
def _clz(ctx, eqn, inputs):
    dt = _dtype(eqn.invars[0])
    u, ut = _as_unsigned(ctx, inputs[0], dt)
    width = 8 * ut.itemsize
    zero = _c(ctx, 0, ut)
    n = zero
    s = width // 2
    while s >= 1:  # binary search for the highest set bit
        empty = ctx.op("Equal", [_shift(ctx, u, width - s, ut, "RIGHT"), zero])
        n = ctx.op("Add", [n, ctx.op("Where", [empty, _c(ctx, s, ut), zero])])
        u = ctx.op("Where", [empty, _shift(ctx, u, s, ut, "LEFT"), u])
        s //= 2
    n = ctx.op("Add", [n, ctx.op("Where", [ctx.op("Equal", [u, zero]), _c(ctx, 1, ut), zero])])
    extra = width - 8 * dt.itemsize  # 16-bit values counted in 32 bits
    if extra:
        n = ctx.op("Sub", [n, _c(ctx, extra, ut)])
    return [_back(ctx, n, dt)]


@builtin("population_count")
def _population_count(ctx, eqn, inputs):
    dt = _dtype(eqn.invars[0])
    u, ut = _as_unsigned(ctx, inputs[0], dt)
    width = 8 * ut.itemsize

    def mask(byte):
        return _c(ctx, int.from_bytes(bytes([byte]) * ut.itemsize, "little"), ut)

    def band(a, b):
        return ctx.op("BitwiseAnd", [a, b])

    u = ctx.op("Sub", [u, band(_shift(ctx, u, 1, ut, "RIGHT"), mask(0x55))])
    u = ctx.op("Add", [band(u, mask(0x33)), band(_shift(ctx, u, 2, ut, "RIGHT"), mask(0x33))])
    u = band(ctx.op("Add", [u, _shift(ctx, u, 4, ut, "RIGHT")]), mask(0x0F))
    s = 8
    while s < width:  # sum the byte counts into the low byte
        u = ctx.op("Add", [u, _shift(ctx, u, s, ut, "RIGHT")])
        s *= 2
    return [_back(ctx, band(u, _c(ctx, 0xFF, ut)), dt)]


def _shift_amount(ctx, eqn, s, ut, bits: int):
    """(amount as ``ut`` clamped into [0, bits - 1], out-of-range mask)."""
    sdt = _dtype(eqn.invars[1])
    bad = ctx.op("GreaterOrEqual", [s, _c(ctx, bits, sdt)])
    if sdt.kind == "i":
        bad = ctx.op("Or", [bad, ctx.op("Less", [s, _c(ctx, 0, sdt)])])
    safe = ctx.op("Where", [bad, _c(ctx, bits - 1, sdt), s])
    return ctx.op("Cast", [safe], {"to": ir.DataType.from_numpy(ut)}), bad


@builtin("shift_left", "shift_right_logical")
def _shift_logical(ctx, eqn, inputs):
    dt = _dtype(eqn.invars[0])
    x, s = inputs
    u, ut = _as_unsigned(ctx, x, dt)
    amount, bad = _shift_amount(ctx, eqn, s, ut, 8 * dt.itemsize)
    direction = "LEFT" if eqn.primitive.name == "shift_left" else "RIGHT"
    out = _back(ctx, _shift(ctx, u, amount, ut, direction), dt)
    return [ctx.op("Where", [bad, _c(ctx, 0, dt), out])]


@builtin("shift_right_arithmetic")
def _shift_right_arithmetic(ctx, eqn, inputs):
    dt = _dtype(eqn.invars[0])
    x, s = inputs
    if dt.kind == "u":
        return _shift_logical(ctx, eqn, inputs)
    # Shifting by bits - 1 fills with the sign: the answer for out-of-range amounts too.
    neg = ctx.op("Less", [x, _c(ctx, 0, dt)])
    pos = ctx.op("Where", [neg, ctx.op("BitwiseNot", [x]), x])  # ~x >= 0 when x < 0
    u, ut = _as_unsigned(ctx, pos, dt)
    amount, _ = _shift_amount(ctx, eqn, s, ut, 8 * dt.itemsize)
    out = _back(ctx, _shift(ctx, u, amount, ut, "RIGHT"), dt)
    return [ctx.op("Where", [neg, ctx.op("BitwiseNot", [out]), out])]


# --- cumulative reductions ---------------------------------------------------------------


def _identity(name: str, dt: np.dtype):
    if name == "cumprod":
        return 1
    big = np.inf if dt.kind == "f" else np.iinfo(dt).max
    small = -np.inf if dt.kind == "f" else np.iinfo(dt).min
    if dt == np.bool_:
        big, small = True, False
    return {"cummax": small, "cummin": big, "cumlogsumexp": -np.inf}[name]


@builtin("cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(ctx, eqn, inputs):
    name = eqn.primitive.name
    dt = _dtype(eqn.invars[0])
    shape = _shape(eqn.invars[0])
    axis = int(eqn.params["axis"]) % len(shape)
    (n,) = require_static([shape[axis]], f"{name} along axis {axis}")
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    keep = (j >= i) if eqn.params.get("reverse") else (j <= i)
    view = [1] * (len(shape) + 1)
    view[axis], view[axis + 1] = n, n
    # pairs[..., i, j, ...] = x[..., j, ...] where j is in the prefix (suffix) of i.
    xj = ctx.op("Unsqueeze", [inputs[0], ctx.i64([axis])])
    pairs = ctx.op("Where", [ctx.const(keep.reshape(view)), xj, _c(ctx, _identity(name, dt), dt)])
    red = ctx.i64([axis + 1])
    if name == "cumlogsumexp":  # max-shifted, so large values do not overflow
        top = ctx.op("ReduceMax", [pairs, red], {"keepdims": 1})
        total = ctx.op("ReduceSum", [ctx.op("Exp", [ctx.op("Sub", [pairs, top])]), red])
        out = ctx.op("Add", [ctx.op("Log", [total]), top])
        return [ctx.op("Squeeze", [out, red])]
    op = {"cumprod": "ReduceProd", "cummax": "ReduceMax", "cummin": "ReduceMin"}[name]
    return [ctx.op(op, [pairs, red], {"keepdims": 0})]


# --- total-order comparisons -------------------------------------------------------------


def _lt_total(ctx, a, b, dt):
    """a < b in IEEE total order (for floats; plain Less for the rest)."""
    if dt.kind != "f":
        return ctx.op("Less", [a, b])
    zero = _c(ctx, 0, dt)

    def neg_zero(v):
        is_zero = ctx.op("Equal", [v, zero])
        return ctx.op("And", [is_zero, ctx.op("Less", [ctx.op("Reciprocal", [v]), zero])])

    zeros = ctx.op("And", [neg_zero(a), ctx.op("Not", [neg_zero(b)])])
    zeros = ctx.op("And", [zeros, ctx.op("Equal", [b, zero])])
    nan_b = ctx.op("And", [ctx.op("IsNaN", [b]), ctx.op("Not", [ctx.op("IsNaN", [a])])])
    return ctx.op("Or", [ctx.op("Or", [ctx.op("Less", [a, b]), zeros]), nan_b])


@builtin("lt_to")
def _lt_to(ctx, eqn, inputs):
    return [_lt_total(ctx, *inputs, _dtype(eqn.invars[0]))]


@builtin("le_to")
def _le_to(ctx, eqn, inputs):
    a, b = inputs
    return [ctx.op("Not", [_lt_total(ctx, b, a, _dtype(eqn.invars[0]))])]


@builtin("eq_to")
def _eq_to(ctx, eqn, inputs):
    a, b = inputs
    dt = _dtype(eqn.invars[0])
    lt = _lt_total(ctx, a, b, dt)
    gt = _lt_total(ctx, b, a, dt)
    return [ctx.op("Not", [ctx.op("Or", [lt, gt])])]


# --- sort with several keys, min pooling ---------------------------------------------------

_SORT_ONE_KEY = handler("sort")


def _topk_type(dt: np.dtype) -> np.dtype | None:
    """The dtype to sort ``dt`` keys in, or None when TopK takes ``dt`` as is."""
    if dt in (np.float32, np.float64, np.int32, np.int64):
        return None
    if dt.kind == "f":
        return np.dtype(np.float32)
    if dt.kind == "u" and dt.itemsize >= 4:
        return np.dtype(np.int64) if dt.itemsize == 4 else np.dtype(np.float64)
    return np.dtype(np.int32)


@builtin("sort")
def _sort(ctx, eqn, inputs):
    """sort(operands...; dimension, num_keys): lexicographic over the first num_keys."""
    num_keys = int(eqn.params.get("num_keys", 1))
    key_types = [_topk_type(_dtype(v)) for v in eqn.invars[:num_keys]]
    if num_keys == 1 and key_types[0] is None:
        return _SORT_ONE_KEY(ctx, eqn, inputs)
    dim = int(eqn.params["dimension"])
    shape = _shape(eqn.invars[0])
    n = ctx.op("Shape", [inputs[0]], {"start": dim, "end": dim + 1})
    view = [1] * len(shape)
    view[dim] = -1
    iota = ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [n]), ctx.i64(1)])
    iota = ctx.op("Reshape", [iota, ctx.i64(view)])
    order = ctx.op("Expand", [iota, ctx.op("Shape", [inputs[0]])])
    # Stable sorts from the least significant key to the most significant one.
    for key, to in reversed(list(zip(inputs[:num_keys], key_types, strict=True))):
        if to is not None:  # an order-preserving widening TopK has a kernel for
            key = ctx.op("Cast", [key], {"to": ir.DataType.from_numpy(to)})
        permuted = ctx.op("GatherElements", [key, order], {"axis": dim})
        _, idx = ctx.op(
            "TopK",
            [permuted, n],
            {"axis": dim, "largest": 0, "sorted": 1},
            num_outputs=2,
        )
        order = ctx.op("GatherElements", [order, idx], {"axis": dim})
    return [ctx.op("GatherElements", [v, order], {"axis": dim}) for v in inputs]


@builtin("reduce_window_min")
def _reduce_window_min(ctx, eqn, inputs):
    # min pooling = -max pooling of -x (padding -inf there is +inf here).
    as_max = SimpleNamespace(
        primitive=SimpleNamespace(name="reduce_window_max"),
        params=eqn.params,
        invars=eqn.invars,
        outvars=eqn.outvars,
        source_info=eqn.source_info,
    )
    (out,) = handler("reduce_window_max")(ctx, as_max, [ctx.op("Neg", inputs)])
    return [ctx.op("Neg", [out])]


# --- edge cases of primitives.py's handlers ------------------------------------------------
# These wrap the handler registered in primitives.py and delegate to it for the common case,
# adding what it lacks: XLA's integer division by zero, bool arguments of ArgMax,
# reductions over no axes, interior padding.

_BASE = {name: handler(name) for name in ("div", "rem", "argmax", "argmin", "pad")}
_BASE["reduce_or"] = handler("reduce_or")
_BASE["reduce_and"] = handler("reduce_and")


@builtin("div", "rem")
def _int_div(ctx, eqn, inputs):
    """Integer div/rem never trap: x / 0 is all ones (-1, or the uint max), x % 0 is x, and
    INT_MIN / -1 wraps (XLA's rules); onnxruntime would fail or fault on them."""
    name = eqn.primitive.name
    dt = _dtype(eqn.invars[0])
    if dt.kind not in "iu":
        return _BASE[name](ctx, eqn, inputs)
    x, y = inputs
    zero = ctx.op("Equal", [y, _c(ctx, 0, dt)])
    bad = zero
    if dt.kind == "i":
        minus_one = ctx.op("Equal", [y, _c(ctx, -1, dt)])
        bad = ctx.op("Or", [zero, minus_one])
    safe = ctx.op("Where", [bad, _c(ctx, 1, dt), y])
    (out,) = _BASE[name](ctx, eqn, [x, safe])
    if name == "div":
        if dt.kind == "i":
            out = ctx.op("Where", [minus_one, ctx.op("Neg", [x]), out])
        ones = -1 if dt.kind == "i" else np.iinfo(dt).max
        return [ctx.op("Where", [zero, _c(ctx, ones, dt), out])]
    if dt.kind == "i":
        out = ctx.op("Where", [minus_one, _c(ctx, 0, dt), out])
    return [ctx.op("Where", [zero, x, out])]


@builtin("argmax", "argmin")
def _argmax_bool(ctx, eqn, inputs):
    if _dtype(eqn.invars[0]) == np.bool_:  # ArgMax has no bool kernel
        inputs = [ctx.op("Cast", inputs, {"to": ir.DataType.INT32})]
    return _BASE[eqn.primitive.name](ctx, eqn, inputs)


@builtin("reduce_or", "reduce_and")
def _reduce_bool_axes(ctx, eqn, inputs):
    if not eqn.params["axes"]:  # ONNX reduces everything when given no axes
        return [ctx.op("Identity", inputs)]
    return _BASE[eqn.primitive.name](ctx, eqn, inputs)


@builtin("pad")
def _pad_interior(ctx, eqn, inputs):
    """Interior padding (``lax.associative_scan``, dilations) spreads each axis first:
    ``[n] -> [n, 1 + c] -> [n * (1 + c)] -> [:-c]``; the edge padding then goes to the base."""
    config = [tuple(int(v) for v in cfg) for cfg in eqn.params["padding_config"]]
    if all(c == 0 for _, _, c in config):
        return _BASE["pad"](ctx, eqn, inputs)
    x, value = inputs
    shape = list(_shape(eqn.invars[0]))
    rank = len(config)
    for axis, (_, _, c) in enumerate(config):
        if c == 0 or shape[axis] == 0:
            continue
        if c < 0:
            raise ConversionError(f"pad with negative interior padding {c}")
        last = [d for d in range(rank) if d != axis] + [axis]
        t = ctx.op("Transpose", [x], {"perm": last}) if axis != rank - 1 else x
        t = ctx.op("Unsqueeze", [t, ctx.i64([rank])])
        pads = [0] * (2 * (rank + 1))
        pads[2 * (rank + 1) - 1] = c
        t = ctx.op("Pad", [t, ctx.i64(pads), value], {"mode": "constant"})
        t = ctx.op("Reshape", [t, ctx.i64([0] * (rank - 1) + [-1])])
        t = ctx.op("Slice", [t, ctx.i64([0]), ctx.i64([-c]), ctx.i64([rank - 1])])
        if axis != rank - 1:
            t = ctx.op("Transpose", [t], {"perm": [int(p) for p in np.argsort(last)]})
        x = t
        shape[axis] = shape[axis] + (shape[axis] - 1) * c
    spread = SimpleNamespace(
        aval=SimpleNamespace(shape=tuple(shape), dtype=eqn.invars[0].aval.dtype)
    )
    edges = SimpleNamespace(
        primitive=eqn.primitive,
        params={**eqn.params, "padding_config": tuple((a, b, 0) for a, b, _ in config)},
        invars=[spread, eqn.invars[1]],
        outvars=eqn.outvars,
        source_info=eqn.source_info,
    )
    return _BASE["pad"](ctx, edges, [x, value])
