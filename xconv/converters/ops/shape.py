"""Shape ops written once against ``xp``: Shape, Size, Reshape, Flatten, Squeeze, Unsqueeze,
Transpose, Concat, Split, Expand, Tile; Identity, Constant, ConstantOfShape; Pad's widths.

Shapes, axes, split sizes and repeats are static (``ctx.static``); the data goes through the
backend kernel's namespace (numpy for static data, so shape arithmetic folds at trace time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from xconv.converters.ops.arrays import astype, normalize_axis
from xconv.converters.ops.attrs import check_choice, static_ints, unsupported


class ShapeKernel(Protocol):
    """What a backend provides for the shape ops."""

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend picks for ``arrays``."""

    def constant(self, a: np.ndarray) -> Any:
        """A numpy result as the backend returns constants (JAX: numpy, folded)."""

    def materialize(self, xp: Any, x: Any) -> Any:
        """``x`` as an array of its own (not a broadcast view), where the backend needs one."""


def reshape_dims(ctx, in_shape: tuple[int, ...], dims: list[int], allowzero: int) -> list[int]:
    """Reshape's target: 0 copies the input dim (unless allowzero), one -1 is inferred."""
    if not allowzero:
        dims = [in_shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if dims.count(-1) > 1:
        raise ctx.error(f"shape {dims} has more than one -1")
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        total = math.prod(in_shape)
        dims[dims.index(-1)] = total // known if known else 0
    return dims


def _squeezed(ctx, in_shape: tuple[int, ...], src) -> tuple[int, ...]:
    if src is None:
        drop = {i for i, d in enumerate(in_shape) if d == 1}
    else:
        drop = {normalize_axis(ctx, a, len(in_shape)) for a in static_ints(ctx, src, "axes")}
        if any(in_shape[a] != 1 for a in drop):
            raise ctx.error(f"cannot squeeze axes {sorted(drop)} of shape {in_shape}")
    return tuple(d for i, d in enumerate(in_shape) if i not in drop)


def _unsqueezed(ctx, in_shape: tuple[int, ...], src) -> tuple[int, ...]:
    values = static_ints(ctx, src, "axes")
    out_rank = len(in_shape) + len(values)
    norm = sorted(normalize_axis(ctx, a, out_rank) for a in values)
    if len(set(norm)) != len(norm):
        raise ctx.error(f"axes {values} repeat an axis")
    dims = list(in_shape)
    for a in norm:
        dims.insert(a, 1)
    return tuple(dims)


def split_sizes(ctx, dim: int, src, num_outputs: int | None) -> list[int]:
    """Split's piece sizes: given, or ``num_outputs`` (else one per output) nearly equal."""
    if src is not None and np.size(ctx.static(src, "split")) > 0:
        sizes = static_ints(ctx, src, "split")
        if sum(sizes) != dim:
            raise ctx.error(f"split sizes {sizes} do not add up to dimension {dim}")
        return sizes
    n = num_outputs or len(ctx.node.outputs)
    chunk = -(-dim // n)
    sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
    if sizes[-1] < 0:
        raise ctx.error(f"cannot split dimension {dim} into {n} parts")
    return sizes


def _split(xp, x, axis: int, sizes: list[int]) -> tuple[Any, ...]:
    bounds = np.cumsum([0, *sizes]).tolist()
    index = [slice(None)] * x.ndim
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        index[axis] = slice(lo, hi)
        out.append(x[tuple(index)])
    return tuple(out)


def _tile_reps(ctx, rank: int, repeats, axis) -> list[int]:
    reps = static_ints(ctx, repeats, "repeats")
    if axis is not None:
        along = normalize_axis(ctx, static_ints(ctx, axis, "axis")[0], rank)
        reps = [reps[0] if i == along else 1 for i in range(rank)]
    if len(reps) != rank:
        raise ctx.error(f"repeats {reps} must have one entry per axis of rank {rank}")
    return reps


def pad_widths(ctx, shape: tuple[int, ...], src, axes) -> tuple[tuple[slice, ...] | None, list]:
    """Pad's plan: the crop negative pads make (None when none), then the non-negative
    ``(before, after)`` widths per axis."""
    raw = static_ints(ctx, src, "pads")
    rank = len(shape)
    if axes is not None:
        ax = [normalize_axis(ctx, a, rank) for a in static_ints(ctx, axes, "axes")]
    else:
        ax = list(range(rank))
    if len(raw) != 2 * len(ax):
        raise ctx.error(f"pads {raw} must hold two entries per padded axis ({len(ax)})")
    width = [[0, 0] for _ in range(rank)]
    for i, a in enumerate(ax):
        width[a] = [raw[i], raw[len(ax) + i]]
    crop = None
    if any(b < 0 or e < 0 for b, e in width):
        crop = tuple(
            slice(-b if b < 0 else 0, (shape[i] + e) if e < 0 else None)
            for i, (b, e) in enumerate(width)
        )
    return crop, [(max(b, 0), max(e, 0)) for b, e in width]


_CONSTANT_ATTRS = (
    "value",
    "value_float",
    "value_floats",
    "value_int",
    "value_ints",
    "value_string",
    "value_strings",
    "sparse_value",
)


def _constant(ctx, attrs: dict[str, Any]) -> np.ndarray:
    """The tensor held by exactly one value_* attribute, as numpy."""
    if attrs["sparse_value"] is not None:
        raise unsupported(
            ctx, "sparse_value is not supported; store the constant as a dense 'value' tensor"
        )
    if attrs["value"] is not None:
        return np.asarray(attrs["value"])
    for name, dtype in (
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
        ("value_string", object),
        ("value_strings", object),
    ):
        if attrs[name] is not None:
            return np.array(attrs[name], dtype=dtype)
    raise ctx.error(
        "Constant needs one of the value, value_float(s), value_int(s) or "
        "value_string(s) attributes"
    )


def register_constant_ops(builtin: Callable[..., Any], k: ShapeKernel) -> None:
    """Identity, Constant and ConstantOfShape (constants as the kernel returns them)."""

    @builtin("Identity", since=1)
    def identity(ctx, x):
        """Identity(input) -> output: the input (tensor, sequence or optional)."""
        return x

    @builtin("Constant", since=1, attrs=dict.fromkeys(_CONSTANT_ATTRS))
    def constant(ctx, **attrs):
        """Constant() -> output: the tensor held by exactly one value_* attribute."""
        return k.constant(_constant(ctx, attrs))

    @builtin("ConstantOfShape", since=9, attrs={"value": None})
    def constant_of_shape(ctx, shape, *, value):
        """ConstantOfShape(input) -> output: a tensor of the given shape filled with
        `value`."""
        dims = static_ints(ctx, shape, "shape")
        fill = np.zeros((1,), np.float32) if value is None else np.asarray(value).reshape(-1)
        return k.constant(np.full(dims, fill[0], dtype=fill.dtype))


def register_shape_ops(builtin: Callable[..., Any], k: ShapeKernel, required: Any) -> None:
    """Register the shape ops with a backend's ``builtin`` and kernel ``k``."""

    def reshaped(x, dims):
        return k.run(lambda xp, x: xp.reshape(x, tuple(dims)), x)

    @builtin("Shape", since=1, attrs={"start": 0, "end": None})
    def shape(ctx, x, *, start, end):
        """Shape(data) -> shape: the int64 shape, optionally sliced to [start, end)."""
        return k.constant(np.array(tuple(np.shape(x))[slice(start, end)], dtype=np.int64))

    @builtin("Size", since=1)
    def size(ctx, x):
        """Size(data) -> size: the int64 number of elements."""
        return k.constant(np.array(math.prod(np.shape(x)), dtype=np.int64))

    @builtin("Reshape", since=1, attrs={"allowzero": 0, "shape": None, "consumed_inputs": None})
    def reshape(ctx, x, shape_in=None, *, allowzero, shape, consumed_inputs):
        """Reshape(data, shape) -> reshaped: 0 copies the input dim (unless allowzero), -1
        infers."""
        del consumed_inputs  # Reshape-1's legacy in-place hint: no effect on the result.
        dims = static_ints(ctx, shape_in if shape_in is not None else shape, "shape")
        return reshaped(x, reshape_dims(ctx, tuple(np.shape(x)), dims, allowzero))

    @builtin("Flatten", since=1, attrs={"axis": 1})
    def flatten(ctx, x, *, axis):
        """Flatten(input) -> output: a 2-D tensor (prod(dims[:axis]), prod(dims[axis:]))."""
        in_shape = tuple(np.shape(x))
        rank = len(in_shape)
        if axis < 0:
            axis += rank
        if not 0 <= axis <= rank:
            raise ctx.error(f"axis {axis} is out of range for rank {rank}")
        return reshaped(x, (math.prod(in_shape[:axis]), math.prod(in_shape[axis:])))

    @builtin("Squeeze", since=1, attrs={"axes": None})
    def squeeze(ctx, x, axes_in=None, *, axes):
        """Squeeze(data, axes?) -> squeezed: drops the given (or every) size-1 dimension."""
        src = axes_in if axes_in is not None else axes
        return reshaped(x, _squeezed(ctx, tuple(np.shape(x)), src))

    @builtin("Unsqueeze", since=1, attrs={"axes": None})
    def unsqueeze(ctx, x, axes_in=None, *, axes):
        """Unsqueeze(data, axes) -> expanded: inserts size-1 dims at `axes` of the output."""
        src = axes_in if axes_in is not None else axes
        return reshaped(x, _unsqueezed(ctx, tuple(np.shape(x)), src))

    _register_layout_ops(builtin, k, required)


def _register_layout_ops(builtin: Callable[..., Any], k: ShapeKernel, required: Any) -> None:
    """Transpose, Concat, Split, Expand, Tile."""

    @builtin("Transpose", since=1, attrs={"perm": None})
    def transpose(ctx, x, *, perm):
        """Transpose(data) -> transposed: permutes axes by `perm` (default: reversed)."""
        if perm is None:
            perm = tuple(reversed(range(np.ndim(x))))
        return k.run(lambda xp, x: xp.transpose(x, tuple(perm)), x)

    @builtin("Concat", since=4, attrs={"axis": required})
    @builtin("Concat", since=1, until=3, attrs={"axis": 1})
    def concat(ctx, *inputs, axis):
        """Concat(inputs...) -> concat_result: joins tensors along `axis`."""
        arrays = [a for a in inputs if a is not None]
        if not arrays:
            raise ctx.error("Concat needs at least one input")
        axis = normalize_axis(ctx, axis, np.ndim(arrays[0]))
        return k.run(lambda xp, *a: xp.concatenate(list(a), axis=axis), *arrays)

    @builtin("Split", since=1, attrs={"axis": 0, "split": None, "num_outputs": None})
    def split(ctx, x, split_in=None, *, axis, split, num_outputs):
        """Split(input, split?) -> outputs...: pieces along `axis` of the given or equal
        sizes."""
        axis = normalize_axis(ctx, axis, np.ndim(x))
        src = split_in if split_in is not None else split
        sizes = split_sizes(ctx, np.shape(x)[axis], src, num_outputs)
        return k.run(lambda xp, x: _split(xp, x, axis, sizes), x)

    @builtin("Expand", since=8)
    def expand(ctx, x, shape):
        """Expand(input, shape) -> output: broadcasts the input to `shape` (bidirectionally)."""
        dims = static_ints(ctx, shape, "shape")
        out = np.broadcast_shapes(tuple(np.shape(x)), tuple(dims))
        return k.run(lambda xp, x: k.materialize(xp, xp.broadcast_to(x, out)), x)

    @builtin("Tile", since=6)
    @builtin("Tile", since=1, until=5)
    def tile(ctx, x, repeats, axis=None):
        """Tile(input, repeats) -> output: repeats the input `repeats[i]` times along axis i.

        Tile-1 is Tile(input, tiles, axis): a scalar count along one axis.
        """
        reps = _tile_reps(ctx, np.ndim(x), repeats, axis)
        return k.run(lambda xp, x: xp.tile(x, reps), x)


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


def register_construction_ops(builtin: Callable[..., Any], kernel: Any, required: Any) -> None:
    """Pad, Range, EyeLike, Trilu, DepthToSpace, SpaceToDepth, CenterCropPad.

    Besides :class:`ShapeKernel`, ``kernel`` provides ``pad(x, widths, mode, fill)`` (the padding
    by non-negative widths) and ``dtype(ctx, code, like)`` (ONNX type -> backend dtype).
    """

    @builtin(
        "Pad", since=1, attrs={"mode": "constant", "pads": None, "paddings": None, "value": 0.0}
    )
    def pad(ctx, x, pads_in=None, constant_value=None, axes=None, *, mode, pads, paddings, value):
        """Pad(data, pads, constant_value?, axes?) -> output: pads (or crops, when negative)."""
        check_choice(ctx, "mode", mode, _PAD_MODES)
        src = pads_in if pads_in is not None else (pads if pads is not None else paddings)
        # Negative pads crop first; the rest pads.
        crop, pos = pad_widths(ctx, tuple(np.shape(x)), src, axes)
        y = x if crop is None else x[crop]
        if not any(b or e for b, e in pos):
            return y
        fill = value
        if constant_value is not None and math.prod(np.shape(constant_value)) > 0:
            fill = constant_value
        return kernel.pad(y, pos, mode, fill)

    @builtin("Range", since=11, attrs={"stash_type": 1})
    def range_(ctx, start, limit, delta, *, stash_type):
        """Range(start, limit, delta) -> output: start + i*delta while before limit."""
        # Scalars, though some exporters hand over 1-element vectors.
        s, lim, d = (
            np.asarray(ctx.static(v, name)).reshape(())
            for v, name in ((start, "start"), (limit, "limit"), (delta, "delta"))
        )
        dtype = s.dtype
        if ctx.opset >= 27 and dtype.itemsize == 2 and dtype.kind not in "iu" and stash_type:
            # Range-27 accumulates 16-bit floats in the stash type (float by default).
            stash = _np_dtype(stash_type)
            out = np.arange(s.astype(stash), lim.astype(stash), d.astype(stash)).astype(dtype)
        else:
            out = np.arange(s, lim, d, dtype=dtype)
        return kernel.constant(out, start)

    @builtin("EyeLike", since=9, attrs={"dtype": None, "k": 0})
    def eye_like(ctx, x, *, dtype, k):
        """EyeLike(input) -> output: a 2-D identity-like tensor with ones on diagonal k."""
        if np.ndim(x) != 2:
            raise ctx.error(f"EyeLike needs a 2-D input, got rank {np.ndim(x)}")
        out_dtype = kernel.dtype(ctx, dtype, x)
        n, m = np.shape(x)
        eye = kernel.constant(np.eye(n, m, k, dtype=np.float64), x)
        return kernel.run(lambda xp, e: astype(xp, e, out_dtype), eye)

    @builtin("Trilu", since=14, attrs={"upper": 1})
    def trilu(ctx, x, k_in=None, *, upper):
        """Trilu(input, k?) -> output: the upper (or lower) triangle from diagonal k."""
        kk = static_ints(ctx, k_in, "k")[0] if k_in is not None else 0
        if np.ndim(x) >= 2:  # torch refuses diagonals far outside the matrix
            n, m = np.shape(x)[-2:]
            kk = max(min(kk, m + 1), -n - 1)
        return kernel.run(lambda xp, x: xp.triu(x, kk) if upper else xp.tril(x, kk), x)

    _register_block_ops(builtin, kernel, required)


def _np_dtype(code: int) -> np.dtype:
    import onnx_ir as ir

    return np.dtype(ir.DataType(code).numpy())


def _register_block_ops(builtin: Callable[..., Any], k: Any, required: Any) -> None:
    """DepthToSpace, SpaceToDepth, CenterCropPad."""

    @builtin("DepthToSpace", since=1, attrs={"blocksize": required, "mode": "DCR"})
    def depth_to_space(ctx, x, *, blocksize, mode):
        """DepthToSpace(input) -> output: moves depth blocks into spatial blocks (DCR or
        CRD)."""
        n, c, h, w = np.shape(x)
        b = blocksize
        if mode == "DCR":
            split, perm = (n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2)
        elif mode == "CRD":
            split, perm = (n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3)
        else:
            raise unsupported(ctx, f"mode {mode!r} not supported; use 'DCR' or 'CRD'")
        out = (n, c // (b * b), h * b, w * b)
        return k.run(lambda xp, x: xp.reshape(xp.transpose(xp.reshape(x, split), perm), out), x)

    @builtin("SpaceToDepth", since=1, attrs={"blocksize": required, "mode": "DCR"})
    def space_to_depth(ctx, x, *, blocksize, mode):
        """SpaceToDepth(input) -> output: moves spatial blocks into depth (DCR or CRD
        order)."""
        n, c, h, w = np.shape(x)
        b = blocksize
        perms = {"DCR": (0, 3, 5, 1, 2, 4), "CRD": (0, 1, 3, 5, 2, 4)}
        check_choice(ctx, "mode", mode, sorted(perms))
        split, out = (n, c, h // b, b, w // b, b), (n, c * b * b, h // b, w // b)
        return k.run(
            lambda xp, x: xp.reshape(xp.transpose(xp.reshape(x, split), perms[mode]), out), x
        )

    @builtin("CenterCropPad", since=18, attrs={"axes": None})
    def center_crop_pad(ctx, x, shape, *, axes):
        """CenterCropPad(input_data, shape) -> output_data: center crop or zero-pad to
        shape."""
        target = static_ints(ctx, shape, "shape")
        dims = tuple(np.shape(x))
        ax = [normalize_axis(ctx, a, len(dims)) for a in axes] if axes is not None else None
        crop = [slice(None)] * len(dims)
        width = [(0, 0)] * len(dims)
        for a, t in zip(ax if ax is not None else range(len(dims)), target, strict=False):
            if t < dims[a]:
                start = (dims[a] - t) // 2
                crop[a] = slice(start, start + t)
            elif t > dims[a]:
                before = (t - dims[a]) // 2
                width[a] = (before, t - dims[a] - before)
        y = x[tuple(crop)]
        return k.pad(y, width, "constant", 0) if any(b or e for b, e in width) else y
