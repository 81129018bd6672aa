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

from xconv.errors import (
    ConversionError,
    InvalidModelError,
    ParityConfigError,
    UsageError,
    require,
)
from xconv.parity.adapters import Adapter, cpu_device, is_float, to_float64, to_numpy, wrap
from xconv.parity.grads import check_grads
from xconv.parity.localize import localize
from xconv.parity.metrics import Metrics, compare
from xconv.parity.policies import Policy, resolve_policy
from xconv.parity.precision import check_request
from xconv.parity.report import DeviceRun, ParityReport
from xconv.parity.shapes import SHAPE_SETS, inadmissible_note

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
    precision: str | None = None,
    shapes: Any = "auto",
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
        precision: ``"default"`` (None): every row runs at its device's default matmul
            precision (or the one the user set: ``jax_default_matmul_precision``, torch's
            ``allow_tf32``), and a row whose float32 dots ran reduced (TF32 on NVIDIA GPUs,
            bfloat16 passes on TPUs) is judged with that rounding's floor
            (:meth:`Policy.at_precision`); ``report.matrix[i].precision`` names it.
            ``"highest"``: the candidate (and the reference's extra devices) run with full
            float32 dots and are judged at float32.
        shapes: Input sets at other shapes (:mod:`xconv.parity.shapes`): when the model's
            input dims are symbolic, ``shape_small`` (batch 1, other symbolic dims smaller)
            and ``shape_large`` (batch + 1, larger) run beside the example's, within the
            dims' limits. ``"auto"`` (default) reads the dims from the candidate's IR (an
            ``xconv.to_jax`` result, an ``onnx_ir.Model``, the ``layerwise`` IR) with the
            limits of a reference ``ExportedProgram``, else from the reference's program or
            IR; ``False`` runs none; an ``onnx_ir.Model``, per-input dim names
            (``[("batch", "seq")]``), a :class:`~xconv.parity.shapes.SymbolicShapes` or
            :class:`~xconv.parity.shapes.ShapeSets` give them. A set the reference rejects
            is dropped with a note ("shape not admissible by the source").

    Returns:
        A :class:`ParityReport`; ``report.passed`` says whether the candidate agrees on
        every input set (``report.input_sets``).

    Raises:
        ParityConfigError: Unknown devices, an invalid policy, or unusable inputs.
    """
    pol = _policy(policy, rtol, atol, k, allow_constant, allow_dtype)
    request = check_request(precision)
    if not (isinstance(n_random, int) and n_random >= 0):
        raise ParityConfigError(f"n_random must be an int >= 0, not {n_random!r}")
    ref, cand = wrap(reference), wrap(candidate)
    arrays = make_inputs(inputs, input_spec, [ref, cand], seed)
    sets = input_sets(arrays, n_random=n_random, edges=edges, seed=seed)
    extra = _shape_sets(arrays, shapes, reference, candidate, layerwise, seed)
    run = _Run(ref, cand, sets + extra.sets, pol)
    run.notes.extend(extra.notes)
    run.request = request
    if mesh is not None:
        from xconv.sharding.parity import wrap_for_mesh

        run.cand = cand = wrap_for_mesh(cand, mesh, rules, arrays, run.notes)
    cand_devs = _candidate_devices(cand, devices)
    run.run_reference()
    if layerwise is not False and layerwise is not None:
        run.layerwise_oracle(reference, layerwise)
    elif pol.uses_oracle:
        run.float64_oracle()
    report, failing = run.report(arrays, cand_devs, devices)
    if failing is not None:
        run.precision_note(report)
    if mesh is not None:
        report.mesh = cand.report()
    if grads:
        args = (ref, cand, run.oracle, arrays, run.ref_outs[0], cand_devs[0], run.ref_dev)
        report.grads = check_grads(*args, run.pol, seed, run.notes, grad_names)
        report.passed = report.passed and all(m.passed for m in report.grads)
    if intermediates and failing is not None and failing.error is None and run.blocks is None:
        _localize_failing(report, run, failing)
    return report


def _shape_sets(arrays, shapes, reference, candidate, layerwise, seed):
    """The input sets at other shapes ``check_parity`` adds (see ``shapes``)."""
    from xconv.parity.shapes import ShapeSets, resolve, shape_sets

    if shapes == "auto" and type(layerwise).__name__ == "LayerwiseResult":
        # One run made beforehand stands for every set: it has no other shape to offer.
        return ShapeSets()
    given = resolve(shapes, reference, candidate, layerwise)
    if isinstance(given, ShapeSets):
        return given
    return shape_sets(arrays, given, seed=seed)


def _policy(policy, rtol, atol, k, allow_constant, allow_dtype) -> Policy:
    """``check_parity``'s policy argument with its explicit overrides applied."""
    pol = resolve_policy(policy, rtol=rtol, atol=atol, k=k)
    if allow_constant is not None or allow_dtype is not None:
        pol = replace(
            pol,
            allow_constant=pol.allow_constant if allow_constant is None else allow_constant,
            allow_dtype=pol.allow_dtype if allow_dtype is None else allow_dtype,
        )
    return pol


def _localize_failing(report: ParityReport, run: _Run, failing: Any) -> None:
    """Name the first divergent scope on the failing input set and device."""
    t = time.perf_counter()
    xs = dict(run.sets)[failing.inputs]
    pol = run.pol.at_precision(failing.precision, failing.dot_depth)
    with run.cand.precision_context(run.request):
        _localize_into(report, run.ref, run.cand, run.oracle, xs, run.ref_dev, failing.device, pol)
    run.timings["localize"] = time.perf_counter() - t


def _candidate_devices(cand: Adapter, devices: Any) -> list[str]:
    cand_devs = _select_devices(cand.devices(), devices)
    if not cand_devs:
        raise ParityConfigError(
            f"none of the devices {devices!r} is visible to {cand.framework}: {cand.devices()}; "
            "pass devices='all' or one of those"
        )
    return cand_devs


class _Run:
    """One parity check's state: the input sets the reference ran on, its outputs, the
    float64 oracle (or layerwise blocks), the policy as the oracle leaves it, notes and
    timings."""

    def __init__(self, ref: Adapter, cand: Adapter, sets, pol: Policy) -> None:
        self.ref, self.cand, self.sets, self.pol = ref, cand, sets, pol
        self.notes: list[str] = []
        self.downgrades: list[dict[str, str]] = []
        self.timings: dict[str, float] = {}
        self.ref_dev = ref.devices()[0]
        self.ref_outs: list[list[np.ndarray]] = []
        self.oracle: Adapter | None = None
        self.oracle_outs: list[list[np.ndarray]] | None = None
        self.blocks: Any = None
        #: ``check_parity(precision=...)``: "default" or "highest".
        self.request = "default"

    def run_reference(self) -> None:
        """Run the reference on every set; a set it cannot run on (but the example) is
        dropped with a note."""
        ref, kept = self.ref, []
        ref.prepare(self.ref_dev)
        for name, xs in self.sets:
            try:
                out, secs = _timed(ref.run, xs, self.ref_dev)
            except ConversionError:
                raise
            except Exception as e:
                if name == "example":
                    raise ParityConfigError(
                        f"the reference ({ref.describe()}) cannot run on the inputs "
                        f"{[(list(a.shape), a.dtype.name) for a in xs]}: {type(e).__name__}: {e}"
                    ) from e
                if name in SHAPE_SETS:
                    self.notes.append(inadmissible_note(name, xs, e))
                else:
                    self.notes.append(
                        f"input set {name!r} skipped: the reference cannot run on it ({e})"
                    )
                continue
            self.timings["reference" + ("" if name == "example" else f"[{name}]")] = secs
            self.ref_outs.append(out)
            kept.append((name, xs))
        self.sets = kept

    def layerwise_oracle(self, reference: Any, layerwise: Any) -> None:
        """One block-by-block float64 run per input set; the example set's blocks are the
        per-scope verdicts, and any set's failing block fails the check. ``layerwise`` may
        map set names to runs made beforehand (the pipeline runs them before loading the
        candidate, to keep peak memory down)."""
        from xconv.parity.layerwise import layerwise_oracle
        from xconv.parity.precision import blocks_policy, jax_context

        model = layerwise if type(layerwise).__name__ == "Model" else None
        given = layerwise if isinstance(layerwise, Mapping) else {}
        todo = [(name, xs) for name, xs in self.sets if name not in given]
        with jax_context(self.request):
            pol = blocks_policy(self.pol, model or getattr(self.cand, "ir_model", None))
            made = layerwise_oracle(reference, self.cand, layerwise, todo, pol) if todo else {}
        runs = [given[name] if name in given else made[name] for name, _ in self.sets]
        self.blocks = runs[0]
        for run in runs[1:]:
            if not run.passed and self.blocks.passed:
                self.blocks = run
        if all(run.oracle_outputs for run in runs):
            self.oracle_outs = [run.oracle_outputs for run in runs]
        for run in runs:
            self.notes.extend(n for n in run.notes if n not in self.notes)
            self.downgrades.extend(d for d in run.downgrades if d not in self.downgrades)

    def float64_oracle(self) -> None:
        """The reference's float64 twin on every set; else the candidate's float64 run (noise
        policy); else the dtype policy."""
        oracle, why = self.ref.oracle()
        if oracle is not None:
            why = self._run_oracle(oracle, why)
            oracle = self.oracle
        if oracle is not None:
            return
        self.oracle_outs = _candidate_float64(
            self.cand, self.sets, len(self.ref_outs[0]), self.timings
        )
        if self.oracle_outs is not None:
            self.notes.append(
                f"no float64 oracle for the reference ({why}): its rounding error is "
                "estimated from the candidate's float64 run (noise policy, capped by the "
                "dtype policy)"
            )
            self.downgrades.append(
                {
                    "kind": "noise_policy",
                    "message": f"no float64 oracle for the reference ({why}): judged by the "
                    "noise policy, which a wrong model can pass",
                }
            )
            self.pol = self.pol.as_noise_policy()
        else:
            self.notes.append(f"no float64 oracle ({why}): fell back to the dtype policy")
            self.downgrades.append(
                {
                    "kind": "dtype_policy",
                    "message": f"no float64 oracle ({why}): judged by the dtype policy",
                }
            )
            self.pol = self.pol.as_dtype_policy()

    def _run_oracle(self, oracle: Adapter, why: str) -> str:
        """Run ``oracle`` on every set; keep it when its float outputs are all float64."""
        try:
            oracle.prepare(cpu_device(oracle))
            t = time.perf_counter()
            outs = [oracle.run(to_float64(xs), cpu_device(oracle)) for _, xs in self.sets]
            self.timings["oracle"] = time.perf_counter() - t
        except Exception as e:
            return f"{why}; it failed to run ({type(e).__name__}: {e})"
        pairs = list(zip(outs, self.ref_outs, strict=True))
        low = [
            o
            for oo, rr in pairs
            for o, r in zip(oo, rr, strict=False)
            if is_float(r) and o.dtype != np.float64
        ]
        if low or any(len(o) != len(r) for o, r in pairs):
            return f"{why}; but its outputs are not all float64"
        self.oracle, self.oracle_outs = oracle, outs
        return why

    def precision_note(self, report: ParityReport) -> None:
        """A JAX or Flax candidate that fails off the CPU only, at JAX's default matmul
        precision: its failing rows run again at ``"highest"`` and a note says what that gives.
        JAX computes float32 dots and convolutions at reduced precision on accelerators by
        default (TF32 on NVIDIA GPUs since Ampere, bfloat16 passes on TPUs), torch's float32
        matmuls do not: such a failure is the runtime's precision, not the conversion, and
        the user needs to know which. The verdict stays as judged."""
        if self.cand.framework not in ("jax", "flax") or self.request == "highest":
            return
        jax = require("jax", "jax")
        if jax.config.jax_default_matmul_precision is not None:
            return  # the user chose the precision: judged as chosen
        bad = [r for r in report.matrix if r.role == "candidate" and not r.passed]
        if not bad or any(r.device.startswith("cpu") or r.error is not None for r in bad):
            return
        names = self.ref.output_names(len(self.ref_outs[0]))
        sets = {name: i for i, (name, _) in enumerate(self.sets)}
        again = [
            _run_row(
                self.cand,
                "candidate",
                r.device,
                self.sets[sets[r.inputs]][1],
                self.judge_for(sets[r.inputs], names),
                {},
                r.inputs,
                "highest",
            )
            for r in bad
        ]
        devs = ", ".join(sorted({r.device for r in bad}))
        if all(r.passed for r in again):
            self.notes.append(
                f"{devs}: passes at jax.default_matmul_precision('highest'): JAX's default "
                "computes float32 dots and convolutions at reduced precision there (TF32 on "
                "NVIDIA GPUs); run the model under that setting for the source's float32 "
                "numbers, or accept the error above"
            )
        else:
            self.notes.append(
                f"{devs}: fails at jax.default_matmul_precision('highest') too, so the "
                "difference is not only the device's default matmul precision"
            )

    def precision_notes(self, matrix: list[DeviceRun]) -> None:
        """One note per (side, device) whose dots ran at reduced precision: which, and the
        floor it adds; and what ``precision="highest"`` did."""
        if self.request == "highest":
            self.notes.append(
                "precision='highest': rows ran with full float32 dots and were judged at float32"
            )
        seen = set()
        for r in matrix:
            if r.error is not None or r.precision == "float32":
                continue
            key = (r.role, r.framework, r.device, r.precision)
            if key in seen:
                continue
            seen.add(key)
            floor = self.pol.at_precision(r.precision, r.dot_depth).describe_precision()
            self.notes.append(
                f"{r.role} {r.framework} on {r.device}: float32 dots and convolutions ran at "
                f"{r.precision} (the device's default or the matmul-precision setting); judged "
                f"with {floor}. precision='highest' (CLI --precision highest) judges at full "
                "float32"
            )

    def judge_for(self, si: int, names: list[str]):
        """Compare a run's outputs with the reference's on input set ``si``."""
        ref_outs, oracle_outs = self.ref_outs[si], self.oracle_outs

        def judge(outs: list[np.ndarray], precision: str = "float32", depth: int = 1):
            pol = self.pol.at_precision(precision, depth)
            if len(outs) != len(ref_outs):
                m = Metrics(name="outputs", passed=False, shape=(len(outs),), dtype="-")
                m.error = f"{len(outs)} outputs, the reference has {len(ref_outs)}"
                return [m]
            return [
                compare(n, c, r, pol, None if oracle_outs is None else oracle_outs[si][i])
                for i, (n, c, r) in enumerate(zip(names, outs, ref_outs, strict=True))
            ]

        return judge

    def report(self, arrays, cand_devs: list[str], devices: Any) -> tuple[ParityReport, Any]:
        """Run the candidate (and the reference's other devices) on every set; the report and
        the first failing candidate row."""
        names = self.ref.output_names(len(self.ref_outs[0]))
        matrix: list[DeviceRun] = []
        for si, (set_name, xs) in enumerate(self.sets):
            judge = self.judge_for(si, names)
            for dev in cand_devs:
                matrix.append(
                    _run_row(
                        self.cand, "candidate", dev, xs, judge, self.timings, set_name, self.request
                    )
                )
            for dev in _select_devices(self.ref.devices(), devices):
                if dev != self.ref_dev:
                    matrix.append(
                        _run_row(
                            self.ref,
                            "reference",
                            dev,
                            xs,
                            judge,
                            self.timings,
                            set_name,
                            self.request,
                        )
                    )
        self.precision_notes(matrix)
        cand_rows = [r for r in matrix if r.role == "candidate"]
        failing = next((r for r in cand_rows if not r.passed), None)
        report = ParityReport(
            passed=failing is None,
            reference=self.ref.describe(),
            candidate=self.cand.describe(),
            policy=self.pol.describe(),
            outputs=(failing if failing is not None else cand_rows[0]).outputs,
            matrix=matrix,
            inputs=[{"shape": list(a.shape), "dtype": a.dtype.name} for a in arrays],
            notes=self.notes,
            timings=self.timings,
            downgrades=self.downgrades,
        )
        report.policy_kind = self.pol.kind
        report.input_sets = [
            {
                "name": set_name,
                "passed": all(r.passed for r in cand_rows if r.inputs == set_name),
                "inputs": [{"shape": list(a.shape), "dtype": a.dtype.name} for a in xs],
            }
            for set_name, xs in self.sets
        ]
        reason = _vacuous(names, self.ref_outs, self.pol)
        if reason is not None:
            report.passed = False
            report.reason = reason
        if self.blocks is not None:
            report.scopes = [b.as_scope() for b in self.blocks.blocks]
            report.first_divergence = self.blocks.first_divergence
            report.passed = report.passed and self.blocks.passed
            stuck = self.blocks.unrunnable
            if stuck is not None and report.reason is None:
                report.reason = f"block {stuck.block.name} could not run ({stuck.error})"
        return report, failing


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
        twin.prepare(cpu_device(twin))
        t = time.perf_counter()
        outs = [twin.run(to_float64(xs), cpu_device(twin)) for _, xs in sets]
        timings["candidate-float64"] = time.perf_counter() - t
    except Exception:
        logger.debug("the candidate's float64 twin failed", exc_info=True)
        return None
    for o in outs:
        if len(o) != n_outputs or any(is_float(a) and a.dtype != np.float64 for a in o):
            return None
    return outs


def _run_row(
    adapter, role, dev, arrays, judge, timings, set_name="example", request="default"
) -> DeviceRun:
    """Run ``adapter`` on ``dev`` at the requested matmul precision and judge its outputs at
    the precision its dots ran at."""
    try:
        adapter.prepare(dev)
        with adapter.precision_context(request):
            outs, secs = _timed(adapter.run, arrays, dev)
            precision, depth = _row_precision(adapter, dev, arrays)
    except Exception as e:
        logger.debug("run failed", exc_info=True)
        return DeviceRun(
            adapter.framework, dev, role, False, [], f"{type(e).__name__}: {e}", inputs=set_name
        )
    timings[f"{role}:{dev}" + ("" if set_name == "example" else f"[{set_name}]")] = secs
    metrics = judge(outs, precision, depth)
    return DeviceRun(
        adapter.framework,
        dev,
        role,
        all(m.passed for m in metrics),
        metrics,
        None,
        secs,
        inputs=set_name,
        precision=precision,
        dot_depth=depth,
    )


def _row_precision(adapter, dev: str, arrays) -> tuple[str, int]:
    """The precision ``adapter``'s dots ran at on ``dev`` and their depth; float32 (judged
    strictly, never looser) where that cannot be told."""
    try:
        return adapter.dot_precision(dev, arrays)
    except Exception:
        logger.debug("cannot tell the matmul precision of %s on %s", adapter.describe(), dev)
        return "float32", 1


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
            oracle_trace = oracle.trace(to_float64(arrays), cpu_device(oracle))
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
            raise UsageError(
                f"{p} is a generated Flax module; checking it imports and runs its model.py",
                missing=[("--trust-code", "if you trust that folder (trust_code=True)")],
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
