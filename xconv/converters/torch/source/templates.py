"""Per-op source templates for the PyTorch source emitter: one torch expression per ONNX node.

A template receives an :class:`OpCall` (argument expressions, constant values, static input
shapes, parsed attributes) and returns the expression computing the node's output(s) (a tuple
expression for several outputs). Node groups recognised as layers never reach these
templates; they become ``torch.nn`` layers. The IR is channels-first like torch, so no layout
bookkeeping is needed here (unlike ``xconv/converters/flax/source/templates.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import onnx_ir as ir

from xconv.converters import expressions as ex
from xconv.converters.codegen import TemplateCall, scalar_literal
from xconv.converters.registry import REQUIRED, Handler, TemplateRegistry
from xconv.errors import UnsupportedAttributeError

INT64_MAX = np.iinfo(np.int64).max


@dataclass
class OpCall(TemplateCall):
    """What a template sees for one node."""

    emitter: ClassVar[str] = "PyTorch source emitter"
    #: Generated helper functions the expression calls (``registry.helpers``' names).
    helpers: set[str] = field(default_factory=set)
    #: The node moves float4e2m1 codes as uint8 (:data:`FLOAT4_VALUES`): its float4 outputs'
    #: type is written ``torch.uint8``.
    float4_codes: bool = False

    def ints(self, i: int) -> str:
        """Input ``i`` as a Python int list: a literal when constant, else ``.tolist()``."""
        c = self.consts[i] if i < len(self.consts) else None
        if c is not None:
            return "[" + ", ".join(str(int(v)) for v in np.asarray(c).reshape(-1)) + "]"
        return f"{self.args[i]}.tolist()"

    def dtype(self, index: int = 0) -> str:
        dtype = self.node.outputs[index].dtype
        if self.float4_codes and dtype == ir.DataType.FLOAT4E2M1:
            return "torch.uint8"
        return dtype_expr(dtype)


@dataclass(frozen=True)
class Template(Handler):
    """A registered template: ``fn(call) -> source expression``."""

    #: Constant inputs are written as bare scalars when 0-d (elementwise ops).
    bare: bool = False


#: The PyTorch source emitter's templates; users add or replace one with :func:`register`
#: (``fn(call) -> source expression``, see :class:`OpCall`), which wins over the built-in.
registry = TemplateRegistry(
    "torch source", module="xconv.converters.torch.source.templates", handler_class=Template
)
register = registry.register


def template(*ops: str, bare: bool = False, **attrs: Any):
    def deco(fn: Callable[[OpCall], str]) -> Callable[[OpCall], str]:
        for op in ops:
            registry.builtin(op, attrs=attrs, bare=bare)(fn)
        return fn

    return deco


# ---------------------------------------------------------------- literals and dtypes


#: torch names the sub-byte integer types too (it computes with none of them), and holds
#: float4e2m1 in ``float4_e2m1fn_x2`` one code a byte, as the torch runtime does (torch's one
#: float4 type packs two; it computes nothing in it, see :data:`FLOAT4_VALUES`).
_DTYPES = {
    **ex.DTYPE_NAMES,
    **{t: t.name.lower() for t in ex.SUB_BYTE},
    ir.DataType.FLOAT4E2M1: "float4_e2m1fn_x2",
}

#: The ops whose templates read float4e2m1 as values (``_float4_values``) and write it by
#: rounding (``_to_float4``). Any other op moves a float4 tensor's codes as uint8 (the
#: emitter views it so and its float4 outputs back), but for those torch runs on the type
#: itself: views, and a control-flow node's subgraph, which takes the tensors as they are.
FLOAT4_VALUES = frozenset({"Cast", "CastLike", "QuantizeLinear", "DequantizeLinear"})
FLOAT4_AS_IS = frozenset(
    {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Shape", "Size"}
    | {"If", "Loop", "Scan"}
)


def dtype_expr(dtype: ir.DataType | None) -> str:
    return f"torch.{ex.dtype_name(_DTYPES, dtype, 'PyTorch source emitter')}"


#: Wide unsigned types: torch has CPU kernels for few of their elementwise ops (2.x: no add,
#: sub, div, comparison, max / min, abs); the written code computes these in int64.
WIDE_UNSIGNED = frozenset({ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64})
#: The elementwise ops computed so: int64 holds every uint16 / uint32 value, and for uint64 it
#: gives the same bits under +, -, * and == (modular); the others order values or divide.
WIDENED_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Mod", "Max", "Min", "Sum", "Abs", "Clip"}
    | {"Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal"}
    | {"BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot"}
)
_BITWISE_UINT64 = frozenset(
    {"Add", "Sub", "Mul", "Sum", "Equal", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot"}
)


def widened(node: ir.Node) -> bool:
    """Whether ``node`` is written over its inputs cast to int64 (and its output cast back):
    an op of :data:`WIDENED_OPS` on a wide unsigned type. Raises where int64 does not give
    uint64's result (ordering or dividing values from 2**63)."""
    types = {v.dtype for v in node.inputs if v is not None} & WIDE_UNSIGNED
    if node.op_type not in WIDENED_OPS or not types:
        return False
    if ir.DataType.UINT64 in types and node.op_type not in _BITWISE_UINT64:
        raise UnsupportedAttributeError(
            f"{node.op_type} of uint64: torch has no kernel for it, and int64 orders and "
            "divides values from 2**63 otherwise",
            op=node.op_type,
            node=node.name,
        )
    return True


