"""Op templates whose target expression is the same Python for every source emitter.

The Flax and PyTorch source emitters write many ONNX ops the same way up to the array
namespace (``jnp.tanh(x)`` / ``torch.tanh(x)``) or not at all namespaced (``a @ b``,
``a + b``). Those forms are written here once; each emitter registers them with its own
namespace and layout flags and keeps only what differs. Format strings take the operands as
``{0}``, ``{1}`` and the namespace as ``{xp}``. Framework-free: imports no framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import TemplateCall, nested_literal, scalar_literal
from xconv.converters.ops.attention import CAUSAL_CONV_ACTIVATIONS, linear_attention_rule
from xconv.converters.ops.attrs import CONV_ATTRS
from xconv.converters.ops.elementwise import prelu_slope_shape
from xconv.converters.ops.linalg import LOSS_REDUCTIONS
from xconv.converters.ops.nn import POOL_ATTRS
from xconv.converters.ops.shapes import conv_padding
from xconv.converters.ops.signal import BLACKMAN, HAMMING, HANN
from xconv.converters.registry import REQUIRED
from xconv.errors import ConversionError

#: Dtype attribute names shared by numpy, ``jax.numpy`` and torch (``bool`` is ``bool_`` in
#: numpy's namespace: the Flax emitter overrides it; numpy has none of the float8 types, which
#: ``jax.numpy`` and torch name alike).
DTYPE_NAMES: dict[ir.DataType, str] = {
    ir.DataType.FLOAT: "float32",
    ir.DataType.DOUBLE: "float64",
    ir.DataType.FLOAT16: "float16",
    ir.DataType.BFLOAT16: "bfloat16",
    ir.DataType.INT8: "int8",
    ir.DataType.INT16: "int16",
    ir.DataType.INT32: "int32",
    ir.DataType.INT64: "int64",
    ir.DataType.UINT8: "uint8",
    ir.DataType.UINT16: "uint16",
    ir.DataType.UINT32: "uint32",
    ir.DataType.UINT64: "uint64",
    ir.DataType.BOOL: "bool",
    ir.DataType.FLOAT8E4M3FN: "float8_e4m3fn",
    ir.DataType.FLOAT8E4M3FNUZ: "float8_e4m3fnuz",
    ir.DataType.FLOAT8E5M2: "float8_e5m2",
    ir.DataType.FLOAT8E5M2FNUZ: "float8_e5m2fnuz",
    ir.DataType.FLOAT8E8M0: "float8_e8m0fnu",
}

#: The float8 types, whose saturating cast both emitters spell out.
FLOAT8 = frozenset(
    {
        ir.DataType.FLOAT8E4M3FN,
        ir.DataType.FLOAT8E4M3FNUZ,
        ir.DataType.FLOAT8E5M2,
        ir.DataType.FLOAT8E5M2FNUZ,
    }
)

#: Unary ops written ``{xp}.<name>(x)`` in both namespaces, plus the two without one.
UNARY: dict[str, str] = {
    "Tanh": "{xp}.tanh({0})",
    "Exp": "{xp}.exp({0})",
    "Log": "{xp}.log({0})",
    "Neg": "-{0}",
    "Abs": "{xp}.abs({0})",
    "Sqrt": "{xp}.sqrt({0})",
    "Reciprocal": "{xp}.reciprocal({0})",
    "Floor": "{xp}.floor({0})",
    "Ceil": "{xp}.ceil({0})",
    "Round": "{xp}.round({0})",
    "Sin": "{xp}.sin({0})",
    "Cos": "{xp}.cos({0})",
    "Tan": "{xp}.tan({0})",
    "Not": "{xp}.logical_not({0})",
    "IsNaN": "{xp}.isnan({0})",
    "Sign": "{xp}.sign({0})",
    "Identity": "{0}",
    "Sinh": "{xp}.sinh({0})",
    "Cosh": "{xp}.cosh({0})",
    "BitwiseNot": "{xp}.bitwise_not({0})",
    "Det": "{xp}.linalg.det({0})",
}


def pow_casts(c) -> bool:
    """Whether a ``Pow`` call's result must be cast back to its base's type: ONNX gives the
    base's type, and an integer base with a float exponent computes in float (the runtimes
    cast it back, truncating; ``xconv.converters.ops.math``)."""
    base, exponent = (v.dtype if v is not None else None for v in c.node.inputs[:2])
    if base is None or exponent is None:
        return False
    return not base.is_floating_point() and exponent.is_floating_point()


#: Broadcasting binary ops: Python operators, and logical functions of the same name.
BINARY: dict[str, str] = {
    "Add": "{0} + {1}",
    "Sub": "{0} - {1}",
    "Mul": "{0} * {1}",
    "Equal": "{0} == {1}",
    "Less": "{0} < {1}",
    "Greater": "{0} > {1}",
    "LessOrEqual": "{0} <= {1}",
    "GreaterOrEqual": "{0} >= {1}",
    "And": "{xp}.logical_and({0}, {1})",
    "Or": "{xp}.logical_or({0}, {1})",
    "Xor": "{xp}.logical_xor({0}, {1})",
    "BitwiseAnd": "{xp}.bitwise_and({0}, {1})",
    "BitwiseOr": "{xp}.bitwise_or({0}, {1})",
    "BitwiseXor": "{xp}.bitwise_xor({0}, {1})",
}


def with_namespace(formats: Mapping[str, str], xp: str) -> dict[str, str]:
    """``formats`` with ``{xp}`` replaced by a fixed namespace (``torch``); operands kept."""
    return {op: fmt.replace("{xp}", xp) for op, fmt in formats.items()}


def dtype_name(table: Mapping[ir.DataType, str], dtype: ir.DataType | None, emitter: str) -> str:
    """``table[dtype]``, or the error naming the emitter and the dtypes it writes."""
    if dtype is None or dtype not in table:
        raise ConversionError(
            f"the {emitter} does not write dtype {dtype}; "
            f"supported: {sorted(str(d) for d in table)}"
        )
    return table[dtype]


def e8m0_call(c: TemplateCall, x: str) -> str:
    """``_to_e8m0(x[, saturate=False][, round_mode=...])``: a Cast / CastLike to float8e8m0,
    which is a rounding of float32's exponent (``ops.elementwise.to_e8m0``), not a framework
    cast; each emitter writes the helper (added to ``c.helpers``). Refused by name: a
    round_mode ONNX does not define."""
    mode = c.attrs["round_mode"]
    if mode not in ("up", "down", "nearest"):
        raise c.fail(f"round_mode={mode!r}; ONNX defines 'up', 'down', 'nearest'")
    c.helpers.add("to_e8m0")
    tail = [] if c.attrs["saturate"] else ["saturate=False"]
    tail += [] if mode == "up" else [f'round_mode="{mode}"']
    return f"_to_e8m0({', '.join([x, *tail])})"


def constructor_literal(a: np.ndarray, ctor: str, dtype: str, *, bare_scalar: bool) -> str:
    """``ctor(<nested list>, dtype=<dtype>)`` for a small constant (``a`` already an array);
    a bare Python scalar for a 0-d one when allowed."""
    if bare_scalar and a.ndim == 0:
        return scalar_literal(a[()])
    return f"{ctor}({nested_literal(a)}, dtype={dtype})"


def variadic(c: TemplateCall, fn: str) -> str:
    """``fn(fn(a, b), c)``: a two-argument function folded over the inputs (Max, Min)."""
    out = c.args[0]
    for a in c.args[1:]:
        out = f"{fn}({out}, {a})"
    return out


def sum_expr(c: TemplateCall) -> str:
    return " + ".join(a for a in c.args if a)


def mean_expr(c: TemplateCall) -> str:
    return f"({' + '.join(a for a in c.args if a)}) / {len(c.args)}"


def where_expr(c: TemplateCall, xp: str) -> str:
    return f"{xp}.where({c.args[0]}, {c.args[1]}, {c.args[2]})"


def shrink_expr(c: TemplateCall, xp: str) -> str:
    """ONNX Shrink: ``x + bias`` below ``-lambd``, ``x - bias`` above ``lambd``, 0 between."""
    x, lambd, bias = c.args[0], scalar_literal(c.attrs["lambd"]), scalar_literal(c.attrs["bias"])
    return f"{xp}.where({x} < -{lambd}, {x} + {bias}, {xp}.where({x} > {lambd}, {x} - {bias}, 0))"


def thresholded_relu_expr(c: TemplateCall, xp: str) -> str:
    return f"{xp}.where({c.args[0]} > {scalar_literal(c.attrs['alpha'])}, {c.args[0]}, 0)"


def swish_expr(c: TemplateCall, silu: str, sigmoid: str) -> str:
    """ONNX Swish: ``x * sigmoid(alpha * x)``; the framework's silu where alpha is 1."""
    x, alpha = c.args[0], c.attrs["alpha"]
    if alpha == 1.0:
        return f"{silu}({x})"
    return f"{x} * {sigmoid}({scalar_literal(alpha)} * {x})"


