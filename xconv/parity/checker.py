"""``xconv.check_parity``: run a reference and a candidate side by side and report where
they part."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from xconv.errors import ConversionError, InvalidModelError, ParityConfigError
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
            try:
                d["shape"] = tuple(int(n) for n in d["shape"])
                return cls(**d)
            except (KeyError, TypeError, ValueError) as e:
                raise ParityConfigError(
                    f"cannot read input spec {spec!r} ({type(e).__name__}: {e}): a dict needs "
                    "shape and may have dtype/low/high/vocab"
                ) from e
        if isinstance(spec, tuple | list) and all(isinstance(d, int) for d in spec):
            return cls(tuple(spec))
        raise ParityConfigError(
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
        if isinstance(inputs, dict):
            inputs = list(inputs.values())
        elif not isinstance(inputs, tuple | list):
            inputs = [inputs]
        try:
            arrays = [to_numpy(x) for x in inputs]
        except Exception as e:
            raise ParityConfigError(
                f"cannot read the inputs as arrays ({type(e).__name__}: {e}); pass numpy, "
                "torch or JAX arrays"
            ) from e
        bad = [i for i, a in enumerate(arrays) if a.dtype.kind in "OSUV"]
        if bad:
            raise ParityConfigError(
                f"input(s) {bad} are not numeric arrays "
                f"({[arrays[i].dtype.name for i in bad]}); pass numpy, torch or JAX arrays"
            )
        return arrays
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
        raise ParityConfigError(
            "no inputs to run: pass inputs=..., or input_spec=[(shape), ...] "
            "(or InputSpec(shape, dtype, low, high, vocab))"
        )
    rng = np.random.default_rng(seed)
    return [s.generate(rng) for s in specs]


def read_inputs_npz(path: str | os.PathLike) -> list[np.ndarray]:
    """Inputs from an ``.npz`` file, in the file's order (no pickles)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = [np.array(data[k]) for k in data.files]
    except Exception as e:
        raise ParityConfigError(
            f"cannot read inputs from {os.fspath(path)!r} ({type(e).__name__}: {e}); pass an "
            ".npz file of arrays in input order (numpy.savez)"
        ) from e
    if not arrays:
        raise ParityConfigError(f"{os.fspath(path)!r} holds no arrays")
    return arrays


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


def input_sets(
    arrays: Sequence[np.ndarray], *, n_random: int = 2, edges: bool = True, seed: int = 0
) -> list[tuple[str, list[np.ndarray]]]:
    """The input sets a check runs: the example inputs, ``n_random`` seeded draws within
    each input's observed range (integer ids within their observed ids, booleans kept), and
    edge draws where there is a float input: ``zeros`` and ``large`` (4x the example)."""
    arrays = list(arrays)
    out: list[tuple[str, list[np.ndarray]]] = [("example", arrays)]
    rng = np.random.default_rng([seed, 13])
    for j in range(n_random):
        out.append((f"random_{j}", [_draw(a, rng) for a in arrays]))
    floats = [is_float(a) and a.size > 0 for a in arrays]
    if edges and any(floats):
        out.append(
            ("zeros", [np.zeros_like(a) if f else a for a, f in zip(arrays, floats, strict=True)])
        )
        large = [
            (a.astype(np.float64) * 4.0).astype(a.dtype) if f else a
            for a, f in zip(arrays, floats, strict=True)
        ]
        out.append(("large", large))
    return out