def tensor_literal(a: np.ndarray, *, bare_scalar: bool = False) -> str:
    """A torch literal for a small constant; a bare Python scalar when allowed."""
    a = np.asarray(a)
    dt = "" if bare_scalar and a.ndim == 0 else dtype_expr(ir.DataType.from_numpy(a.dtype))
    return ex.constructor_literal(a, "torch.tensor", dt, bare_scalar=bare_scalar)


# ---------------------------------------------------------------- elementwise

_UNARY = {
    **ex.with_namespace(ex.UNARY, "torch"),
    "Relu": "torch.relu({0})",
    "Sigmoid": "torch.sigmoid({0})",
    "Erf": "torch.erf({0})",
    "Softplus": "F.softplus({0})",
    "Softsign": "F.softsign({0})",
    "HardSwish": "F.hardswish({0})",
    "Mish": "F.mish({0})",
    "Asin": "torch.asin({0})",
    "Acos": "torch.acos({0})",
    "Atan": "torch.atan({0})",
    "Asinh": "torch.asinh({0})",
    "Acosh": "torch.acosh({0})",
    "Atanh": "torch.atanh({0})",
}


def _unary(fmt: str) -> Callable[[OpCall], str]:
    return lambda c: fmt.format(c.args[0])


for _op, _fmt in _UNARY.items():
    registry.builtin(_op)(_unary(_fmt))


@template("Dropout", seed=None, training_mode=None)
def _dropout(c: OpCall) -> str:
    return ex.inference_dropout(c, "torch.ones_like({0}, dtype=torch.bool)")


@template("Gelu", approximate="none")
def _gelu(c: OpCall) -> str:
    a = c.attrs["approximate"]
    if a not in ("none", "tanh"):
        raise c.fail(f"approximate={a!r}; supported: 'none', 'tanh'")
    return f"F.gelu({c.args[0]})" if a == "none" else f'F.gelu({c.args[0]}, approximate="tanh")'


@template("LeakyRelu", alpha=0.01)
def _leaky(c: OpCall) -> str:
    return f"F.leaky_relu({c.args[0]}, {scalar_literal(c.attrs['alpha'])})"


@template("Elu", alpha=1.0)
def _elu(c: OpCall) -> str:
    return f"F.elu({c.args[0]}, {scalar_literal(c.attrs['alpha'])})"


