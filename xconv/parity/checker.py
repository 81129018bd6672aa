"""``xconv.check_parity``: run a reference and a candidate side by side and report where
they part."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xconv.errors import InvalidModelError
from xconv.parity.adapters import Adapter, is_float, to_float64, to_numpy, wrap
from xconv.parity.localize import localize
from xconv.parity.metrics import Metrics, compare
from xconv.parity.policies import Policy, resolve_policy
from xconv.parity.report import DeviceRun, ParityReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputSpec:
    """How to generate one input deterministically.

    Attributes:
        shape: Static shape.
        dtype: numpy dtype name.
        low: Lower bound of the values (floats: uniform; ints: inclusive).
        high: Upper bound (floats: uniform; ints: exclusive).
        vocab: For integer ids: values in ``[0, vocab)`` (overrides low/high).
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    low: float = -1.0
    high: float = 1.0
    vocab: int | None = None

    @classmethod
    def coerce(cls, spec: Any) -> InputSpec:
        if isinstance(spec, InputSpec):
            return spec
        if isinstance(spec, dict):
            d = dict(spec)
            d["shape"] = tuple(d["shape"])
            return cls(**d)
        if isinstance(spec, tuple | list) and all(isinstance(d, int) for d in spec):
            return cls(tuple(spec))
        raise TypeError(
            f"cannot read input spec {spec!r}: use a shape tuple, a dict with shape/dtype/low/"
            "high/vocab, or xconv.parity.InputSpec"
        )

    def generate(self, rng: np.random.Generator) -> np.ndarray:
        dt = np.dtype(self.dtype) if self.dtype != "bfloat16" else None
        if self.vocab is not None:
            return rng.integers(0, self.vocab, size=self.shape).astype(dt or np.int64)
        if dt is not None and dt.kind == "b":
            return rng.integers(0, 2, size=self.shape).astype(bool)
        if dt is not None and dt.kind in "iu":
            lo, hi = int(self.low), int(self.high)
            if hi <= lo:
                hi = lo + 1
            return rng.integers(lo, hi, size=self.shape).astype(dt)
        x = rng.uniform(self.low, self.high, size=self.shape)
        if dt is None:
            import ml_dtypes

            return x.astype(ml_dtypes.bfloat16)
        return x.astype(dt)


def make_inputs(
    inputs: Any, input_spec: Any, adapters: Sequence[Adapter], seed: int = 0
) -> list[np.ndarray]:
    """Inputs as numpy: given ones converted, else generated from specs (given, or read
    from an IR-backed side's graph inputs), deterministically from ``seed``."""
    if inputs is not None:
        if isinstance(inputs, tuple | list):
            return [to_numpy(x) for x in inputs]
        if isinstance(inputs, dict):
            return [to_numpy(x) for x in inputs.values()]
        return [to_numpy(inputs)]
    specs = None
    if input_spec is not None:
        if isinstance(input_spec, InputSpec | dict) or (
            isinstance(input_spec, tuple) and all(isinstance(d, int) for d in input_spec)
        ):
            input_spec = [input_spec]
        specs = [InputSpec.coerce(s) for s in input_spec]
    else:
        for a in adapters:
            specs = a.input_specs()
            if specs:
                break
    if not specs:
        raise ValueError(
            "no inputs to run: pass inputs=..., or input_spec=[(shape), ...] "
            "(or InputSpec(shape, dtype, low, high, vocab))"
        )
    rng = np.random.default_rng(seed)
    return [s.generate(rng) for s in specs]


