"""The mutation suite with the candidate on a simulated reduced-precision accelerator.

Each mutant of :mod:`tests.parity.test_mutants` (and each correct conversion) runs as an
``xconv.to_jax`` candidate on the device matrix a GPU / TPU machine gives: ``cpu:0`` at
float32 and ``gpu:0`` / ``tpu:0`` with every dot's inputs rounded to TF32 / one bfloat16 pass
(:mod:`tests.parity.simulate`). Right models must pass on every row, every mutant must fail
the check (named at its scope), and the report must name each row's precision. Kill counts of
the reduced-precision row alone are printed: faults smaller than that precision's rounding (a
weight off by 1e-3 against bfloat16's 2^-8) pass there, by design, and are killed by the
float32 row.

By default the tiny Llama and two mutants run at each precision; ``-m slow`` runs every
correct conversion and every mutant at both.
"""

from __future__ import annotations

import pytest

import xconv
from tests.parity import test_mutants as tm
from tests.parity.simulate import simulated_accelerator
from tests.parity.test_mutants import MUTANTS, _killed, _mutate

PRECISIONS = {"gpu": "tf32", "tpu": "bf16"}

#: Default run: a fault below bfloat16's resolution (killed by the float32 row, named at its
#: scope) and one above it.
SUBSET = ("mha/out_proj_x1.001", "llama/rope_base_5e5")


class _Subjects(dict):
    """test_mutants' conversions, each built on first use (the default tests need two)."""

    def __missing__(self, name: str) -> tm.Subject:
        if name == "llama":
            self[name] = tm.llama_subject()
        else:
            from fixtures.torch_models import FIXTURES

            self[name] = tm._subject(*FIXTURES[name]())
        return self[name]


@pytest.fixture(scope="module")
def subjects() -> _Subjects:
    return _Subjects()


def _check(kind: str, module, model, inputs, **kw):
    with simulated_accelerator(kind) as dev:
        report = xconv.check_parity(module, xconv.to_jax(model), inputs, **kw)
    rows = [r for r in report.matrix if r.device == dev]
    assert rows and all(r.precision == PRECISIONS[kind] for r in rows), report.summary()
    assert any(r.device == "cpu:0" and r.precision == "float32" for r in report.matrix)
    assert f"precision={PRECISIONS[kind]}" in report.summary()
    return report, rows


def _run(kind: str, names, subjects, capsys) -> None:
    results, row_kills = {}, 0
    for name in names:
        subject, edit, scope = MUTANTS[name]
        s = subjects[subject]
        report, rows = _check(kind, s.module, _mutate(s, edit), s.inputs, n_random=0, edges=False)
        results[name] = _killed(report, scope)
        row_kills += not all(r.passed for r in rows)
    killed = sum(ok for ok, _ in results.values())
    with capsys.disabled():
        print(
            f"\nmutants at simulated {PRECISIONS[kind]}: {killed}/{len(results)} killed by the "
            f"check, {row_kills}/{len(results)} by the {PRECISIONS[kind]} row alone"
        )
    survivors = {n: why for n, (ok, why) in results.items() if not ok}
    assert not survivors, survivors


@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_correct_llama_passes_and_mutants_killed_at_simulated_precision(kind, subjects, capsys):
    s = subjects["llama"]
    report, _ = _check(kind, s.module, s.model, s.inputs, n_random=0, intermediates=False)
    assert report.passed, report.summary()
    _run(kind, SUBSET, subjects, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpu", "tpu"])
def test_every_mutant_killed_at_simulated_precision(kind, subjects, capsys):
    for name in ("resnet", "transformer", "mha_weights", "llama"):
        s = subjects[name]
        report, _ = _check(kind, s.module, s.model, s.inputs, intermediates=False)
        assert report.passed, f"{name}: " + report.summary()
    _run(kind, list(MUTANTS), subjects, capsys)
