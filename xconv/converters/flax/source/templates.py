"""Per-op source templates for the Flax emitter: one jnp / lax expression per ONNX node.

A template receives an :class:`OpCall` (argument expressions, constant values, static input
shapes, parsed attributes) and returns the expression computing the node's output(s). Node
groups recognised as layers never reach these templates; they become Flax layers.

Each template declares how it treats activation layout (see ``layout.py``):

* ``unary``: elementwise on one array; keeps whatever layout its input has.
* ``binary``: elementwise with broadcasting; channels-last when its inputs agree.
* ``axis``: has an ``axis``/``axes`` attribute or input that is remapped to the layout.
* ``channels_last``: pooling; needs its input channels-last and returns channels-last.
* ``plain``: needs the source (channels-first) layout.

Users add templates for ops the emitter lacks (or replace built-in ones) with
:func:`register_template`; a user template wins over the built-in one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import onnx_ir as ir

from xconv.converters import expressions as ex
from xconv.converters.codegen import TemplateCall, int_tuple, scalar_literal
from xconv.converters.registry import REQUIRED, Handler, TemplateRegistry
from xconv.errors import (
    ConversionError,
    MissingOp,
    UnsupportedOpError,
)

INT64_MAX = np.iinfo(np.int64).max


@dataclass
class OpCall(TemplateCall):
    """What a template sees for one node."""

    xp: str = "jnp"
    perm: tuple[int, ...] | None = None
    helpers: set[str] = field(default_factory=set)
    low: bool = False  # the emitter computes in bfloat16

    emitter: ClassVar[str] = "Flax emitter"

    def axis(self, a: int, i: int = 0) -> int:
        """Map a source-layout axis of input ``i`` to the physical axis of its array."""
        r = self.rank(i)
        if a < 0:
            if r is None:
                raise ConversionError(
                    "negative axis on an input of unknown rank",
                    op=self.node.op_type,
                    node=self.node.name,
                )
            a += r
        return self.perm.index(a) if self.perm is not None else a

    def dtype(self, index: int = 0) -> str:
        return dtype_expr(self.node.outputs[index].dtype, self.xp)

    def float_output(self, index: int = 0) -> bool:
        """Whether output ``index`` is known to be a floating-point tensor."""
        dtype = self.node.outputs[index].dtype
        return dtype is not None and dtype.is_floating_point()


@dataclass(frozen=True)
class Template(Handler):
    """A registered template: ``fn(call) -> source expression`` and how it treats layout."""

    layout: str = "plain"
    static_ok: bool = False
    outputs: int = 1


#: The Flax emitter's templates (built-in and user ones; a user template wins) and the
#: helper functions they call.
registry = TemplateRegistry(
    "flax emitter", module="xconv.converters.flax.source.templates", handler_class=Template
)

#: The helper sources (``registry.helpers``), under the name ``render`` imports.
HELPERS = registry.helpers


def template(*ops: str, layout: str = "plain", static_ok: bool = False, **attrs: Any):
    def deco(fn: Callable[[OpCall], str]) -> Callable[[OpCall], str]:
        for op in ops:
            registry.builtin(op, attrs=attrs, layout=layout, static_ok=static_ok)(fn)
        return fn

    return deco


def register_template(
    op_type: str,
    fn: Callable[[OpCall], str] | None = None,
    *,
    domain: str = "",
    attrs: dict[str, Any] | None = None,
    layout: str = "plain",
    helpers: dict[str, str] | None = None,
):
    """Teach the Flax emitter (``xconv.to_flax``) an op: ``fn(call) -> source expression``.

    ``fn`` receives an :class:`OpCall` (``call.args`` are the input expressions,
    ``call.consts`` their constant values or None, ``call.attrs`` the parsed attributes, with
    the defaults given in ``attrs``; an attribute not listed there is an error) and returns
    one Python expression computing the node's output (a tuple for several outputs). A
    user template wins over the built-in one for the same op. ``helpers`` maps a helper name
    to module-level source (a function named ``_<name>``) that the template may call after
    ``call.helpers.add(name)``. Usable as a decorator::

        @register_template("MyOp", domain="my.domain", attrs={"alpha": 1.0})
        def my_op(call):
            return f"{call.args[0]} * {call.attrs['alpha']}"
    """
    if layout not in ("plain", "unary", "binary", "axis", "channels_last"):
        raise ConversionError(
            f"layout={layout!r}; supported: 'plain', 'unary', 'binary', 'axis', 'channels_last'"
        )

    def deco(f: Callable[[OpCall], str]) -> Callable[[OpCall], str]:
        registry.unregister(op_type, domain=domain)
        registry.register(op_type, domain=domain, attrs=attrs, layout=layout)(f)
        registry.helpers.update(helpers or {})
        return f

    return deco if fn is None else deco(fn)


def unregister_template(op_type: str, *, domain: str = "") -> None:
    """Remove a user template (the built-in one, if any, applies again)."""
    registry.unregister(op_type, domain=domain)


def find_template(node: ir.Node, opsets: dict[str, int] | None = None) -> Template | None:
    """The template for ``node``: the user's first, then the built-in one; None if neither
    (``opsets``: the model's, for an op whose templates differ by opset)."""
    return registry.find(node, opsets)


class UnsupportedTemplateError(UnsupportedOpError):
    """Ops the Flax emitter has no template for; all listed at once, with how to add one."""

    def __init__(self, missing: list[MissingOp]) -> None:
        super().__init__(
            "flax emitter",
            missing,
            headline=f"the flax emitter has no template for {len(missing)} op type(s):",
            hint="Add a template for each with "
            "xconv.converters.flax.source.templates.register_template(op_type, fn, domain=..., "
            "attrs=...) before converting; fn(call) returns the Python expression for the node.",
        )


# ---------------------------------------------------------------- literals and dtypes

#: numpy's (and ``jax.numpy``'s) dtype names: ``bool_`` where torch has ``bool``.
#: jax.numpy holds the sub-byte types too (through ml_dtypes), and computes with them.
_DTYPES = {
    **ex.DTYPE_NAMES,
    ir.DataType.BOOL: "bool_",
    ir.DataType.INT4: "int4",
    ir.DataType.UINT4: "uint4",
    ir.DataType.INT2: "int2",
    ir.DataType.UINT2: "uint2",
    ir.DataType.FLOAT4E2M1: "float4_e2m1fn",
}


def dtype_expr(dtype: ir.DataType | None, xp: str = "jnp") -> str:
    name = ex.dtype_name(_DTYPES, dtype, "Flax emitter")
    if not hasattr(np, name):  # bfloat16, float8, int4 ...: jnp's are ml_dtypes' (numpy takes them)
        return f"jnp.{name}"
    return f"{xp}.{name}"


def array_literal(a: np.ndarray, *, bare_scalar: bool = False) -> str:
    """A numpy literal for a small constant; a bare Python scalar when allowed."""
    a = np.asarray(a)
    dt = "" if bare_scalar and a.ndim == 0 else dtype_expr(ir.DataType.from_numpy(a.dtype), "np")
    return ex.constructor_literal(a, "np.asarray", dt, bare_scalar=bare_scalar)


def _lead(shape: tuple[int, ...], core: int) -> str:
    """The indexing that gives a ``core``-D array ``shape``'s leading unit axes."""
    extra = len(shape) - core
    return "[" + ", ".join(["None"] * extra) + "]" if extra else ""


def closed_form(a: np.ndarray) -> str | None:
    """A short numpy expression for a constant a person would compute rather than spell out:
    one repeated value (``np.ones((1, 8), dtype=bool)``), a range of integers
    (``np.arange(10, dtype=np.int64)[None]``), a lower-triangular (causal) mask
    (``np.tril(np.ones((8, 8), dtype=bool))[None, None]``); None for anything else."""
    a = np.asarray(a)
    if a.ndim == 0 or a.size < 2 or a.dtype.kind not in "biuf":
        return None
    dt = dtype_expr(ir.DataType.from_numpy(a.dtype), "np")
    dt = "bool" if a.dtype == np.bool_ else dt
    shape = tuple(int(d) for d in a.shape)
    flat = a.reshape(-1)
    if np.all(flat == flat[0]) and not (a.dtype.kind == "f" and np.isnan(flat[0])):
        v = flat[0]
        if a.dtype == np.bool_:
            return f"np.{'ones' if v else 'zeros'}({shape}, dtype=bool)"
        return f"np.full({shape}, {scalar_literal(v)}, dtype={dt})"
    units = [d for d in shape[:-1] if d != 1]
    if a.dtype.kind in "iu" and not units:
        start = int(flat[0])
        if np.array_equal(flat, np.arange(start, start + flat.size, dtype=a.dtype)):
            bounds = f"{start}, {start + flat.size}" if start else f"{flat.size}"
            return f"np.arange({bounds}, dtype={dt}){_lead(shape, 1)}"
    if a.dtype == np.bool_ and a.ndim >= 2 and all(d == 1 for d in shape[:-2]):
        q, k = shape[-2:]
        for diag in range(-q, k + 1):
            if np.array_equal(a.reshape(q, k), np.tril(np.ones((q, k), dtype=bool), diag)):
                off = f", {diag}" if diag else ""
                return f"np.tril(np.ones(({q}, {k}), dtype=bool){off}){_lead(shape, 2)}"
    return None


tuple_literal = int_tuple


# ---------------------------------------------------------------- elementwise

_UNARY = {
    **ex.UNARY,
    "Relu": "jax.nn.relu({0})",
    "Sigmoid": "jax.nn.sigmoid({0})",
    "Erf": "lax.erf({0})",
    "Softplus": "jax.nn.softplus({0})",
    "Softsign": "jax.nn.soft_sign({0})",
    "HardSwish": "jax.nn.hard_swish({0})",
    "Mish": "{0} * jnp.tanh(jax.nn.softplus({0}))",
    "Asin": "{xp}.arcsin({0})",
    "Acos": "{xp}.arccos({0})",
    "Atan": "{xp}.arctan({0})",
    "Asinh": "{xp}.arcsinh({0})",
    "Acosh": "{xp}.arccosh({0})",
    "Atanh": "{xp}.arctanh({0})",
}

for _op, _fmt in _UNARY.items():
    registry.builtin(
        _op,
        layout="unary",
        static_ok=_op in ("Neg", "Abs", "Identity", "Not", "Floor", "Ceil", "Sign", "Sqrt"),
    )(lambda c, _f=_fmt: _f.format(c.args[0], xp=c.xp))


@template("Dropout", layout="unary", seed=None, training_mode=None)
def _dropout(c: OpCall) -> str:
    """A Dropout node outside a recognised layer (those become ``nn.Dropout``): at inference
    (no training_mode input, or a constant false one) the identity, its mask all true."""
    return ex.inference_dropout(c, "jnp.ones(jnp.shape({0}), dtype=bool)")


@template("Gelu", layout="unary", approximate="none")
def _gelu(c: OpCall) -> str:
    approx = c.attrs["approximate"]
    if approx not in ("none", "tanh"):
        raise c.fail(f"approximate={approx!r}; supported: 'none' (erf), 'tanh'")
    return f"jax.nn.gelu({c.args[0]}, approximate={approx == 'tanh'})"


@template("LeakyRelu", layout="unary", alpha=0.01)
def _leaky_relu(c: OpCall) -> str:
    return f"jax.nn.leaky_relu({c.args[0]}, negative_slope={scalar_literal(c.attrs['alpha'])})"


@template("Elu", layout="unary", alpha=1.0)
def _elu(c: OpCall) -> str:
    return f"jax.nn.elu({c.args[0]}, alpha={scalar_literal(c.attrs['alpha'])})"


@template("Selu", layout="unary", alpha=1.67326319217681884765625, gamma=1.05070102214813232421875)
def _selu(c: OpCall) -> str:
    x, a, g = c.args[0], scalar_literal(c.attrs["alpha"]), scalar_literal(c.attrs["gamma"])
    return f"{g} * jnp.where({x} > 0, {x}, {a} * jnp.expm1({x}))"


@template("Celu", layout="unary", alpha=1.0)
def _celu(c: OpCall) -> str:
    alpha = c.attrs["alpha"]
    tail = "" if alpha == 1.0 else f", alpha={scalar_literal(alpha)}"
    return f"jax.nn.celu({c.args[0]}{tail})"


@template("SwiGLU", layout="binary", alpha=1.0)
def _swiglu(c: OpCall) -> str:
    """a * sigmoid(alpha * a) * b."""
    a, b, alpha = c.args[0], c.args[1], c.attrs["alpha"]
    scaled = a if alpha == 1.0 else f"{scalar_literal(alpha)} * {a}"
    return f"{a} * jax.nn.sigmoid({scaled}) * {b}"


@template("Swish", layout="unary", alpha=1.0)
def _swish(c: OpCall) -> str:
    return ex.swish_expr(c, "jax.nn.silu", "jax.nn.sigmoid")


@template("ThresholdedRelu", layout="unary", alpha=1.0)
def _thresholded_relu(c: OpCall) -> str:
    return ex.thresholded_relu_expr(c, "jnp")


@template("Shrink", layout="unary", bias=0.0, lambd=0.5)
def _shrink(c: OpCall) -> str:
    if not c.float_output():
        raise c.fail("Shrink of integers (ONNX computes it in float and casts back)")
    return ex.shrink_expr(c, "jnp")


@template("HardSigmoid", layout="unary", alpha=0.2, beta=0.5)
def _hard_sigmoid(c: OpCall) -> str:
    a, b = scalar_literal(c.attrs["alpha"]), scalar_literal(c.attrs["beta"])
    return f"jnp.clip({a} * {c.args[0]} + {b}, 0, 1)"


@template("IsInf", layout="unary", detect_negative=1, detect_positive=1)
def _isinf(c: OpCall) -> str:
    x = c.args[0]
    if c.attrs["detect_negative"] and c.attrs["detect_positive"]:
        return f"jnp.isinf({x})"
    if c.attrs["detect_positive"]:
        return f"jnp.isposinf({x})"
    return f"jnp.isneginf({x})" if c.attrs["detect_negative"] else f"jnp.zeros_like({x}, bool)"


@template("Clip", layout="unary")
def _clip(c: OpCall) -> str:
    lo = c.args[1] if c.has(1) else "None"
    hi = c.args[2] if c.has(2) else "None"
    return f"{c.xp}.clip({c.args[0]}, {lo}, {hi})"


def _saturated(c: OpCall, to: ir.DataType | None) -> str:
    """The input, clipped into a float8 type's finite range first when the cast saturates
    (ONNX's default; a plain cast overflows to inf / nan as the runtime does not)."""
    x = c.args[0]
    src = c.node.inputs[0].dtype
    if not c.attrs["saturate"] or to not in ex.FLOAT8 or src is None or not src.is_floating_point():
        return x
    hi = scalar_literal(float(ml_dtypes.finfo(to.numpy()).max))
    return f"{c.xp}.clip({x}, -{hi}, {hi})"


registry.helpers["to_e8m0"] = '''
def _to_e8m0(x, saturate=True, round_mode="up"):
    """A cast to float8e8m0 as ONNX rounds it: float32's exponent byte, rounded "up" (by any
    mantissa bit), "down" or to "nearest"; NaN and infinities are NaN (0xFF), and saturating
    keeps the largest exponent (0xFE) from rounding up to it."""
    bits = lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.uint32)
    exponent = (bits >> 23) & 0xFF
    special = exponent == 0xFF
    if round_mode == "nearest":
        up = ((bits & 0x400000) > 0) & (((bits & 0x3FFFFF) > 0) | (exponent > 0))
    elif round_mode == "up":
        up = (bits & 0x7FFFFF) > 0
    else:
        up = jnp.zeros_like(special)
    up = up & ~special
    if saturate:
        up = up & (exponent != 0xFE)
    exponent = jnp.where(special, 0xFF, exponent + up.astype(jnp.uint32))
    return lax.bitcast_convert_type(exponent.astype(jnp.uint8), jnp.float8_e8m0fnu)
'''


def _cast_to(c: OpCall, to: ir.DataType | None, dtype: str) -> str:
    """Input 0 cast to ONNX type ``to`` (``dtype``: its text): float8e8m0 by the
    ``_to_e8m0`` helper (a rounding, not a cast), float8 clipped first when saturating."""
    if to == ir.DataType.FLOAT8E8M0:
        return ex.e8m0_call(c, c.args[0])
    return f"{_saturated(c, to)}.astype({dtype})"


@template("Cast", layout="unary", static_ok=True, to=REQUIRED, saturate=1, round_mode="up")
def _cast(c: OpCall) -> str:
    to = ir.DataType(c.attrs["to"])
    return _cast_to(c, to, dtype_expr(to, c.xp))


@template("BitCast", layout="unary", to=REQUIRED)
def _bit_cast(c: OpCall) -> str:
    dt = dtype_expr(ir.DataType(c.attrs["to"]))
    return ex.bit_cast_expr(c, f"lax.bitcast_convert_type({{}}, {dt})", f"{{}}.astype({dt})")


@template("CastLike", layout="unary", static_ok=True, saturate=1, round_mode="up")
def _cast_like(c: OpCall) -> str:
    return _cast_to(c, c.node.inputs[1].dtype, f"{c.args[1]}.dtype")


for _op, _fmt in ex.BINARY.items():
    registry.builtin(_op, layout="binary", static_ok=True)(
        lambda c, _f=_fmt: _f.format(*c.args, xp=c.xp)
    )


@template("Pow", layout="binary", static_ok=True)
def _pow(c: OpCall) -> str:
    out = f"{c.xp}.power({c.args[0]}, {c.args[1]})"
    return f"{out}.astype({c.dtype()})" if ex.pow_casts(c) else out


@template("BitShift", layout="binary", direction=REQUIRED)
def _bit_shift(c: OpCall) -> str:
    """ONNX shifts unsigned types only, as XLA's logical shifts do: a shift by the width or
    more gives 0."""
    return f"jnp.{ex.shift_direction(c).lower()}_shift({c.args[0]}, {c.args[1]})"


@template("Div", layout="binary", static_ok=True)
def _div(c: OpCall) -> str:
    dt = c.node.outputs[0].dtype
    if dt is not None and dt.is_integer():
        # ONNX integer division truncates toward zero.
        return f"{c.xp}.trunc({c.args[0]} / {c.args[1]}).astype({c.dtype()})"
    return f"{c.args[0]} / {c.args[1]}"


registry.helpers["quant_param"] = '''
def _quant_param(p, x, axis, block_size):
    """A scale or zero point against x: per tensor, per ``axis``, or each entry repeated over
    a block of ``block_size`` along it."""
    if p.size == 1:
        return jnp.reshape(p, ())
    axis %= x.ndim
    if block_size:
        p = jnp.repeat(p, block_size, axis=axis)
        return lax.slice_in_dim(p, 0, x.shape[axis], axis=axis)
    shape = [1] * x.ndim
    shape[axis] = -1
    return jnp.reshape(p, shape)
'''
registry.helpers["dequantize_linear"] = '''
def _dequantize_linear(x, scale, zero_point=None, axis=1, block_size=0):
    """ONNX DequantizeLinear of integers or float8: (x - zero_point) * scale, in scale's dtype."""
    y = x.astype(jnp.float32)
    if zero_point is not None:
        y = y - _quant_param(zero_point, x, axis, block_size).astype(jnp.float32)
    scale = _quant_param(scale, x, axis, block_size)
    return (y * scale).astype(scale.dtype)
'''
registry.helpers["quantize_linear"] = '''
def _quantize_linear(x, scale, zero_point, lo, hi, dtype, axis=1, block_size=0):
    """ONNX QuantizeLinear to integers: x / scale rounded half to even, plus the zero point,
    saturated into [lo, hi]. The division is a true one (XLA would multiply by 1 / scale,
    which moves ties)."""
    scale = _quant_param(scale, x, axis, block_size)
    dt = jnp.promote_types(x.dtype, scale.dtype)
    x, scale = jnp.broadcast_arrays(x.astype(dt), scale.astype(dt))
    y = jnp.rint(lax.div(x, lax.optimization_barrier(scale)))
    if zero_point is not None:
        zero_point = _quant_param(zero_point, x, axis, block_size)
        y = y.astype(jnp.float32) + zero_point.astype(jnp.float32)
    return jnp.clip(y, lo, hi).astype(dtype)
'''


@template("QuantizeLinear", axis=1, saturate=1, block_size=0, output_dtype=0, precision=0)
def _quantize_linear(c: OpCall) -> str:
    return ex.quant_call(c, c.dtype())


@template("DequantizeLinear", axis=1, block_size=0, output_dtype=0)
def _dequantize_linear(c: OpCall) -> str:
    return ex.quant_call(c, c.dtype())


registry.helpers["quantize_float"] = '''
def _quantize_float(x, scale, lo, hi, dtype, zero_point=None, axis=1, block_size=0):
    """ONNX QuantizeLinear to a float8 or float4 type: x / scale (a true division), plus a
    float4 zero point, clipped into [lo, hi] first when saturating."""
    scale = _quant_param(scale, x, axis, block_size)
    dt = jnp.promote_types(x.dtype, scale.dtype)
    x, scale = jnp.broadcast_arrays(x.astype(dt), scale.astype(dt))
    y = lax.div(x, lax.optimization_barrier(scale))
    if zero_point is not None:
        y = y + _quant_param(zero_point, x, axis, block_size).astype(y.dtype)
    if lo is not None:
        y = jnp.clip(y.astype(jnp.float32), lo, hi)
    return y.astype(dtype)
'''


registry.helpers["dynamic_quantize_linear"] = """
def _dynamic_quantize_linear(x):
    \"\"\"ONNX DynamicQuantizeLinear: x as uint8 over its range widened to include 0, with that
    scale and zero point (true divisions: XLA would multiply by 1 / scale).\"\"\"
    xf = x.astype(jnp.float32)
    hi = jnp.maximum(jnp.max(xf, initial=0.0), 0.0)
    lo = jnp.minimum(jnp.min(xf, initial=0.0), 0.0)
    scale = jnp.where(hi == lo, 1.0, hi - lo) / 255.0
    zero_point = jnp.rint(jnp.clip(0.0 - lax.div(lo, lax.optimization_barrier(scale)), 0, 255))
    xf, scales = jnp.broadcast_arrays(xf, scale)
    y = jnp.clip(jnp.rint(lax.div(xf, lax.optimization_barrier(scales))) + zero_point, 0, 255)
    return y.astype(jnp.uint8), scale.astype(x.dtype), zero_point.astype(jnp.uint8)
"""
registry.helpers["matmul_integer"] = """
def _matmul_integer(a, b, a_zero_point=None, b_zero_point=None):
    \"\"\"ONNX MatMulInteger: (a - a_zero_point) @ (b - b_zero_point) in int32; a's zero point
    per row has shape [M].\"\"\"
    a, b = a.astype(jnp.int32), b.astype(jnp.int32)
    if a_zero_point is not None:
        zp = a_zero_point.astype(jnp.int32)
        a = a - (jnp.reshape(zp, (-1, 1)) if zp.size > 1 else zp)
    if b_zero_point is not None:
        b = b - b_zero_point.astype(jnp.int32)
    return jnp.matmul(a, b, preferred_element_type=jnp.int32)
"""
registry.helpers["requantize"] = """
def _requantize(acc, factor, zero_point):
    \"\"\"An int32 accumulator (QLinearMatMul's, QLinearConv's) rescaled by ``factor``, rounded
    half to even, plus the output's zero point, saturated into its type.\"\"\"
    y = jnp.rint(acc.astype(jnp.float32) * factor.astype(jnp.float32))
    info = jnp.iinfo(zero_point.dtype)
    y = jnp.clip(y + zero_point.astype(jnp.float32), info.min, info.max)
    return y.astype(zero_point.dtype)
"""
registry.helpers["zero_shifted"] = """
def _zero_shifted(x, zero_point=None):
    \"\"\"x - zero_point in int32; a zero point of several entries is per output channel.\"\"\"
    x = x.astype(jnp.int32)
    if zero_point is None:
        return x
    zero_point = zero_point.astype(jnp.int32)
    if zero_point.size > 1:
        zero_point = jnp.reshape(zero_point, (-1,) + (1,) * (x.ndim - 1))
    return x - zero_point
"""


for _op in ("DynamicQuantizeLinear", "MatMulInteger", "QLinearMatMul"):
    registry.builtin(_op)(ex.integer_product_call)


registry.builtin("Mod", attrs={"fmod": 0}, layout="binary")(lambda c: ex.mod_expr(c, c.xp))
registry.builtin("Where", layout="binary", static_ok=True)(lambda c: ex.where_expr(c, c.xp))


@template("PRelu", layout="binary")
def _prelu(c: OpCall) -> str:
    x, s = c.args
    shape = ex.prelu_slope(c)  # opset < 7: a per-channel slope [C] against NC...
    if shape is not None and c.perm is not None:
        raise c.fail("a per-channel (opset < 7) PRelu slope in a channels-last layout")
    s = s if shape is None else f"jnp.reshape({s}, {shape})"
    return f"jnp.where({x} >= 0, {x}, {s} * {x})"


def _variadic(fn: str) -> Callable[[OpCall], str]:
    return lambda c: ex.variadic(c, f"{c.xp}.{fn}")


for _op, _fn in (("Max", "maximum"), ("Min", "minimum")):
    registry.builtin(_op, layout="binary", static_ok=True)(_variadic(_fn))
registry.builtin("Sum", layout="binary", static_ok=True)(ex.sum_expr)
registry.builtin("Mean", layout="binary")(ex.mean_expr)


# ---------------------------------------------------------------- linear algebra

registry.builtin("MatMul")(ex.matmul_expr)
registry.builtin("Gemm", attrs=ex.GEMM_ATTRS)(ex.gemm_expr)


@template("Einsum", equation=REQUIRED)
def _einsum(c: OpCall) -> str:
    return f"jnp.einsum({c.attrs['equation']!r}, {', '.join(c.args)})"


# The op families register into ``registry`` on import (they import it from this module).
from xconv.converters.flax.source import (  # noqa: E402
    helpers,
    templates_attention,
    templates_control,
    templates_conv,
    templates_detection,
    templates_ml,
    templates_norm,
    templates_recurrent,
    templates_resize,
    templates_rnn,
    templates_scatter,
    templates_select,
    templates_sequence,
    templates_shape,
    templates_signal,
    templates_softmax,
    templates_strings,
)

del helpers, templates_attention, templates_control, templates_conv, templates_detection
del templates_norm, templates_recurrent, templates_resize, templates_rnn, templates_scatter
del templates_select, templates_sequence, templates_shape, templates_signal, templates_softmax
del templates_strings
del templates_ml
