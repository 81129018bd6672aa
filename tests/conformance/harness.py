"""Conformance harness: the ONNX backend test cases against any xconv backend.

The corpus is what the installed onnx package ships: the node cases built in memory with
``onnx.backend.test.loader.load_model_tests(kind="node")`` plus the ``simple``,
``pytorch-converted`` and ``pytorch-operator`` model cases (2,024 with onnx 1.23). A backend
is a function ``prepare(model_proto) -> run(inputs) -> outputs``; every case ends as pass,
fail (wrong numbers), error (raised) or skip (the backend declines it up front).

Run ``python -m tests.conformance.run --help`` for the command-line entry point.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

KINDS = ("node", "simple", "pytorch-converted", "pytorch-operator")
#: The corpus must be at least this big, or the harness refuses to report (a short corpus
#: would make any pass rate meaningless).
MIN_CASES = {"node": 1800, "simple": 20, "pytorch-converted": 80, "pytorch-operator": 30}

Runner = Callable[[list[Any]], Sequence[Any]]
Prepare = Callable[[onnx.ModelProto], Runner]


class SkipCase(Exception):
    """Raised by a backend's prepare() to decline a case up front (counted as skip)."""


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    model: onnx.ModelProto
    data_sets: tuple[tuple[list[Any], list[Any]], ...]
    rtol: float
    atol: float

    @property
    def op_types(self) -> tuple[str, ...]:
        if self.kind == "node":
            return tuple(dict.fromkeys(n.op_type for n in self.model.graph.node))
        return ()


@dataclass(frozen=True)
class Result:
    case: str
    kind: str
    status: str  # pass | fail | error | skip
    message: str = ""
    seconds: float = 0.0
    op_types: tuple[str, ...] = ()


@dataclass
class Report:
    backend: str
    results: list[Result] = field(default_factory=list)

    @property
    def counts(self) -> Counter:
        return Counter(r.status for r in self.results)

    @property
    def passed(self) -> int:
        return self.counts["pass"]

    def by_case(self) -> dict[str, Result]:
        return {r.case: r for r in self.results}

    def summary(self) -> str:
        c = self.counts
        return (
            f"{self.backend}: {c['pass']} passed, {c['fail']} failed, {c['error']} errors, "
            f"{c['skip']} skipped of {len(self.results)}"
        )


def _load_proto(path: str) -> Any:
    data = Path(path).read_bytes()
    for cls in (onnx.TensorProto, onnx.SequenceProto, onnx.OptionalProto, onnx.MapProto):
        proto = cls()
        try:
            proto.ParseFromString(data)
        except Exception:
            continue
        if cls is onnx.TensorProto:
            return numpy_helper.to_array(proto)
        if cls is onnx.SequenceProto:
            return numpy_helper.to_list(proto)
        if cls is onnx.OptionalProto:
            return numpy_helper.to_optional(proto)
        return numpy_helper.to_dict(proto)
    raise ValueError(f"cannot read test data {path}")


def _as_array(x: Any) -> Any:
    """In-memory case data as the shipped files held it: arrays, lists, optionals."""
    if isinstance(x, np.generic):
        return np.asarray(x)
    if isinstance(x, onnx.TensorProto):
        return numpy_helper.to_array(x)
    if isinstance(x, onnx.SequenceProto):
        return numpy_helper.to_list(x)
    if isinstance(x, onnx.OptionalProto):
        return numpy_helper.to_optional(x)
    return x


def _data_sets_from_dir(model_dir: str) -> list[tuple[list[Any], list[Any]]]:
    sets = []
    for d in sorted(glob.glob(os.path.join(model_dir, "test_data_set_*"))):
        ins = [
            _load_proto(p)
            for p in sorted(
                glob.glob(os.path.join(d, "input_*.pb")),
                key=lambda p: int(Path(p).stem.split("_")[1]),
            )
        ]
        outs = [
            _load_proto(p)
            for p in sorted(
                glob.glob(os.path.join(d, "output_*.pb")),
                key=lambda p: int(Path(p).stem.split("_")[1]),
            )
        ]
        sets.append((ins, outs))
    return sets


def load_cases(kinds: Iterable[str] = KINDS, *, pattern: str | None = None) -> list[Case]:
    """Build the corpus; refuses a corpus smaller than ``MIN_CASES`` for each kind."""
    from onnx.backend.test.loader import load_model_tests

    cases: list[Case] = []
    for kind in kinds:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tests = load_model_tests(kind=kind)
        if len(tests) < MIN_CASES[kind]:
            raise RuntimeError(
                f"the onnx package ships only {len(tests)} {kind!r} cases (expected at least "
                f"{MIN_CASES[kind]}); refusing to report on a short corpus"
            )
        for t in tests:
            if pattern and pattern not in t.name:
                continue
            if t.model is not None:
                model = t.model
                data = [
                    ([_as_array(x) for x in i], [_as_array(x) for x in o]) for i, o in t.data_sets
                ]
            else:
                model = onnx.load(os.path.join(t.model_dir, "model.onnx"))
                data = _data_sets_from_dir(t.model_dir)
            cases.append(Case(t.name, kind, model, tuple(data), t.rtol, t.atol))
    return cases


