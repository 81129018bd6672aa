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
from xconv.converters.flax.source.attention import BSHD, bhsd_operands, dot_product_attention
from xconv.converters.ops import formulation
from xconv.converters.ops.rnn import COMMON_ATTRS
from xconv.converters.registry import REQUIRED
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


@dataclass(frozen=True)
class Template:
    fn: Callable[[OpCall], str]
    attrs: dict[str, Any]
    layout: str = "plain"
    static_ok: bool = False
    outputs: int = 1


#: Built-in templates, keyed by default-domain op type.
TEMPLATES: dict[str, Template] = {}

#: Templates registered with :func:`register_template`, keyed by ``(domain, op_type)``;
#: they win over the built-in ones.
USER_TEMPLATES: dict[tuple[str, str], Template] = {}

_DEFAULT_DOMAINS = ("", "ai.onnx")


def template(*ops: str, layout: str = "plain", static_ok: bool = False, **attrs: Any):
    def deco(fn: Callable[[OpCall], str]) -> Callable[[OpCall], str]:
        for op in ops:
            TEMPLATES[op] = Template(fn, dict(attrs), layout, static_ok)
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
        key = ("" if domain in _DEFAULT_DOMAINS else domain, op_type)
        USER_TEMPLATES[key] = Template(f, dict(attrs or {}), layout)
        HELPERS.update(helpers or {})
        return f

    return deco if fn is None else deco(fn)


def unregister_template(op_type: str, *, domain: str = "") -> None:
    """Remove a user template (the built-in one, if any, applies again)."""
    USER_TEMPLATES.pop(("" if domain in _DEFAULT_DOMAINS else domain, op_type), None)


def find_template(node: ir.Node) -> Template | None:
    """The template for ``node``: the user's first, then the built-in one; None if neither."""
    domain = "" if node.domain in _DEFAULT_DOMAINS else node.domain
    user = USER_TEMPLATES.get((domain, node.op_type))
    if user is not None:
        return user
    return TEMPLATES.get(node.op_type) if domain == "" else None


class UnsupportedTemplateError(UnsupportedOpError):
    """Ops the Flax emitter has no template for; all listed at once, with how to add one."""

    def __init__(self, missing: list[MissingOp]) -> None:
        self.backend = "flax emitter"
        self.missing = tuple(missing)
        lines = [f"the flax emitter has no template for {len(self.missing)} op type(s):"]
        for m in self.missing:
            where = f", first at node {m.first_node!r}" if m.first_node else ""
            if m.first_scope:
                where += f" (scope {m.first_scope!r})"
            if m.source_line:
                where += f" [{m.source_line}]"
            lines.append(f"  - {m.qualified_name} x{m.count}{where}")
        lines.append(
            "Add a template for each with "
            "xconv.converters.flax.source.templates.register_template(op_type, fn, domain=..., "
            "attrs=...) before converting; fn(call) returns the Python expression for the node."
        )
        ConversionError.__init__(self, "\n".join(lines))


# ---------------------------------------------------------------- literals and dtypes

#: numpy's (and ``jax.numpy``'s) dtype names: ``bool_`` where torch has ``bool``.
_DTYPES = {**ex.DTYPE_NAMES, ir.DataType.BOOL: "bool_"}


def dtype_expr(dtype: ir.DataType | None, xp: str = "jnp") -> str:
    name = ex.dtype_name(_DTYPES, dtype, "Flax emitter")
    if dtype == ir.DataType.BFLOAT16:  # numpy has no bfloat16; jnp's is ml_dtypes' (numpy takes it)
        return "jnp.bfloat16"
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
}

for _op, _fmt in _UNARY.items():
    TEMPLATES[_op] = Template(
        lambda c, _f=_fmt: _f.format(c.args[0], xp=c.xp),
        {},
        "unary",
        static_ok=_op in ("Neg", "Abs", "Identity", "Not", "Floor", "Ceil", "Sign", "Sqrt"),
    )


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


@template("Cast", layout="unary", static_ok=True, to=REQUIRED, saturate=1, round_mode="up")
def _cast(c: OpCall) -> str:
    to = ir.DataType(c.attrs["to"])
    return f"{_saturated(c, to)}.astype({dtype_expr(to, c.xp)})"


@template("CastLike", layout="unary", static_ok=True, saturate=1, round_mode="up")
def _cast_like(c: OpCall) -> str:
    return f"{_saturated(c, c.node.inputs[1].dtype)}.astype({c.args[1]}.dtype)"


_BINARY = {**ex.BINARY, "Pow": "{xp}.power({0}, {1})", "BitShift": None}
for _op, _fmt in _BINARY.items():
    if _fmt is not None:
        TEMPLATES[_op] = Template(
            lambda c, _f=_fmt: _f.format(*c.args, xp=c.xp), {}, "binary", static_ok=True
        )


@template("Div", layout="binary", static_ok=True)
def _div(c: OpCall) -> str:
    dt = c.node.outputs[0].dtype
    if dt is not None and dt.is_integer():
        # ONNX integer division truncates toward zero.
        return f"{c.xp}.trunc({c.args[0]} / {c.args[1]}).astype({c.dtype()})"
    return f"{c.args[0]} / {c.args[1]}"


TEMPLATES["Mod"] = Template(lambda c: ex.mod_expr(c, c.xp), {"fmod": 0}, "binary")
TEMPLATES["Where"] = Template(lambda c: ex.where_expr(c, c.xp), {}, "binary", static_ok=True)


@template("PRelu", layout="binary")
def _prelu(c: OpCall) -> str:
    x, s = c.args
    return f"jnp.where({x} >= 0, {x}, {s} * {x})"


def _variadic(fn: str) -> Callable[[OpCall], str]:
    return lambda c: ex.variadic(c, f"{c.xp}.{fn}")


