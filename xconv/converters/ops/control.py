"""Control flow written once where it runs in Python: If on a known condition, Loop's
Python loop, Scan's attribute handling (Scan-9 and Scan-8's batch loop), Scan's Python loop
and its axis moves. What lowers to the backend's own loops stays per backend: JAX's
``lax.cond``/``lax.while_loop``/``lax.scan`` for traced values (its ``scan_core`` and Loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np


class ScanKernel(Protocol):
    """What a backend provides for Scan."""

    def scan_core(self, ctx, body, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs):
        """Scan-9 semantics on unbatched values: ``(final states..., scan outputs...)``."""

    def stack(self, items: Sequence[Any]) -> Any:
        """The items stacked along a new leading axis."""

    def pad_time(self, y: Any, extra: int) -> Any:
        """``y`` with ``extra`` zero rows appended along axis 0."""

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend picks for ``arrays``."""

    def constant(self, a: np.ndarray) -> Any:
        """A numpy value as the backend hands it to a subgraph."""

    def truth(self, value: Any) -> bool | None:
        """The first element of ``value`` as a bool; None when only known at run time."""


def empty_output(value, leading: int = 0) -> np.ndarray:
    """An empty scan output (zero iterations), shaped from the body's declared output."""
    dtype = value.dtype.numpy() if value.dtype is not None else np.float32
    dims = []
    if value.shape is not None:
        dims = [d if isinstance(d, int) else 0 for d in value.shape]
    return np.zeros([leading, *dims], dtype=dtype)


def _flip(xp, x, direction):
    return xp.flip(x, 0) if direction else x


def to_leading(k: ScanKernel, xs, axes, directions) -> list[Any]:
    """Scan inputs with their scan axis moved first (reversed for direction 1)."""
    return [
        k.run(lambda xp, x, a=a, d=d: _flip(xp, xp.moveaxis(x, a, 0), d), x)
        for x, a, d in zip(xs, axes, directions, strict=True)
    ]


def from_leading(k: ScanKernel, ys, axes, directions) -> list[Any]:
    """Scan outputs moved from axis 0 to their output axis (reversed for direction 1)."""
    return [
        k.run(lambda xp, y, a=a, d=d: xp.moveaxis(_flip(xp, y, d), 0, a % y.ndim), y)
        for y, a, d in zip(ys, axes, directions, strict=True)
    ]


def python_scan(
    k: ScanKernel, ctx, body, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs
):
    """Scan-9 semantics on unbatched values as a Python loop: ``(final states..., scan
    outputs...)``."""
    xs = to_leading(k, scan_inputs, in_axes, in_dirs)
    final, ys = scan_steps(ctx, body, states, xs, k.stack, lambda v: k.constant(empty_output(v)))
    return (*final, *from_leading(k, ys, out_axes, out_dirs))


def loop_steps(k: ScanKernel, ctx, body, m, cond, v_initial) -> tuple | None:
    """Loop in Python: ``(v_final..., scan_outputs...)``, or None when the body's condition
    becomes known only at run time (``k.truth`` None: the caller lowers the loop instead)."""
    n_carried = len(v_initial)
    n_scan = len(body.outputs) - 1 - n_carried
    trips = None if m is None else np.asarray(ctx.static(m, "M"))
    it_dtype = np.int64 if trips is None else trips.dtype
    max_trip = None if trips is None else int(trips.reshape(-1)[0])
    keep_going = True if cond is None else k.truth(cond)
    cond_in = k.constant(np.array(keep_going))
    values = list(v_initial)
    scans: list[list[Any]] = [[] for _ in range(n_scan)]
    it = 0
    while keep_going and (max_trip is None or it < max_trip):
        outs = ctx.run_subgraph(body, [k.constant(np.array(it, it_dtype)), cond_in, *values])
        keep_going = k.truth(outs[0])
        if keep_going is None:
            return None
        values = list(outs[1 : 1 + n_carried])
        for j in range(n_scan):
            scans[j].append(outs[1 + n_carried + j])
        cond_in = outs[0]
        it += 1
    declared = body.outputs[1 + n_carried :]
    stacked = [
        k.stack(c) if c else k.constant(empty_output(declared[j])) for j, c in enumerate(scans)
    ]
    return (*values, *stacked)