def lrn_window(c: TemplateCall) -> tuple[int, int]:
    """LRN's channel window around each channel: ``(size - 1) // 2`` before, ``size // 2``
    after (ONNX's floor / ceil of ``(size - 1) / 2``)."""
    size = int(c.attrs["size"])
    return (size - 1) // 2, size // 2


def block_rearrange(c: TemplateCall, permute: str) -> str:
    """DepthToSpace / SpaceToDepth of an (N, C, H, W) input as reshape, ``permute`` (the
    namespace's transpose method: ``transpose`` for jax, ``permute`` for torch), reshape,
    with the shapes written out (N left to ``-1``)."""
    shape = c.shapes[0]
    if shape is None or len(shape) != 4 or None in shape[1:]:
        raise c.fail(f"{c.node.op_type} needs a 4-D input with known C, H and W")
    _, ch, h, w = (int(d) if d is not None else None for d in shape)
    b, mode = int(c.attrs["blocksize"]), c.attrs.get("mode", "DCR")
    if c.node.op_type == "DepthToSpace":
        split = (-1, b, b, ch // b**2, h, w) if mode == "DCR" else (-1, ch // b**2, b, b, h, w)
        perm = (0, 3, 4, 1, 5, 2) if mode == "DCR" else (0, 1, 4, 2, 5, 3)
        out = (-1, ch // b**2, h * b, w * b)
    else:
        split, out = (-1, ch, h // b, b, w // b, b), (-1, ch * b * b, h // b, w // b)
        perm = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
    if mode not in ("DCR", "CRD"):
        raise c.fail(f"mode {mode!r}; supported: 'DCR', 'CRD'")
    x = c.args[0] if c.args[0].isidentifier() else f"({c.args[0]})"
    return f"{x}.reshape({split}).{permute}({perm}).reshape({out})"


def bit_cast_expr(c: TemplateCall, reinterpret: str, cast: str) -> str:
    """ONNX BitCast between types of one width: ``reinterpret`` (a format of the input and the
    target dtype's text) of the same bits; a bool is a 0 / 1 byte, so to bool it is ``!= 0``
    and from bool ``cast``."""
    source, target = c.node.inputs[0].dtype, ir.DataType(c.attrs["to"])
    if source is None or source.itemsize != target.itemsize:
        raise c.fail(f"BitCast from {source} to {target}: ONNX casts bits between one width")
    x = c.args[0]
    if target == ir.DataType.BOOL:
        return f"{x} != 0"
    return (cast if source == ir.DataType.BOOL else reinterpret).format(x)


def mod_expr(c: TemplateCall, xp: str) -> str:
    """ONNX Mod: C's ``fmod`` (sign of the dividend) or Python's ``%`` (sign of the divisor)."""
    fn = "fmod" if c.attrs["fmod"] else "remainder"
    return f"{xp}.{fn}({c.args[0]}, {c.args[1]})"


def matmul_expr(c: TemplateCall) -> str:
    return f"{c.args[0]} @ {c.args[1]}"


def gemm_expr(c: TemplateCall) -> str:
    """Gemm's generic form, ``alpha * (A' @ B') + beta * C``, with unit factors left out."""
    a = f"{c.args[0]}.T" if c.attrs["transA"] else c.args[0]
    b = f"{c.args[1]}.T" if c.attrs["transB"] else c.args[1]
    out = f"{a} @ {b}"
    if c.attrs["alpha"] != 1.0:
        out = f"{scalar_literal(c.attrs['alpha'])} * ({out})"
    if c.has(2):
        bias = c.args[2]
        if c.attrs["beta"] != 1.0:
            bias = f"{scalar_literal(c.attrs['beta'])} * {bias}"
        out = f"{out} + {bias}"
    return out


# The attributes (and defaults) the source templates declare, where both emitters declare
# the same ones (the runtimes' tables, with ``kernel_shape`` required for pooling).

GEMM_ATTRS = {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}
CONV_TRANSPOSE_ATTRS = {**CONV_ATTRS, "output_padding": None, "output_shape": None}
MAX_POOL_ATTRS = {**POOL_ATTRS, "kernel_shape": REQUIRED, "storage_order": 0}
AVERAGE_POOL_ATTRS = {**POOL_ATTRS, "kernel_shape": REQUIRED, "count_include_pad": 0}
LP_POOL_ATTRS = {**POOL_ATTRS, "kernel_shape": REQUIRED, "p": 2}


def pool_padding(c: TemplateCall) -> list[tuple[int, int]]:
    """A pooling's ``(low, high)`` padding per spatial axis, auto_pad SAME_* resolved over the
    input's spatial size (which it then needs)."""
    k = [int(v) for v in c.attrs["kernel_shape"]]
    n, mode = len(k), c.attrs["auto_pad"]
    s = [int(v) for v in c.attrs["strides"] or [1] * n]
    d = [int(v) for v in c.attrs["dilations"] or [1] * n]
    spatial = list(c.shapes[0][2:]) if c.shapes[0] is not None else []
    if mode in ("SAME_UPPER", "SAME_LOWER") and (
        len(spatial) != n or not all(isinstance(v, int) for v in spatial)
    ):
        raise c.fail(f"auto_pad {mode} over an input of unknown spatial size")
    return conv_padding(c.node, mode, spatial or [0] * n, k, s, d, c.attrs["pads"])


def ceil_pads(c: TemplateCall, pairs) -> list[tuple[int, int]]:
    """A pooling's ``(low, high)`` pads with ceil_mode's extra high padding: room for the last
    window ONNX keeps (one that starts inside the input or its low padding)."""
    pairs = [(int(lo), int(hi)) for lo, hi in pairs]
    if not c.attrs.get("ceil_mode"):
        return pairs
    shape, n = c.shapes[0], len(pairs)
    if shape is None or any(d is None for d in shape[2:]):
        raise c.fail("ceil_mode=1 needs static spatial dims")
    k = c.attrs["kernel_shape"]
    s = c.attrs.get("strides") or (1,) * n
    d = c.attrs.get("dilations") or (1,) * n
    for i, (lo, hi) in enumerate(pairs):
        size, window = shape[2 + i] + lo + hi, (k[i] - 1) * d[i] + 1
        out = -(-(size - window) // s[i]) + 1
        if (out - 1) * s[i] >= shape[2 + i] + lo:
            out -= 1
        pairs[i] = (lo, hi + max((out - 1) * s[i] + window - size, 0))
    return pairs


#: ONNX Resize's plan in numpy (framework-free): the text of the ``_resize_plan`` helper both
#: source emitters write (it reads only the input's shape), each applying the plan with its own
#: gather and weighted sum (the Flax and torch ``_resize``), as ``ops/resize`` plans it for the
#: runtimes.
RESIZE_PLAN = """
def _resize_plan(
    shape, scales, sizes, mode, coord, nearest_mode="round_prefer_floor", cubic_a=-0.75,
    antialias=False, exclude_outside=False, axes=None, keep_aspect_ratio_policy="stretch",
):
    \"\"\"ONNX Resize of an input of ``shape`` to ``scales`` or ``sizes`` (over ``axes``), planned
    in float64 numpy per axis that changes: ``(axis, indices, weights)``, each output index
    mapped back to an input coordinate by ``coord``, then the nearest input (``nearest_mode``;
    weights None) or the linear / cubic taps around it (``cubic_a``; widened by ``antialias``
    when downsampling; ``exclude_outside`` drops the taps outside the axis), clamped into it.\"\"\"
    rank = len(shape)
    axes = range(rank) if axes is None else [a % rank for a in axes]
    if scales is not None and len(scales):
        scale_of = dict(zip(axes, (float(s) for s in scales), strict=True))
        scales = [scale_of.get(a, 1.0) for a in range(rank)]
        sizes = [n if s == 1.0 else int(s * n) for s, n in zip(scales, shape, strict=True)]
    else:
        size_of = dict(zip(axes, (int(s) for s in sizes), strict=True))
        sizes = [size_of.get(a, n) for a, n in enumerate(shape)]
        scales = [1.0 if s is n else s / n for s, n in zip(sizes, shape, strict=True)]
        if keep_aspect_ratio_policy != "stretch":  # one scale for every resized axis
            pick = min if keep_aspect_ratio_policy == "not_larger" else max
            common = pick(scales[a] for a in axes)
            scales = [common if a in axes else 1.0 for a in range(rank)]
            sizes = [int(common * n + 0.5) if a in axes else n for a, n in enumerate(shape)]
    plan = []
    for axis, (n, out, scale) in enumerate(zip(shape, sizes, scales, strict=True)):
        if scale == 1.0 and out == n:
            continue
        y, width = np.arange(out, dtype=np.float64), scale * n
        if coord == "align_corners":
            src = np.zeros_like(y) if width == 1 else y * (n - 1) / (width - 1)
        elif coord == "asymmetric":
            src = y / scale
        elif coord == "pytorch_half_pixel":
            src = np.full_like(y, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
        elif coord == "half_pixel_symmetric":
            src = n / 2 * (1 - out / width) + (y + 0.5) / scale - 0.5
        elif coord == "tf_half_pixel_for_nn":
            src = (y + 0.5) / scale
        else:  # half_pixel
            src = (y + 0.5) / scale - 0.5
        low = np.floor(src)
        if mode == "nearest":
            index = {
                "round_prefer_floor": np.where(src - low <= 0.5, low, low + 1),
                "round_prefer_ceil": np.where(src - low < 0.5, low, low + 1),
                "floor": low,
                "ceil": np.ceil(src),
            }[nearest_mode]
            plan.append((axis, np.clip(index, 0, n - 1).astype(np.int64), None))
            continue
        ratio = np.where(src == low, 1.0, src - low)  # an integer coordinate: the left tap's 1
        step = scale if antialias and scale < 1 else 1.0  # the kernel stretched over 1 / scale
        reach = int(np.floor(-(1.0 if mode == "linear" else 2.0) / step) + 1) if step < 1 else None
        if reach is not None:
            offsets = np.arange(reach, 2 - reach)
        else:
            offsets = np.arange(-1, 3) if mode == "cubic" else np.arange(0, 2)
        t = np.abs((offsets[None, :] - ratio[:, None]) * step)
        if mode == "linear":
            weights = np.clip(1 - t, 0, 1)
        else:
            a = cubic_a
            near = ((a + 2) * t - (a + 3)) * t * t + 1
            far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
            weights = np.where(t <= 1, near, np.where(t < 2, far, 0.0))
        if antialias:
            weights = weights / weights.sum(axis=1, keepdims=True)
        index = np.where(src == low, low - 1, low).astype(np.int64)[:, None] + offsets[None, :]
        if exclude_outside:
            weights = np.where((index < 0) | (index >= n), 0.0, weights)
            total = weights.sum(axis=1, keepdims=True)
            weights = weights / np.where(total == 0, 1.0, total)
        plan.append((axis, np.clip(index, 0, n - 1), weights))
    return plan
"""


def resize_call(c: TemplateCall, runtime: Callable[[int, str], str]) -> str:
    """ONNX Resize as a call of the emitter's generated ``_resize`` (which applies
    ``_resize_plan``; both added to ``c.helpers``): the scales or sizes as literals, or as
    ``runtime(i, what)`` where the graph computes them. Refused by name: another mode,
    tf_crop_and_resize (roi and an extrapolation value), antialias of ``nearest``, Resize-10."""
    a = c.attrs
    mode, coord, nearest = a["mode"], a["coordinate_transformation_mode"], a["nearest_mode"]
    if mode not in ("nearest", "linear", "cubic"):
        raise c.fail(f"Resize mode={mode!r}; the {c.emitter} writes 'nearest', 'linear', 'cubic'")
    coords = (*RESIZE_COORDS, "half_pixel_symmetric")
    if coord not in coords or nearest not in RESIZE_NEAREST:
        raise c.fail(
            f"Resize coordinate_transformation_mode={coord!r} / nearest_mode={nearest!r}; "
            f"supported: {', '.join(coords)} / {', '.join(RESIZE_NEAREST)}"
        )
    if a["antialias"] and mode == "nearest":
        raise c.fail("Resize antialias of mode 'nearest' (ONNX defines it for linear, cubic)")
    if c.node.graph is not None and c.node.graph.opset_imports.get("", 11) < 11:
        raise c.fail("Resize-10 (scales as its second input)")
    values = []
    for i, what in ((2, "scales"), (3, "sizes")):
        v = None if not c.has(i) or c.consts[i] is None else np.reshape(c.consts[i], -1)
        if c.has(i) and c.consts[i] is None:
            values.append(runtime(i, what))
        elif v is None or not v.size:
            values.append("None")
        else:
            values.append(repr(tuple((float if i == 2 else int)(x) for x in v)))
    if values == ["None", "None"]:
        raise c.fail("Resize needs scales or sizes")
    extra = "".join(
        f", {name}={value!r}"
        for name, value, default in (
            ("cubic_a", float(a["cubic_coeff_a"]), -0.75),
            ("antialias", bool(a["antialias"]), False),
            ("exclude_outside", bool(a["exclude_outside"]), False),
            ("axes", None if a["axes"] is None else tuple(int(x) for x in a["axes"]), None),
            ("keep_aspect_ratio_policy", a["keep_aspect_ratio_policy"], "stretch"),
        )
        if value != default
    )
    c.helpers |= {"resize", "resize_plan"}
    scales, sizes = values
    return f'_resize({c.args[0]}, {scales}, {sizes}, "{mode}", "{coord}", "{nearest}"{extra})'


#: The generalized cosine window in numpy (framework-free): the text of the ``_cosine_window``
#: helper both source emitters write for HannWindow, HammingWindow and BlackmanWindow, as
#: ``ops/signal.cosine_window`` computes them for the runtimes.
COSINE_WINDOW = '''
def _cosine_window(n, periodic, coefficients):
    """sum_k a_k cos(2 pi k i / N') over i < n, N' = n (periodic) or n - 1, in float64."""
    i, length = np.arange(n, dtype=np.float64), n if periodic else n - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = [a * np.cos(2 * np.pi * k * i / length) for k, a in enumerate(coefficients)]
    return np.asarray(sum(terms))
'''

#: The windows' coefficients (``ops/signal``).
WINDOWS = {"HannWindow": HANN, "HammingWindow": HAMMING, "BlackmanWindow": BLACKMAN}


def window_call(c: TemplateCall, size: str) -> str:
    """``_cosine_window(n, periodic, coefficients)`` of a window op (``size`` writes its
    length as a Python int), the helper added to ``c.helpers``."""
    c.helpers.add("cosine_window")
    coefficients = tuple(float(a) for a in WINDOWS[c.node.op_type])
    return f"_cosine_window({size}, {bool(c.attrs['periodic'])}, {coefficients!r})"


#: DFT's attributes since opset 20 (the axis is an input, default -2); opsets 17 to 19 have
#: an ``axis`` attribute instead (default 1).
DFT_ATTRS = {"inverse": 0, "onesided": 0}


def dft_call(c: TemplateCall, axis: str, length: str | None) -> str:
    """``_dft(x, axis, n=..., inverse=..., onesided=...)`` of a DFT node (``axis`` and
    ``length`` written as Python ints; ``length`` None when dft_length is absent)."""
    c.helpers.add("dft")
    n = "" if length is None else f", n={length}"
    flags = "".join(f", {k}=True" for k in DFT_ATTRS if c.attrs[k])
    return f"_dft({c.args[0]}, {axis}{n}{flags})"


def stft_call(c: TemplateCall, step: str, length: str | None) -> str:
    """``_stft(signal, step, window=..., length=..., onesided=...)`` of an STFT node (``step``
    and ``length`` written as Python ints), the helpers added to ``c.helpers``."""
    c.helpers |= {"stft", "dft"}
    window = f", window={c.args[2]}" if c.has(2) else ""
    frame = "" if length is None else f", length={length}"
    tail = "" if c.attrs["onesided"] else ", onesided=False"
    return f"_stft({c.args[0]}, {step}{window}{frame}{tail})"


def numpy_scalar(a: np.ndarray) -> str:
    """A constant scalar as a numpy scalar of its type (``np.float32(16000.0)``): numpy
    computes with the input's type, as the runtimes do."""
    a = np.asarray(a).reshape(-1)
    return f"np.{DTYPE_NAMES[ir.DataType.from_numpy(a.dtype)]}({scalar_literal(a[0])})"


#: MelWeightMatrix in numpy (framework-free): the text of the ``_mel_weight_matrix`` helper
#: both source emitters write, as ``ops/signal.mel_weight_matrix`` computes it for the
#: runtimes (its arguments numpy scalars of the inputs' types).
MEL_WEIGHT_MATRIX = '''
def _mel_weight_matrix(bins, n_fft, rate, low, high):
    """[n_fft // 2 + 1, bins] triangular filters over mel points equally spaced from ``low``
    to ``high`` Hz, in float64."""
    bins, n_fft = int(bins), int(n_fft)
    points = np.arange(0, bins + 2)
    low_mel = 2595 * np.log1p(low / 700) / np.log(10)
    high_mel = 2595 * np.log1p(high / 700) / np.log(10)
    step = (high_mel - low_mel) / points.shape[0]
    hz = 700 * np.expm1((points * step + low_mel) / 2595 * np.log(10))
    edges = (((n_fft + 1) * hz) // rate).astype(int)
    out = np.zeros((n_fft // 2 + 1, bins))
    for i in range(bins):
        left, center, right = edges[i], edges[i + 1], edges[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            j = np.arange(left, center + 1)
            out[j, i] = (j - left) / (center - left)
        if right > center:
            j = np.arange(center, right)
            out[j, i] = (right - j) / (right - center)
    return out
'''

#: MelWeightMatrix's inputs, in order.
MEL_INPUTS = ("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz", "upper_edge_hertz")


def mel_weight_matrix_call(c: TemplateCall, read: Callable[[int, str], str]) -> str:
    """``_mel_weight_matrix(bins, n_fft, rate, low, high)``: a constant input as a numpy
    scalar of its type, one computed at run time as ``read(i, name)`` writes it."""
    c.helpers.add("mel_weight_matrix")
    values = [
        read(i, what) if c.consts[i] is None else numpy_scalar(c.consts[i])
        for i, what in enumerate(MEL_INPUTS)
    ]
    return f"_mel_weight_matrix({', '.join(values)})"


RESIZE_COORDS = (
    "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn"
)  # fmt: skip
RESIZE_NEAREST = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def resize_plan(
    c: TemplateCall, modes: tuple[str, ...]
) -> tuple[list[int | None], list[float | None], bool]:
    """A Resize a framework's own interpolation may compute (the torch source's check before
    ``F.interpolate``): ``(output sizes, scale per axis, whether the node gave scales)``, from
    constant ``scales`` or ``sizes``; a size or scale that depends on an unknown dimension is
    ``None``. Raises the emitter's refusal for a mode outside ``modes``, another coordinate
    mode, antialias, axes, exclude_outside, an input of unknown rank, scales and sizes known
    only at run time."""
    a = c.attrs
    mode, coord = a["mode"], a["coordinate_transformation_mode"]
    if mode not in modes:
        raise c.fail(f"Resize mode={mode!r}; the {c.emitter} writes {', '.join(map(repr, modes))}")
    if coord not in RESIZE_COORDS or a["nearest_mode"] not in RESIZE_NEAREST:
        raise c.fail(
            f"Resize coordinate_transformation_mode={coord!r} / nearest_mode="
            f"{a['nearest_mode']!r}; supported: {', '.join(RESIZE_COORDS)} / "
            f"{', '.join(RESIZE_NEAREST)}"
        )
    if a["antialias"] or a["axes"] is not None or a["exclude_outside"]:
        raise c.fail("Resize with antialias, axes or exclude_outside")
    shape = c.shapes[0]
    if shape is None:
        raise c.fail("Resize of an input whose shape is not static")
    scales = c.consts[2] if len(c.consts) > 2 and c.has(2) else None
    sizes = c.consts[3] if len(c.consts) > 3 and c.has(3) else None
    if sizes is not None and np.size(sizes):
        out = [int(s) for s in np.asarray(sizes).reshape(-1)]
        factors = [None if n is None else o / n for o, n in zip(out, shape, strict=True)]
        return out, factors, False
    if scales is not None and np.size(scales):
        factors = [float(s) for s in np.asarray(scales).reshape(-1)]
        out = [
            None if n is None else int(np.floor(n * f)) for n, f in zip(shape, factors, strict=True)
        ]
        return out, factors, True
    raise c.fail("Resize needs constant scales or sizes")


#: ONNX RNN / GRU / LSTM: (default activations, number of outputs of the helper).
RECURRENT_DEFAULTS = {
    "RNN": (("Tanh",), 2),
    "GRU": (("Sigmoid", "Tanh"), 2),
    "LSTM": (("Sigmoid", "Tanh", "Tanh"), 3),
}


def recurrent_call(c: TemplateCall) -> str:
    """ONNX RNN / GRU / LSTM as a call of the emitter's generated ``_rnn`` / ``_gru`` /
    ``_lstm`` (each built on its ``_rnn_scan``), the names added to ``c.helpers``. Refused by
    name: other activations, clip, LSTM's input_forget, another direction or layout."""
    op = c.node.op_type
    defaults, n_out = RECURRENT_DEFAULTS[op]
    acts = c.attrs["activations"]
    if acts is not None and [a.lower() for a in acts] not in (
        [a.lower() for a in defaults],
        [a.lower() for a in defaults * 2],
    ):
        raise c.fail(f"activations={list(acts)}; the {c.emitter} writes {list(defaults)}")
    if c.attrs["clip"] is not None:
        raise c.fail(f"clip; the {c.emitter} writes unclipped cells")
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


def _zero_or_none(c: TemplateCall, i: int) -> str:
    """The argument expression, or ``None`` when absent or a constant zero (initial states)."""
    if not c.has(i):
        return "None"
    const = c.consts[i]
    return "None" if const is not None and not np.asarray(const).any() else c.args[i]


def prelu_slope(c: TemplateCall) -> tuple[int, ...] | None:
    """The shape PRelu's slope is written reshaped to, or None where it broadcasts to X as it
    is or a shape is unknown (:func:`~xconv.converters.ops.elementwise.prelu_slope_shape`:
    opset < 7's per-channel slope [C] against NC...); the emitter's refusal where neither."""
    x, slope = c.shapes[0], c.shapes[1]
    if x is None or slope is None or None in (*x, *slope):
        return None
    try:
        return prelu_slope_shape(x, slope)
    except ValueError as e:
        raise c.fail(str(e)) from None


#: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opset 12 on): attributes, defaults.
LOSS_ATTRS = {"reduction": "mean", "ignore_index": None}


def loss_keywords(c: TemplateCall) -> list[str]:
    """The keywords of a loss call that differ from torch's ``F.nll_loss`` defaults (and the
    Flax helper's, which are the same): ``reduction``, ``ignore_index``. Refused by name: a
    reduction ONNX does not define, an input of rank < 2."""
    reduction = c.attrs["reduction"]
    if reduction not in LOSS_REDUCTIONS:
        raise c.fail(f"reduction={reduction!r}; ONNX defines {list(LOSS_REDUCTIONS)}")
    rank = c.rank(0)
    if rank is not None and rank < 2:
        raise c.fail(f"the scores must have shape (N, C, ...), got rank {rank}")
    kw = [] if reduction == "mean" else [f"reduction={reduction!r}"]
    if c.attrs["ignore_index"] is not None:
        kw.append(f"ignore_index={int(c.attrs['ignore_index'])}")
    return kw


def attention_cache(c: TemplateCall) -> bool:
    """Whether an ONNX Attention call reads past key / value inputs or writes its present key
    / value outputs (the emitter then writes a call of its ``_cached_attention`` helper, see
    :func:`cached_attention_call`); asked after :func:`attention_steps_call`, which takes the
    qk_matmul output and nonpad_kv_seqlen. Refused by name: a past key without its value."""
    outs = c.node.outputs

    def wanted(i: int) -> bool:
        return i < len(outs) and bool(outs[i].uses() or outs[i].is_graph_output())

    if c.has(4) != c.has(5):
        raise c.fail("past_key and past_value must be given together")
    return c.has(4) or wanted(1) or wanted(2)


def attention_steps_call(c: TemplateCall, dtype_expr) -> str | None:
    """A call of the emitter's generated ``_attention_steps`` (ONNX Attention as its
    reference computes it, step by step) where the node needs what the fused calls lack:
    softcap, the qk_matmul output, a sliding window, nonpad_kv_seqlen, a softmax precision;
    None otherwise. ``dtype_expr`` writes an ONNX dtype in the emitter's namespace. Indexed
    down to the node's outputs: (Y, present_key, present_value, qk_matmul_output)."""
    a, outs = c.attrs, c.node.outputs
    scores_wanted = len(outs) > 3 and bool(outs[3].uses() or outs[3].is_graph_output())
    windowed = a["left_window_size"] >= 0 or a["right_window_size"] >= 0
    precision = a["softmax_precision"]
    if not (a["softcap"] or scores_wanted or windowed or c.has(6) or precision is not None):
        return None
    if c.has(4) != c.has(5):
        raise c.fail("past_key and past_value must be given together")
    names = ("mask", "past_key", "past_value", "nonpad_kv_seqlen")
    args = list(c.args[:3]) + [f"{n}={c.args[i]}" for i, n in enumerate(names, 3) if c.has(i)]
    args += attention_keywords(c, bool(a["is_causal"]))
    if a["softcap"]:
        args.append(f"softcap={scalar_literal(a['softcap'])}")
    if scores_wanted and a["qk_matmul_output_mode"]:
        args.append(f"qk_matmul_output_mode={int(a['qk_matmul_output_mode'])}")
    if precision is not None:
        args.append(f"softmax_dtype={dtype_expr(ir.DataType(precision))}")
    args += [f"{k}={int(a[k])}" for k in ("left_window_size", "right_window_size") if a[k] >= 0]
    call = f"_attention_steps({', '.join(args)})"
    c.helpers.add("attention_steps")
    return f"{call}[0]" if len(outs) == 1 else f"{call}[:{len(outs)}]"


def attention_keywords(c: TemplateCall, causal: bool, heads: bool = True) -> list[str]:
    """An Attention call's keywords where they differ from the defaults (not causal, a scale
    of 1/sqrt(d), and with ``heads`` 4-D inputs): ``is_causal``, ``scale``, ``q_num_heads``,
    ``kv_num_heads``."""
    kw = ["is_causal=True"] if causal else []
    if c.attrs["scale"] is not None:
        kw.append(f"scale={scalar_literal(c.attrs['scale'])}")
    for key in ("q_num_heads", "kv_num_heads") if heads else ():
        if c.attrs[key]:
            kw.append(f"{key}={c.attrs[key]}")
    return kw


def reverse_sequence_call(c: TemplateCall) -> str:
    """ONNX ReverseSequence as a call of the emitter's generated ``_reverse_sequence``."""
    c.helpers.add("reverse_sequence")
    a = c.attrs
    return f"_reverse_sequence({c.args[0]}, {c.args[1]}, {a['batch_axis']}, {a['time_axis']})"


def cached_attention_call(c: TemplateCall, head: str) -> str:
    """``head`` (``"_cached_attention("``, the Flax one with its attention helper first)
    followed by q, k, v, the past key and value, and the keywords that differ from the
    helper's defaults; indexed down to the node's outputs: (Y, present_key, present_value)."""
    args = list(c.args[:3]) + ([c.args[4], c.args[5]] if c.has(4) else [])
    if c.has(3):
        args.append(f"mask={c.args[3]}")
    args += attention_keywords(c, bool(c.attrs["is_causal"]))
    call = f"{head}{', '.join(args)})"
    n = len(c.node.outputs)
    return {1: f"{call}[0]", 2: f"{call}[:2]", 3: call}.get(n, f"{call} + (None,)")


def rotary_call(c: TemplateCall) -> str:
    """``_rotary_embedding(x, cos, sin[, position_ids])`` for ONNX RotaryEmbedding, with the
    attributes that differ from the helper's defaults (each emitter writes its helper)."""
    args = list(c.args[:3]) + ([c.args[3]] if c.has(3) else [])
    if c.attrs["interleaved"]:
        args.append("interleaved=True")
    for key in ("num_heads", "rotary_embedding_dim"):
        if c.attrs[key]:
            args.append(f"{key}={int(c.attrs[key])}")
    return f"_rotary_embedding({', '.join(args)})"


def _outputs_of(c: TemplateCall, call: str) -> str:
    """A call returning (output, present_state), indexed down to the node's outputs."""
    return f"{call}[0]" if len(c.node.outputs) == 1 else call


def linear_attention_call(c: TemplateCall) -> str:
    """``_linear_attention(query, key, value[, past_state][, decay=][, beta=], q_num_heads=,
    kv_num_heads=[, scale=])`` for ONNX LinearAttention (each emitter writes its helper; the
    rule follows from decay and beta, checked against ``update_rule`` here; ``chunk_size`` is
    a tiling hint). Returns (output, present_state), indexed down to the node's outputs."""
    a = c.attrs
    linear_attention_rule(
        a["update_rule"], a["q_num_heads"], a["kv_num_heads"], has_decay=c.has(4),
        has_beta=c.has(5), fail=c.fail,
    )  # fmt: skip
    args = list(c.args[:3]) + ([c.args[3]] if c.has(3) else [])
    args += [f"{n}={c.args[i]}" for i, n in ((4, "decay"), (5, "beta")) if c.has(i)]
    args += [f"q_num_heads={int(a['q_num_heads'])}", f"kv_num_heads={int(a['kv_num_heads'])}"]
    if a["scale"]:
        args.append(f"scale={scalar_literal(a['scale'])}")
    c.helpers.add("linear_attention")
    return _outputs_of(c, f"_linear_attention({', '.join(args)})")


def causal_conv_call(c: TemplateCall) -> str:
    """``_causal_conv_with_state(x, weight[, bias][, past_state=][, silu=True])`` for ONNX
    CausalConvWithState (each emitter writes its helper). Refused by name: an activation ONNX
    does not define. Returns (output, present_state), indexed down to the node's outputs."""
    act = c.attrs["activation"]
    if act not in CAUSAL_CONV_ACTIVATIONS:
        raise c.fail(f"activation={act!r}; ONNX defines {list(CAUSAL_CONV_ACTIVATIONS)}")
    args = list(c.args[:2]) + ([c.args[2]] if c.has(2) else [])
    if c.has(3):
        args.append(f"past_state={c.args[3]}")
    if act != "none":
        args.append("silu=True")
    c.helpers.add("causal_conv_with_state")
    return _outputs_of(c, f"_causal_conv_with_state({', '.join(args)})")


#: The integer types the source emitters quantize to and from (narrower ones have no array
#: dtype in them): their ranges.
QUANT_INT = {
    ir.DataType.UINT8: (0, 255),
    ir.DataType.INT8: (-128, 127),
    ir.DataType.UINT16: (0, 65535),
    ir.DataType.INT16: (-32768, 32767),
    ir.DataType.UINT4: (0, 15),
    ir.DataType.INT4: (-8, 7),
    ir.DataType.UINT2: (0, 3),
    ir.DataType.INT2: (-2, 1),
}
#: The sub-byte integer types: jax.numpy computes with them; torch names them only, so the
#: torch source computes them in their byte type.
SUB_BYTE = frozenset({ir.DataType.UINT4, ir.DataType.INT4, ir.DataType.UINT2, ir.DataType.INT2})


def quant_call(c: TemplateCall, dtype_text: str, *, float4: str | None = None) -> str:
    """``_quantize_linear(...)`` / ``_quantize_float(...)`` / ``_dequantize_linear(...)`` for
    ONNX QuantizeLinear / DequantizeLinear of 2- to 16-bit integers, float8 and float4, per tensor,
    per axis or blocked (each emitter writes its helpers; the call adds them to
    ``c.helpers``); ``dtype_text`` writes the quantized type. ``float4`` names the helper of an
    emitter whose framework cannot cast to float4e2m1 (torch), called
    ``_<float4>(x, scale[, zero_point=...][, axis=...][, block_size=...])`` for that type.
    Refused by name: other types, output_dtype on dequantize, precision on quantize."""
    a = c.attrs
    tail = []
    if a["axis"] != 1:
        tail.append(f"axis={a['axis']}")
    if a["block_size"]:
        tail.append(f"block_size={a['block_size']}")
    zp = c.args[2] if c.has(2) else "None"
    c.helpers.add("quant_param")
    if c.node.op_type == "DequantizeLinear":
        c.helpers.add("dequantize_linear")
        source = c.node.inputs[0].dtype
        low = source in FLOAT8 or source == ir.DataType.FLOAT4E2M1
        if source not in QUANT_INT and not low and source != ir.DataType.INT32:
            raise c.fail(
                f"DequantizeLinear of {source}; the {c.emitter} writes 2- to 16-bit ints, float8 "
                "and float4"
            )
        if a["output_dtype"]:
            raise c.fail("DequantizeLinear output_dtype")
        if low:  # a float8 / float4 zero point is zero: the spec ignores it
            zp = "None"
        args = [c.args[0], c.args[1], *([zp] if zp != "None" else [])]
        return f"_dequantize_linear({', '.join(args + tail)})"
    target = c.node.outputs[0].dtype
    low = target in FLOAT8 or target == ir.DataType.FLOAT4E2M1
    if target not in QUANT_INT and not low:
        raise c.fail(
            f"QuantizeLinear to {target}; the {c.emitter} writes 2- to 16-bit ints, float8 "
            "and float4"
        )
    if a["precision"]:
        raise c.fail("QuantizeLinear precision")
    if low:
        # x / scale, clipped into a float8 type's finite range when saturating; float4 adds
        # a zero point when given (float8 ignores it, as the runtimes do).
        if target == ir.DataType.FLOAT4E2M1 and zp != "None":
            tail.insert(0, f"zero_point={zp}")
        if target == ir.DataType.FLOAT4E2M1 and float4:
            c.helpers.add(float4)
            return f"_{float4}({', '.join([c.args[0], c.args[1], *tail])})"
        c.helpers.add("quantize_float")
        import ml_dtypes

        info = ml_dtypes.finfo(target.numpy())
        bounds = [scalar_literal(float(info.min)), scalar_literal(float(info.max))]
        saturate = a["saturate"] and target in FLOAT8
        args = [c.args[0], c.args[1], *(bounds if saturate else ["None", "None"])]
        return f"_quantize_float({', '.join([*args, dtype_text, *tail])})"
    c.helpers.add("quantize_linear")
    lo, hi = QUANT_INT[target]
    args = [c.args[0], c.args[1], zp, str(lo), str(hi), dtype_text]
    return f"_quantize_linear({', '.join(args + tail)})"


def integer_product_call(c: TemplateCall) -> str:
    """MatMulInteger as ``_matmul_integer(a, b[, zero points])``, QLinearMatMul as that
    product requantized (``_requantize``), DynamicQuantizeLinear as its helper's call; the
    helpers (each emitter writes its own) added to ``c.helpers``."""
    op = c.node.op_type
    if op == "DynamicQuantizeLinear":
        c.helpers.add("dynamic_quantize_linear")
        return f"_dynamic_quantize_linear({c.args[0]})"
    c.helpers.add("matmul_integer")
    if op == "MatMulInteger":
        return f"_matmul_integer({', '.join(a or 'None' for a in c.args)})"
    if not all(c.has(i) for i in range(8)):
        raise c.fail("QLinearMatMul without y's zero point")
    c.helpers.add("requantize")
    a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp = c.args
    product = f"_matmul_integer({a}, {b}, {a_zp}, {b_zp})"
    return f"_requantize({product}, {a_scale} * {b_scale} / {y_scale}, {y_zp})"


def mean_variance_call(c: TemplateCall) -> str:
    """MeanVarianceNormalization as a call of the emitter's ``_mean_variance_normalization``."""
    c.helpers.add("mean_variance_normalization")
    axes = tuple(int(a) for a in c.attrs["axes"])
    return f"_mean_variance_normalization({c.args[0]}, {axes})"


def inference_dropout(c: TemplateCall, mask: str) -> str:
    """An inference Dropout node (no training_mode input, or a constant false one): the
    identity, and ``mask`` (a format of the input) for its mask output. Refused in training
    mode, which has no fixed source form."""
    if c.has(2) and (c.consts[2] is None or bool(np.asarray(c.consts[2]))):
        raise c.fail("a Dropout node in training mode has no fixed source form")
    return c.args[0] if len(c.node.outputs) == 1 else f"{c.args[0]}, {mask.format(c.args[0])}"


def shift_direction(c: TemplateCall) -> str:
    """BitShift's direction, ``"LEFT"`` or ``"RIGHT"``; the refusal for another."""
    direction = c.attrs["direction"]
    if direction not in ("LEFT", "RIGHT"):
        raise c.fail(f"direction={direction!r}; ONNX defines 'LEFT', 'RIGHT'")
    return direction
