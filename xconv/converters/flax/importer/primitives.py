"""jaxpr primitive handlers: each lax primitive becomes ONNX ops (opset ``xconv.ir.OPSET``).

A handler is ``fn(ctx, eqn, inputs) -> list of output values``; ``inputs`` are the IR values
of ``eqn.invars``. Handlers live in ``registry`` keyed by primitive name (domain ``jax``);
``register`` adds or overrides one (a user registration wins over the built-in one).
Call-like primitives (``jit``, ``custom_jvp_call``, ``scan``, ``cond``) translate their
sub-jaxprs through ``ctx.inline``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.flax.importer.symbolic import (
    as_dims,
    dim_value,
    dims,
    expand_target,
    is_static,
    require_static,
    reshape_target,
    shape_value,
    static_dim,
)
from xconv.converters.registry import Registry
from xconv.errors import ConversionError

Handler = Callable[[Any, Any, list], list]

#: The domain primitive handlers are registered under (primitive names are the op types).
DOMAIN = "jax"

#: The primitive handlers: built-in ones, and users' (:func:`register`), which win.
registry = Registry("flax frontend", module=__name__, name_chars="_-")

#: Primitives whose sub-jaxpr is translated inline (the call itself leaves no node).
CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
INLINE = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "remat",
        "checkpoint",
        "named_call",
    }
)


def builtin(*names: str) -> Callable[[Handler], Handler]:
    """Register ``fn`` as the built-in handler of each primitive in ``names`` (replacing an
    earlier built-in one; a user's registration still wins)."""

    def deco(fn: Handler) -> Handler:
        for name in names:
            registry.unregister(name, domain=DOMAIN, user=False)
            registry.builtin(name, domain=DOMAIN)(fn)
        return fn

    return deco


def register(*names: str) -> Callable[[Handler], Handler]:
    """Register ``fn(ctx, eqn, inputs) -> list of output values`` for each primitive in
    ``names``; a user handler wins over the built-in one."""

    def deco(fn: Handler) -> Handler:
        for name in names:
            registry.unregister(name, domain=DOMAIN)
            registry.register(name, domain=DOMAIN)(fn)
        return fn

    return deco


def handler(name: str) -> Handler:
    """The handler of primitive ``name`` (the user's first); KeyError if none."""
    found, _ = registry.lookup(DOMAIN, name, 1)
    if found is None:
        raise KeyError(name)
    return found.fn


def _aval(var: Any):
    return var.aval


def _shape(var: Any) -> tuple[Any, ...]:
    """Ints, or jax symbolic dims (``batch``) under ``dynamic_batch``: see ``symbolic``."""
    return dims(var)


def _dim_i64(ctx, d: Any) -> ir.Value:
    """A dimension as an int64 scalar constant, or a run-time ``[d]`` when symbolic."""
    return ctx.i64(d) if static_dim(d) is not None else dim_value(ctx, d)


def _ir_dtype(dtype: Any) -> ir.DataType:
    return ir.DataType.from_numpy(np.dtype(dtype))


# --- elementwise -------------------------------------------------------------------------

_UNARY = {
    "exp": "Exp",
    "log": "Log",
    "tanh": "Tanh",
    "logistic": "Sigmoid",
    "erf": "Erf",
    "sqrt": "Sqrt",
    "abs": "Abs",
    "neg": "Neg",
    "sign": "Sign",
    "floor": "Floor",
    "ceil": "Ceil",
    "sin": "Sin",
    "cos": "Cos",
    "tan": "Tan",
    "asin": "Asin",
    "acos": "Acos",
    "atan": "Atan",
    "sinh": "Sinh",
    "cosh": "Cosh",
    "asinh": "Asinh",
    "acosh": "Acosh",
    "atanh": "Atanh",
    "reduce_precision": "Identity",
    "stop_gradient": "Identity",
    "copy": "Identity",
    "copy_p": "Identity",
    "device_put": "Identity",
}
_BINARY = {
    "add": "Add",
    "sub": "Sub",
    "mul": "Mul",
    "div": "Div",
    "max": "Max",
    "min": "Min",
    "pow": "Pow",
    "eq": "Equal",
    "lt": "Less",
    "le": "LessOrEqual",
    "gt": "Greater",
    "ge": "GreaterOrEqual",
    "add_any": "Add",
}
_LOGICAL = {"and": ("And", "BitwiseAnd"), "or": ("Or", "BitwiseOr"), "xor": ("Xor", "BitwiseXor")}


def _unary(op: str) -> Handler:
    def handle(ctx, eqn, inputs):
        return [ctx.op(op, inputs[:1])]

    return handle


def _binary(op: str) -> Handler:
    def handle(ctx, eqn, inputs):
        return [ctx.op(op, inputs)]

    return handle


def _logical(ops: tuple[str, str]) -> Handler:
    def handle(ctx, eqn, inputs):
        is_bool = np.dtype(eqn.outvars[0].aval.dtype) == np.bool_
        return [ctx.op(ops[0] if is_bool else ops[1], inputs)]

    return handle


for _name, _op in _UNARY.items():
    builtin(_name)(_unary(_op))
for _name, _op in _BINARY.items():
    builtin(_name)(_binary(_op))
for _name, _ops in _LOGICAL.items():
    builtin(_name)(_logical(_ops))


@builtin("not")
def _not(ctx, eqn, inputs):
    is_bool = np.dtype(eqn.outvars[0].aval.dtype) == np.bool_
    return [ctx.op("Not" if is_bool else "BitwiseNot", inputs)]


@builtin("ne")
def _ne(ctx, eqn, inputs):
    return [ctx.op("Not", [ctx.op("Equal", inputs)])]


@builtin("rem")
def _rem(ctx, eqn, inputs):
    # lax.rem keeps the dividend's sign (C fmod) for ints and floats alike.
    return [ctx.op("Mod", inputs, {"fmod": 1})]


@builtin("rsqrt")
def _rsqrt(ctx, eqn, inputs):
    return [ctx.op("Reciprocal", [ctx.op("Sqrt", inputs)])]


@builtin("square")
def _square(ctx, eqn, inputs):
    return [ctx.op("Mul", [inputs[0], inputs[0]])]


@builtin("log1p")
def _log1p(ctx, eqn, inputs):
    one = ctx.const(np.ones((), eqn.invars[0].aval.dtype))
    return [ctx.op("Log", [ctx.op("Add", [inputs[0], one])])]


@builtin("expm1")
def _expm1(ctx, eqn, inputs):
    one = ctx.const(np.ones((), eqn.invars[0].aval.dtype))
    return [ctx.op("Sub", [ctx.op("Exp", inputs), one])]


@builtin("exp2")
def _exp2(ctx, eqn, inputs):
    two = ctx.const(np.full((), 2, eqn.invars[0].aval.dtype))
    return [ctx.op("Pow", [two, inputs[0]])]


@builtin("is_finite")
def _is_finite(ctx, eqn, inputs):
    bad = ctx.op("Or", [ctx.op("IsInf", inputs), ctx.op("IsNaN", inputs)])
    return [ctx.op("Not", [bad])]


@builtin("round")
def _round(ctx, eqn, inputs):
    method = int(eqn.params.get("rounding_method", 0))
    if method == 1:  # to nearest even: ONNX Round's rule
        return [ctx.op("Round", inputs)]
    # away from zero: sign(x) * floor(|x| + 0.5)
    half = ctx.const(np.full((), 0.5, eqn.invars[0].aval.dtype))
    mag = ctx.op("Floor", [ctx.op("Add", [ctx.op("Abs", inputs), half])])
    return [ctx.op("Mul", [ctx.op("Sign", inputs), mag])]


@builtin("integer_pow")
def _integer_pow(ctx, eqn, inputs):
    y = int(eqn.params["y"])
    dtype = np.dtype(eqn.invars[0].aval.dtype)
    if dtype.kind == "f":
        return [ctx.op("Pow", [inputs[0], ctx.const(np.full((), y, dtype))])]
    if y < 0:
        raise ConversionError(f"integer_pow with negative exponent {y} on integers")
    if y == 0:
        target = shape_value(ctx, _shape(eqn.invars[0]))
        return [ctx.op("Expand", [ctx.const(np.ones((), dtype)), target])]
    out = inputs[0]
    for _ in range(y - 1):
        out = ctx.op("Mul", [out, inputs[0]])
    return [out]


@builtin("convert_element_type")
def _convert(ctx, eqn, inputs):
    to = _ir_dtype(eqn.params["new_dtype"])
    return [ctx.op("Cast", inputs, {"to": to})]


@builtin("clamp")
def _clamp(ctx, eqn, inputs):
    lo, x, hi = inputs
    return [ctx.op("Max", [ctx.op("Min", [x, hi]), lo])]


@builtin("select_n")
def _select_n(ctx, eqn, inputs):
    pred, *cases = inputs
    pdtype = np.dtype(eqn.invars[0].aval.dtype)
    if len(cases) == 1:
        return [ctx.op("Identity", cases)]
    if pdtype == np.bool_ and len(cases) == 2:
        return [ctx.op("Where", [pred, cases[1], cases[0]])]
    out = cases[0]
    for i, case in enumerate(cases[1:], start=1):
        cond = ctx.op("Equal", [pred, ctx.const(np.array(i, pdtype))])
        out = ctx.op("Where", [cond, case, out])
    return [out]


# --- linear algebra ----------------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@builtin("dot_general")
def _dot_general(ctx, eqn, inputs):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(list, (lc, rc, lb, rb))
    lr, rr = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    lhs, rhs = inputs
    in_dtype = np.dtype(eqn.invars[0].aval.dtype)
    if in_dtype != out_dtype or np.dtype(eqn.invars[1].aval.dtype) != out_dtype:
        lhs = ctx.op("Cast", [lhs], {"to": _ir_dtype(out_dtype)})
        rhs = ctx.op("Cast", [rhs], {"to": _ir_dtype(out_dtype)})
    nb = len(lb)
    plain = (
        lb == list(range(nb))
        and rb == list(range(nb))
        and lc == [lr - 1]
        and len(rc) == 1
        and lr >= 1
    )
    if plain and rr == 2 and nb == 0 and rc == [0]:
        return [ctx.op("MatMul", [lhs, rhs])]
    if plain and nb > 0 and lr == nb + 2 and rr == nb + 2 and rc == [nb]:
        return [ctx.op("MatMul", [lhs, rhs])]
    letters = iter(_LETTERS)
    ls = [""] * lr
    rs = [""] * rr
    for a, b in zip(lb, rb, strict=True):
        ls[a] = rs[b] = next(letters)
    for a, b in zip(lc, rc, strict=True):
        ls[a] = rs[b] = next(letters)
    for i in range(lr):
        ls[i] = ls[i] or next(letters)
    for i in range(rr):
        rs[i] = rs[i] or next(letters)
    out = [ls[a] for a in lb]
    out += [ls[i] for i in range(lr) if i not in lb and i not in lc]
    out += [rs[i] for i in range(rr) if i not in rb and i not in rc]
    equation = f"{''.join(ls)},{''.join(rs)}->{''.join(out)}"
    return [ctx.op("Einsum", [lhs, rhs], {"equation": equation})]


def _inverse(perm: list[int]) -> list[int]:
    return [int(i) for i in np.argsort(perm)]


@builtin("conv_general_dilated")
def _conv(ctx, eqn, inputs):
    p = eqn.params
    if int(p.get("batch_group_count", 1)) != 1:
        raise ConversionError("conv_general_dilated with batch_group_count > 1 is not supported")
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = (list(s) for s in (dn.lhs_spec, dn.rhs_spec, dn.out_spec))
    x, w = inputs
    nsp = len(lhs_spec) - 2
    if lhs_spec != list(range(nsp + 2)):
        x = ctx.op("Transpose", [x], {"perm": lhs_spec})
    if rhs_spec != list(range(nsp + 2)):
        w = ctx.op("Transpose", [w], {"perm": rhs_spec})
    kshape = [_shape(eqn.invars[1])[d] for d in rhs_spec[2:]]
    strides = [int(s) for s in p["window_strides"]]
    padding = [(int(lo), int(hi)) for lo, hi in p["padding"]]
    lhs_dil = [int(d) for d in (p.get("lhs_dilation") or [1] * nsp)]
    rhs_dil = [int(d) for d in (p.get("rhs_dilation") or [1] * nsp)]
    groups = int(p.get("feature_group_count", 1))
    info: dict[str, Any] = {
        "kernel_size": kshape,
        "dilations": rhs_dil,
        "groups": groups,
        "in_channels": _shape(eqn.invars[0])[lhs_spec[1]],
        "out_channels": _shape(eqn.invars[1])[rhs_spec[0]],
    }
    if any(d != 1 for d in lhs_dil):
        if groups != 1 or any(s != 1 for s in strides):
            raise ConversionError(
                "conv_general_dilated with lhs_dilation needs window_strides 1 and one group"
            )
        # Zero-inserted input + conv == ConvTranspose with the kernel flipped and I/O swapped.
        eff = [d * (k - 1) + 1 for d, k in zip(rhs_dil, kshape, strict=True)]
        lo = [e - 1 - a for e, (a, _) in zip(eff, padding, strict=True)]
        hi = [e - 1 - b for e, (_, b) in zip(eff, padding, strict=True)]
        if any(v < 0 for v in lo):
            raise ConversionError("conv_general_dilated: this lhs_dilation padding is unsupported")
        out_pad = [max(0, -v) for v in hi]
        hi = [max(0, v) for v in hi]
        # Reverse the spatial axes (ONNX: a negative step starts at -1 and runs to INT64_MIN).
        big = np.iinfo(np.int64)
        starts = ctx.i64([-1] * nsp)
        ends = ctx.i64([big.min] * nsp)
        axes = ctx.i64(list(range(2, nsp + 2)))
        steps = ctx.i64([-1] * nsp)
        w = ctx.op("Slice", [w, starts, ends, axes, steps])
        w = ctx.op("Transpose", [w], {"perm": [1, 0, *range(2, nsp + 2)]})
        y = ctx.op(
            "ConvTranspose",
            [x, w],
            {
                "strides": lhs_dil,
                "pads": lo + hi,
                "dilations": rhs_dil,
                "output_padding": out_pad,
                "kernel_shape": kshape,
            },
        )
        info.update(kind="conv_transpose", strides=lhs_dil, padding=[list(pp) for pp in padding])
    else:
        if any(a < 0 or b < 0 for a, b in padding):
            raise ConversionError("conv_general_dilated with negative padding is not supported")
        y = ctx.op(
            "Conv",
            [x, w],
            {
                "strides": strides,
                "pads": [a for a, _ in padding] + [b for _, b in padding],
                "dilations": rhs_dil,
                "group": groups,
                "kernel_shape": kshape,
            },
        )
        info.update(kind="conv", strides=strides, padding=[list(pp) for pp in padding])
    ctx.node_info[y.producer().name] = info
    back = _inverse(out_spec)
    if back != list(range(nsp + 2)):
        y = ctx.op("Transpose", [y], {"perm": back})
    return [y]


# --- reductions --------------------------------------------------------------------------

_REDUCE = {
    "reduce_sum": "ReduceSum",
    "reduce_max": "ReduceMax",
    "reduce_min": "ReduceMin",
    "reduce_prod": "ReduceProd",
}


def _reduce(op: str) -> Handler:
    def handle(ctx, eqn, inputs):
        axes = [int(a) for a in eqn.params["axes"]]
        if not axes:
            return [ctx.op("Identity", inputs[:1])]
        return [ctx.op(op, [inputs[0], ctx.i64(axes)], {"keepdims": 0})]

    return handle


for _name, _op in _REDUCE.items():
    builtin(_name)(_reduce(_op))


@builtin("reduce_and", "reduce_or")
def _reduce_bool(ctx, eqn, inputs):
    axes = [int(a) for a in eqn.params["axes"]]
    as_int = ctx.op("Cast", inputs, {"to": ir.DataType.INT32})
    op = "ReduceMin" if eqn.primitive.name == "reduce_and" else "ReduceMax"
    red = ctx.op(op, [as_int, ctx.i64(axes)], {"keepdims": 0})
    return [ctx.op("Cast", [red], {"to": ir.DataType.BOOL})]


@builtin("argmax", "argmin")
def _argmax(ctx, eqn, inputs):
    (axis,) = eqn.params["axes"]
    op = "ArgMax" if eqn.primitive.name == "argmax" else "ArgMin"
    out = ctx.op(op, inputs, {"axis": int(axis), "keepdims": 0})
    return [ctx.op("Cast", [out], {"to": _ir_dtype(eqn.params["index_dtype"])})]


@builtin("cumsum")
def _cumsum(ctx, eqn, inputs):
    axis = ctx.i64(int(eqn.params["axis"]))
    return [ctx.op("CumSum", [inputs[0], axis], {"reverse": int(bool(eqn.params["reverse"]))})]


@builtin("sort")
def _sort(ctx, eqn, inputs):
    if int(eqn.params.get("num_keys", 1)) != 1:
        raise ConversionError("sort with more than one key operand is not supported")
    dim = int(eqn.params["dimension"])
    n = _shape(eqn.invars[0])[dim]
    values, idx = ctx.op(
        "TopK",
        [inputs[0], shape_value(ctx, [n])],
        {"axis": dim, "largest": 0, "sorted": 1},
        num_outputs=2,
    )
    outs = [values]
    for other in inputs[1:]:
        outs.append(ctx.op("GatherElements", [other, idx], {"axis": dim}))
    return outs


@builtin("top_k")
def _top_k(ctx, eqn, inputs):
    k = int(eqn.params["k"])
    values, idx = ctx.op(
        "TopK",
        [inputs[0], ctx.i64([k])],
        {"axis": -1, "largest": 1, "sorted": 1},
        num_outputs=2,
    )
    return [values, ctx.op("Cast", [idx], {"to": _ir_dtype(eqn.outvars[1].aval.dtype)})]


@builtin("reduce_window_max", "reduce_window_sum")
def _reduce_window(ctx, eqn, inputs):
    p = eqn.params
    if any(int(d) != 1 for d in p.get("base_dilation", ())):
        raise ConversionError("reduce_window with base_dilation is not supported")
    window = [int(d) for d in p["window_dimensions"]]
    strides = [int(s) for s in p["window_strides"]]
    padding = [(int(a), int(b)) for a, b in p["padding"]]
    dil = [int(d) for d in p.get("window_dilation", [1] * len(window))]
    rank = len(window)
    spatial = [
        i
        for i in range(rank)
        if window[i] != 1 or strides[i] != 1 or padding[i] != (0, 0) or dil[i] != 1
    ]
    other = [i for i in range(rank) if i not in spatial]
    x = inputs[0]
    if len(other) == 2:
        perm = other + spatial
        x = ctx.op("Transpose", [x], {"perm": perm}) if perm != list(range(rank)) else x
    else:
        perm = None
        spatial = list(range(rank))
        x = ctx.op("Unsqueeze", [x, ctx.i64([0, 1])])
    attrs = {
        "kernel_shape": [window[i] for i in spatial],
        "strides": [strides[i] for i in spatial],
        "pads": [padding[i][0] for i in spatial] + [padding[i][1] for i in spatial],
    }
    if eqn.primitive.name == "reduce_window_max":
        y = ctx.op("MaxPool", [x], {**attrs, "dilations": [dil[i] for i in spatial]})
        kind = "max_pool"
    else:
        if any(dil[i] != 1 for i in spatial):
            raise ConversionError("reduce_window_sum with window_dilation is not supported")
        y = ctx.op("AveragePool", [x], {**attrs, "count_include_pad": 1})
        size = int(np.prod(attrs["kernel_shape"]))
        kind = "avg_pool"
    ctx.node_info[y.producer().name] = {
        "kind": kind,
        "kernel_size": attrs["kernel_shape"],
        "strides": attrs["strides"],
        "padding": [[padding[i][0], padding[i][1]] for i in spatial],
    }
    if kind == "avg_pool":
        y = ctx.op("Mul", [y, ctx.const(np.array(size, eqn.outvars[0].aval.dtype))])
    if perm is None:
        return [ctx.op("Squeeze", [y, ctx.i64([0, 1])])]
    if perm != list(range(rank)):
        y = ctx.op("Transpose", [y], {"perm": _inverse(perm)})
    return [y]


# --- shapes ------------------------------------------------------------------------------


@builtin("broadcast_in_dim")
def _broadcast_in_dim(ctx, eqn, inputs):
    shape = list(as_dims(eqn.params["shape"]))
    bdims = [int(d) for d in eqn.params["broadcast_dimensions"]]
    in_shape = _shape(eqn.invars[0])
    x = inputs[0]
    target = [1] * len(shape)
    for d, s in zip(bdims, in_shape, strict=True):
        target[d] = s
    if tuple(target) == tuple(in_shape) and target == shape:
        return [ctx.op("Identity", [x])]
    if len(target) != len(in_shape) or tuple(target) != tuple(in_shape):
        x = ctx.op("Reshape", [x, reshape_target(ctx, target)])
    if target == shape:
        return [x]
    return [ctx.op("Expand", [x, expand_target(ctx, target, shape)])]


@builtin("reshape")
def _reshape(ctx, eqn, inputs):
    if eqn.params.get("dimensions") is not None:
        raise ConversionError("reshape with `dimensions` is not supported")
    return [ctx.op("Reshape", [inputs[0], reshape_target(ctx, _shape(eqn.outvars[0]))])]


@builtin("squeeze")
def _squeeze(ctx, eqn, inputs):
    axes = [int(a) for a in eqn.params["dimensions"]]
    if not axes:
        return [ctx.op("Identity", inputs[:1])]
    return [ctx.op("Squeeze", [inputs[0], ctx.i64(axes)])]


@builtin("expand_dims")
def _expand_dims(ctx, eqn, inputs):
    return [ctx.op("Unsqueeze", [inputs[0], ctx.i64([int(a) for a in eqn.params["dimensions"]])])]


@builtin("transpose")
def _transpose(ctx, eqn, inputs):
    return [ctx.op("Transpose", inputs, {"perm": [int(p) for p in eqn.params["permutation"]]})]


@builtin("concatenate")
def _concatenate(ctx, eqn, inputs):
    return [ctx.op("Concat", inputs, {"axis": int(eqn.params["dimension"])})]


@builtin("split")
def _split(ctx, eqn, inputs):
    sizes = list(as_dims(eqn.params["sizes"]))
    outs = ctx.op(
        "Split",
        [inputs[0], shape_value(ctx, sizes)],
        {"axis": int(eqn.params["axis"])},
        num_outputs=len(sizes),
    )
    return list(outs) if len(sizes) > 1 else [outs]


@builtin("rev")
def _rev(ctx, eqn, inputs):
    dims = [int(d) for d in eqn.params["dimensions"]]
    if not dims:
        return [ctx.op("Identity", inputs)]
    n = len(dims)
    big = np.iinfo(np.int64)
    return [
        ctx.op(
            "Slice",
            [
                inputs[0],
                ctx.i64([-1] * n),
                ctx.i64([big.min] * n),
                ctx.i64(dims),
                ctx.i64([-1] * n),
            ],
        )
    ]


@builtin("pad")
def _pad(ctx, eqn, inputs):
    config = [(int(a), int(b), int(c)) for a, b, c in eqn.params["padding_config"]]
    if any(c != 0 for _, _, c in config):
        raise ConversionError("pad with interior padding is not supported")
    x, value = inputs
    rank = len(config)
    pos = [max(a, 0) for a, _, _ in config] + [max(b, 0) for _, b, _ in config]
    if any(pos):
        x = ctx.op("Pad", [x, ctx.i64(pos), value], {"mode": "constant"})
    if any(a < 0 or b < 0 for a, b, _ in config):
        shape = _shape(eqn.invars[0])
        starts = [max(-a, 0) for a, _, _ in config]
        ends = [shape[i] + max(config[i][0], 0) - max(-config[i][1], 0) for i in range(rank)]
        if not is_static(ends):
            padded = [shape[i] + max(a, 0) + max(b, 0) for i, (a, b, _) in enumerate(config)]
            starts, ends = _from_end(padded, starts, ends)
        axes = ctx.i64(list(range(rank)))
        x = ctx.op("Slice", [x, ctx.i64(starts), shape_value(ctx, ends), axes])
    return [x if x is not inputs[0] else ctx.op("Identity", [x])]


@builtin("slice")
def _slice(ctx, eqn, inputs):
    starts = list(as_dims(eqn.params["start_indices"]))
    ends = list(as_dims(eqn.params["limit_indices"]))
    if not is_static(starts + ends):
        starts, ends = _from_end(_shape(eqn.invars[0]), starts, ends)
    strides = eqn.params.get("strides") or [1] * len(starts)
    args = [
        inputs[0],
        shape_value(ctx, starts),
        shape_value(ctx, ends),
        ctx.i64(list(range(len(starts)))),
        ctx.i64([int(s) for s in strides]),
    ]
    return [ctx.op("Slice", args)]


def _from_end(shape, starts, ends):
    """Symbolic slice bounds a static distance from the dim's end, as negative indices (or
    INT64_MAX for the end itself), so the bounds stay constants; others stay symbolic."""
    big = int(np.iinfo(np.int64).max)

    def rel(bound, dim, is_end):
        k = static_dim(dim - bound) if static_dim(bound) is None else None
        if k is None or k < 0:
            return bound
        return big if (k == 0 and is_end) else -k

    return (
        [rel(s, d, False) for s, d in zip(starts, shape, strict=True)],
        [rel(e, d, True) for e, d in zip(ends, shape, strict=True)],
    )


def _clamped_starts(ctx, eqn, starts, operand_shape, sizes):
    """jax clamps dynamic start indices into ``[0, dim - size]``: do the same, as int64."""
    pieces = []
    for s, dim, size in zip(starts, operand_shape, sizes, strict=True):
        s64 = ctx.op("Cast", [s], {"to": ir.DataType.INT64})
        s64 = ctx.op("Max", [ctx.op("Min", [s64, _dim_i64(ctx, dim - size)]), ctx.i64(0)])
        pieces.append(ctx.op("Reshape", [s64, ctx.i64([1])]))
    return ctx.op("Concat", pieces, {"axis": 0}) if len(pieces) > 1 else pieces[0]


@builtin("dynamic_slice")
def _dynamic_slice(ctx, eqn, inputs):
    sizes = list(as_dims(eqn.params["slice_sizes"]))
    shape = _shape(eqn.invars[0])
    x, *starts = inputs
    begin = _clamped_starts(ctx, eqn, starts, shape, sizes)
    end = ctx.op("Add", [begin, shape_value(ctx, sizes)])
    return [ctx.op("Slice", [x, begin, end, ctx.i64(list(range(len(shape))))])]


@builtin("dynamic_update_slice")
def _dynamic_update_slice(ctx, eqn, inputs):
    x, update, *starts = inputs
    ushape = require_static(_shape(eqn.invars[1]), "dynamic_update_slice's update")
    begin = _clamped_starts(ctx, eqn, starts, _shape(eqn.invars[0]), ushape)
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in ushape], indexing="ij"), axis=-1)
    indices = ctx.op("Add", [ctx.const(grid.astype(np.int64)), begin])
    return [ctx.op("ScatterND", [x, indices, update])]


