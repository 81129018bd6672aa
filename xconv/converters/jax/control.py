"""Control flow: If, Loop, Scan.

Each op runs its subgraph with ``ctx.run_subgraph``. When the values that steer the
control flow (the If condition, the Loop trip count and condition) are concrete, the
handler runs in Python: branches may then differ in shape, loop-carried values may grow
and carry ONNX sequences. Under ``jax.jit`` (traced values) it lowers to ``lax.cond``,
``lax.while_loop`` and ``lax.scan``, which need shape-stable bodies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.control import (
    from_leading,
    loop_steps,
    python_scan,
    register_scan_ops,
    to_leading,
)
from xconv.errors import ConversionError


def is_traced(value: Any) -> bool:
    """True when ``value`` (or any element of a sequence value) is a JAX tracer."""
    if isinstance(value, list | tuple):
        return any(is_traced(v) for v in value)
    return isinstance(value, jax.core.Tracer)


def _cast_like(value: Any, like: Any) -> Any:
    """Cast a loop-carried value to the dtype of its initial value (lax needs fixed types)."""
    if value is None or like is None or isinstance(value, list):
        return value
    dtype = jnp.asarray(like).dtype
    return jnp.asarray(value).astype(dtype)


# --------------------------------------------------------------------------------------- If


def _traced_if(ctx, cond, then_branch, else_branch):
    """If on a traced condition as ``lax.cond``: both branches must agree in shape."""
    n = len(ctx.node.outputs)
    dtypes = [ctx.output_dtype(i) for i in range(n)]

    def make(branch):
        def run():
            outs = ctx.run_subgraph(branch, [])
            return tuple(
                jnp.asarray(o, dtype=dt) if dt is not None and not isinstance(o, list | None) else o
                for o, dt in zip(outs, dtypes, strict=False)
            )

        return run

    pred = jnp.reshape(jnp.asarray(cond), (-1,))[0].astype(bool)
    try:
        return tuple(jax.lax.cond(pred, make(then_branch), make(else_branch)))
    except ConversionError:
        raise
    except (TypeError, ValueError) as e:
        raise ctx.error(
            "under jax.jit the If condition is traced, so both branches must produce outputs "
            f"of the same shapes and dtypes ({e}); make the condition a constant or run "
            "without jit"
        ) from e


# ------------------------------------------------------------------------------------- Loop


def _loop_while(ctx, body, m, cond, v_initial):
    """Loop without scan outputs as ``lax.while_loop``."""
    it_dtype = jax.dtypes.canonicalize_dtype(np.int64)
    init_cond = jnp.asarray(True if cond is None else cond).reshape(()).astype(bool)
    init = (jnp.zeros((), it_dtype), init_cond, tuple(jnp.asarray(v) for v in v_initial))

    if m is None or is_traced(m):
        limit = m
    else:
        # Exporters write "no limit" as INT64_MAX; clamp it to the iteration counter's range
        # (int32 when JAX runs without x64) instead of letting it wrap around.
        limit = np.array(min(int(np.asarray(m)), np.iinfo(it_dtype).max), dtype=it_dtype)

    def cond_fn(state):
        i, c, _ = state
        if limit is None:
            return c
        return jnp.logical_and(c, i < jnp.asarray(limit).reshape(()).astype(it_dtype))

    def body_fn(state):
        i, c, values = state
        outs = ctx.run_subgraph(body, [i, c, *values])
        new_values = tuple(
            _cast_like(o, v) for o, v in zip(outs[1 : 1 + len(values)], values, strict=True)
        )
        new_cond = jnp.asarray(outs[0]).reshape(()).astype(bool)
        return i + 1, new_cond, new_values

    try:
        _, _, values = jax.lax.while_loop(cond_fn, body_fn, init)
    except ConversionError:
        raise
    except (TypeError, ValueError) as e:
        raise _CarryMismatch(
            "under jax.jit a Loop lowers to lax.while_loop, whose loop-carried values must "
            f"keep their shapes and dtypes ({e}); use a constant trip count and condition, "
            "or run without jit"
        ) from e
    return tuple(values)


def _loop_scan(ctx, body, trip: int, v_initial, n_scan):
    """Loop with scan outputs and a static trip count as ``lax.scan``.

    The condition must stay statically true (the usual for-loop export), otherwise the
    length of the scan outputs would depend on run-time data.
    """
    it_dtype = jax.dtypes.canonicalize_dtype(np.int64)
    n_carried = len(v_initial)
    cond_static: list[bool] = []

    def step(values, i):
        outs = ctx.run_subgraph(body, [i, np.array(True), *values])
        cond_out = outs[0]
        cond_static.append(not is_traced(cond_out) and bool(np.asarray(cond_out)))
        new_values = tuple(
            _cast_like(o, v) for o, v in zip(outs[1 : 1 + n_carried], values, strict=True)
        )
        return new_values, tuple(jnp.asarray(o) for o in outs[1 + n_carried :])

    try:
        values, scans = jax.lax.scan(
            step, tuple(jnp.asarray(v) for v in v_initial), jnp.arange(trip, dtype=it_dtype)
        )
    except ConversionError:
        raise
    except (TypeError, ValueError) as e:
        raise _CarryMismatch(
            "under jax.jit a Loop with scan outputs lowers to lax.scan, whose loop-carried "
            f"values must keep their shapes and dtypes ({e}); run without jit"
        ) from e
    if not all(cond_static):
        raise ctx.error(
            "a Loop with scan outputs whose condition depends on run-time data has a "
            "data-dependent output length, which jax.jit cannot trace; run without jit"
        )
    return (*values, *scans)


class _CarryMismatch(Exception):
    """lax could not lower a Loop: its carried values change shape or dtype."""


@builtin("Loop", since=1, attrs={"body": REQUIRED})
def loop(ctx, m, cond, *v_initial, body):
    """Loop(M?, cond?, v_initial...) -> (v_final..., scan_outputs...)."""
    n_scan = len(body.outputs) - 1 - len(v_initial)
    steering_static = not is_traced(m) and not is_traced(cond)
    has_sequences = any(isinstance(v, list) for v in v_initial)
    carried_traced = any(is_traced(v) for v in v_initial)
    # Eager and sequence-carrying loops run in Python; under jit, lax comes first.
    if steering_static and (has_sequences or not carried_traced):
        out = loop_steps(_KERNEL, ctx, body, m, cond, v_initial)
        if out is not None:
            return out
    if has_sequences:
        raise ctx.error(
            "a Loop carrying sequences needs a constant trip count and a condition that stays "
            "constant under jax.jit"
        )
    try:
        if not n_scan:
            return _loop_while(ctx, body, m, cond, v_initial)
        if not steering_static or m is None:
            raise ctx.error(
                "a Loop with scan outputs needs a constant trip count and condition under "
                "jax.jit (its output length would depend on run-time data); run without jit"
            )
        if cond is not None and not bool(np.asarray(cond)):
            return loop_steps(_KERNEL, ctx, body, m, cond, v_initial)
        return _loop_scan(ctx, body, int(np.asarray(m)), v_initial, n_scan)
    except _CarryMismatch as e:
        # Carried values that grow (e.g. a Concat per step) cannot go through lax; with a
        # constant trip count and condition the loop can still unroll in Python.
        if steering_static and m is not None:
            out = loop_steps(_KERNEL, ctx, body, m, cond, v_initial)
            if out is not None:
                return out
        raise ctx.error(str(e)) from e


# ------------------------------------------------------------------------------------- Scan


def _lax_scan(ctx, body, states, xs):
    """Scan's loop as ``lax.scan`` over the leading axis of ``xs``."""
    n_state = len(states)

    def step(carry, x):
        outs = ctx.run_subgraph(body, [*carry, *x])
        new = tuple(_cast_like(o, c) for o, c in zip(outs[:n_state], carry, strict=True))
        return new, tuple(jnp.asarray(o) for o in outs[n_state:])

    try:
        final, ys = jax.lax.scan(
            step, tuple(jnp.asarray(s) for s in states), tuple(jnp.asarray(x) for x in xs)
        )
    except ConversionError:
        raise
    except (TypeError, ValueError) as e:
        raise ctx.error(
            f"Scan lowers to lax.scan, whose state must keep its shape and dtype ({e})"
        ) from e
    return list(final), list(ys)


