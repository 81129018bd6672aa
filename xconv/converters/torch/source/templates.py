"""Per-op source templates for the PyTorch source emitter: one torch expression per ONNX node.

A template receives an :class:`OpCall` (argument expressions, constant values, static input
shapes, parsed attributes) and returns the expression computing the node's output(s) (a tuple
expression for several outputs). Node groups recognised as layers never reach these
templates; they become ``torch.nn`` layers. The IR is channels-first like torch, so no layout
bookkeeping is needed here (unlike ``xconv/converters/flax/source/templates.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import onnx_ir as ir

from xconv.converters import expressions as ex
from xconv.converters.codegen import TemplateCall, int_tuple, scalar_literal
from xconv.converters.registry import REQUIRED, Handler, TemplateRegistry

INT64_MAX = np.iinfo(np.int64).max


@dataclass
class OpCall(TemplateCall):
    """What a template sees for one node."""

    emitter: ClassVar[str] = "PyTorch source emitter"

    def ints(self, i: int) -> str:
        """Input ``i`` as a Python int list: a literal when constant, else ``.tolist()``."""
        c = self.consts[i] if i < len(self.consts) else None
        if c is not None:
            return "[" + ", ".join(str(int(v)) for v in np.asarray(c).reshape(-1)) + "]"
        return f"{self.args[i]}.tolist()"

    def dtype(self, index: int = 0) -> str:
        return dtype_expr(self.node.outputs[index].dtype)


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


def dtype_expr(dtype: ir.DataType | None) -> str:
    return f"torch.{ex.dtype_name(ex.DTYPE_NAMES, dtype, 'PyTorch source emitter')}"


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
}


def _unary(fmt: str) -> Callable[[OpCall], str]:
    return lambda c: fmt.format(c.args[0])


for _op, _fmt in _UNARY.items():
    registry.builtin(_op)(_unary(_fmt))


@template("Dropout", seed=None, training_mode=None)
def _dropout(c: OpCall) -> str:
    # An inference Dropout node (no training_mode input) is the identity.
    if c.has(2) and (c.consts[2] is None or bool(np.asarray(c.consts[2]))):
        raise c.fail("a Dropout node in training mode has no fixed source form")
    if len(c.node.outputs) > 1:
        return f"{c.args[0]}, torch.ones_like({c.args[0]}, dtype=torch.bool)"
    return c.args[0]


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


@template("Cast", to=REQUIRED, saturate=1, round_mode="up")
def _cast(c: OpCall) -> str:
    to = ir.DataType(c.attrs["to"])
    return f"{_saturated(c, to)}.to({dtype_expr(to)})"


@template("CastLike", saturate=1, round_mode="up")
def _cast_like(c: OpCall) -> str:
    return f"{_saturated(c, c.node.inputs[1].dtype)}.to({c.args[1]}.dtype)"


_BINARY = {**ex.with_namespace(ex.BINARY, "torch"), "Pow": "torch.pow({0}, {1})"}


def _binary(fmt: str) -> Callable[[OpCall], str]:
    def fn(c: OpCall) -> str:
        a, b = c.args[0], c.args[1]
        # A Python scalar on the left has no ``torch.pow(2.0, x)`` problem but needs parens
        # when the right operand is an expression.
        if " " in b and not b.startswith("torch."):
            b = f"({b})"
        return fmt.format(a, b)

    return fn


for _op, _fmt in _BINARY.items():
    registry.builtin(_op, bare=True)(_binary(_fmt))


@template("Div", bare=True)
def _div(c: OpCall) -> str:
    dt = c.node.outputs[0].dtype
    if dt is not None and not dt.is_floating_point():
        return f'torch.div({c.args[0]}, {c.args[1]}, rounding_mode="trunc")'
    return f"{c.args[0]} / {c.args[1]}"


registry.builtin("Mod", attrs={"fmod": 0}, bare=True)(lambda c: ex.mod_expr(c, "torch"))
registry.builtin("Where")(lambda c: ex.where_expr(c, "torch"))


@template("PRelu")
def _prelu(c: OpCall) -> str:
    x, s = c.args[0], c.args[1]
    return f"torch.where({x} >= 0, {x}, {x} * {s})"


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


# ---------------------------------------------------------------- convolution and pooling


def _sym_pads(c: OpCall, n: int) -> list[int]:
    pads = c.attrs.get("pads") or [0] * (2 * n)
    if c.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise c.fail("auto_pad SAME_* is not supported; canonicalise to explicit pads")
    lo, hi = list(pads[:n]), list(pads[n:])
    if lo != hi:
        raise c.fail(f"asymmetric pads {list(pads)} have no torch padding argument")
    return lo


@template("Conv", **ex.CONV_ATTRS)
def _conv(c: OpCall) -> str:
    n = c.need_rank() - 2
    x = c.args[0]
    pads = c.attrs.get("pads") or [0] * (2 * n)
    if c.attrs.get("auto_pad", "NOTSET") == "NOTSET" and list(pads[:n]) != list(pads[n:]):
        # Asymmetric zero padding (TensorFlow's SAME with stride 2) has no conv argument:
        # pad explicitly (F.pad lists the last dim first), then convolve unpadded.
        order = [v for i in reversed(range(n)) for v in (pads[i], pads[n + i])]
        x, pad = f"F.pad({x}, {int_tuple(order)})", [0] * n
    else:
        pad = _sym_pads(c, n)
    s = c.attrs["strides"] or [1] * n
    d = c.attrs["dilations"] or [1] * n
    b = c.args[2] if c.has(2) else "None"
    return (
        f"F.conv{n}d({x}, {c.args[1]}, {b}, stride={int_tuple(s)}, "
        f"padding={int_tuple(pad)}, dilation={int_tuple(d)}, groups={c.attrs['group']})"
    )


@template("ConvTranspose", **ex.CONV_TRANSPOSE_ATTRS)
def _conv_transpose(c: OpCall) -> str:
    n = c.need_rank() - 2
    if c.attrs["output_shape"] is not None:
        raise c.fail("output_shape is not supported; canonicalise to pads")
    pads = c.attrs.get("pads") or [0] * (2 * n)
    crop = None
    if c.attrs.get("auto_pad", "NOTSET") == "NOTSET" and list(pads[:n]) != list(pads[n:]):
        # Asymmetric pads crop the output unevenly: pad the common part, slice the rest off.
        pad = [min(lo, hi) for lo, hi in zip(pads[:n], pads[n:], strict=True)]
        crop = [(lo - m, hi - m) for lo, hi, m in zip(pads[:n], pads[n:], pad, strict=True)]
    else:
        pad = _sym_pads(c, n)
    s = c.attrs["strides"] or [1] * n
    d = c.attrs["dilations"] or [1] * n
    op = c.attrs["output_padding"] or [0] * n
    b = c.args[2] if c.has(2) else "None"
    expr = (
        f"F.conv_transpose{n}d({c.args[0]}, {c.args[1]}, {b}, stride={int_tuple(s)}, "
        f"padding={int_tuple(pad)}, output_padding={int_tuple(op)}, "
        f"groups={c.attrs['group']}, dilation={int_tuple(d)})"
    )
    if crop is None:
        return expr
    index = [":", ":"] + [f"{lo or ''}:{-hi if hi else ''}" for lo, hi in crop]
    return f"{expr}[{', '.join(index)}]"


@template("MaxPool", **ex.MAX_POOL_ATTRS)
def _max_pool(c: OpCall) -> str:
    if len(c.node.outputs) > 1:
        raise c.fail("MaxPool with an Indices output is not supported")
    k = c.attrs["kernel_shape"]
    n = len(k)
    pad = _sym_pads(c, n)
    s = c.attrs["strides"] or [1] * n
    d = c.attrs["dilations"] or [1] * n
    args = [c.args[0], _compact(k)]
    args += [f"stride={_compact(s)}"] if list(s) != list(k) else []  # torch: stride = kernel
    args += [f"padding={_compact(pad)}"] if any(pad) else []
    args += [f"dilation={_compact(d)}"] if any(x != 1 for x in d) else []
    args += ["ceil_mode=True"] if c.attrs["ceil_mode"] else []
    return f"F.max_pool{n}d({', '.join(args)})"


def _compact(values) -> str:
    """``3`` for ``(3, 3)``: torch's pooling functions take one int for all dimensions."""
    values = [int(v) for v in values]
    return str(values[0]) if len(set(values)) == 1 else int_tuple(values)