def scan_steps(ctx, body, states, xs, stack, empty_like_output) -> tuple[list, list]:
    """Scan's loop in Python over the leading axis of ``xs``: the final states and the
    stacked scan outputs (``empty_like_output(value)`` for a loop of no steps)."""
    n_state = len(states)
    n_out = len(body.outputs) - n_state
    final = list(states)
    collected: list[list[Any]] = [[] for _ in range(n_out)]
    for t in range(xs[0].shape[0]):
        outs = ctx.run_subgraph(body, [*final, *(x[t] for x in xs)])
        final = list(outs[:n_state])
        for k in range(n_out):
            collected[k].append(outs[n_state + k])
    ys = [
        stack(c) if c else empty_like_output(body.outputs[n_state + k])
        for k, c in enumerate(collected)
    ]
    return final, ys


def _fill(values: Sequence[int] | None, n: int, what: str, ctx) -> list[int]:
    if values is None:
        return [0] * n
    if len(values) != n:
        raise ctx.error(f"{what} has {len(values)} entries, expected {n}")
    return list(values)


def register_if(builtin: Callable[..., Any], k: ScanKernel, required: Any) -> None:
    """Register If (``k.traced_if(ctx, cond, then_branch, else_branch)`` runs one whose
    condition is known only at run time)."""

    @builtin("If", since=1, attrs={"then_branch": required, "else_branch": required})
    def if_(ctx, cond, *, then_branch, else_branch):
        """If(cond) -> outputs of then_branch or else_branch."""
        truth = k.truth(cond)
        if truth is None:
            return k.traced_if(ctx, cond, then_branch, else_branch)
        return tuple(ctx.run_subgraph(then_branch if truth else else_branch, []))


def register_scan_ops(builtin: Callable[..., Any], k: ScanKernel, required: Any) -> None:
    """Register If and Scan (opsets 8 and 9+) with a backend's ``builtin`` and kernel ``k``."""
    register_if(builtin, k, required)

    @builtin(
        "Scan",
        since=9,
        attrs={
            "body": required,
            "num_scan_inputs": required,
            "scan_input_axes": None,
            "scan_input_directions": None,
            "scan_output_axes": None,
            "scan_output_directions": None,
        },
    )
    def scan(
        ctx,
        *inputs,
        body,
        num_scan_inputs,
        scan_input_axes,
        scan_input_directions,
        scan_output_axes,
        scan_output_directions,
    ):
        """Scan(initial_state_and_scan_inputs...) -> (final_state..., scan_outputs...)."""
        n_state = len(inputs) - num_scan_inputs
        states, xs = inputs[:n_state], inputs[n_state:]
        n_out = len(body.outputs) - n_state
        axes = _fill(scan_input_axes, num_scan_inputs, "scan_input_axes", ctx)
        in_axes = [a % np.ndim(x) for a, x in zip(axes, xs, strict=True)]
        in_dirs = _fill(scan_input_directions, num_scan_inputs, "scan_input_directions", ctx)
        out_axes = _fill(scan_output_axes, n_out, "scan_output_axes", ctx)
        out_dirs = _fill(scan_output_directions, n_out, "scan_output_directions", ctx)
        return k.scan_core(ctx, body, states, xs, in_axes, in_dirs, out_axes, out_dirs)

    @builtin(
        "Scan",
        since=8,
        until=8,
        attrs={"body": required, "num_scan_inputs": required, "directions": None},
    )
    def scan_8(ctx, sequence_lens, *inputs, body, num_scan_inputs, directions):
        """Scan-8(sequence_lens?, initial_state_and_scan_inputs...): batch axis 0, scan axis
        1."""
        n_state = len(inputs) - num_scan_inputs
        states, xs = inputs[:n_state], inputs[n_state:]
        n_out = len(body.outputs) - n_state
        dirs = _fill(directions, num_scan_inputs, "directions", ctx)
        batch, max_len = (int(d) for d in np.shape(xs[0])[:2])
        lens = (
            [max_len] * batch
            if sequence_lens is None
            else [int(v) for v in ctx.static(sequence_lens, "sequence_lens").reshape(-1)]
        )
        results = []
        for b in range(batch):
            n = lens[b]
            per = k.scan_core(
                ctx,
                body,
                [s[b] for s in states],
                [x[b, :n] for x in xs],
                [0] * num_scan_inputs,
                dirs,
                [0] * n_out,
                [0] * n_out,
            )
            if n < max_len:
                per = (*per[:n_state], *(k.pad_time(y, max_len - n) for y in per[n_state:]))
            results.append(per)
        return tuple(k.stack([r[i] for r in results]) for i in range(n_state + n_out))