@template("Selu", alpha=1.67326319217681884765625, gamma=1.05070102214813232421875)
def _selu(c: OpCall) -> str:
    a, g = c.attrs["alpha"], c.attrs["gamma"]
    if np.float32(a) == np.float32(1.6732632) and np.float32(g) == np.float32(1.0507010):
        return f"torch.selu({c.args[0]})"
    x = c.args[0]
    return (
        f"{scalar_literal(g)} * torch.where({x} > 0, {x}, "
        f"{scalar_literal(a)} * (torch.exp({x}) - 1))"
    )


@template("Celu", alpha=1.0)
def _celu(c: OpCall) -> str:
    alpha = c.attrs["alpha"]
    return (
        f"F.celu({c.args[0]})" if alpha == 1.0 else f"F.celu({c.args[0]}, {scalar_literal(alpha)})"
    )


@template("SwiGLU", alpha=1.0)
def _swiglu(c: OpCall) -> str:
    """a * sigmoid(alpha * a) * b."""
    a, b, alpha = c.args[0], c.args[1], c.attrs["alpha"]
    scaled = a if alpha == 1.0 else f"{scalar_literal(alpha)} * {a}"
    return f"{a} * torch.sigmoid({scaled}) * {b}"


@template("Swish", alpha=1.0)
def _swish(c: OpCall) -> str:
    return ex.swish_expr(c, "F.silu", "torch.sigmoid")


@template("ThresholdedRelu", alpha=1.0)
def _thresholded_relu(c: OpCall) -> str:
    return f"F.threshold({c.args[0]}, {scalar_literal(c.attrs['alpha'])}, 0.0)"


@template("Shrink", bias=0.0, lambd=0.5)
def _shrink(c: OpCall) -> str:
    dtype = c.node.outputs[0].dtype
    if dtype is None or not dtype.is_floating_point():
        raise c.fail("Shrink of integers (ONNX computes it in float and casts back)")
    lambd, bias = c.attrs["lambd"], c.attrs["bias"]
    if bias == 0.0:
        return f"F.hardshrink({c.args[0]}, {scalar_literal(lambd)})"
    if bias == lambd:
        return f"F.softshrink({c.args[0]}, {scalar_literal(lambd)})"
    return ex.shrink_expr(c, "torch")


@template("IsInf", detect_negative=1, detect_positive=1)
def _isinf(c: OpCall) -> str:
    x, neg, pos = c.args[0], c.attrs["detect_negative"], c.attrs["detect_positive"]
    if neg and pos:
        return f"torch.isinf({x})"
    if pos:
        return f"torch.isposinf({x})"
    return f"torch.isneginf({x})" if neg else f"torch.zeros_like({x}, dtype=torch.bool)"


@template("HardSigmoid", alpha=0.2, beta=0.5)
def _hard_sigmoid(c: OpCall) -> str:
    a, b = scalar_literal(c.attrs["alpha"]), scalar_literal(c.attrs["beta"])
    return f"torch.clamp({a} * {c.args[0]} + {b}, 0, 1)"


@template("Clip")
def _clip(c: OpCall) -> str:
    lo = c.args[1] if c.has(1) else "None"
    hi = c.args[2] if c.has(2) else "None"
    for i in (1, 2):
        if c.has(i) and c.consts[i] is not None:
            v = scalar_literal(np.asarray(c.consts[i]).reshape(())[()])
            lo, hi = (v, hi) if i == 1 else (lo, v)
    if lo == "None" and hi == "None":  # torch.clamp needs one bound
        return c.args[0]
    if lo == "0" or lo == "0.0":
        if hi in ("6", "6.0"):
            return f"F.relu6({c.args[0]})"
        if hi == "None":
            return f"torch.relu({c.args[0]})"
    return f"torch.clamp({c.args[0]}, {lo}, {hi})"