for _op, _fn in (("Max", "maximum"), ("Min", "minimum")):
    TEMPLATES[_op] = Template(_variadic(_fn), {}, "binary", static_ok=True)
TEMPLATES["Sum"] = Template(ex.sum_expr, {}, "binary", static_ok=True)
TEMPLATES["Mean"] = Template(ex.mean_expr, {}, "binary")


# ---------------------------------------------------------------- linear algebra

TEMPLATES["MatMul"] = Template(ex.matmul_expr, {})
TEMPLATES["Gemm"] = Template(ex.gemm_expr, dict(ex.GEMM_ATTRS))


@template("Einsum", equation=REQUIRED)
def _einsum(c: OpCall) -> str:
    return f"jnp.einsum({c.attrs['equation']!r}, {', '.join(c.args)})"


# ---------------------------------------------------------------- convolution and pooling


def _spatial_pads(c: OpCall, n: int) -> list[tuple[int, int]]:
    if c.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise c.fail(f"auto_pad={c.attrs['auto_pad']!r}; the importer should make pads explicit")
    pads = c.attrs.get("pads") or (0,) * (2 * n)
    return [(int(pads[i]), int(pads[i + n])) for i in range(n)]


@template("Conv", **ex.CONV_ATTRS)
def _conv(c: OpCall) -> str:
    w_shape = c.shapes[1]
    n = len(w_shape) - 2 if w_shape is not None else len(c.attrs["kernel_shape"])
    strides = tuple(c.attrs["strides"] or (1,) * n)
    dil = tuple(c.attrs["dilations"] or (1,) * n)
    spatial = "DHW"[-n:] if n <= 3 else None
    if spatial is None:
        raise c.fail("Conv with more than 3 spatial dims")
    dn = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    out = (
        f"lax.conv_general_dilated({c.args[0]}, {c.args[1]}, window_strides={strides}, "
        f"padding={_spatial_pads(c, n)}, rhs_dilation={dil}, dimension_numbers={dn}, "
        f"feature_group_count={c.attrs['group']})"
    )
    bias = c.consts[2] if len(c.consts) > 2 else None
    if c.has(2) and not (bias is not None and not bias.any()):  # exporters add zero biases
        out += f" + {c.args[2]}.reshape({_channel_shape(n)})"
    return out


def _channel_shape(n: int) -> str:
    """``(-1, 1, 1)``: a per-channel vector broadcast over ``n`` spatial dims."""
    return "(" + ", ".join(["-1"] + ["1"] * n) + ("," if n == 0 else "") + ")"