def _select_devices(available: list[str], devices: Any) -> list[str]:
    if devices in (None, "all"):
        return available
    wanted = [devices] if isinstance(devices, str) else list(devices)
    wanted = [w.strip().lower() for w in wanted if w.strip()]
    picked = [
        d
        for d in available
        if any(d == w or d.startswith(w.rstrip(":") + ":") or d.split(":")[0] == w for w in wanted)
    ]
    return picked


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def check_parity(
    reference: Any,
    candidate: Any,
    inputs: Any = None,
    *,
    input_spec: Any = None,
    policy: str | Policy = "oracle",
    devices: str | Sequence[str] = "all",
    intermediates: bool = True,
    grads: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    k: float | None = None,
    seed: int = 0,
    layerwise: Any = False,
) -> ParityReport:
    """Run ``reference`` and ``candidate`` on the same inputs and compare them.

    Args:
        reference: The source of truth: a torch module or function, ``(fn, params)`` for
            JAX (``xconv.to_jax`` results included), ``(module, variables)`` for Flax linen,
            an nnx module, a TF function or Keras model, an onnxruntime session, a ``.onnx``
            path or an ``onnx_ir.Model`` (run by onnxruntime).
        candidate: The converted model, any of the same kinds.
        inputs: An array or a sequence of arrays (numpy, torch, JAX). Generated from
            ``input_spec`` (or an ONNX side's input types) when None.
        input_spec: Shapes, dicts or :class:`InputSpec` for generated inputs.
        policy: ``"oracle"`` (default), ``"dtype"`` or a :class:`Policy`.
        devices: ``"all"``, ``"cpu"``, or device names (``"cuda:0"``, ``"gpu"``) to run the
            candidate (and the reference's extra devices) on.
        intermediates: When outputs part, compare module-scope outputs to name the first
            divergent scope.
        grads: Also compare gradients of ``sum(outputs * fixed random cotangents)`` with
            respect to float inputs and weights (matched by name).
        rtol / atol: Explicit tolerances (switch to the explicit policy).
        k: Oracle policy: allowed ratio to the reference's own float64 error.
        seed: Seed for generated inputs and cotangents.
        layerwise: Build the float64 oracle one block at a time (reference: a
            ``torch.export.ExportedProgram``), and judge each block of the candidate's IR
            too (see :mod:`xconv.parity.layerwise`). ``True`` takes the IR from the
            candidate (``xconv.to_jax`` results) or converts the program; an
            ``onnx_ir.Model`` is used as given; a ``LayerwiseResult`` from
            ``xconv.parity.layerwise.run_layerwise`` on the same inputs is taken as is.

    Returns:
        A :class:`ParityReport`; ``report.passed`` says whether the candidate agrees.
    """
    pol = resolve_policy(policy, rtol=rtol, atol=atol, k=k)
    ref = wrap(reference)
    cand = wrap(candidate)
    arrays = make_inputs(inputs, input_spec, [ref, cand], seed)
    notes: list[str] = []
    timings: dict[str, float] = {}

    ref_dev = ref.devices()[0]
    ref.prepare(ref_dev)
    ref_out, timings["reference"] = _timed(ref.run, arrays, ref_dev)
    names = ref.output_names(len(ref_out))

    oracle, oracle_out = None, None
    blocks = None
    if layerwise is not False and layerwise is not None:
        from xconv.parity.layerwise import layerwise_oracle

        blocks = layerwise_oracle(reference, cand, layerwise, arrays, pol)
        oracle_out = blocks.oracle_outputs or None
        notes.extend(blocks.notes)
    elif pol.uses_oracle:
        oracle, why = ref.oracle()
        if oracle is not None:
            try:
                oracle.prepare(_cpu(oracle))
                oracle_out, timings["oracle"] = _timed(oracle.run, to_float64(arrays), _cpu(oracle))
            except Exception as e:
                oracle, why = None, f"{why}; it failed to run ({type(e).__name__}: {e})"
            else:
                low = [
                    o
                    for o, r in zip(oracle_out, ref_out, strict=False)
                    if is_float(r) and o.dtype != np.float64
                ]
                if low or len(oracle_out) != len(ref_out):
                    oracle, why = None, f"{why}; but its outputs are not all float64"
        if oracle is None:
            oracle_out = _candidate_float64(cand, arrays, len(ref_out), timings)
            if oracle_out is not None:
                notes.append(
                    f"no float64 oracle for the reference ({why}): its rounding error is "
                    "estimated from the candidate's float64 run (noise policy)"
                )
                pol = pol.as_noise_policy()
            else:
                notes.append(f"no float64 oracle ({why}): fell back to the dtype policy")
                pol = pol.as_dtype_policy()

    def judge(outs: list[np.ndarray]) -> list[Metrics]:
        if len(outs) != len(ref_out):
            m = Metrics(name="outputs", passed=False, shape=(len(outs),), dtype="-")
            m.error = f"{len(outs)} outputs, the reference has {len(ref_out)}"
            return [m]
        return [
            compare(n, c, r, pol, None if oracle_out is None else oracle_out[i])
            for i, (n, c, r) in enumerate(zip(names, outs, ref_out, strict=True))
        ]

    matrix: list[DeviceRun] = []
    cand_devs = _select_devices(cand.devices(), devices)
    if not cand_devs:
        raise ValueError(
            f"none of the devices {devices!r} is visible to {cand.framework}: {cand.devices()}"
        )
    for dev in cand_devs:
        matrix.append(_run_row(cand, "candidate", dev, arrays, judge, timings))
    for dev in _select_devices(ref.devices(), devices):
        if dev != ref_dev:
            matrix.append(_run_row(ref, "reference", dev, arrays, judge, timings))
    cand_rows = [r for r in matrix if r.role == "candidate"]
    passed = all(r.passed for r in cand_rows)

    report = ParityReport(
        passed=passed,
        reference=ref.describe(),
        candidate=cand.describe(),
        policy=pol.describe(),
        outputs=cand_rows[0].outputs,
        matrix=matrix,
        inputs=[{"shape": list(a.shape), "dtype": a.dtype.name} for a in arrays],
        notes=notes,
        timings=timings,
    )

    if blocks is not None:
        report.scopes = [b.as_scope() for b in blocks.blocks]
        report.first_divergence = blocks.first_divergence
        report.passed = report.passed and blocks.passed
    if grads:
        report.grads = _check_grads(
            ref, cand, oracle, arrays, ref_out, cand_devs[0], ref_dev, pol, seed, notes
        )
        report.passed = report.passed and all(m.passed for m in report.grads)

    failing = next((r for r in cand_rows if not r.passed and r.error is None), None)
    if intermediates and failing is not None and blocks is None:
        t = time.perf_counter()
        _localize_into(report, ref, cand, oracle, arrays, ref_dev, failing.device, pol)
        timings["localize"] = time.perf_counter() - t
    return report