def _saturated(c: OpCall, to: ir.DataType | None) -> str:
    """The input, clipped into a float8 type's finite range first when the cast saturates
    (ONNX's default; a plain cast overflows to inf / nan as the runtime does not)."""
    x = c.args[0]
    src = c.node.inputs[0].dtype
    if to not in ex.FLOAT8 or src is None or not src.is_floating_point():
        return x
    hi = scalar_literal(float(ml_dtypes.finfo(to.numpy()).max))
    if c.attrs["saturate"]:
        return f"torch.clamp({x}.float(), -{hi}, {hi})"
    if to == ir.DataType.FLOAT8E5M2:  # has infinities: torch's cast overflows to them
        return x
    # No infinities: ONNX makes overflow NaN, where torch's cast would saturate.
    return f'torch.where({x}.float().abs() > {hi}, float("nan"), {x}.float())'


def _byte_type(dtype: ir.DataType) -> str:
    """The torch type a sub-byte integer type's values are held in, one per byte."""
    return "torch.int8" if dtype in (ir.DataType.INT4, ir.DataType.INT2) else "torch.uint8"


def _byte_view(c: OpCall, i: int = 0) -> str:
    """Input ``i``, viewed as its byte type where it is a sub-byte integer tensor (torch
    neither copies nor computes with those; the emitter's constants already hold int8)."""
    dtype = c.node.inputs[i].dtype
    if dtype not in ex.SUB_BYTE:
        return c.args[i]
    return f"{c.args[i]}.view({_byte_type(dtype)})"


registry.helpers["sub_byte"] = '''
def _sub_byte(x, dtype, lo, hi):
    """A cast to a sub-byte integer type as the ONNX reference's: a float truncated (0 out of
    range and for NaN), an integer wrapped around; held one value per byte as torch's dtype."""
    if x.is_floating_point():
        t = torch.trunc(x)
        v = torch.where((t >= lo) & (t <= hi), t, torch.zeros_like(t)).to(torch.int32)
    else:
        v = (x.to(torch.int32) - lo) % (hi - lo + 1) + lo
    return v.to(torch.int8 if lo < 0 else torch.uint8).view(dtype)
'''


registry.helpers["float4_values"] = '''
def _float4_values(x):
    """float4e2m1 codes (one a byte, in torch.float4_e2m1fn_x2) as float32 values: bit 3 is
    the sign, bits 0-2 index the magnitudes."""
    codes = x.view(torch.uint8).to(torch.int64)
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=x.device)
    return torch.where((codes & 8) != 0, -magnitudes[codes & 7], magnitudes[codes & 7])
'''
registry.helpers["to_float4"] = '''
def _to_float4(x):
    """x rounded to float4e2m1 as ml_dtypes (and ONNX's reference) rounds: to the nearest
    value, a tie to the even code; past 6 and infinities to 6, NaN to the zero of the
    opposite sign. One code a byte in torch.float4_e2m1fn_x2, which torch computes nothing in."""
    negative = torch.signbit(x) ^ x.isnan()  # (before float32: torch's drops a NaN's sign)
    x = x if x.dtype == torch.float64 else x.to(torch.float32)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=x.dtype, device=x.device)
    a = x.abs()
    # the midpoints below |x|; on 0.75, 1.75 or 3.5 the even code is the one above
    code = torch.bucketize(a, mids) + torch.isin(a, mids[1::2])
    code = torch.where(x.isnan(), 0, code)
    return (code + 8 * negative).to(torch.uint8).view(torch.float4_e2m1fn_x2)
'''