@template("ConvTranspose", **ex.CONV_TRANSPOSE_ATTRS)
def _conv_transpose(c: OpCall) -> str:
    w_shape = c.shapes[1]
    if w_shape is None:
        raise c.fail("ConvTranspose with a kernel of unknown shape")
    n = len(w_shape) - 2
    if c.attrs["group"] != 1 or c.attrs["output_shape"] is not None or n > 3:
        raise c.fail("grouped ConvTranspose or output_shape; supported: group=1, explicit pads")
    k = [int(d) for d in w_shape[2:]]
    strides = tuple(c.attrs["strides"] or (1,) * n)
    dil = tuple(c.attrs["dilations"] or (1,) * n)
    opad = c.attrs["output_padding"] or (0,) * n
    pads = _spatial_pads(c, n)
    # The gradient of a convolution: dilate the input by the strides, convolve with the
    # spatially flipped kernel whose in/out channels are swapped.
    padding = [
        (dil[i] * (k[i] - 1) - pads[i][0], dil[i] * (k[i] - 1) - pads[i][1] + int(opad[i]))
        for i in range(n)
    ]
    spatial = "DHW"[-n:]
    dn = (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")
    flip = ", ".join([":", ":"] + ["::-1"] * n)
    w = f"jnp.swapaxes({c.args[1]}, 0, 1)[{flip}]"
    out = (
        f"lax.conv_general_dilated({c.args[0]}, {w}, window_strides={(1,) * n}, "
        f"padding={padding}, lhs_dilation={strides}, rhs_dilation={dil}, dimension_numbers={dn})"
    )
    if c.has(2):
        out += f" + {c.args[2]}.reshape({_channel_shape(n)})"
    return out


def _pool_pads(c: OpCall, n: int, kernel, strides) -> list[tuple[int, int]]:
    pads = _spatial_pads(c, n)
    if c.attrs.get("ceil_mode"):
        shape = c.shapes[0]
        if shape is None or any(d is None for d in shape[2:]):
            raise c.fail("ceil_mode=1 needs static spatial dims")
        for i in range(n):
            size = shape[2 + i] + pads[i][0] + pads[i][1]
            k = (kernel[i] - 1) * (c.attrs.get("dilations") or (1,) * n)[i] + 1
            out_ceil = -(-(size - k) // strides[i]) + 1
            if (out_ceil - 1) * strides[i] >= shape[2 + i] + pads[i][0]:
                out_ceil -= 1
            extra = max((out_ceil - 1) * strides[i] + k - size, 0)
            pads[i] = (pads[i][0], pads[i][1] + extra)
    return pads


@template("MaxPool", layout="channels_last", **ex.MAX_POOL_ATTRS)
def _max_pool(c: OpCall) -> str:
    if len(c.node.outputs) > 1 and c.node.outputs[1].uses():
        raise c.fail("MaxPool indices output")
    k = tuple(c.attrs["kernel_shape"])
    n = len(k)
    if any(d != 1 for d in (c.attrs["dilations"] or ())):
        raise c.fail("dilated MaxPool")
    s = tuple(c.attrs["strides"] or (1,) * n)
    pads = _pool_pads(c, n, k, s)
    return f"nn.max_pool({c.args[0]}, {_pool_args(k, s, pads)})"


def _pool_args(k, s, pads, include: bool = True) -> str:
    """``window_shape=...`` and the strides / padding / count_include_pad that differ from
    Flax's defaults (strides 1, ``"VALID"``, ``count_include_pad=True``)."""
    out = [f"window_shape={k}"]
    if any(v != 1 for v in s):
        out.append(f"strides={s}")
    if any(p != (0, 0) for p in pads):
        out.append(f"padding={tuple(tuple(p) for p in pads)}")
        if not include:
            out.append("count_include_pad=False")
    return ", ".join(out)


@template("AveragePool", layout="channels_last", **ex.AVERAGE_POOL_ATTRS)
def _avg_pool(c: OpCall) -> str:
    k = tuple(c.attrs["kernel_shape"])
    n = len(k)
    if any(d != 1 for d in (c.attrs["dilations"] or ())):
        raise c.fail("dilated AveragePool")
    s = tuple(c.attrs["strides"] or (1,) * n)
    pads = _pool_pads(c, n, k, s)
    include = bool(c.attrs["count_include_pad"])
    if c.attrs["ceil_mode"] and include:
        raise c.fail("ceil_mode=1 with count_include_pad=1")
    return f"nn.avg_pool({c.args[0]}, {_pool_args(k, s, pads, include)})"


@template("GlobalAveragePool", layout="channels_last")
def _global_avg_pool(c: OpCall) -> str:
    n = c.need_rank() - 2
    return f"jnp.mean({c.args[0]}, axis={tuple(range(1, n + 1))}, keepdims=True)"


@template("GlobalMaxPool", layout="channels_last")
def _global_max_pool(c: OpCall) -> str:
    n = c.need_rank() - 2
    return f"jnp.max({c.args[0]}, axis={tuple(range(1, n + 1))}, keepdims=True)"


# ---------------------------------------------------------------- normalisation


@template("BatchNormalization", epsilon=1e-5, momentum=0.9, training_mode=0)
def _batch_norm(c: OpCall) -> str:
    if c.attrs["training_mode"]:
        raise c.fail("training_mode=1 outside a recognised batch_norm layer")
    x, scale, bias, mean, var = c.args[:5]
    r = c.rank()
    shape = _channel_shape(r - 2) if r is not None else f"(-1,) + (1,) * ({x}.ndim - 2)"
    eps = scalar_literal(c.attrs["epsilon"])
    return (
        f"({x} - {mean}.reshape({shape})) * lax.rsqrt({var}.reshape({shape}) + {eps}) "
        f"* {scale}.reshape({shape}) + {bias}.reshape({shape})"
    )


@template("LayerNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _layer_norm(c: OpCall) -> str:
    if len(c.node.outputs) > 1 and any(o.uses() or o.is_graph_output() for o in c.node.outputs[1:]):
        raise c.fail("LayerNormalization mean / inv_std_dev outputs")
    c.helpers.add("layer_norm")
    bias = c.args[2] if c.has(2) else "None"
    return (
        f"_layer_norm({c.args[0]}, {c.args[1]}, {bias}, axis={c.attrs['axis']}, "
        f"epsilon={scalar_literal(c.attrs['epsilon'])})"
    )


@template("RMSNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _rms_norm(c: OpCall) -> str:
    c.helpers.add("rms_norm")
    return (
        f"_rms_norm({c.args[0]}, {c.args[1]}, axis={c.attrs['axis']}, "
        f"epsilon={scalar_literal(c.attrs['epsilon'])})"
    )


@template("GroupNormalization", epsilon=1e-5, num_groups=REQUIRED, stash_type=1)
def _group_norm(c: OpCall) -> str:
    c.helpers.add("group_norm")
    return (
        f"_group_norm({c.args[0]}, {c.args[1]}, {c.args[2]}, "
        f"num_groups={c.attrs['num_groups']}, epsilon={scalar_literal(c.attrs['epsilon'])})"
    )


@template("Softmax", layout="axis", axis=-1)
def _softmax(c: OpCall) -> str:
    return f"jax.nn.softmax({c.args[0]}, axis={c.axis(c.attrs['axis'])})"


@template("LogSoftmax", layout="axis", axis=-1)
def _log_softmax(c: OpCall) -> str:
    return f"jax.nn.log_softmax({c.args[0]}, axis={c.axis(c.attrs['axis'])})"


def _causal_mask(mask: np.ndarray | None) -> bool:
    """A constant mask that allows exactly what ``is_causal`` allows: a square lower triangle
    (bool, or additive 0 / -inf), the same for every batch and head."""
    if mask is None or mask.ndim < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    n = mask.shape[-1]
    tril = np.broadcast_to(np.tril(np.ones((n, n), dtype=bool)), mask.shape)
    if mask.dtype == np.bool_:
        return bool(np.array_equal(mask, tril))
    if mask.dtype.kind != "f":
        return False
    return bool(np.all(np.where(tril, mask == 0, np.isneginf(mask))))


@template(
    "Attention",
    is_causal=0,
    kv_num_heads=0,
    q_num_heads=0,
    qk_matmul_output_mode=0,
    scale=None,
    softcap=0.0,
    softmax_precision=None,
)
def _attention(c: OpCall) -> str:
    if len(c.args) > 4 and any(c.has(i) for i in range(4, len(c.args))):
        raise c.fail("Attention with past key/value inputs")
    if any(o.uses() or o.is_graph_output() for o in c.node.outputs[1:]):
        raise c.fail("Attention present key/value or qk outputs")
    if c.attrs["qk_matmul_output_mode"] or c.attrs["softcap"]:
        raise c.fail("Attention qk_matmul_output_mode / softcap")
    # "reference" (xconv.converters.ops.formulation) writes the older einsum-softmax helper.
    name = "attention" if formulation.get("attention") == "auto" else "attention_reference"
    mask = c.args[3] if c.has(3) else "None"
    causal = bool(c.attrs["is_causal"])
    if c.has(3) and _causal_mask(c.consts[3]):
        mask, causal = "None", True  # the mask a causal model builds: is_causal says it
    direct = dot_product_attention(c, mask, causal)
    if direct is not None and name == "attention":
        return direct
    c.helpers.add(name)
    # the helper's defaults (no mask, not causal, 1/sqrt(d), 4-D inputs) are not spelled out
    args = bhsd_operands(c) + ([mask] if mask != "None" else [])
    if causal:
        args.append("is_causal=True")
    if c.attrs["scale"] is not None:
        args.append(f"scale={scalar_literal(c.attrs['scale'])}")
    for key in ("q_num_heads", "kv_num_heads"):
        if c.attrs[key]:
            args.append(f"{key}={c.attrs[key]}")
    out = f"_{name}({', '.join(args)})"
    return f"jnp.swapaxes({out}, 1, 2)" if c.node.metadata_props.get(BSHD) else out


# ---------------------------------------------------------------- reductions


def _reduce(fn: str, pre: str = "{0}", post: str = "{0}") -> Callable[[OpCall], str]:
    def emit(c: OpCall) -> str:
        axes = c.attrs.get("axes")
        if c.has(1):
            axes = c.const(1, "axes")
        keep = bool(c.attrs["keepdims"])
        x = pre.format(c.args[0])
        if axes is None or len(np.asarray(axes).reshape(-1)) == 0:
            if c.attrs["noop_with_empty_axes"]:
                return c.args[0]
            return post.format(f"{c.xp}.{fn}({x}, keepdims={keep})")
        phys = tuple(sorted(c.axis(int(a)) for a in np.asarray(axes).reshape(-1)))
        return post.format(f"{c.xp}.{fn}({x}, axis={phys}, keepdims={keep})")

    return emit


for _op, _args in {
    "ReduceMean": ("mean",),
    "ReduceSum": ("sum",),
    "ReduceMax": ("max",),
    "ReduceMin": ("min",),
    "ReduceProd": ("prod",),
    "ReduceSumSquare": ("sum", "jnp.square({0})"),
    "ReduceL1": ("sum", "jnp.abs({0})"),
    "ReduceL2": ("sum", "jnp.square({0})", "jnp.sqrt({0})"),
    "ReduceLogSumExp": ("sum", "jnp.exp({0})", "jnp.log({0})"),
}.items():
    TEMPLATES[_op] = Template(
        _reduce(*_args),
        {"axes": None, "keepdims": 1, "noop_with_empty_axes": 0},
        "reduce",
        static_ok=_op in ("ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin"),
    )


@template("ArgMax", "ArgMin", axis=0, keepdims=1, select_last_index=0)
def _argmax(c: OpCall) -> str:
    if c.attrs["select_last_index"]:
        raise c.fail("select_last_index=1")
    fn = "argmax" if c.node.op_type == "ArgMax" else "argmin"
    return (
        f"jnp.{fn}({c.args[0]}, axis={c.attrs['axis']}, "
        f"keepdims={bool(c.attrs['keepdims'])}).astype({c.dtype()})"
    )


@template("CumSum", exclusive=0, reverse=0)
def _cumsum(c: OpCall) -> str:
    if c.attrs["exclusive"] or c.attrs["reverse"]:
        raise c.fail("CumSum exclusive / reverse")
    return f"jnp.cumsum({c.args[0]}, axis={int(c.const(1, 'axis'))})"


# ---------------------------------------------------------------- shape and indexing


@template("Shape", static_ok=True, start=0, end=None)
def _shape(c: OpCall) -> str:
    s, e = c.attrs["start"], c.attrs["end"]
    sl = "" if (s == 0 and e is None) else f"[{s or ''}:{'' if e is None else e}]"
    return f"np.asarray({c.args[0]}.shape{sl}, dtype=np.int64)"


@template("Size", static_ok=True)
def _size(c: OpCall) -> str:
    return f"np.asarray(math.prod({c.args[0]}.shape), dtype=np.int64)"


@template("Reshape", static_ok=True, allowzero=0)
def _reshape(c: OpCall) -> str:
    target = c.consts[1]
    if target is not None:
        dims = [int(t) for t in target]
        parts = []
        for i, t in enumerate(dims):
            if t == 0 and not c.attrs["allowzero"]:
                in_shape = c.shapes[0]
                known = in_shape[i] if in_shape is not None and i < len(in_shape) else None
                parts.append(str(known) if known is not None else f"{c.args[0]}.shape[{i}]")
            else:
                parts.append(str(t))
        return f"{c.xp}.reshape({c.args[0]}, ({', '.join(parts)}{',' if len(parts) == 1 else ''}))"
    c.helpers.add("reshape")
    return f"_reshape({c.args[0]}, {c.args[1]})"


@template("Flatten", axis=1)
def _flatten(c: OpCall) -> str:
    a = c.attrs["axis"]
    if a == 0:
        return f"jnp.reshape({c.args[0]}, (1, -1))"
    if a == 1:
        return f"jnp.reshape({c.args[0]}, ({c.args[0]}.shape[0], -1))"
    return f"jnp.reshape({c.args[0]}, (math.prod({c.args[0]}.shape[:{a}]), -1))"


@template("Transpose", static_ok=True, perm=None)
def _transpose(c: OpCall) -> str:
    perm = c.attrs["perm"]
    if perm is None:
        return f"{c.xp}.transpose({c.args[0]})"
    return f"{c.xp}.transpose({c.args[0]}, {tuple(int(p) for p in perm)})"


@template("Concat", layout="axis", static_ok=True, axis=REQUIRED)
def _concat(c: OpCall) -> str:
    return f"{c.xp}.concatenate([{', '.join(c.args)}], axis={c.axis(c.attrs['axis'])})"


@template("Squeeze", static_ok=True)
def _squeeze(c: OpCall) -> str:
    if not c.has(1):
        return f"{c.xp}.squeeze({c.args[0]})"
    return f"{c.xp}.squeeze({c.args[0]}, axis={tuple_literal(c.const(1, 'axes'))})"


@template("Unsqueeze", static_ok=True)
def _unsqueeze(c: OpCall) -> str:
    return f"{c.xp}.expand_dims({c.args[0]}, {tuple_literal(c.const(1, 'axes'))})"


@template("Expand", static_ok=True)
def _expand(c: OpCall) -> str:
    shape = c.consts[1]
    target = tuple_literal(shape) if shape is not None else f"tuple({c.args[1]})"
    return f"{c.xp}.broadcast_to({c.args[0]}, {c.xp}.broadcast_shapes({c.args[0]}.shape, {target}))"


@template("Tile", static_ok=True)
def _tile(c: OpCall) -> str:
    return f"{c.xp}.tile({c.args[0]}, {tuple_literal(c.const(1, 'repeats'))})"


def _slice_bound(v: int, dim: int | None) -> str | None:
    if v >= INT64_MAX // 2 or v <= -INT64_MAX // 2:
        return None
    return str(v)


@template("Slice", static_ok=True)
def _slice(c: OpCall) -> str:
    starts = c.const(1, "starts").reshape(-1)
    ends = c.const(2, "ends").reshape(-1)
    rank = c.rank()
    axes = c.const(3, "axes").reshape(-1) if c.has(3) else np.arange(len(starts))
    steps = c.const(4, "steps").reshape(-1) if c.has(4) else np.ones(len(starts), np.int64)
    if rank is None:
        raise c.fail("Slice of an input with unknown rank")
    idx = [":"] * rank
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        a = int(a) + rank if a < 0 else int(a)
        st = int(st)
        lo = _slice_bound(int(s), None)
        hi = _slice_bound(int(e), None)
        if st > 0:
            lo = None if lo == "0" else lo
        idx[a] = f"{lo or ''}:{hi or ''}" + (f":{st}" if st != 1 else "")
    while idx and idx[-1] == ":":
        idx.pop()
    return f"{c.args[0]}[{', '.join(idx) or '...'}]"


@template("Gather", static_ok=True, axis=0)
def _gather(c: OpCall) -> str:
    a = c.attrs["axis"]
    idx = c.consts[1]
    if idx is not None and idx.ndim == 0 and c.rank() is not None:
        r = c.rank()
        a = a + r if a < 0 else a
        return f"{c.args[0]}[{', '.join([':'] * a + [str(int(idx))])}]"
    return f"{c.xp}.take({c.args[0]}, {c.args[1]}, axis={a})"


@template("GatherElements", axis=0)
def _gather_elements(c: OpCall) -> str:
    return f"jnp.take_along_axis({c.args[0]}, {c.args[1]}, axis={c.attrs['axis']})"


@template("Split", axis=0, num_outputs=None)
def _split(c: OpCall) -> str:
    a = c.attrs["axis"]
    if c.has(1):
        sizes = [int(s) for s in c.const(1, "split")]
        cuts = tuple(int(x) for x in np.cumsum(sizes)[:-1])
        return f"jnp.split({c.args[0]}, {list(cuts)}, axis={a})"
    n = c.attrs["num_outputs"] or len(c.node.outputs)
    dim = c.shapes[0][a] if c.shapes[0] is not None else None
    if dim is None or dim % n:
        if dim is None:
            raise c.fail("Split into num_outputs of an unknown-size axis")
        size = -(-dim // n)
        cuts = [size * i for i in range(1, n)]
        return f"jnp.split({c.args[0]}, {cuts}, axis={a})"
    return f"jnp.split({c.args[0]}, {n}, axis={a})"


@template("SplitToSequence", axis=0, keepdims=1)
def _split_to_sequence(c: OpCall) -> str:
    """A Python list of arrays (an ONNX sequence)."""
    a = c.attrs["axis"]
    shape = c.shapes[0]
    dim = shape[a] if shape is not None and -len(shape) <= a < len(shape) else None
    if not c.has(1):
        pieces = f"jnp.split({c.args[0]}, {c.args[0]}.shape[{a}], axis={a})"
        if c.attrs["keepdims"]:
            return f"list({pieces})"
        return f"[jnp.squeeze(p, axis={a}) for p in {pieces}]"
    split = c.const(1, "split")
    if split.ndim == 0:
        if dim is None:
            raise c.fail("SplitToSequence by a chunk size along an axis of unknown size")
        cuts = list(range(int(split), dim, int(split)))
    else:
        cuts = [int(x) for x in np.cumsum(split)[:-1]]
    return f"list(jnp.split({c.args[0]}, {cuts}, axis={a}))"


@template("SequenceAt")
def _sequence_at(c: OpCall) -> str:
    return f"{c.args[0]}[{int(c.const(1, 'position'))}]"


@template("SequenceLength")
def _sequence_length(c: OpCall) -> str:
    return f"np.asarray(len({c.args[0]}), dtype=np.int64)"


@template("Pad", mode="constant")
def _pad(c: OpCall) -> str:
    pads = [int(p) for p in c.const(1, "pads")]
    rank = c.rank()
    if rank is None:
        raise c.fail("Pad of an input with unknown rank")
    axes = list(range(rank))
    if c.has(3):
        axes = [int(a) + rank if a < 0 else int(a) for a in c.const(3, "axes")]
    widths = [(0, 0)] * rank
    n = len(axes)
    for i, a in enumerate(axes):
        widths[a] = (pads[i], pads[i + n])
    mode = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}
    m = c.attrs["mode"]
    if m not in mode:
        raise c.fail(f"mode={m!r}")
    if any(lo < 0 or hi < 0 for lo, hi in widths):
        raise c.fail("negative pads")
    extra = ""
    if m == "constant" and c.has(2):
        extra = f", constant_values={c.args[2]}"
    return f"jnp.pad({c.args[0]}, {tuple(widths)}, mode={m!r}{extra})"


@template("ConstantOfShape", static_ok=True, value=None)
def _constant_of_shape(c: OpCall) -> str:
    v = c.attrs["value"]
    val = np.zeros((), np.float32) if v is None else np.asarray(v).reshape(())
    dt = dtype_expr(ir.DataType.from_numpy(val.dtype), c.xp)
    shape = tuple_literal(c.consts[0]) if c.consts[0] is not None else f"tuple({c.args[0]})"
    return f"{c.xp}.full({shape}, {scalar_literal(val[()])}, dtype={dt})"


@template("Range", static_ok=True)
def _range(c: OpCall) -> str:
    return f"{c.xp}.arange({c.args[0]}, {c.args[1]}, {c.args[2]}, dtype={c.dtype()})"


@template("Trilu", upper=1)
def _trilu(c: OpCall) -> str:
    fn = "triu" if c.attrs["upper"] else "tril"
    k = f", {int(c.const(1, 'k'))}" if c.has(1) else ""
    return f"jnp.{fn}({c.args[0]}{k})"


@template("TopK", axis=-1, largest=1, sorted=1)
def _topk(c: OpCall) -> str:
    r = c.rank()
    a = c.attrs["axis"]
    if r is None or (a + r if a < 0 else a) != r - 1:
        raise c.fail("TopK over an axis other than the last one")
    k = int(c.const(1, "k").reshape(-1)[0])
    x = c.args[0] if c.attrs["largest"] else f"-{c.args[0]}"
    vals = "{0}[0]" if c.attrs["largest"] else "-{0}[0]"
    return f"(lambda r: ({vals.format('r')}, r[1].astype(jnp.int64)))(lax.top_k({x}, {k}))"


# ---------------------------------------------------------------- recurrent layers

_RNN_ATTRS = COMMON_ATTRS

#: op -> (default activations, number of outputs of the helper)
_RNN_DEFAULTS = {
    "RNN": (("Tanh",), 2),
    "GRU": (("Sigmoid", "Tanh"), 2),
    "LSTM": (("Sigmoid", "Tanh", "Tanh"), 3),
}


def _zero_or_none(c: OpCall, i: int) -> str:
    """The argument expression, or ``None`` when absent or a constant zero (initial states)."""
    if not c.has(i):
        return "None"
    const = c.consts[i]
    return "None" if const is not None and not np.asarray(const).any() else c.args[i]


def _recurrent(c: OpCall) -> str:
    """ONNX RNN / GRU / LSTM as a call of the generated ``_rnn`` / ``_gru`` / ``_lstm``."""
    op = c.node.op_type
    defaults, n_out = _RNN_DEFAULTS[op]
    acts = c.attrs["activations"]
    if acts is not None and [a.lower() for a in acts] not in (
        [a.lower() for a in defaults],
        [a.lower() for a in defaults * 2],
    ):
        raise c.fail(f"activations={list(acts)}; the Flax emitter writes {list(defaults)}")
    if c.attrs["clip"] is not None:
        raise c.fail("clip; the Flax emitter writes unclipped cells")
    direction = c.attrs["direction"]
    if direction not in ("forward", "reverse", "bidirectional"):
        raise c.fail(f"direction={direction!r}; supported: forward, reverse, bidirectional")
    if op == "LSTM" and c.attrs["input_forget"]:
        raise c.fail("input_forget=1")
    if c.attrs["layout"] not in (0, 1):
        raise c.fail(f"layout={c.attrs['layout']}; supported: 0, 1")
    b = c.args[3] if c.has(3) else "None"
    lens = c.args[4] if c.has(4) else "None"
    args = [c.args[0], c.args[1], c.args[2], b, lens, _zero_or_none(c, 5)]
    if op == "LSTM":
        args += [_zero_or_none(c, 6), c.args[7] if c.has(7) else "None"]
    kw = f"reverse={direction == 'reverse'}, batch_first={bool(c.attrs['layout'])}"
    if op == "GRU":
        kw += f", linear_before_reset={bool(c.attrs['linear_before_reset'])}"
    name = op.lower()
    c.helpers |= {name, "rnn_scan"}
    call = f"_{name}({', '.join(args)}, {kw})"
    n = len(c.node.outputs)
    return f"{call}[0]" if n == 1 else call if n == n_out else f"{call}[:{n}]"


TEMPLATES["RNN"] = Template(_recurrent, dict(_RNN_ATTRS))
TEMPLATES["GRU"] = Template(_recurrent, {**_RNN_ATTRS, "linear_before_reset": 0})
TEMPLATES["LSTM"] = Template(_recurrent, {**_RNN_ATTRS, "input_forget": 0})


# ---------------------------------------------------------------- helper functions

HELPERS: dict[str, str] = {
    # torch updates running_var with the unbiased batch variance (n / (n - 1)), Flax's
    # BatchNorm with the biased one; a torch source's BatchNorm keeps torch's statistics.
    "torch_batch_norm_linen": '''
def _torch_batch_norm(bn, x, train):
    """Flax BatchNorm with torch's running-variance update (unbiased batch variance)."""
    y = bn(x, use_running_average=not train)
    if train and not bn.is_initializing():
        x = x.reshape(-1, x.shape[-1])
        var = bn.get_variable("batch_stats", "var") + (1 - bn.momentum) * x.var(0) / (len(x) - 1)
        bn.put_variable("batch_stats", "var", var)
    return y
''',
    "torch_batch_norm_nnx": '''
def _torch_batch_norm(bn, x, train):
    """Flax BatchNorm with torch's running-variance update (unbiased batch variance)."""
    y = bn(x, use_running_average=not train)
    if train:
        x = x.reshape(-1, x.shape[-1])
        bn.var.value += (1 - bn.momentum) * x.var(0) / (len(x) - 1)
    return y
''',
    "reshape": '''
def _reshape(x, shape):
    """ONNX Reshape: 0 copies the input dimension, -1 is inferred."""
    dims = [x.shape[i] if int(d) == 0 else int(d) for i, d in enumerate(shape)]
    return jnp.reshape(x, dims)
''',
    "layer_norm": """
def _layer_norm(x, scale, bias, axis, epsilon):
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) * lax.rsqrt(var + epsilon) * scale
    return y if bias is None else y + bias
""",
    "rms_norm": """
def _rms_norm(x, scale, axis, epsilon):
    axes = tuple(range(axis % x.ndim, x.ndim))
    return x * lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + epsilon) * scale
""",
    "group_norm": """
def _group_norm(x, scale, bias, num_groups, epsilon):
    n, c = x.shape[:2]
    g = jnp.reshape(x, (n, num_groups, -1))
    mean = jnp.mean(g, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(g - mean), axis=-1, keepdims=True)
    y = jnp.reshape((g - mean) * lax.rsqrt(var + epsilon), x.shape)
    bshape = (1, c) + (1,) * (x.ndim - 2)
    return y * jnp.reshape(scale, bshape) + jnp.reshape(bias, bshape)
""",
    "attention": '''
def _attention(q, k, v, mask=None, is_causal=False, scale=None, q_num_heads=0, kv_num_heads=0):
    """ONNX Attention (opset 23) without past key/value: 4-D (B, H, S, D) or 3-D (B, S, H*D)
    inputs, computed in their own layout (head- or sequence-major, no transposes); cuDNN's
    fused kernel on a GPU for float16/bfloat16 without a mask. A query row nothing may attend
    gives zeros."""
    three_d = q.ndim == 3
    if three_d:
        b = q.shape[0]
        q = jnp.reshape(q, (b, q.shape[1], q_num_heads, -1))
        k = jnp.reshape(k, (b, k.shape[1], kv_num_heads, -1))
        v = jnp.reshape(v, (b, v.shape[1], kv_num_heads, -1))
    head, seq = (2, 1) if three_d else (1, 2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if (
        mask is None
        and q.dtype in (jnp.float16, jnp.bfloat16)
        and jax.default_backend() in ("gpu", "cuda")
    ):
        swap = (lambda t: t) if three_d else (lambda t: jnp.swapaxes(t, 1, 2))
        out = swap(jax.nn.dot_product_attention(
            swap(q), swap(k), swap(v), scale=scale, is_causal=is_causal, implementation="cudnn"
        ))
        return jnp.reshape(out, (b, out.shape[1], -1)) if three_d else out
    groups = q.shape[head] // k.shape[head]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=head)
        v = jnp.repeat(v, groups, axis=head)
    lhs = "bqhd,bkhd->bhqk" if three_d else "bhqd,bhkd->bhqk"
    scores = jnp.einsum(lhs, q, k) * jnp.asarray(scale, q.dtype)
    lowest = jnp.finfo(scores.dtype).min
    allowed = empty = None
    if is_causal:
        allowed = jnp.tril(jnp.ones((q.shape[seq], k.shape[seq]), dtype=bool))
    if mask is not None and mask.dtype == bool:
        allowed = mask if allowed is None else mask & allowed
        empty = ~jnp.any(allowed, axis=-1, keepdims=True)
    elif mask is not None:
        scores = scores + jnp.maximum(mask, lowest)
        dead = jnp.isneginf(mask) if allowed is None else jnp.isneginf(mask) | ~allowed
        empty = jnp.all(dead, axis=-1, keepdims=True)
    if allowed is not None:
        scores = jnp.where(allowed, scores, lowest)
    probs = jax.nn.softmax(scores, axis=-1)
    if empty is not None:
        probs = jnp.where(empty, 0, probs)
    rhs = "bhqk,bkhd->bqhd" if three_d else "bhqk,bhkd->bhqd"
    out = jnp.einsum(rhs, probs, v)
    return jnp.reshape(out, (b, out.shape[1], -1)) if three_d else out
''',
    "attention_reference": '''
def _attention_reference(
    q, k, v, mask=None, is_causal=False, scale=None, q_num_heads=0, kv_num_heads=0
):
    """ONNX Attention (opset 23) without past key/value: 4-D (B, H, S, D) or 3-D inputs."""
    three_d = q.ndim == 3
    if three_d:
        b = q.shape[0]
        q = jnp.transpose(jnp.reshape(q, (b, q.shape[1], q_num_heads, -1)), (0, 2, 1, 3))
        k = jnp.transpose(jnp.reshape(k, (b, k.shape[1], kv_num_heads, -1)), (0, 2, 1, 3))
        v = jnp.transpose(jnp.reshape(v, (b, v.shape[1], kv_num_heads, -1)), (0, 2, 1, 3))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=1)
        v = jnp.repeat(v, groups, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if is_causal:
        causal = jnp.tril(jnp.ones((q.shape[2], k.shape[2]), dtype=bool))
        scores = jnp.where(causal, scores, -jnp.inf)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf) if mask.dtype == bool else scores + mask
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)
    if three_d:
        out = jnp.reshape(jnp.transpose(out, (0, 2, 1, 3)), (out.shape[0], out.shape[2], -1))
    return out
''',
    "rnn_scan": """
def _rnn_scan(step, xs, carry, lens, reverse):
    \"\"\"Scan ``step(carry, x_t) -> (carry, y_t)`` over time (axis 0).

    With ``lens`` each batch entry stops at its own length: its state is frozen and its
    later outputs are zero; in reverse it starts from its own last step.
    \"\"\"
    if lens is None:
        carry, ys = lax.scan(step, carry, xs, reverse=reverse)
        return ys, carry
    t = jnp.arange(xs.shape[0])[:, None]
    valid = t < lens[None, :]
    if reverse:
        order = jnp.where(valid, lens[None, :] - 1 - t, t)
        xs = jnp.take_along_axis(xs, order[:, :, None], axis=0)

    def masked(carry, inp):
        x_t, ok = inp
        new, y = step(carry, x_t)
        keep = ok[:, None]
        new = jax.tree_util.tree_map(lambda n, o: jnp.where(keep, n, o), new, carry)
        return new, jnp.where(keep, y, 0)

    carry, ys = lax.scan(masked, carry, (xs, valid))
    if reverse:
        ys = jnp.take_along_axis(ys, order[:, :, None], axis=0)
    return ys, carry
""",
    "rnn": """
def _rnn(x, w, r, b, lens, h0, *, reverse, batch_first):
    \"\"\"ONNX RNN (tanh): weights (directions, hidden, in); returns (Y, Y_h).\"\"\"
    if batch_first:
        x, h0 = jnp.swapaxes(x, 0, 1), None if h0 is None else jnp.swapaxes(h0, 0, 1)
    ys, hs = [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        if b is not None:
            wb, rb = jnp.split(b[d], 2)
            xw = xw + wb + rb
        h = jnp.zeros((x.shape[1], r.shape[-1]), x.dtype) if h0 is None else h0[d]

        def step(h, xw_t, r_d=r[d]):
            h = jnp.tanh(xw_t + h @ r_d.T)
            return h, h

        y, h = _rnn_scan(step, xw, h, lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
    y, h = jnp.stack(ys, 1), jnp.stack(hs)
    if batch_first:
        return jnp.transpose(y, (2, 0, 1, 3)), jnp.swapaxes(h, 0, 1)
    return y, h
""",
    "gru": """
def _gru(x, w, r, b, lens, h0, *, reverse, batch_first, linear_before_reset):
    \"\"\"ONNX GRU, gates z, r, h: weights (directions, 3 * hidden, in); returns (Y, Y_h).\"\"\"
    if batch_first:
        x, h0 = jnp.swapaxes(x, 0, 1), None if h0 is None else jnp.swapaxes(h0, 0, 1)
    hidden = r.shape[-1]
    ys, hs = [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        rb = jnp.zeros((3 * hidden,), x.dtype)
        if b is not None:
            wb, rb = jnp.split(b[d], 2)
            xw = xw + wb
        h = jnp.zeros((x.shape[1], hidden), x.dtype) if h0 is None else h0[d]

        def step(h, xw_t, r_d=r[d], rb=rb):
            xz, xr, xh = jnp.split(xw_t, 3, axis=-1)
            rz, rr, rh = jnp.split(r_d, 3)
            bz, br, bh = jnp.split(rb, 3)
            z = jax.nn.sigmoid(xz + h @ rz.T + bz)
            reset = jax.nn.sigmoid(xr + h @ rr.T + br)
            if linear_before_reset:
                n = jnp.tanh(xh + reset * (h @ rh.T + bh))
            else:
                n = jnp.tanh(xh + (reset * h) @ rh.T + bh)
            h = (1 - z) * n + z * h
            return h, h

        y, h = _rnn_scan(step, xw, h, lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
    y, h = jnp.stack(ys, 1), jnp.stack(hs)
    if batch_first:
        return jnp.transpose(y, (2, 0, 1, 3)), jnp.swapaxes(h, 0, 1)
    return y, h
""",
    "lstm": """
def _lstm(x, w, r, b, lens, h0, c0, p, *, reverse, batch_first):
    \"\"\"ONNX LSTM, gates i, o, f, c: weights (directions, 4 * hidden, in); (Y, Y_h, Y_c).\"\"\"
    if batch_first:
        x = jnp.swapaxes(x, 0, 1)
        h0 = None if h0 is None else jnp.swapaxes(h0, 0, 1)
        c0 = None if c0 is None else jnp.swapaxes(c0, 0, 1)
    hidden = r.shape[-1]
    ys, hs, cs = [], [], []
    for d in range(w.shape[0]):
        xw = x @ w[d].T
        if b is not None:
            wb, rb = jnp.split(b[d], 2)
            xw = xw + wb + rb
        zeros = jnp.zeros((x.shape[1], hidden), x.dtype)
        h = zeros if h0 is None else h0[d]
        c = zeros if c0 is None else c0[d]
        pi, po, pf = (0, 0, 0) if p is None else jnp.split(p[d], 3)

        def step(carry, xw_t, r_d=r[d], pi=pi, po=po, pf=pf):
            h, c = carry
            i, o, f, g = jnp.split(xw_t + h @ r_d.T, 4, axis=-1)
            i = jax.nn.sigmoid(i + pi * c)
            f = jax.nn.sigmoid(f + pf * c)
            c = f * c + i * jnp.tanh(g)
            h = jax.nn.sigmoid(o + po * c) * jnp.tanh(c)
            return (h, c), h

        y, (h, c) = _rnn_scan(step, xw, (h, c), lens, reverse or d == 1)
        ys.append(y)
        hs.append(h)
        cs.append(c)
    y, h, c = jnp.stack(ys, 1), jnp.stack(hs), jnp.stack(cs)
    if batch_first:
        return jnp.transpose(y, (2, 0, 1, 3)), jnp.swapaxes(h, 0, 1), jnp.swapaxes(c, 0, 1)
    return y, h, c
""",
}