def _draw(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random array like ``a`` within its observed range (booleans and empties kept)."""
    if a.size == 0 or a.dtype.kind == "b" or not (is_float(a) or a.dtype.kind in "iu"):
        return a
    if is_float(a):
        x = a.astype(np.float64)
        x = x[np.isfinite(x)]
        if x.size == 0:
            return a
        return rng.uniform(float(x.min()), float(x.max()), size=a.shape).astype(a.dtype)
    lo, hi = int(a.min()), int(a.max())
    return rng.integers(lo, hi + 1, size=a.shape).astype(a.dtype)


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
    n_random: int = 2,
    edges: bool = True,
    allow_constant: bool | None = None,
    allow_dtype: Any = None,
    grad_names: Mapping[str, str] | None = None,
    layerwise: Any = False,
    mesh: Any = None,
    rules: Any = None,
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
            respect to float inputs and weights. Weights are matched by the name map of
            the conversion either side comes from (``xconv.to_jax`` / ``to_torch`` weight
            names, ``SOURCE_NAMES`` of a module ``xconv.to_flax`` wrote), else by name rules;
            the notes say which. A weight gradient left unmatched is an error unless
            ``grad_names`` is given.
        rtol / atol: Explicit tolerances (switch to the explicit policy).
        k: Oracle policy: allowed ratio to the reference's own float64 error.
        seed: Seed for generated inputs, random input draws and cotangents.
        n_random: Random input sets drawn within the example inputs' observed range.
        edges: Also run edge input sets (zeros, large magnitude) when there is a float input.
        allow_constant: Accept reference outputs that are constant on every input set.
        allow_dtype: Allowed dtype changes, reference -> candidate (``Policy.allow_dtype``).
        grad_names: Reference weight name -> candidate weight name, for ``grads=True``.
        layerwise: Build the float64 oracle one block at a time (reference: a
            ``torch.export.ExportedProgram``), and judge each block of the candidate's IR
            too (see :mod:`xconv.parity.layerwise`). ``True`` takes the IR from the
            candidate (``xconv.to_jax`` results) or converts the program; an
            ``onnx_ir.Model`` is used as given; a ``LayerwiseResult`` from
            ``xconv.parity.layerwise.run_layerwise`` on the same inputs is taken as is, and so is a mapping from input-set name (:func:`input_sets`) to such runs.
        mesh: Run the candidate (a JAX or Flax model) sharded over this mesh
            (``"2x4"`` = data 2 x model 4, or a ``jax.sharding.Mesh``): batch split over
            ``data``, params kept as placed or placed by ``rules`` (see
            :mod:`xconv.sharding`). ``report.mesh`` gives the mesh and each param's sharding.
        rules: ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` (default) or a rule table, for ``mesh``.

    Returns:
        A :class:`ParityReport`; ``report.passed`` says whether the candidate agrees on
        every input set (``report.input_sets``).

    Raises:
        ParityConfigError: Unknown devices, an invalid policy, or unusable inputs.
    """
    pol = resolve_policy(policy, rtol=rtol, atol=atol, k=k)
    if allow_constant is not None or allow_dtype is not None:
        pol = replace(
            pol,
            allow_constant=pol.allow_constant if allow_constant is None else allow_constant,
            allow_dtype=pol.allow_dtype if allow_dtype is None else allow_dtype,
        )
    if not (isinstance(n_random, int) and n_random >= 0):
        raise ParityConfigError(f"n_random must be an int >= 0, not {n_random!r}")
    ref = wrap(reference)
    cand = wrap(candidate)
    arrays = make_inputs(inputs, input_spec, [ref, cand], seed)
    sets = input_sets(arrays, n_random=n_random, edges=edges, seed=seed)
    notes: list[str] = []
    if mesh is not None:
        from xconv.sharding.parity import wrap_for_mesh

        cand = wrap_for_mesh(cand, mesh, rules, arrays, notes)
    timings: dict[str, float] = {}

    cand_devs = _select_devices(cand.devices(), devices)
    if not cand_devs:
        raise ParityConfigError(
            f"none of the devices {devices!r} is visible to {cand.framework}: {cand.devices()}; "
            "pass devices='all' or one of those"
        )

    ref_dev = ref.devices()[0]
    ref.prepare(ref_dev)
    ref_outs: list[list[np.ndarray]] = []
    kept: list[tuple[str, list[np.ndarray]]] = []
    for name, xs in sets:
        try:
            out, secs = _timed(ref.run, xs, ref_dev)
        except ConversionError:
            raise
        except Exception as e:
            if name == "example":
                raise ParityConfigError(
                    f"the reference ({ref.describe()}) cannot run on the inputs "
                    f"{[(list(a.shape), a.dtype.name) for a in xs]}: {type(e).__name__}: {e}"
                ) from e
            notes.append(f"input set {name!r} skipped: the reference cannot run on it ({e})")
            continue
        timings["reference" + ("" if name == "example" else f"[{name}]")] = secs
        ref_outs.append(out)
        kept.append((name, xs))
    sets = kept
    ref_out = ref_outs[0]
    names = ref.output_names(len(ref_out))

    oracle, oracle_outs = None, None
    blocks = None
    if layerwise is not False and layerwise is not None:
        from xconv.parity.layerwise import layerwise_oracle

        # One block-by-block float64 run per input set; the example set's blocks are the
        # per-scope verdicts, and any set's failing block fails the check.
        # ``layerwise`` may map set names to runs made beforehand (the pipeline runs them
        # before loading the candidate, to keep peak memory down).
        runs = [
            layerwise[name]
            if isinstance(layerwise, Mapping) and name in layerwise
            else layerwise_oracle(reference, cand, layerwise, xs, pol)
            for name, xs in sets
        ]
        blocks = runs[0]
        for run in runs[1:]:
            if not run.passed and blocks.passed:
                blocks = run
        if all(run.oracle_outputs for run in runs):
            oracle_outs = [run.oracle_outputs for run in runs]
        for run in runs:
            notes.extend(n for n in run.notes if n not in notes)
    elif pol.uses_oracle:
        oracle, why = ref.oracle()
        if oracle is not None:
            try:
                oracle.prepare(_cpu(oracle))
                t = time.perf_counter()
                oracle_outs = [oracle.run(to_float64(xs), _cpu(oracle)) for _, xs in sets]
                timings["oracle"] = time.perf_counter() - t
            except Exception as e:
                oracle, why = None, f"{why}; it failed to run ({type(e).__name__}: {e})"
            else:
                low = [
                    o
                    for oo, rr in zip(oracle_outs, ref_outs, strict=True)
                    for o, r in zip(oo, rr, strict=False)
                    if is_float(r) and o.dtype != np.float64
                ]
                if low or any(len(o) != len(r) for o, r in zip(oracle_outs, ref_outs, strict=True)):
                    oracle, why = None, f"{why}; but its outputs are not all float64"
        if oracle is None:
            oracle_outs = _candidate_float64(cand, sets, len(ref_out), timings)
            if oracle_outs is not None:
                notes.append(
                    f"no float64 oracle for the reference ({why}): its rounding error is "
                    "estimated from the candidate's float64 run (noise policy, capped by the "
                    "dtype policy)"
                )
                pol = pol.as_noise_policy()
            else:
                notes.append(f"no float64 oracle ({why}): fell back to the dtype policy")
                pol = pol.as_dtype_policy()

    def judge_for(si: int):
        def judge(outs: list[np.ndarray]) -> list[Metrics]:
            if len(outs) != len(ref_outs[si]):
                m = Metrics(name="outputs", passed=False, shape=(len(outs),), dtype="-")
                m.error = f"{len(outs)} outputs, the reference has {len(ref_outs[si])}"
                return [m]
            return [
                compare(n, c, r, pol, None if oracle_outs is None else oracle_outs[si][i])
                for i, (n, c, r) in enumerate(zip(names, outs, ref_outs[si], strict=True))
            ]

        return judge

    matrix: list[DeviceRun] = []
    for si, (set_name, xs) in enumerate(sets):
        for dev in cand_devs:
            row = _run_row(cand, "candidate", dev, xs, judge_for(si), timings, set_name)
            matrix.append(row)
        for dev in _select_devices(ref.devices(), devices):
            if dev != ref_dev:
                matrix.append(_run_row(ref, "reference", dev, xs, judge_for(si), timings, set_name))
    cand_rows = [r for r in matrix if r.role == "candidate"]
    passed = all(r.passed for r in cand_rows)
    failing = next((r for r in cand_rows if not r.passed), None)
    shown = failing if failing is not None else cand_rows[0]

    report = ParityReport(
        passed=passed,
        reference=ref.describe(),
        candidate=cand.describe(),
        policy=pol.describe(),
        outputs=shown.outputs,
        matrix=matrix,
        inputs=[{"shape": list(a.shape), "dtype": a.dtype.name} for a in arrays],
        notes=notes,
        timings=timings,
    )
    report.policy_kind = pol.kind
    if mesh is not None:
        report.mesh = cand.report()
    report.input_sets = [
        {
            "name": set_name,
            "passed": all(r.passed for r in cand_rows if r.inputs == set_name),
            "inputs": [{"shape": list(a.shape), "dtype": a.dtype.name} for a in xs],
        }
        for set_name, xs in sets
    ]
    reason = _vacuous(names, ref_outs, pol)
    if reason is not None:
        report.passed = False
        report.reason = reason

    if blocks is not None:
        report.scopes = [b.as_scope() for b in blocks.blocks]
        report.first_divergence = blocks.first_divergence
        report.passed = report.passed and blocks.passed
    if grads:
        report.grads = _check_grads(
            ref,
            cand,
            oracle,
            arrays,
            ref_out,
            cand_devs[0],
            ref_dev,
            pol,
            seed,
            notes,
            grad_names,
        )
        report.passed = report.passed and all(m.passed for m in report.grads)

    if intermediates and failing is not None and failing.error is None and blocks is None:
        t = time.perf_counter()
        xs = dict(sets)[failing.inputs]
        _localize_into(report, ref, cand, oracle, xs, ref_dev, failing.device, pol)
        timings["localize"] = time.perf_counter() - t
    return report


def _vacuous(names: list[str], ref_outs: list[list[np.ndarray]], pol: Policy) -> str | None:
    """Why the check compares nothing, or None: no outputs, or an output whose reference is
    empty or constant on every input set (unless the policy allows constants)."""
    if not ref_outs[0]:
        return "vacuous: the reference returns no outputs, so nothing was compared"
    if pol.allow_constant:
        return None
    const = []
    for i, name in enumerate(names):
        vals = [np.asarray(outs[i]) for outs in ref_outs if i < len(outs)]
        total = sum(v.size for v in vals)
        if total == 0:
            const.append(f"{name} (empty)")
            continue
        if total == 1:
            continue
        first = vals[0].reshape(-1)[0]
        same = all(
            np.all((v == first) | (np.isnan(v) & np.isnan(first)) if is_float(v) else v == first)
            for v in vals
        )
        if same:
            const.append(f"{name} (always {first!r})")
    if const:
        return (
            f"vacuous: the reference output(s) {', '.join(const)} are constant on every input "
            "set, so they cannot tell a right model from a wrong one; pass "
            "allow_constant=True if that is expected"
        )
    return None


def _candidate_float64(
    cand: Adapter,
    sets: list[tuple[str, list[np.ndarray]]],
    n_outputs: int,
    timings: dict[str, float],
) -> list[list[np.ndarray]] | None:
    """The candidate's float64 outputs per input set, or None when it has no float64 twin."""
    try:
        twin, _ = cand.oracle()
        if twin is None:
            return None
        twin.prepare(_cpu(twin))
        t = time.perf_counter()
        outs = [twin.run(to_float64(xs), _cpu(twin)) for _, xs in sets]
        timings["candidate-float64"] = time.perf_counter() - t
    except Exception:
        logger.debug("the candidate's float64 twin failed", exc_info=True)
        return None
    for o in outs:
        if len(o) != n_outputs or any(is_float(a) and a.dtype != np.float64 for a in o):
            return None
    return outs


def _cpu(adapter: Adapter) -> str:
    devs = adapter.devices()
    return next((d for d in devs if d.startswith("cpu")), devs[0])


def _run_row(adapter, role, dev, arrays, judge, timings, set_name="example") -> DeviceRun:
    try:
        adapter.prepare(dev)
        outs, secs = _timed(adapter.run, arrays, dev)
    except Exception as e:
        logger.debug("run failed", exc_info=True)
        return DeviceRun(
            adapter.framework, dev, role, False, [], f"{type(e).__name__}: {e}", inputs=set_name
        )
    timings[f"{role}:{dev}" + ("" if set_name == "example" else f"[{set_name}]")] = secs
    metrics = judge(outs)
    return DeviceRun(
        adapter.framework,
        dev,
        role,
        all(m.passed for m in metrics),
        metrics,
        None,
        secs,
        inputs=set_name,
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
    ref, cand, oracle, arrays, ref_out, cand_dev, ref_dev, pol, seed, notes, grad_names=None
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
    mapping, how, cand_sources = _grad_mapping(ref, cand, rg.params, cg.params, grad_names)
    notes.append(
        f"weight gradients: {len(mapping)} of {len(rg.params)} reference weight(s) matched by {how}"
    )
    lost_ref = [n for n in rg.params if n not in mapping]
    # A candidate-only leaf whose gradient is identically zero is not trained, and state
    # either side keeps out of differentiation (torch buffers) is not a weight.
    frozen = {_loose_param(n) for n in (*rg.frozen, *cg.frozen)}
    lost_ref = [n for n in lost_ref if _loose_param(n) not in frozen]
    # A candidate leaf the conversion made from reference state (nnx BatchStat from a torch
    # running_mean buffer) is not a weight either.
    lost_cand = sorted(
        n
        for n in set(cg.params) - set(mapping.values())
        if _loose_param(n) not in frozen
        and _loose_param(cand_sources.get(n, n)) not in frozen
        and np.any(np.asarray(cg.params[n], dtype=np.float64) != 0)
    )
    if lost_ref or lost_cand:
        what = (
            f"{len(lost_ref)} reference weight gradient(s) {lost_ref[:6]} and "
            f"{len(lost_cand)} candidate one(s) {lost_cand[:6]} are not matched by name"
        )
        if grad_names is None:
            m = Metrics(name="d/<weights>", passed=False, shape=(), dtype="-")
            m.error = f"{what} by {how}; pass grad_names={{reference name: candidate name}}"
            out.append(m)
        else:
            notes.append(f"{what} (outside grad_names, not compared)")
    for rn, cn in mapping.items():
        r, c = rg.params[rn], _to_layout(cg.params[cn], rg.params[rn].shape)
        o = og.params.get(rn) if og is not None else None
        out.append(compare(f"d/{rn}", c, r, gpol, o))
    return out


def _grad_mapping(
    ref, cand, ref_names, cand_names, explicit: Mapping[str, str] | None
) -> tuple[dict[str, str], str, dict[str, str]]:
    """Reference weight name -> candidate weight name, how it was found, and the candidate's
    source names where its conversion recorded them. The mapping comes from ``explicit``
    (``grad_names``, name rules for the rest); else the name map of the conversion one side
    comes from (:meth:`Adapter.source_names`: ``xconv.to_jax`` / ``to_torch`` weight names,
    ``SOURCE_NAMES`` of a generated Flax module), with no guessing; else the name rules of
    :func:`match_param_names` when neither side records one."""
    if explicit is not None:
        return match_param_names(ref_names, cand_names, explicit), "grad_names (and name rules)", {}
    out: dict[str, str] = {}
    recorded = cand.source_names(list(cand_names))
    if recorded is not None:
        sources, where = recorded
        for cn, source in sources.items():
            rn = _same_name(source, ref_names)
            if rn is not None and rn not in out:
                out[rn] = cn
        return out, f"the conversion's name map ({where})", sources
    recorded = ref.source_names(list(ref_names))
    if recorded is not None:
        sources, where = recorded
        taken: set[str] = set()
        for rn, source in sources.items():
            cn = _same_name(source, cand_names)
            if cn is not None and cn not in taken:
                out[rn] = cn
                taken.add(cn)
        return out, f"the conversion's name map ({where})", {}
    rules = match_param_names(ref_names, cand_names, None)
    return rules, "name rules (no conversion name map on either side)", {}


def _same_name(source: str, names) -> str | None:
    """``source`` as spelled among ``names``: itself, or with ``/`` for ``.`` and without a
    leading ``params`` collection (the spellings of one name, not a guess at another)."""
    dotted = source.replace("/", ".")
    for n in (source, dotted, dotted.removeprefix("params.")):
        if n in names:
            return n
    return None


def match_param_names(
    ref_names: Sequence[str], cand_names: Sequence[str], explicit: Mapping[str, str] | None
) -> dict[str, str]:
    """Reference weight name -> candidate weight name: ``explicit`` entries, then equal
    names, then names equal up to separators (``/``, ``.``, and the ``_`` of generated Flax
    module names), a ``params.`` prefix, an nnx ``.value`` suffix and the role's spelling
    (Flax ``kernel``/``scale``/``embedding`` for torch ``weight``). Names that become
    ambiguous under these rules match nothing."""
    cand_set = set(cand_names)
    out: dict[str, str] = {}
    for r, c in (explicit or {}).items():
        if r in ref_names and c in cand_set:
            out[r] = c
    used = set(out.values())
    for r in ref_names:
        if r not in out and r in cand_set and r not in used:
            out[r] = r
            used.add(r)
    loose: dict[str, str | None] = {}
    for c in cand_names:
        if c not in used:
            key = _loose_param(c)
            loose[key] = None if key in loose else c  # ambiguous names match nothing
    for r in ref_names:
        if r not in out:
            hit = loose.get(_loose_param(r))
            if hit is not None and hit not in used:
                out[r] = hit
                used.add(hit)
    return out


def _loose_param(name: str) -> str:
    parts = [p for p in name.replace("/", ".").split(".") if p]
    if parts and parts[0] == "params":
        parts = parts[1:]
    if parts and parts[-1] == "value":
        parts = parts[:-1]
    if parts and parts[-1] in ("kernel", "scale", "embedding"):
        parts[-1] = "weight"
    # Generated Flax modules flatten ``blocks.0.conv`` to ``blocks_0_conv``.
    return ".".join(parts).replace("_", ".")


def _to_layout(c: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A candidate weight gradient in the reference's layout: Flax ``[spatial..., I, O]``
    (or ``[I, O]``) to torch ``[O, I, spatial...]`` when that is what makes shapes agree."""
    if c.shape == tuple(shape) or c.ndim != len(shape) or c.ndim < 2:
        return c
    perm = (c.ndim - 1, c.ndim - 2, *range(c.ndim - 2))
    moved = np.transpose(c, perm)
    return moved if moved.shape == tuple(shape) else c


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