registry.helpers["to_e8m0"] = '''
def _to_e8m0(x, saturate=True, round_mode="up"):
    """A cast to float8e8m0 as ONNX rounds it: float32's exponent byte, rounded "up" (by any
    mantissa bit), "down" or to "nearest"; NaN and infinities are NaN (0xFF), and saturating
    keeps the largest exponent (0xFE) from rounding up to it."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exponent = (bits >> 23) & 0xFF
    special = exponent == 0xFF
    if round_mode == "nearest":
        up = ((bits & 0x400000) > 0) & (((bits & 0x3FFFFF) > 0) | (exponent > 0))
    elif round_mode == "up":
        up = (bits & 0x7FFFFF) > 0
    else:
        up = torch.zeros_like(special)
    up = up & ~special
    if saturate:
        up = up & (exponent != 0xFE)
    exponent = torch.where(special, 0xFF, exponent + up.to(torch.int64))
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)
'''


def _float4_values(c: OpCall, i: int) -> str:
    """Input ``i`` as its values where it is float4e2m1 (torch casts nothing from it)."""
    if c.node.inputs[i].dtype != ir.DataType.FLOAT4E2M1:
        return c.args[i]
    c.helpers.add("float4_values")
    return f"_float4_values({c.args[i]})"


def _cast_to(c: OpCall, to: ir.DataType | None, dtype: str) -> str:
    """Input 0 cast to ONNX type ``to`` (``dtype``: its torch text): float4e2m1 read as its
    values and written rounded, float8e8m0 rounded, the sub-byte integers held as bytes."""
    float4 = c.node.inputs[0].dtype == ir.DataType.FLOAT4E2M1
    x = _float4_values(c, 0) if float4 else _byte_view(c)
    if to == ir.DataType.FLOAT4E2M1:
        c.helpers.add("to_float4")
        return f"_to_float4({x})"
    if to == ir.DataType.FLOAT8E8M0:
        return ex.e8m0_call(c, x)
    if to in ex.SUB_BYTE:
        c.helpers.add("sub_byte")
        lo, hi = ex.QUANT_INT[to]
        return f"_sub_byte({x}, {dtype}, {lo}, {hi})"
    if float4 and to == ir.DataType.FLOAT:
        return x  # _float4_values gives float32
    if x != c.args[0]:
        return f"{x}.to({dtype})"
    return f"{_saturated(c, to)}.to({dtype})"


@template("Cast", to=REQUIRED, saturate=1, round_mode="up")
def _cast(c: OpCall) -> str:
    to = ir.DataType(c.attrs["to"])
    return _cast_to(c, to, dtype_expr(to))


@template("BitCast", to=REQUIRED)
def _bit_cast(c: OpCall) -> str:
    if ir.DataType.FLOAT4E2M1 in (c.node.inputs[0].dtype, ir.DataType(c.attrs["to"])):
        raise c.fail("BitCast of float4e2m1 (held one code a byte, as the torch runtime does)")
    dt = dtype_expr(ir.DataType(c.attrs["to"]))
    return ex.bit_cast_expr(c, f"{{}}.view({dt})", f"{{}}.to({dt})")


@template("CastLike", saturate=1, round_mode="up")
def _cast_like(c: OpCall) -> str:
    return _cast_to(c, c.node.inputs[1].dtype, f"{c.args[1]}.dtype")


_BINARY = {**ex.with_namespace(ex.BINARY, "torch"), "Pow": "torch.pow({0}, {1})"}


#: ``torch.logical_and`` and its kin take tensors only; with a Python ``True`` / ``False`` (a
#: folded 0-d constant, e.g. the ``True`` of a vmapped mask function) they are written with the
#: operator, which is the same op on the bool tensors ONNX allows.
_LOGICAL_OPERATORS = {"And": "&", "Or": "|", "Xor": "^"}


def _paren(expr: str) -> str:
    return f"({expr})" if " " in expr and not expr.startswith("torch.") else expr


def _binary(fmt: str, op: str) -> Callable[[OpCall], str]:
    def fn(c: OpCall) -> str:
        a, b = c.args[0], c.args[1]
        if op in _LOGICAL_OPERATORS and {a, b} & {"True", "False"}:
            if a in ("True", "False"):
                a, b = b, a  # the tensor first: ``x & True``
            return f"{_paren(a)} {_LOGICAL_OPERATORS[op]} {b}"
        # A Python scalar on the left has no ``torch.pow(2.0, x)`` problem but needs parens
        # when the right operand is an expression.
        return fmt.format(a, _paren(b))

    return fn