@template("AveragePool", **ex.AVERAGE_POOL_ATTRS)
def _avg_pool(c: OpCall) -> str:
    k = c.attrs["kernel_shape"]
    n = len(k)
    if c.attrs["dilations"] and any(x != 1 for x in c.attrs["dilations"]):
        raise c.fail("dilated AveragePool has no torch counterpart")
    pad = _sym_pads(c, n)
    s = c.attrs["strides"] or [1] * n
    args = [c.args[0], _compact(k)]
    args += [f"stride={_compact(s)}"] if list(s) != list(k) else []  # torch: stride = kernel
    args += [f"padding={_compact(pad)}"] if any(pad) else []
    args += ["ceil_mode=True"] if c.attrs["ceil_mode"] else []
    if any(pad) and not c.attrs["count_include_pad"]:  # ONNX's default, not torch's
        args.append("count_include_pad=False")
    return f"F.avg_pool{n}d({', '.join(args)})"


@template("GlobalAveragePool")
def _gap(c: OpCall) -> str:
    dims = tuple(range(2, c.need_rank()))
    return f"{c.args[0]}.mean(dim={dims}, keepdim=True)"


@template("GlobalMaxPool")
def _gmp(c: OpCall) -> str:
    dims = tuple(range(2, c.need_rank()))
    return f"{c.args[0]}.amax(dim={dims}, keepdim=True)"