def _candidate_float64(
    cand: Adapter, arrays: list[np.ndarray], n_outputs: int, timings: dict[str, float]
) -> list[np.ndarray] | None:
    """The candidate's float64 outputs, or None when it has no float64 twin."""
    try:
        twin, _ = cand.oracle()
        if twin is None:
            return None
        twin.prepare(_cpu(twin))
        outs, timings["candidate-float64"] = _timed(twin.run, to_float64(arrays), _cpu(twin))
    except Exception:
        logger.debug("the candidate's float64 twin failed", exc_info=True)
        return None
    if len(outs) != n_outputs or any(is_float(o) and o.dtype != np.float64 for o in outs):
        return None
    return outs


def _cpu(adapter: Adapter) -> str:
    devs = adapter.devices()
    return next((d for d in devs if d.startswith("cpu")), devs[0])


def _run_row(adapter, role, dev, arrays, judge, timings) -> DeviceRun:
    try:
        adapter.prepare(dev)
        outs, secs = _timed(adapter.run, arrays, dev)
    except Exception as e:
        logger.debug("run failed", exc_info=True)
        return DeviceRun(adapter.framework, dev, role, False, [], f"{type(e).__name__}: {e}")
    timings[f"{role}:{dev}"] = secs
    metrics = judge(outs)
    return DeviceRun(
        adapter.framework, dev, role, all(m.passed for m in metrics), metrics, None, secs
    )


def _localize_into(report, ref, cand, oracle, arrays, ref_dev, cand_dev, pol) -> None:
    try:
        ref_trace = ref.trace(arrays, ref_dev)
        cand_trace = cand.trace(arrays, cand_dev)
    except Exception as e:
        report.notes.append(f"could not trace module scopes ({type(e).__name__}: {e})")
        return
    if ref_trace is None or cand_trace is None:
        side = "reference" if ref_trace is None else "candidate"
        report.notes.append(
            f"the {side} ({(ref if ref_trace is None else cand).describe()}) gives no module-scope trace; cannot localise"
        )
        return
    oracle_trace = None
    if oracle is not None:
        try:
            oracle_trace = oracle.trace(to_float64(arrays), _cpu(oracle))
        except Exception as e:
            report.notes.append(
                f"oracle scope trace failed ({type(e).__name__}: {e}); scopes judged by dtype"
            )
    scope_pol = (
        pol if oracle_trace is not None else pol.as_dtype_policy() if pol.uses_oracle else pol
    )
    results, first, note = localize(ref_trace, cand_trace, scope_pol, oracle_trace)
    report.scopes = results
    report.first_divergence = first
    if note:
        report.notes.append(note)


