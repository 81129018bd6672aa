"""Input sets at other shapes: a model whose input dims are symbolic is checked at two other
admissible sizes too, not only at the example's.

A converted model that is right at the example shape can still be wrong at every other one
(a size folded into a constant, a mask built from the example's length). When the IR says
an input dim is symbolic, :func:`shape_sets` adds two sets beside the example's:

* ``shape_small``: batch 1, every other symbolic dim smaller (a sequence of 8 -> 5, a
  spatial size by its largest power-of-two step: 32 -> 16);
* ``shape_large``: batch + 1, every other symbolic dim larger (8 -> 12, 32 -> 48).

Inputs that share a symbol are resized together. Each input is cropped or tiled from the
example along its resized axes (token ids stay valid, attention masks stay well formed), and
float inputs are then drawn anew within the example's observed range. Sizes stay within the
model's limits where known (``range_constraints`` of a ``torch.export`` program, e.g. BERT's
sequence ``[2, 512]``); a set with no admissible size to change is skipped with a note. A set
the source model itself rejects is dropped by the check with a note ("shape not admissible by
the source"), never counted against the conversion.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Names of the sets :func:`shape_sets` builds.
SHAPE_SETS = ("shape_small", "shape_large")

Dims = tuple[str | None, ...]


@dataclass(frozen=True)
class SymbolicShapes:
    """Which input axes are symbolic, and their limits.

    Attributes:
        dims: Per input, per axis: the symbol's name, or None for a fixed axis. Axes with
            the same name are one size.
        limits: Symbol name -> ``(min, max)``; ``max`` None when unbounded.
        origin: Where the dims were read (for the report's notes).
    """

    dims: tuple[Dims, ...]
    limits: Mapping[str, tuple[int, int | None]] = field(default_factory=dict)
    origin: str = "the model's inputs"

    @property
    def symbolic(self) -> bool:
        return any(d is not None for dims in self.dims for d in dims)


@dataclass
class ShapeSets:
    """The extra input sets (name, arrays) and the notes on the ones skipped or built."""

    sets: list[tuple[str, list[np.ndarray]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ reading the dims


def model_dims(model: Any) -> tuple[Dims, ...] | None:
    """Per graph input of an ``onnx_ir.Model``, each axis's symbol name (None: fixed)."""
    import onnx_ir as ir

    out = []
    for value in model.graph.inputs:
        shape = value.shape
        if shape is None:
            return None
        dims: list[str | None] = []
        for i, d in enumerate(shape):
            if isinstance(d, ir.SymbolicDim):
                # An unnamed symbolic dim is its own size.
                dims.append(d.value if d.value else f"{value.name}:{i}")
            else:
                dims.append(None)
        out.append(tuple(dims))
    return tuple(out)


def program_dims(program: Any) -> tuple[tuple[Any, ...], ...]:
    """Per user input of a ``torch.export.ExportedProgram``: each axis's size (an int, or
    the symbol of a symbolic one)."""
    import torch

    users = set(program.graph_signature.user_inputs)
    out = []
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in users:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            out.append(())
            continue
        dims = []
        for d in val.shape:
            expr = d.node.expr if isinstance(d, torch.SymInt) else None
            dims.append(expr if expr is not None and getattr(expr, "is_Symbol", False) else int(d))
        out.append(tuple(dims))
    return tuple(out)


def program_limits(program: Any, dims: Sequence[Dims] | None = None) -> dict[str, tuple]:
    """The ``range_constraints`` of a program's input symbols, keyed by the names ``dims``
    give the same (input, axis) positions (the IR's inputs follow the program's user inputs
    in order, whatever their dims are named), or by the symbols' own names."""
    ranges = getattr(program, "range_constraints", None) or {}
    pdims = program_dims(program)
    if dims is not None and len(dims) != len(pdims):
        logger.debug("program has %d user inputs, the IR %d: no limits", len(pdims), len(dims))
        return {}
    out: dict[str, tuple] = {}
    for i, axes in enumerate(pdims):
        names = dims[i] if dims is not None else tuple(str(a) for a in axes)
        if len(names) != len(axes):
            continue
        for sym, name in zip(axes, names, strict=True):
            if isinstance(sym, int) or name is None or sym not in ranges:
                continue
            lo, hi = _bound(ranges[sym].lower), _bound(ranges[sym].upper)
            # torch.export gives every dynamic dim a lower bound of 2 (it specialises sizes 0
            # and 1 when tracing), not a limit of the model: the program runs at 1 (a source
            # that does not is dropped with a note, as for any shape it rejects).
            if lo == 2:
                lo = 1
            if name in out:  # two symbols under one name: the tighter range
                plo, phi = out[name]
                lo = max(lo or 0, plo or 0)
                hi = hi if phi is None else phi if hi is None else min(hi, phi)
            out[name] = (lo if lo is not None else 0, hi)
    return out


def _bound(v: Any) -> int | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return int(f) if np.isfinite(f) else None


def from_model(model: Any, program: Any = None) -> SymbolicShapes | None:
    """The symbolic dims of an ``onnx_ir.Model``'s inputs, with the limits of the torch
    program it came from (when given); None when it has none."""
    dims = model_dims(model)
    if dims is None:
        return None
    limits: dict[str, tuple] = {}
    if program is not None and type(program).__name__ == "ExportedProgram":
        try:
            limits = program_limits(program, dims)
        except Exception:  # noqa: BLE001 (no limits known: sizes are chosen unbounded)
            logger.debug("cannot read the program's range constraints", exc_info=True)
    shapes = SymbolicShapes(dims, limits, "the converted model's inputs")
    return shapes if shapes.symbolic else None


def from_program(program: Any) -> SymbolicShapes | None:
    """The symbolic dims and limits of an ``ExportedProgram``'s user inputs."""
    pdims = program_dims(program)
    dims = tuple(tuple(None if isinstance(a, int) else str(a) for a in axes) for axes in pdims)
    shapes = SymbolicShapes(dims, program_limits(program), "the exported program's inputs")
    return shapes if shapes.symbolic else None


def resolve(shapes: Any, reference: Any, candidate: Any, layerwise: Any = None) -> Any:
    """``check_parity``'s ``shapes`` argument as a :class:`SymbolicShapes`, a
    :class:`ShapeSets` given as is, or None (no shape sets).

    ``"auto"``: the candidate's IR (an ``xconv.to_jax`` result, an ``onnx_ir.Model``, the
    ``layerwise`` IR) with the reference program's limits, else the reference's own
    (an ``ExportedProgram`` or an ONNX model); None when no side says its dims are symbolic.
    """
    if shapes is None or shapes is False:
        return None
    if isinstance(shapes, SymbolicShapes | ShapeSets):
        return shapes
    if _ir_of(shapes) is not None:
        return from_model(shapes)
    if shapes != "auto":
        if isinstance(shapes, Sequence) and not isinstance(shapes, str):
            dims = tuple(tuple(None if d is None else str(d) for d in axes) for axes in shapes)
            return SymbolicShapes(dims, {}, "the given dims")
        from xconv.errors import ParityConfigError

        raise ParityConfigError(
            f"shapes={shapes!r}: use 'auto', False, per-input dim names, an onnx_ir.Model or "
            "xconv.parity.shapes.SymbolicShapes"
        )
    program = _program(reference)
    for side in (layerwise, candidate, reference):
        model = _ir_of(side)
        if model is not None:
            return from_model(model, program)
    return from_program(program) if program is not None else None


def _program(side: Any) -> Any:
    side = getattr(side, "program", side)
    return side if type(side).__name__ == "ExportedProgram" else None


def _ir_of(side: Any) -> Any:
    """The ``onnx_ir.Model`` behind a side, if any: the model itself, an adapter's, or an
    ``xconv.to_jax`` function's."""
    import onnx_ir as ir

    if side is None or isinstance(side, bool | str):
        return None
    if isinstance(side, ir.Model):
        return side
    model = getattr(side, "ir_model", None)
    if isinstance(model, ir.Model):
        return model
    if isinstance(side, tuple) and side and callable(side[0]):
        fn = side[0]
        model = getattr(fn, "model", None)
        if hasattr(fn, "intermediates") and isinstance(model, ir.Model):
            return model
    return None


# ------------------------------------------------------------------ choosing sizes


@dataclass
class _Axis:
    """One symbol: its example size, where it occurs and its role."""

    size: int
    places: list[tuple[int, int]]  # (input, axis)
    role: str = "seq"


def _role(name: str, places: list[tuple[int, int]], arrays: Sequence[np.ndarray]) -> str:
    lname = name.lower()
    if lname == "batch" or all(ax == 0 and arrays[i].ndim >= 2 for i, ax in places):
        return "batch"
    if lname in ("height", "width", "depth") or all(
        arrays[i].ndim >= 4 and ax >= 1 for i, ax in places
    ):
        return "spatial"
    return "seq"


def _sizes(role: str, n: int) -> tuple[int, int]:
    """The smaller and the larger size tried for a dim of example size ``n``."""
    if role == "batch":
        return 1, n + 1
    if role == "spatial":
        # Keep the size's power-of-two factor (a stride structure) and step by it.
        step = n & -n
        step = min(step, 32)
        while step > 1 and n - step < n // 2:
            step //= 2
        return n - step, n + step
    return n - max(1, (3 * n) // 8), n + max(1, n // 2)


def _admissible(want: int, n: int, limits: tuple[int, int | None] | None) -> int | None:
    """``want`` moved into the dim's limits; None when no size other than ``n`` is left on
    that side of it."""
    lo, hi = limits if limits is not None else (1, None)
    lo = max(lo or 0, 1)
    size = max(want, lo)
    if hi is not None:
        size = min(size, hi)
    if size == n or (want < n) != (size < n):
        return None
    return size


def shape_sets(
    arrays: Sequence[np.ndarray], shapes: SymbolicShapes | None, *, seed: int = 0
) -> ShapeSets:
    """The ``shape_small`` and ``shape_large`` input sets for ``arrays`` (the example inputs)
    under ``shapes``; none for a static model. Notes say which set was skipped and why."""
    out = ShapeSets()
    if shapes is None or not shapes.symbolic:
        return out
    arrays = [np.asarray(a) for a in arrays]
    if len(shapes.dims) != len(arrays) or any(
        len(d) != a.ndim for d, a in zip(shapes.dims, arrays, strict=True)
    ):
        out.notes.append(
            f"no input sets at other shapes: the {len(arrays)} inputs' ranks "
            f"{[a.ndim for a in arrays]} do not match {shapes.origin} "
            f"{[len(d) for d in shapes.dims]}"
        )
        return out
    axes: dict[str, _Axis] = {}
    clash: set[str] = set()
    for i, dims in enumerate(shapes.dims):
        for ax, name in enumerate(dims):
            if name is None:
                continue
            n = int(arrays[i].shape[ax])
            if name in axes and axes[name].size != n:
                clash.add(name)
            axes.setdefault(name, _Axis(n, [])).places.append((i, ax))
    for name in clash:
        out.notes.append(
            f"symbolic dim {name!r} has different example sizes across the inputs; "
            "kept at the example's"
        )
        del axes[name]
    small: dict[str, int] = {}
    large: dict[str, int] = {}
    for name, axis in axes.items():
        if axis.size < 1:
            continue
        axis.role = _role(name, axis.places, arrays)
        lo, hi = _sizes(axis.role, axis.size)
        limits = shapes.limits.get(name)
        s, b = _admissible(lo, axis.size, limits), _admissible(hi, axis.size, limits)
        if s is not None:
            small[name] = s
        if b is not None:
            large[name] = b
    rng = np.random.default_rng([seed, 17])
    for set_name, sizes, how in (
        ("shape_small", small, "smaller"),
        ("shape_large", large, "larger"),
    ):
        if not sizes:
            limits = {n: shapes.limits[n] for n in axes if n in shapes.limits}
            out.notes.append(
                f"input set {set_name!r} skipped: no symbolic dim of {shapes.origin} "
                f"({', '.join(f'{n}={a.size}' for n, a in axes.items()) or 'none usable'}) "
                f"has an admissible {how} size"
                + (f" within its limits {_limits_text(limits)}" if limits else "")
            )
            continue
        out.sets.append(
            (
                set_name,
                [_resize(a, d, sizes, rng) for a, d in zip(arrays, shapes.dims, strict=True)],
            )
        )
    return out


def _limits_text(limits: Mapping[str, tuple]) -> str:
    return ", ".join(
        f"{n} in [{lo}, {'inf' if hi is None else hi}]" for n, (lo, hi) in limits.items()
    )


def _resize(a: np.ndarray, dims: Dims, sizes: Mapping[str, int], rng) -> np.ndarray:
    """``a`` cropped or tiled to ``sizes`` along its symbolic axes; a float input drawn anew
    within its observed range."""
    from xconv.parity.adapters import is_float
    from xconv.parity.checker import _draw

    changed = False
    for ax, name in enumerate(dims):
        if name is None or name not in sizes or a.shape[ax] == sizes[name]:
            continue
        a = np.take(a, np.arange(sizes[name]) % a.shape[ax], axis=ax)
        changed = True
    a = np.ascontiguousarray(a)
    return _draw(a, rng) if changed and is_float(a) else a


def describe_set(inputs: Sequence[Any]) -> str:
    """A set's input shapes for one line of the report: ``(2, 8)`` or ``(2, 8) (2, 8)``."""
    shapes = []
    for x in inputs:
        shape = x["shape"] if isinstance(x, Mapping) else np.shape(x)
        shapes.append(
            "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"
        )
    return " ".join(shapes)


def inadmissible_note(name: str, inputs: Sequence[np.ndarray], error: BaseException) -> str:
    """The note for a shape set the source model cannot run."""
    return (
        f"input set {name!r} at {describe_set(inputs)} dropped: shape not admissible by the "
        f"source (the reference raised {type(error).__name__}: {str(error)[:300]}); not "
        "counted against the conversion"
    )


__all__ = [
    "SHAPE_SETS",
    "ShapeSets",
    "SymbolicShapes",
    "describe_set",
    "from_model",
    "from_program",
    "inadmissible_note",
    "model_dims",
    "program_limits",
    "resolve",
    "shape_sets",
]