# ---------------------------------------------------------------- normalisation


@template("BatchNormalization", epsilon=1e-5, momentum=0.9, training_mode=0)
def _batch_norm(c: OpCall) -> str:
    if c.attrs["training_mode"] or len(c.node.outputs) > 1:
        raise c.fail("training-mode BatchNormalization nodes are not supported")
    x, s, b, m, v = c.args[:5]
    eps = scalar_literal(c.attrs["epsilon"])
    # eval mode: torch's training=False and momentum (unused then) are the defaults
    return (
        f"F.batch_norm({x}, {m}, {v}, {s}, {b}" + ("" if eps == "1e-05" else f", eps={eps}") + ")"
    )


def _norm_shape(c: OpCall, axis: int) -> str:
    r = c.need_rank()
    a = axis + r if axis < 0 else axis
    shape = c.shapes[1] if c.shapes[1] is not None and len(c.shapes[1]) == r - a else None
    if shape is not None and all(isinstance(d, int) for d in shape):
        return int_tuple(shape)
    return f"{c.args[0]}.shape[{a}:]"


@template("LayerNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _layer_norm(c: OpCall) -> str:
    if len(c.node.outputs) > 1:
        raise c.fail("LayerNormalization with Mean / InvStdDev outputs is not supported")
    b = c.args[2] if c.has(2) else "None"
    return (
        f"F.layer_norm({c.args[0]}, {_norm_shape(c, c.attrs['axis'])}, {c.args[1]}, {b}, "
        f"{scalar_literal(c.attrs['epsilon'])})"
    )


@template("RMSNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _rms_norm(c: OpCall) -> str:
    return (
        f"F.rms_norm({c.args[0]}, {_norm_shape(c, c.attrs['axis'])}, {c.args[1]}, "
        f"{scalar_literal(c.attrs['epsilon'])})"
    )


@template("GroupNormalization", epsilon=1e-5, num_groups=REQUIRED, stash_type=1)
def _group_norm(c: OpCall) -> str:
    return (
        f"F.group_norm({c.args[0]}, {c.attrs['num_groups']}, {c.args[1]}, {c.args[2]}, "
        f"{scalar_literal(c.attrs['epsilon'])})"
    )


@template("Softmax", axis=-1)
def _softmax(c: OpCall) -> str:
    return f"torch.softmax({c.args[0]}, dim={c.attrs['axis']})"


@template("LogSoftmax", axis=-1)
def _log_softmax(c: OpCall) -> str:
    return f"torch.log_softmax({c.args[0]}, dim={c.attrs['axis']})"


# ---------------------------------------------------------------- reductions

_REDUCE = {
    "ReduceMean": "torch.mean({x}, dim={d}, keepdim={k})",
    "ReduceSum": "torch.sum({x}, dim={d}, keepdim={k})",
    "ReduceMax": "torch.amax({x}, dim={d}, keepdim={k})",
    "ReduceMin": "torch.amin({x}, dim={d}, keepdim={k})",
    "ReduceSumSquare": "torch.sum(torch.square({x}), dim={d}, keepdim={k})",
    "ReduceL1": "torch.sum(torch.abs({x}), dim={d}, keepdim={k})",
    "ReduceL2": "torch.sqrt(torch.sum(torch.square({x}), dim={d}, keepdim={k}))",
    "ReduceLogSumExp": "torch.logsumexp({x}, dim={d}, keepdim={k})",
    "ReduceProd": "torch.prod({x}, dim={d}, keepdim={k})",
}


def _reduce(fmt: str) -> Callable[[OpCall], str]:
    def fn(c: OpCall) -> str:
        axes = c.const(1, "axes") if c.has(1) else None
        if axes is None or np.asarray(axes).size == 0:
            if c.attrs["noop_with_empty_axes"]:
                return c.args[0]
            axes = np.arange(c.need_rank())
        ax = [int(a) for a in np.asarray(axes).reshape(-1)]
        if c.node.op_type == "ReduceProd":
            if len(ax) != 1:
                raise c.fail("ReduceProd over several axes has no single torch call")
            d = str(ax[0])
        else:
            d = str(ax[0]) if len(ax) == 1 else int_tuple(ax)
        out = fmt.format(x=c.args[0], d=d, k=bool(c.attrs["keepdims"]))
        return out.replace(", keepdim=False", "")  # torch's default

    return fn


for _op, _fmt in _REDUCE.items():
    registry.builtin(_op, attrs={"keepdims": 1, "noop_with_empty_axes": 0})(_reduce(_fmt))


@template("ArgMax", "ArgMin", axis=0, keepdims=1, select_last_index=0)
def _arg(c: OpCall) -> str:
    if c.attrs["select_last_index"]:
        raise c.fail("select_last_index=1 is not supported")
    fn = "torch.argmax" if c.node.op_type == "ArgMax" else "torch.argmin"
    return f"{fn}({c.args[0]}, dim={c.attrs['axis']}, keepdim={bool(c.attrs['keepdims'])})"


@template("CumSum", exclusive=0, reverse=0)
def _cumsum(c: OpCall) -> str:
    if c.attrs["exclusive"] or c.attrs["reverse"]:
        raise c.fail("exclusive / reverse CumSum is not supported")
    axis = int(np.asarray(c.const(1, "axis")).reshape(()))
    return f"torch.cumsum({c.args[0]}, dim={axis})"


@template("TopK", axis=-1, largest=1, sorted=1)
def _topk(c: OpCall) -> str:
    k = int(np.asarray(c.const(1, "k")).reshape(-1)[0])
    return (
        f"torch.topk({c.args[0]}, {k}, dim={c.attrs['axis']}, "
        f"largest={bool(c.attrs['largest'])}, sorted={bool(c.attrs['sorted'])})"
    )


# ---------------------------------------------------------------- shape


@template("Shape", start=0, end=None)
def _shape(c: OpCall) -> str:
    s, e = c.attrs["start"], c.attrs["end"]
    sl = "" if s == 0 and e is None else f"[{s}:{'' if e is None else e}]"
    return f"torch.tensor({c.args[0]}.shape{sl}, dtype=torch.int64)"


@template("Size")
def _size(c: OpCall) -> str:
    return f"torch.tensor({c.args[0]}.numel(), dtype=torch.int64)"


@template("Reshape", allowzero=0)
def _reshape(c: OpCall) -> str:
    if c.consts[1] is None:
        return f"{c.args[0]}.reshape({c.args[1]}.tolist())"
    dims = [int(d) for d in np.asarray(c.consts[1]).reshape(-1)]
    if not c.attrs["allowzero"] and 0 in dims:
        shape = c.shapes[0]
        out = []
        for i, d in enumerate(dims):
            if d != 0:
                out.append(str(d))
            elif shape is not None and isinstance(shape[i], int):
                out.append(str(shape[i]))
            else:
                out.append(f"{c.args[0]}.shape[{i}]")
        return f"{c.args[0]}.reshape({', '.join(out)})"
    if not dims:  # to a scalar: reshape() takes no empty argument list
        return f"{c.args[0]}.reshape(())"
    return f"{c.args[0]}.reshape({', '.join(map(str, dims))})"


@template("Flatten", axis=1)
def _flatten(c: OpCall) -> str:
    a = c.attrs["axis"]
    if a < 0:
        a += c.need_rank()
    if a == 0:
        return f"{c.args[0]}.reshape(1, -1)"
    if a == 1:
        return f"{c.args[0]}.flatten(1)"
    return f"{c.args[0]}.flatten(0, {a - 1}).flatten(1)"


@template("Transpose", perm=None)
def _transpose(c: OpCall) -> str:
    perm = c.attrs["perm"]
    if perm is None:
        perm = list(range(c.need_rank()))[::-1]
    return f"{c.args[0]}.permute({', '.join(str(int(p)) for p in perm)})"


@template("Concat", axis=REQUIRED)
def _concat(c: OpCall) -> str:
    return f"torch.cat([{', '.join(a for a in c.args if a)}], dim={c.attrs['axis']})"


@template("Squeeze")
def _squeeze(c: OpCall) -> str:
    if not c.has(1):
        return f"{c.args[0]}.squeeze()"
    axes = [int(a) for a in np.asarray(c.const(1, "axes")).reshape(-1)]
    return f"{c.args[0]}.squeeze({axes[0] if len(axes) == 1 else int_tuple(axes)})"


@template("Unsqueeze")
def _unsqueeze(c: OpCall) -> str:
    axes = [int(a) for a in np.asarray(c.const(1, "axes")).reshape(-1)]
    r = c.rank()
    if r is None and any(a < 0 for a in axes) and len(axes) > 1:
        raise c.fail("negative axes on an input of unknown rank")
    out_rank = (r or 0) + len(axes)
    expr = c.args[0]
    for a in sorted(a + out_rank if a < 0 else a for a in axes):
        expr = f"{expr}.unsqueeze({a})"
    return expr


@template("Expand")
def _expand(c: OpCall) -> str:
    return f"{c.args[0]}.expand(torch.broadcast_shapes({c.args[0]}.shape, {c.ints(1)}))"


@template("Tile")
def _tile(c: OpCall) -> str:
    return f"{c.args[0]}.repeat({c.ints(1)})"


@template("Slice")
def _slice(c: OpCall) -> str:
    starts = np.asarray(c.const(1, "starts")).reshape(-1)
    ends = np.asarray(c.const(2, "ends")).reshape(-1)
    r = c.need_rank()
    axes = np.asarray(c.const(3, "axes")).reshape(-1) if c.has(3) else np.arange(len(starts))
    steps = np.asarray(c.const(4, "steps")).reshape(-1) if c.has(4) else np.ones_like(starts)
    index = [":"] * r
    dims = c.shapes[0]
    flips = []
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        a = int(a) + r if a < 0 else int(a)
        s, e, st = int(s), int(e), int(st)
        dim = dims[a] if dims is not None else None
        if st < 0:
            # torch has no negative steps: flip the axis, then slice forward. ONNX clamps a
            # negative-step start into [0, dim - 1] and its end into [-1, dim - 1].
            if not isinstance(dim, int):
                raise c.fail("a negative Slice step needs the axis size")
            s = min(max(s + dim if s < 0 else s, 0), dim - 1)
            e = min(max(e + dim if e < 0 else e, -1), dim - 1)
            flips.append(a)
            s, e, st = dim - 1 - s, dim - 1 - e, -st
        if isinstance(dim, int):
            s = min(max(s + dim if s < 0 else s, 0), dim)
            e = min(max(e + dim if e < 0 else e, 0), dim)
            e = max(e, s)
            if s == 0 and e == dim and st == 1:
                continue
        elif e >= INT64_MAX // 2:
            e = None
        text = f"{s or ''}:{'' if e is None or e == dim else e}"
        if st != 1:
            text += f":{st}"
        index[a] = text
    while index and index[-1] == ":":
        index.pop()
    base = f"{c.args[0]}.flip({int_tuple(flips)})" if flips else c.args[0]
    if not index:
        return base
    return f"{base}[{', '.join(index)}]"


@template("GatherND", batch_dims=0)
def _gather_nd(c: OpCall) -> str:
    if c.attrs["batch_dims"]:
        raise c.fail("batch_dims > 0 is not supported")
    # The last index axis picks one coordinate per leading data axis (negatives wrap in both).
    return f"{c.args[0]}[{c.args[1]}.long().unbind(-1)]"


@template("Gather", axis=0)
def _gather(c: OpCall) -> str:
    a = c.attrs["axis"]
    if a < 0:
        a += c.need_rank()
    idx = c.args[1]
    if c.consts[1] is not None:
        idx_arr = np.asarray(c.consts[1])
        dims = c.shapes[0]
        if idx_arr.ndim == 0:
            i = int(idx_arr)
            if dims is not None and isinstance(dims[a], int) and i < 0:
                i += dims[a]
            idx = str(i)
    return f"{c.args[0]}[{':, ' * a}{idx}]"


@template("GatherElements", axis=0)
def _gather_elements(c: OpCall) -> str:
    a, idx = c.attrs["axis"], c.args[1]
    const = c.consts[1]
    if const is None or (np.asarray(const) < 0).any():  # ONNX counts negative indices from the end
        idx = f"({idx} % {c.args[0]}.shape[{a}])"
    return f"torch.gather({c.args[0]}, {a}, {idx}.long())"


def _split_sizes(c: OpCall, n: int) -> str:
    if c.has(1):
        return c.ints(1)
    shape = c.shapes[0]
    a = c.attrs["axis"]
    dim = None if shape is None else shape[a]
    if not isinstance(dim, int):
        raise c.fail("Split of a dimension of unknown size needs explicit sizes")
    size = -(-dim // n)
    return "[" + ", ".join(str(min(size, dim - i * size)) for i in range(n)) + "]"


@template("Split", axis=0, num_outputs=None)
def _split(c: OpCall) -> str:
    n = len(c.node.outputs)
    expr = f"torch.split({c.args[0]}, {_split_sizes(c, n)}, dim={c.attrs['axis']})"
    return f"{expr}[0]" if n == 1 else expr  # one piece: the tensor, not a 1-tuple


@template("SplitToSequence", axis=0, keepdims=1)
def _split_to_sequence(c: OpCall) -> str:
    x, a = c.args[0], c.attrs["axis"]
    if not c.has(1):
        expr = f"torch.split({x}, 1, dim={a})"
        if not c.attrs["keepdims"]:
            return f"[t.squeeze({a}) for t in {expr}]"
        return f"list({expr})"
    split = np.asarray(c.const(1, "split"))
    sizes = str(int(split)) if split.ndim == 0 else c.ints(1)
    return f"list(torch.split({x}, {sizes}, dim={a}))"


@template("SequenceAt")
def _sequence_at(c: OpCall) -> str:
    if c.consts[1] is not None:
        return f"{c.args[0]}[{int(np.asarray(c.consts[1]))}]"
    return f"{c.args[0]}[int({c.args[1]})]"


@template("SequenceLength")
def _sequence_length(c: OpCall) -> str:
    return f"torch.tensor(len({c.args[0]}), dtype=torch.int64)"


@template("Pad", mode="constant")
def _pad(c: OpCall) -> str:
    pads = [int(p) for p in np.asarray(c.const(1, "pads")).reshape(-1)]
    r = c.need_rank()
    axes = (
        [int(a) + r if a < 0 else int(a) for a in np.asarray(c.const(3, "axes")).reshape(-1)]
        if c.has(3)
        else list(range(r))
    )
    n = len(axes)
    per_axis = {a: (pads[i], pads[i + n]) for i, a in enumerate(axes)}
    last = max((a for a, p in per_axis.items() if p != (0, 0)), default=None)
    if last is None:
        return c.args[0]
    flat: list[int] = []
    for a in range(r - 1, -1, -1):
        if a < min(per_axis):
            break
        flat += list(per_axis.get(a, (0, 0)))
        if all(per_axis.get(b, (0, 0)) == (0, 0) for b in range(a)):
            break
    mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}
    m = mode.get(c.attrs["mode"])
    if m is None:
        raise c.fail(f"mode={c.attrs['mode']!r}; supported: {sorted(mode)}")
    value = ""
    if m == "constant" and c.has(2):
        v = c.const(2, "constant_value")
        if np.asarray(v).reshape(-1)[0] != 0:
            value = f", value={scalar_literal(np.asarray(v).reshape(-1)[0])}"
    mode_arg = "" if m == "constant" else f', mode="{m}"'
    return f"F.pad({c.args[0]}, {int_tuple(flat)}{mode_arg}{value})"


@template("ConstantOfShape", value=None)
def _constant_of_shape(c: OpCall) -> str:
    v = c.attrs["value"]
    arr = np.zeros(1, np.float32) if v is None else np.asarray(v)
    fill = scalar_literal(arr.reshape(-1)[0])
    dt = dtype_expr(ir.DataType.from_numpy(arr.dtype))
    return f"torch.full({c.ints(0)}, {fill}, dtype={dt})"


@template("Range")
def _range(c: OpCall) -> str:
    parts = []
    for i in range(3):
        if c.consts[i] is not None:
            parts.append(scalar_literal(np.asarray(c.consts[i]).reshape(())[()]))
        else:
            parts.append(f"{c.args[i]}.item()")
    return f"torch.arange({', '.join(parts)}, dtype={c.dtype()})"


@template("Trilu", upper=1)
def _trilu(c: OpCall) -> str:
    fn = "torch.triu" if c.attrs["upper"] else "torch.tril"
    if not c.has(1):
        return f"{fn}({c.args[0]})"
    k = c.consts[1]
    kk = str(int(np.asarray(k).reshape(()))) if k is not None else f"int({c.args[1]})"
    return f"{fn}({c.args[0]}, {kk})"


# ---------------------------------------------------------------- attention


@template(
    "Attention",
    is_causal=0,
    kv_num_heads=None,
    q_num_heads=None,
    qk_matmul_output_mode=0,
    scale=None,
    softcap=0.0,
    softmax_precision=None,
)
def _attention(c: OpCall) -> str:
    if len([o for o in c.node.outputs if o.name]) > 1 and any(
        o.uses() or o.is_graph_output() for o in c.node.outputs[1:]
    ):
        raise c.fail("Attention's present key/value or qk outputs are not supported")
    if c.attrs["softcap"] or c.attrs["qk_matmul_output_mode"]:
        raise c.fail("softcap / qk_matmul_output_mode are not supported")
    if c.need_rank(0) != 4 or c.attrs["q_num_heads"] is not None:
        raise c.fail("only 4-D (batch, heads, seq, dim) Attention inputs are supported")
    if any(c.has(i) for i in range(4, len(c.args))):
        raise c.fail("past key/value inputs are not supported")
    q, k, v = c.args[:3]
    extra = []
    if c.has(3):
        if c.attrs["is_causal"]:
            raise c.fail("is_causal together with attn_mask is not supported")
        extra.append(f"attn_mask={c.args[3]}")
    if c.attrs["is_causal"]:
        extra.append("is_causal=True")
    if c.attrs["scale"] is not None:
        extra.append(f"scale={scalar_literal(c.attrs['scale'])}")
    hq, hk = c.shapes[0][1] if c.shapes[0] else None, c.shapes[1][1] if c.shapes[1] else None
    if isinstance(hq, int) and isinstance(hk, int) and hq != hk:
        extra.append("enable_gqa=True")
    tail = "".join(f", {e}" for e in extra)
    return f"F.scaled_dot_product_attention({q}, {k}, {v}{tail})"