def _compare(expected: Any, actual: Any, rtol: float, atol: float, where: str) -> None:
    if isinstance(expected, list):
        if not isinstance(actual, list | tuple) or len(actual) != len(expected):
            raise AssertionError(
                f"{where}: expected a sequence of {len(expected)}, got {actual!r:.80}"
            )
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _compare(e, a, rtol, atol, f"{where}[{i}]")
        return
    if expected is None:
        if actual is not None and not (isinstance(actual, list) and not actual):
            raise AssertionError(f"{where}: expected an empty optional, got {type(actual)}")
        return
    if isinstance(expected, dict):
        raise AssertionError(f"{where}: map outputs are not supported")
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    if expected.dtype.kind in "OSU":
        if actual.shape != expected.shape or not all(
            str(a) == str(e)
            for a, e in zip(actual.ravel().tolist(), expected.ravel().tolist(), strict=True)
        ):
            raise AssertionError(f"{where}: string values differ")
        return
    if expected.dtype != actual.dtype:
        raise AssertionError(f"{where}: dtype {actual.dtype} != expected {expected.dtype}")
    if expected.shape != actual.shape:
        raise AssertionError(f"{where}: shape {actual.shape} != expected {expected.shape}")
    if expected.dtype.kind in "biu" or expected.dtype == bool:
        if not np.array_equal(expected, actual):
            bad = int(np.sum(expected != actual))
            raise AssertionError(f"{where}: {bad} of {expected.size} elements differ")
        return
    e = expected.astype(np.float64)
    a = actual.astype(np.float64)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=where, equal_nan=True)


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"timed out after {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_case(prepare: Prepare, case: Case, *, timeout: float = 60.0) -> Result:
    start = time.perf_counter()

    def result(status: str, message: str = "") -> Result:
        return Result(
            case.name, case.kind, status, message[:500], time.perf_counter() - start, case.op_types
        )

    try:
        with _time_limit(timeout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = prepare(case.model)
            for inputs, expected in case.data_sets:
                actual = list(run(list(inputs)))
                if len(actual) < len(expected):
                    return result("fail", f"{len(actual)} outputs, expected {len(expected)}")
                for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
                    _compare(e, a, case.rtol, case.atol, f"output {i}")
    except SkipCase as e:
        return result("skip", str(e))
    except AssertionError as e:
        return result("fail", str(e).strip().splitlines()[0] if str(e).strip() else "mismatch")
    except _Timeout as e:
        return result("error", str(e))
    except Exception as e:
        return result("error", f"{type(e).__name__}: {e}")
    return result("pass")


def run_backend(
    name: str,
    prepare: Prepare,
    cases: Sequence[Case],
    *,
    timeout: float = 60.0,
    progress: Callable[[int, int, Result], None] | None = None,
) -> Report:
    report = Report(name)
    for i, case in enumerate(cases):
        r = run_case(prepare, case, timeout=timeout)
        report.results.append(r)
        if progress:
            progress(i + 1, len(cases), r)
    return report


def write_coverage(reports: Sequence[Report], path: str | os.PathLike) -> None:
    """Write docs/coverage.md: totals per backend, then cases passed per op type."""
    names = [r.backend for r in reports]
    lines = [
        "# ONNX backend conformance",
        "",
        "Generated by `python -m tests.conformance.run`; do not edit by hand. Each cell counts "
        "cases passed out of cases run, over the ONNX backend test corpus shipped with the "
        f"installed onnx package ({onnx.__version__}).",
        "",
        "| backend | passed | failed | errors | skipped | total |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in reports:
        c = r.counts
        lines.append(
            f"| {r.backend} | {c['pass']} | {c['fail']} | {c['error']} | {c['skip']} | {len(r.results)} |"
        )
    lines += [
        "",
        "## By kind",
        "",
        "| kind | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    kinds = list(dict.fromkeys(res.kind for r in reports for res in r.results))
    for kind in kinds:
        cells = []
        for r in reports:
            sel = [x for x in r.results if x.kind == kind]
            cells.append(f"{sum(x.status == 'pass' for x in sel)}/{len(sel)}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Node cases by op type",
        "",
        "| op | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    per_op: dict[str, dict[str, list[int]]] = {}
    for r in reports:
        for res in r.results:
            if res.kind != "node":
                continue
            for op in res.op_types[:1] or ("?",):
                cell = per_op.setdefault(op, {}).setdefault(r.backend, [0, 0])
                cell[0] += res.status == "pass"
                cell[1] += 1
    for op in sorted(per_op):
        cells = [f"{per_op[op].get(n, [0, 0])[0]}/{per_op[op].get(n, [0, 0])[1]}" for n in names]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    # The differential section (tests/conformance/differential.py writes it) is its own
    # run's: kept as it stands.
    old = Path(path).read_text() if Path(path).exists() else ""
    kept = old[old.index(DIFFERENTIAL) :] if DIFFERENTIAL in old else ""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n" + kept)


#: The heading of the section of docs/coverage.md that ``write_coverage`` does not write.
DIFFERENTIAL = "\n## Generated source against the runtime\n"
