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

from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops.control import register_scan_ops, scan_steps
from xconv.errors import ConversionError


def is_traced(value: Any) -> bool:
    """True when ``value`` (or any element of a sequence value) is a JAX tracer."""
    if isinstance(value, list | tuple):
        return any(is_traced(v) for v in value)
    return isinstance(value, jax.core.Tracer)


def _stack(items: Sequence[Any]) -> Any:
    if all(isinstance(x, np.ndarray | np.generic) for x in items):
        return np.stack([np.asarray(x) for x in items])
    return jnp.stack([jnp.asarray(x) for x in items])


def _empty_like_output(value, leading: int = 0) -> np.ndarray:
    """An empty scan output (zero iterations), shaped from the body's declared output."""
    dtype = value.dtype.numpy() if value.dtype is not None else np.float32
    dims = []
    if value.shape is not None:
        dims = [d if isinstance(d, int) else 0 for d in value.shape]
    return np.zeros([leading, *dims], dtype=dtype)


def _cast_like(value: Any, like: Any) -> Any:
    """Cast a loop-carried value to the dtype of its initial value (lax needs fixed types)."""
    if value is None or like is None or isinstance(value, list):
        return value
    dtype = jnp.asarray(like).dtype
    return jnp.asarray(value).astype(dtype)


# --------------------------------------------------------------------------------------- If


@builtin("If", since=1, attrs={"then_branch": REQUIRED, "else_branch": REQUIRED})
def if_(ctx, cond, *, then_branch, else_branch):
    """If(cond) -> outputs of then_branch or else_branch."""
    if not is_traced(cond):
        branch = then_branch if bool(np.asarray(cond).reshape(-1)[0]) else else_branch
        return tuple(ctx.run_subgraph(branch, []))

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


def _loop_python(ctx, body, m, cond, v_initial, n_scan):
    """Run a Loop eagerly in Python; returns None if the condition becomes traced."""
    n_carried = len(v_initial)
    it_dtype = np.asarray(m).dtype if m is not None else np.int64
    max_trip = None if m is None else int(np.asarray(m))
    keep_going = True if cond is None else bool(np.asarray(cond))
    cond_in = np.array(keep_going)
    values = list(v_initial)
    scans: list[list[Any]] = [[] for _ in range(n_scan)]
    it = 0
    while keep_going and (max_trip is None or it < max_trip):
        outs = ctx.run_subgraph(body, [np.array(it, dtype=it_dtype), cond_in, *values])
        cond_out = outs[0]
        if is_traced(cond_out):
            return None
        values = list(outs[1 : 1 + n_carried])
        for k in range(n_scan):
            scans[k].append(outs[1 + n_carried + k])
        cond_in = cond_out
        keep_going = bool(np.asarray(cond_out).reshape(-1)[0])
        it += 1
    results = list(values)
    body_scan_outputs = body.outputs[1 + n_carried :]
    for k in range(n_scan):
        results.append(_stack(scans[k]) if scans[k] else _empty_like_output(body_scan_outputs[k]))
    return tuple(results)


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
        out = _loop_python(ctx, body, m, cond, v_initial, n_scan)
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
            return _loop_python(ctx, body, m, cond, v_initial, n_scan)
        return _loop_scan(ctx, body, int(np.asarray(m)), v_initial, n_scan)
    except _CarryMismatch as e:
        # Carried values that grow (e.g. a Concat per step) cannot go through lax; with a
        # constant trip count and condition the loop can still unroll in Python.
        if steering_static and m is not None:
            out = _loop_python(ctx, body, m, cond, v_initial, n_scan)
            if out is not None:
                return out
        raise ctx.error(str(e)) from e


# ------------------------------------------------------------------------------------- Scan


def _scan_core(ctx, body, states, scan_inputs, in_axes, in_dirs, out_axes, out_dirs):
    """Scan-9 semantics on unbatched values; returns (final states..., scan outputs...)."""
    n_state = len(states)
    xs = []
    for x, axis, direction in zip(scan_inputs, in_axes, in_dirs, strict=True):
        x = (
            jnp.moveaxis(jnp.asarray(x), axis, 0)
            if not isinstance(x, np.ndarray)
            else (np.moveaxis(x, axis, 0))
        )
        xs.append(x[::-1] if direction else x)
    traced = is_traced(list(states)) or is_traced(list(scan_inputs))
    if traced:

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
        final, ys = list(final), list(ys)
    else:
        final, ys = scan_steps(ctx, body, states, xs, _stack, _empty_like_output)
    outputs = []
    for y, axis, direction in zip(ys, out_axes, out_dirs, strict=True):
        y = y[::-1] if direction else y
        mod = np if isinstance(y, np.ndarray) else jnp
        outputs.append(mod.moveaxis(y, 0, axis % y.ndim))
    return (*final, *outputs)


class _ScanKernel:
    """The JAX side of :mod:`xconv.converters.ops.control`."""

    scan_core = staticmethod(_scan_core)
    stack = staticmethod(_stack)

    @staticmethod
    def pad_time(y, extra):
        return jnp.pad(jnp.asarray(y), [(0, extra)] + [(0, 0)] * (y.ndim - 1))


register_scan_ops(builtin, _ScanKernel(), REQUIRED)