def _check_grads(
    ref, cand, oracle, arrays, ref_out, cand_dev, ref_dev, pol, seed, notes
) -> list[Metrics]:
    rng = np.random.default_rng(seed + 1)
    cots = [rng.standard_normal(o.shape) if is_float(o) else None for o in ref_out]
    try:
        rg = ref.grads(arrays, cots, ref_dev)
        cg = cand.grads(arrays, cots, cand_dev)
    except Exception as e:
        m = Metrics(name="grads", passed=False, shape=(), dtype="-")
        m.error = f"gradient computation failed: {type(e).__name__}: {e}"
        return [m]
    if rg is None or cg is None:
        side = ref if rg is None else cand
        m = Metrics(name="grads", passed=False, shape=(), dtype="-")
        m.error = f"{side.describe()} cannot compute gradients"
        return [m]
    og = None
    if oracle is not None and pol.uses_oracle:
        try:
            og = oracle.grads(to_float64(arrays), cots, _cpu(oracle))
        except Exception as e:
            notes.append(
                f"oracle gradients failed ({type(e).__name__}: {e}); gradients judged by dtype"
            )
    gpol = pol if og is not None or not pol.uses_oracle else pol.as_dtype_policy()
    out = []
    for i, (r, c) in enumerate(zip(rg.inputs, cg.inputs, strict=False)):
        if r is None or c is None:
            continue
        o = og.inputs[i] if og is not None else None
        out.append(compare(f"d/input_{i}", c, r, gpol, o))
    common = [n for n in rg.params if n in cg.params]
    unmatched = sorted(set(rg.params) ^ set(cg.params))
    if unmatched:
        notes.append(f"{len(unmatched)} weight gradient(s) not matched by name: {unmatched[:6]}")
    for n in common:
        o = og.params.get(n) if og is not None else None
        out.append(compare(f"d/{n}", cg.params[n], rg.params[n], gpol, o))
    return out


def check_files(
    reference_path: str | os.PathLike,
    candidate_path: str | os.PathLike,
    inputs: Any = None,
    *,
    trust_code: bool = False,
    **kwargs: Any,
) -> ParityReport:
    """Check two saved models (for ``xconv check``).

    Each path may be a ``.onnx`` file, a directory holding exactly one, or an
    ``xconv.to_flax`` output directory (``model.py`` + ``variables.msgpack``). Loading the
    latter runs its generated Python, so it needs ``trust_code=True``. Other keyword
    arguments go to :func:`check_parity`.
    """
    return check_parity(
        _load_side(reference_path, trust_code),
        _load_side(candidate_path, trust_code),
        inputs,
        **kwargs,
    )


def _load_side(path: str | os.PathLike, trust_code: bool) -> Any:
    p = Path(path)
    if p.is_dir() and (p / "model.py").is_file() and (p / "xconv.json").is_file():
        if not trust_code:
            raise InvalidModelError(
                f"{p} is a generated Flax module; checking it imports and runs its model.py. "
                "Pass trust_code=True (CLI: --trust-code) if you trust that directory."
            )
        return _load_flax_dir(p)
    return _model_file(p)


def _load_flax_dir(p: Path) -> Any:
    import importlib.util
    import json

    api = json.loads((p / "xconv.json").read_text()).get("api", "linen")
    spec = importlib.util.spec_from_file_location(
        f"xconv_generated_{abs(hash(str(p)))}", p / "model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loaded = module.load(str(p))
    if api == "linen" and not (isinstance(loaded, tuple) and len(loaded) == 2):
        raise InvalidModelError(f"{p / 'model.py'}: load() should return (module, variables)")
    return loaded


def _model_file(path: str | os.PathLike) -> str:
    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*.onnx"))
        if len(found) != 1:
            raise InvalidModelError(
                f"{p} holds {len(found)} .onnx files and no generated Flax module; "
                "point at the model file itself"
            )
        return str(found[0])
    if not p.is_file():
        raise InvalidModelError(f"no such model file: {p}")
    if p.suffix != ".onnx":
        raise InvalidModelError(
            f"cannot check {p}: xconv check reads .onnx files, or a directory holding one or "
            "an xconv.to_flax output"
        )
    return str(p)