@builtin("dim_as_value")
def _dim_as_value(ctx, eqn, inputs):
    """A symbolic dimension used as a number (``x.shape[0]`` in arithmetic, ``jnp.mean``)."""
    n = ctx.op("Reshape", [dim_value(ctx, eqn.params["dim"]), ctx.i64([])])
    return [ctx.op("Cast", [n], {"to": _ir_dtype(eqn.outvars[0].aval.dtype)})]


@builtin("iota")
def _iota(ctx, eqn, inputs):
    shape = list(as_dims(eqn.params["shape"]))
    dim = int(eqn.params["dimension"])
    dtype = np.dtype(eqn.params["dtype"])
    view = [1] * len(shape)
    view[dim] = shape[dim]
    if not is_static(shape):
        n = ctx.op("Squeeze", [dim_value(ctx, shape[dim]), ctx.i64([0])])
        values = ctx.op("Range", [ctx.i64(0), n, ctx.i64(1)])
        values = ctx.op("Cast", [values], {"to": _ir_dtype(dtype)})
        values = ctx.op("Reshape", [values, reshape_target(ctx, view)])
        if view == shape:
            return [values]
        return [ctx.op("Expand", [values, expand_target(ctx, view, shape)])]
    values = np.broadcast_to(np.arange(shape[dim]).reshape(view), shape).astype(dtype)
    return [ctx.const(np.ascontiguousarray(values))]


# --- control flow ------------------------------------------------------------------------


def sub_jaxpr(eqn) -> Any:
    for key in CALL_PARAMS:
        if key in eqn.params:
            return eqn.params[key]
    raise ConversionError(f"{eqn.primitive.name}: no sub-jaxpr found")


# Handler families in their own modules register themselves on import.
from xconv.converters.flax.importer import control, indexing, math  # noqa: E402,F401
