"""The public source emitters ``to_flax`` and ``to_torch_source``, each checked against the
IR's runtime on example inputs (``to_jax`` / ``to_torch``): the differential check, which the
pipeline's check (:mod:`xconv.pipeline.checks`) runs too.

:mod:`xconv.pipeline` re-exports them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.parity.metrics import compare, is_float
from xconv.parity.policies import DIFFERENTIAL_NOISE, differential_policy
from xconv.pipeline.targets import _load_generated


def to_flax(
    model: ir.Model,
    out_dir: str | os.PathLike,
    *,
    api: str = "linen",
    options: Any = None,
    example_inputs: Any = None,
    partitioning: Any = None,
    format: str | None = None,
    dtype: Any = None,
) -> Path:
    """Write Flax source for ``model`` (see ``flax_emitter.to_flax``; ``partitioning`` and
    ``format`` as in ``xconv.sharding.flax.to_flax``); with ``example_inputs`` (an array or a
    tuple of arrays), run the written ``model.py`` and check it against ``xconv.to_jax`` of
    the same IR before returning.

    ``dtype="bfloat16"`` writes a model computing in bfloat16 with float32 parameters (layers
    get ``dtype=jnp.bfloat16``; norms and softmax run in float32); it is checked against
    ``xconv.to_jax(model, dtype="bfloat16")`` within :func:`bf16_differential_bound`.

    Raises:
        ParityError: the generated module disagrees with the runtime; names the first differing
            output. ``out_dir`` is removed: nothing wrong is left behind.
    """
    from xconv.converters.ops.precision import resolve_dtype
    from xconv.sharding.flax import to_flax as emit

    low = resolve_dtype(dtype)
    if low is not None:
        from dataclasses import replace

        from xconv.converters.flax.source.emitter import FlaxOptions

        options = replace(options or FlaxOptions(), dtype=low)
    out = emit(model, out_dir, api=api, options=options, partitioning=partitioning, format=format)
    if example_inputs is None:
        return out
    try:
        inputs = _as_input_tuple(example_inputs)
        generated = _load_generated(out / "model.py")
        if api == "linen":
            module, variables = generated.load(out)
            got = module.apply(variables, *inputs)
        else:
            got = generated.load(out)(*inputs)
        from xconv.converters.jax.interpreter import to_jax

        fn, params = to_jax(model) if low is None else to_jax(model, dtype=low)
        bound = None if low is None else bf16_differential_bound(model)
        what = f"generated Flax ({api}{', bfloat16' if low else ''})"
        want = fn(params, *inputs)
        _differential(model, what, "to_jax", got, want, bound, lambda: jax_float64(model, inputs))
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def to_torch_source(model: ir.Model, example_inputs: Any = None) -> tuple[str, dict[str, Any]]:
    """Readable torch source and its state_dict (see ``source_emitter.to_torch_source``); with
    ``example_inputs``, run the source and check it against ``xconv.to_torch`` of the same IR.

    Raises:
        ParityError: the generated module disagrees with the runtime; names the first differing
            output.
    """
    from xconv.converters.torch.emitter import to_torch
    from xconv.converters.torch.emitter import to_torch_source as emit

    source, state = emit(model)
    if example_inputs is None:
        return source, state
    import torch

    inputs = tuple(torch.as_tensor(np.asarray(x)) for x in _as_input_tuple(example_inputs))
    namespace: dict[str, Any] = {"__name__": "xconv_generated_torch_source"}
    exec(compile(source, "<xconv generated torch source>", "exec"), namespace)  # noqa: S102
    generated = namespace["Model"]().eval()
    generated.load_state_dict(state)
    runtime, _ = to_torch(model)
    with torch.no_grad():
        got, want = generated(*inputs), runtime(*inputs)
    oracle = lambda: torch_float64(model, inputs)  # noqa: E731
    _differential(model, "generated torch source", "to_torch", got, want, oracle=oracle)
    return source, state


def jax_float64(model: ir.Model, inputs: tuple[Any, ...]) -> list[np.ndarray]:
    """``to_jax`` of ``model`` cast to float64 (weights, value types, casts), run on
    ``inputs`` (float ones as float64) under ``jax.enable_x64``: the differential check's
    measure of the runtime's own float32 rounding."""
    import jax

    from xconv.converters.jax.interpreter import to_jax
    from xconv.parity.adapters import to_float64
    from xconv.parity.onnx_adapters import cast_model_to_double

    with jax.enable_x64(True):
        fn, params = to_jax(cast_model_to_double(model))
        out = fn(params, *to_float64([np.asarray(x) for x in inputs]))
        return [np.asarray(o) for o in jax.tree_util.tree_leaves(out)]


def torch_float64(model: ir.Model, inputs: tuple[Any, ...]) -> list[np.ndarray]:
    """``to_torch`` of ``model`` cast to float64, run on ``inputs`` (float ones as float64):
    as :func:`jax_float64`, for the torch source's check."""
    import torch

    from xconv.converters.torch.emitter import to_torch
    from xconv.parity.adapters import to_float64
    from xconv.parity.onnx_adapters import cast_model_to_double

    module, _ = to_torch(cast_model_to_double(model))
    xs = [torch.as_tensor(x) for x in to_float64([_numpy(x) for x in inputs])]
    with torch.no_grad():
        out = module(*xs)
    return [_numpy(o) for o in (out if isinstance(out, tuple | list) else [out])]


