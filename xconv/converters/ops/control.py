"""Scan's attribute handling (Scan-9 and Scan-8's batch loop) written once; the loop itself
(:meth:`ScanKernel.scan_core`) stays per backend (``lax.scan`` under tracing on JAX, a Python
loop on torch), as do If and Loop.
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


def register_scan_ops(builtin: Callable[..., Any], k: ScanKernel, required: Any) -> None:
    """Register Scan (opsets 8 and 9+) with a backend's ``builtin`` and kernel ``k``."""

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