for _op, _fmt in _BINARY.items():
    if _op != "Pow":
        registry.builtin(_op, bare=True)(_binary(_fmt, _op))


@template("Pow", bare=True)
def _pow(c: OpCall) -> str:
    out = _binary(_BINARY["Pow"], "Pow")(c)
    return f"{out}.to({c.dtype()})" if ex.pow_casts(c) else out


@template("Div", bare=True)
def _div(c: OpCall) -> str:
    dt = c.node.outputs[0].dtype
    if dt is not None and not dt.is_floating_point():
        return f'torch.div({c.args[0]}, {c.args[1]}, rounding_mode="trunc")'
    return f"{c.args[0]} / {c.args[1]}"


registry.helpers["bit_shift"] = '''
def _bit_shift(x, y, left):
    """ONNX BitShift of ``x`` by ``y`` bits, computed in int64 (torch has no shift kernels for
    uint16/32/64 and promotes uint8's) and wrapped back to x's width: a shift by the width or
    more gives 0, or -1 for a negative x shifted right."""
    dtype, bits = x.dtype, torch.iinfo(x.dtype).bits
    x, y = x.to(torch.int64), y.to(torch.int64)
    kept = (y >= 0) & (y < bits)
    y = torch.where(kept, y, 0)
    if left:
        return torch.where(kept, x << y, 0).to(dtype)
    out = x >> y
    if bits == 64 and not dtype.is_signed:  # logical: >> copies int64's sign bit down
        out = out & ~((-1 << (63 - y)) << 1)
    fill = torch.where(x < 0, -1, 0) if dtype.is_signed else 0
    return torch.where(kept, out, fill).to(dtype)
'''


@template("BitShift", direction=REQUIRED)
def _bit_shift(c: OpCall) -> str:
    left = ex.shift_direction(c) == "LEFT"
    c.helpers.add("bit_shift")
    return f"_bit_shift({c.args[0]}, {c.args[1]}, left={left})"


registry.helpers["quant_param"] = '''
def _quant_param(p, x, axis, block_size):
    """A scale or zero point against x: per tensor, per ``axis``, or each entry repeated over
    a block of ``block_size`` along it."""
    if p.numel() == 1:
        return p.reshape(())
    axis %= x.dim()
    if block_size:
        return p.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x.shape[axis])
    shape = [1] * x.dim()
    shape[axis] = -1
    return p.reshape(shape)
'''
registry.helpers["dequantize_linear"] = '''
def _dequantize_linear(x, scale, zero_point=None, axis=1, block_size=0):
    """ONNX DequantizeLinear of integers or float8: (x - zero_point) * scale, in scale's dtype."""
    y = x.to(torch.float32)
    if zero_point is not None:
        y = y - _quant_param(zero_point, x, axis, block_size).to(torch.float32)
    scale = _quant_param(scale, x, axis, block_size)
    return (y * scale).to(scale.dtype)
'''
registry.helpers["quantize_linear"] = '''
def _quantize_linear(x, scale, zero_point, lo, hi, dtype, axis=1, block_size=0):
    """ONNX QuantizeLinear to integers: x / scale rounded half to even, plus the zero point,
    saturated into [lo, hi]."""
    scale = _quant_param(scale, x, axis, block_size)
    dt = torch.promote_types(x.dtype, scale.dtype)
    y = torch.round(x.to(dt) / scale.to(dt))
    if zero_point is not None:
        zero_point = _quant_param(zero_point, x, axis, block_size)
        y = y.to(torch.float32) + zero_point.to(torch.float32)
    return y.clamp(lo, hi).to(dtype)
'''