def _as_input_tuple(example_inputs: Any) -> tuple[Any, ...]:
    items = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    return tuple(x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x) for x in items)


def bf16_differential_bound(model: ir.Model) -> float:
    """Generated bfloat16 Flax vs bfloat16 ``to_jax``: the same ops, rounded to bfloat16 in
    different places (inside a Flax layer vs after an ONNX op): per element, within
    ``4 * 2**-8 * sqrt(L) * (|want| + max|want|)``, L the matmul/conv depth
    (:func:`xconv.converters.ops.precision.rounding_depth`)."""
    from xconv.converters.ops.precision import rounding_depth

    return 4 * 2.0**-8 * float(np.sqrt(rounding_depth(model)))


def _differential(
    model: ir.Model,
    what: str,
    runtime: str,
    got: Any,
    want: Any,
    bf16: float | None = None,
    oracle: Any = None,
) -> None:
    """Raise ParityError at the first output where ``got`` and ``want`` disagree, each judged
    by :func:`xconv.parity.metrics.compare` under
    :func:`~xconv.parity.policies.differential_policy` (within ``bf16`` relative to the
    element and the output's largest magnitude, when given).

    ``oracle`` (called at most once, only when a float32 output is outside the fixed bound)
    returns the runtime's outputs computed in float64: such an output is judged again with the
    bound widened by :data:`~xconv.parity.policies.DIFFERENTIAL_NOISE` times the runtime's
    largest error against it. Two runs that each round as float32 does differ by about their
    own errors; an emitter's mistake sits well above them."""
    from xconv.errors import ParityError

    f64: list[np.ndarray] | None = None

    got = list(got) if isinstance(got, tuple | list) else [got]
    want = list(want) if isinstance(want, tuple | list) else [want]
    names = [v.name for v in model.graph.outputs]
    if len(got) != len(want):
        raise ParityError(f"{what} returned {len(got)} outputs, {runtime} {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = _numpy(g), _numpy(w)
        name = names[i] if i < len(names) else str(i)
        first = f"{what} disagrees with {runtime} first at output {i} ({name!r})"
        if g.shape != w.shape:
            raise ParityError(f"{first}: shape {g.shape} vs {w.shape}")
        w64 = w.astype(np.float64) if is_float(w) else None
        scale = 0.0 if w64 is None else float(np.abs(w64).max(where=np.isfinite(w64), initial=0))
        m = compare(name, g, w, differential_policy(w.dtype, scale, bf16), logits=False,
                    check_dtype=False)  # fmt: skip
        noted = ""
        float32 = w.dtype == np.float32 and bf16 is None
        if not m.passed and m.error is None and float32 and oracle is not None:
            if f64 is None:
                f64 = _float64_run(oracle, len(want))
            noise = _runtime_error(w64, f64[i] if f64 else None)
            if noise is not None:
                policy = differential_policy(w.dtype, scale, noise=noise)
                m = compare(name, g, w, policy, logits=False, check_dtype=False)
                noted = (
                    f" (beyond {DIFFERENTIAL_NOISE:g} x {runtime}'s own float32 error "
                    f"on it, {noise:.3g} against its float64 run)"
                )
        if m.error is not None:
            raise ParityError(f"{first}: {m.error}")
        if not m.passed:
            where = m.first_mismatch  # a 0-d output is judged as one element
            g1, w1 = np.atleast_1d(g), np.atleast_1d(w)
            raise ParityError(
                f"{first}: {m.mismatches} of {g.size} elements, first at index {where}: "
                f"{g1[where]!r} vs {w1[where]!r}{noted}. The source emitter and the IR runtime "
                "differ on this graph: please report it."
            )


def _float64_run(oracle: Any, n: int) -> list[np.ndarray]:
    """``oracle()``'s outputs as float64 arrays, or ``[]`` where it cannot run or gives
    another number of outputs (the fixed bound then stands alone)."""
    try:
        out = [np.asarray(o, np.float64) for o in oracle()]
    except Exception:  # noqa: BLE001 - an op without float64: the fixed bound decides
        return []
    return out if len(out) == n else []


def _runtime_error(w64: np.ndarray, f64: np.ndarray | None) -> float | None:
    """The runtime's largest |error| against its float64 run over the finite elements."""
    if f64 is None or f64.shape != w64.shape:
        return None
    both = np.isfinite(w64) & np.isfinite(f64)
    return float(np.abs(w64 - f64)[both].max()) if both.any() else None


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; bfloat16 has no numpy dtype
        from xconv.converters.torch.runtime.dtypes import FLOAT4, SUB_BYTE, to_numpy, widen

        x = x.detach().cpu()
        if x.dtype == FLOAT4:  # one code a byte: ml_dtypes' float4e2m1 by a view
            return to_numpy(x)
        if x.dtype.is_floating_point and x.element_size() < 4:
            return x.float().numpy()
        if x.dtype in SUB_BYTE:  # torch.int4 ...: one value per byte, read as the byte type
            return widen(x).numpy()
        return x.numpy()
    return np.asarray(x)