class _ControlKernel:
    """The JAX side of :mod:`xconv.converters.ops.control`: ``lax`` for traced values."""

    run = staticmethod(KERNEL.run)
    constant = staticmethod(KERNEL.constant)
    traced_if = staticmethod(_traced_if)

    @staticmethod
    def truth(value: Any) -> bool | None:
        return None if is_traced(value) else bool(np.asarray(value).reshape(-1)[0])

    @staticmethod
    def stack(items: Sequence[Any]) -> Any:
        if all(isinstance(x, np.ndarray | np.generic) for x in items):
            return np.stack([np.asarray(x) for x in items])
        return jnp.stack([jnp.asarray(x) for x in items])

    @staticmethod
    def pad_time(y, extra):
        return jnp.pad(jnp.asarray(y), [(0, extra)] + [(0, 0)] * (y.ndim - 1))

    def scan_core(self, ctx, body, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs):
        """Scan-9 on unbatched values: ``lax.scan`` when a value is traced, else Python."""
        if not (is_traced(list(states)) or is_traced(list(scan_inputs))):
            args = (states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs)
            return python_scan(self, ctx, body, *args)
        xs = to_leading(self, scan_inputs, in_axes, in_dirs)
        final, ys = _lax_scan(ctx, body, states, xs)
        return (*final, *from_leading(self, ys, out_axes, out_dirs))


_KERNEL = _ControlKernel()
register_scan_ops(builtin, _KERNEL, REQUIRED)