registry.helpers["quantize_float"] = '''
def _quantize_float(x, scale, lo, hi, dtype, axis=1, block_size=0):
    """ONNX QuantizeLinear to a float8 type: x / scale, clipped into [lo, hi] first when
    saturating (its zero point is ignored)."""
    scale = _quant_param(scale, x, axis, block_size)
    dt = torch.promote_types(x.dtype, scale.dtype)
    y = x.to(dt) / scale.to(dt)
    if lo is not None:
        y = y.float().clamp(lo, hi)
    return y.to(dtype)
'''


registry.helpers["quantize_float4"] = '''
def _quantize_float4(x, scale, zero_point=None, axis=1, block_size=0):
    """ONNX QuantizeLinear to float4e2m1: x / scale plus the zero point's value, rounded
    (saturating) by _to_float4."""
    scale = _quant_param(scale, x, axis, block_size)
    dt = torch.promote_types(x.dtype, scale.dtype)
    y = x.to(dt) / scale.to(dt)
    if zero_point is not None:
        y = y + _quant_param(zero_point, x, axis, block_size).to(dt)
    return _to_float4(y)
'''


registry.helpers["dynamic_quantize_linear"] = """
def _dynamic_quantize_linear(x):
    \"\"\"ONNX DynamicQuantizeLinear: x as uint8 over its range widened to include 0, with that
    scale and zero point.\"\"\"
    xf = x.float()
    zero = xf.new_zeros(())
    hi = torch.maximum(xf.max(), zero) if xf.numel() else zero
    lo = torch.minimum(xf.min(), zero) if xf.numel() else zero
    scale = torch.where(hi == lo, 1.0, hi - lo) / 255.0
    zero_point = torch.round(torch.clamp(0.0 - lo / scale, 0, 255))
    y = torch.clamp(torch.round(xf / scale) + zero_point, 0, 255)
    return y.to(torch.uint8), scale.to(x.dtype), zero_point.to(torch.uint8)
"""
registry.helpers["matmul_integer"] = """
def _matmul_integer(a, b, a_zero_point=None, b_zero_point=None):
    \"\"\"ONNX MatMulInteger: (a - a_zero_point) @ (b - b_zero_point) as int32, computed in
    float64 (exact for 8-bit data; torch lacks integer matmul kernels on most devices); a's
    zero point per row has shape [M].\"\"\"
    a, b = a.to(torch.float64), b.to(torch.float64)
    if a_zero_point is not None:
        zp = a_zero_point.to(torch.float64)
        a = a - (zp.reshape(-1, 1) if zp.numel() > 1 else zp)
    if b_zero_point is not None:
        b = b - b_zero_point.to(torch.float64)
    return (a @ b).to(torch.int32)
"""
registry.helpers["requantize"] = """
def _requantize(acc, factor, zero_point):
    \"\"\"An integer accumulator (QLinearMatMul's, QLinearConv's) rescaled by ``factor``,
    rounded half to even, plus the output's zero point, saturated into its type.\"\"\"
    y = torch.round(acc.float() * factor.float()) + zero_point.float()
    info = torch.iinfo(zero_point.dtype)
    return torch.clamp(y, info.min, info.max).to(zero_point.dtype)
"""
registry.helpers["zero_shifted"] = """
def _zero_shifted(x, zero_point=None):
    \"\"\"x - zero_point in float64 (exact for 8-bit data: torch lacks integer convolution
    kernels); a zero point of several entries is per output channel.\"\"\"
    x = x.to(torch.float64)
    if zero_point is None:
        return x
    zero_point = zero_point.to(torch.float64)
    if zero_point.numel() > 1:
        zero_point = zero_point.reshape((-1,) + (1,) * (x.dim() - 1))
    return x - zero_point
"""


for _op in ("DynamicQuantizeLinear", "MatMulInteger", "QLinearMatMul"):
    registry.builtin(_op)(ex.integer_product_call)


@template("QuantizeLinear", axis=1, saturate=1, block_size=0, output_dtype=0, precision=0)
def _quantize_linear(c: OpCall) -> str:
    target = c.node.outputs[0].dtype
    if target == ir.DataType.FLOAT4E2M1:  # rounded by _to_float4; a zero point read as values
        c.helpers.add("to_float4")
        args = [_float4_values(c, i) if i == 2 and c.has(i) else a for i, a in enumerate(c.args)]
        return ex.quant_call(replace(c, args=args), c.dtype(), float4="quantize_float4")
    if target not in ex.SUB_BYTE:
        return ex.quant_call(c, c.dtype())
    # Into the byte type, viewed as torch's sub-byte one (it neither copies nor computes).
    args = [_byte_view(c, i) if i == 2 and c.has(i) else a for i, a in enumerate(c.args)]
    call = ex.quant_call(replace(c, args=args), _byte_type(target))
    return f"{call}.view({dtype_expr(target)})"


@template("DequantizeLinear", axis=1, block_size=0, output_dtype=0)
def _dequantize_linear(c: OpCall) -> str:
    args = [_byte_view(c, i) if i != 1 and c.has(i) else a for i, a in enumerate(c.args)]
    args[0] = _float4_values(replace(c, args=args), 0)
    return ex.quant_call(replace(c, args=args), c.dtype())


registry.builtin("Mod", attrs={"fmod": 0}, bare=True)(lambda c: ex.mod_expr(c, "torch"))
registry.builtin("Where")(lambda c: ex.where_expr(c, "torch"))


@template("PRelu")
def _prelu(c: OpCall) -> str:
    x, s = c.args[0], _prelu_slope(c)
    return f"torch.where({x} >= 0, {x}, {x} * {s})"


def _prelu_slope(c: OpCall) -> str:
    """PRelu's slope, reshaped where it broadcasts to X only as opset < 7 aligns it."""
    shape = ex.prelu_slope(c)
    return c.args[1] if shape is None else f"{c.args[1]}.reshape{shape}"


def _variadic(fn: str) -> Callable[[OpCall], str]:
    return lambda c: ex.variadic(c, fn)


def _max(c: OpCall) -> str:
    """``torch.relu(x)`` for ``Max(x, 0)`` (how JAX traces ``nn.relu``), else ``maximum``."""
    if len(c.args) == 2:
        for i in (0, 1):
            z, x = c.consts[1 - i], c.shapes[i]
            zero = z is not None and z.size == 1 and not z.any()
            if zero and x is not None and z.ndim <= len(x) and c.consts[i] is None:
                return f"torch.relu({c.args[i]})"
    return _variadic("torch.maximum")(c)


registry.builtin("Max")(_max)
registry.builtin("Min")(_variadic("torch.minimum"))


registry.builtin("Sum")(ex.sum_expr)
registry.builtin("Mean")(ex.mean_expr)


# ---------------------------------------------------------------- linear algebra

registry.builtin("MatMul")(ex.matmul_expr)


@template("Gemm", **ex.GEMM_ATTRS)
def _gemm(c: OpCall) -> str:
    if not c.attrs["transA"] and c.attrs["transB"] and c.attrs["alpha"] == c.attrs["beta"] == 1.0:
        bias = f", {c.args[2]}" if c.has(2) else ""
        return f"F.linear({c.args[0]}, {c.args[1]}{bias})"
    return ex.gemm_expr(c)


@template("Einsum", equation=REQUIRED)
def _einsum(c: OpCall) -> str:
    return f'torch.einsum("{c.attrs["equation"]}", {", ".join(a for a in c.args if a)})'


# The op families register into ``registry`` on import (they import it from this module).
from xconv.converters.torch.source import (  # noqa: E402
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

del templates_attention, templates_control, templates_conv, templates_detection
del templates_norm, templates_recurrent, templates_resize, templates_rnn, templates_scatter
del templates_select, templates_sequence, templates_shape, templates_signal, templates_softmax
del templates_strings
del templates_ml
