"""The source emitters against the IR's runtimes on the ONNX backend suite.

For every case that ``to_jax`` passes (its outputs match the case's expected ones), the
generated Flax (linen and nnx) must produce ``to_jax``'s outputs; for every case that
``to_torch`` passes, the generated torch source must produce ``to_torch``'s. Both sides run
the same IR in the same framework, so the comparison is ``xconv.pipeline._differential``'s
(the check ``xconv.to_flax`` / ``xconv.to_torch_source`` run with example inputs).

Each emitter's case ends as:

* ``agree``: the generated code ran and matched the runtime;
* ``disagree``: it ran and differs (a wrong emitter: the count must be 0);
* ``crash``: the generated code was written but raised when loaded or run (an emitter bug too);
* ``not emitted``: the emitter declined the graph up front (an op without a template,
  ``UnsupportedOpError`` / ``ConversionError``): a coverage gap, not a wrong answer.

    python -m tests.conformance.differential                 # every case; prints the counts
    python -m tests.conformance.differential --every 9       # a sample
    python -m tests.conformance.differential --write-docs    # docs/coverage.md section
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.conformance import harness
from tests.conformance.backends import _uses_wide_types

EMITTERS = ("flax-linen", "flax-nnx", "torch-source")
STATUSES = ("agree", "disagree", "crash", "not emitted")
ROOT = Path(__file__).resolve().parents[2]
COVERAGE = ROOT / "docs" / "coverage.md"
BEGIN, END = "<!-- differential:begin -->", "<!-- differential:end -->"


@dataclass(frozen=True)
class Outcome:
    case: str
    emitter: str
    status: str
    message: str = ""


def _arrays(inputs: list[Any]) -> bool:
    return all(isinstance(x, np.ndarray) for x in inputs)


def _reference_passes(outs: list[Any], expected: list[Any], case: harness.Case) -> bool:
    if len(outs) < len(expected):
        return False
    try:
        for i, (e, a) in enumerate(zip(expected, outs, strict=False)):
            harness._compare(e, a, case.rtol, case.atol, f"output {i}")
    except AssertionError:
        return False
    return True


def _classify(case: str, emitter: str, emit, run, want: list[Any], model) -> Outcome:
    from xconv.errors import ConversionError, ParityError
    from xconv.pipeline import _differential

    try:
        emitted = emit()
    except ConversionError as e:
        return Outcome(case, emitter, "not emitted", _gap(e))
    except Exception as e:  # noqa: BLE001 (an emitter crash is a bug, recorded)
        return Outcome(case, emitter, "crash", f"emit: {_first_line(e)}")
    try:
        got = run(emitted)
    except Exception as e:  # noqa: BLE001
        return Outcome(case, emitter, "crash", _first_line(e))
    try:
        _differential(model, emitter, "runtime", _flat(got), _flat(want))
    except ParityError as e:
        return Outcome(case, emitter, "disagree", _first_line(e))
    return Outcome(case, emitter, "agree")


def _flat(outputs) -> list[Any]:
    """The outputs with each sequence output (a list) spread into its tensors: a generated
    module returns a tuple for several outputs and a list for one sequence output."""
    return [t for o in outputs for t in (o if isinstance(o, list) else [o])]


def _gap(e: BaseException) -> str:
    """The emitter's refusal without node names, so equal causes group together."""
    text = " ".join(str(e).split())
    text = re.sub(r",? first at node .*", "", text)
    return f"{type(e).__name__}: {text}"[:200]


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}"[:200]


def run_case(case: harness.Case, where: Path, emitters=EMITTERS) -> list[Outcome]:
    """The outcomes of ``case`` for each emitter whose runtime passes it (none otherwise)."""
    import jax

    import xconv

    if not case.data_sets:
        return []
    inputs, expected = case.data_sets[0]
    if not _arrays(inputs):
        return []
    x64 = _uses_wide_types(case.model)
    ctx = (lambda: jax.enable_x64(True)) if x64 else contextlib.nullcontext
    out: list[Outcome] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flax_ones = [e for e in emitters if e.startswith("flax")]
        if flax_ones:
            try:
                with ctx():
                    model = xconv.load(case.model)
                    fn, params = xconv.to_jax(model)
                    want = [np.asarray(o) for o in fn(params, *inputs)]
            except Exception:  # noqa: BLE001 (to_jax does not pass the case: not compared)
                want = None
            if want is not None and _reference_passes(want, expected, case):
                for emitter in flax_ones:
                    api = emitter.split("-")[1]
                    target = where / f"{case.name}_{api}"
                    out.append(
                        _classify(
                            case.name, emitter,
                            lambda api=api, target=target: _emit_flax(model, target, api, ctx),
                            lambda gen, api=api: _run_flax(gen, api, inputs, ctx),
                            want, model,
                        )
                    )  # fmt: skip
        if "torch-source" in emitters:
            out += _torch_case(case, inputs, expected)
    return out


def _emit_flax(model, target: Path, api: str, ctx):
    import xconv
    from xconv.pipeline import _load_generated

    with ctx():
        xconv.to_flax(model, target, api=api)
        generated = _load_generated(target / "model.py")
        return generated.load(target)


def _run_flax(loaded, api: str, inputs, ctx):
    with ctx():
        if api == "linen":
            module, variables = loaded
            got = module.apply(variables, *inputs)
        else:
            got = loaded(*inputs)
        got = got if isinstance(got, tuple) else (got,)  # a list: one sequence output
        return [[np.asarray(t) for t in g] if isinstance(g, list) else np.asarray(g) for g in got]


def _torch_case(case: harness.Case, inputs, expected) -> list[Outcome]:
    import torch

    import xconv
    from tests.conformance.backends import torch_backend

    try:
        model = xconv.load(case.model)
        run = torch_backend(case.model)
        want = run(list(inputs))
    except Exception:  # noqa: BLE001 (to_torch does not pass the case)
        return []
    if not _reference_passes(want, expected, case):
        return []
    from xconv.converters.torch.runtime.dtypes import to_tensor

    def emit():
        return xconv.to_torch_source(model)

    def run_source(emitted):
        source, state = emitted
        namespace: dict[str, Any] = {"__name__": "xconv_generated_torch_source"}
        exec(compile(source, "<generated>", "exec"), namespace)  # noqa: S102
        module = namespace["Model"]().eval()
        module.load_state_dict(state)
        with torch.no_grad():
            got = module(*(to_tensor(x) for x in inputs))
        return got if isinstance(got, tuple) else (got,)  # a list: one sequence output

    return [_classify(case.name, "torch-source", emit, run_source, list(want), model)]


def sweep(cases, emitters=EMITTERS, *, timeout: float = 60.0, progress=None) -> list[Outcome]:
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases):
            try:
                with harness._time_limit(timeout):
                    got = run_case(case, Path(tmp), emitters)
            except harness._Timeout as e:
                got = [Outcome(case.name, em, "crash", str(e)) for em in emitters]
            outcomes += got
            if progress:
                progress(i + 1, len(cases), got)
    return outcomes


def counts(outcomes: list[Outcome]) -> dict[str, Counter]:
    table = {e: Counter() for e in EMITTERS}
    for o in outcomes:
        table[o.emitter][o.status] += 1
    return table


def render(outcomes: list[Outcome], n_cases: int) -> str:
    table = counts(outcomes)
    lines = [
        f"Over {n_cases} cases of the corpus; each emitter is compared on the cases its runtime "
        "passes (`to_jax` for Flax, `to_torch` for torch source).",
        "",
        "| emitter | compared | " + " | ".join(STATUSES) + " |",
        "| --- | ---: |" + " ---: |" * len(STATUSES),
    ]
    for e in EMITTERS:
        c = table[e]
        lines.append(
            f"| {e} | {sum(c.values())} | " + " | ".join(str(c[s]) for s in STATUSES) + " |"
        )
    wrong = [o for o in outcomes if o.status in ("disagree", "crash")]
    if wrong:
        lines += ["", "Disagreements and crashes:", ""]
        for o in sorted(wrong, key=lambda o: (o.emitter, o.case)):
            lines.append(f"- {o.emitter} `{o.case}` ({o.status}): {o.message}")
    gaps = Counter(
        (o.emitter, re.sub(r"node '[^']*'", "node ...", o.message))
        for o in outcomes
        if o.status == "not emitted"
    )
    if gaps:
        lines += ["", "Not emitted, by message (cases):", ""]
        for (emitter, msg), n in sorted(gaps.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"- {n}: {emitter}: {msg}")
    return "\n".join(lines)


def write_docs(text: str, stamp: str) -> None:
    doc = COVERAGE.read_text()
    block = f"{BEGIN}\n{stamp}\n\n{text.rstrip()}\n{END}"
    if BEGIN in doc:
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, doc, flags=re.S)
    else:
        doc = doc.rstrip("\n") + "\n\n## Generated source against the runtime\n\n" + block + "\n"
    COVERAGE.write_text(doc)


def _commit() -> str:
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout

    dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    return git("rev-parse", "--short", "HEAD").strip() + (
        " plus uncommitted changes" if dirty else ""
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=1, help="every n-th case (a sample)")
    p.add_argument("--pattern", help="only cases whose name contains this")
    p.add_argument("--emitter", action="append", choices=EMITTERS, help="repeatable")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    p.add_argument("--write-docs", action="store_true", help="write docs/coverage.md's section")
    args = p.parse_args(argv)
    commit = _commit()  # at the start: the code that ran
    cases = harness.load_cases(pattern=args.pattern)[:: args.every]
    emitters = tuple(args.emitter or EMITTERS)
    start = time.perf_counter()

    def progress(i, n, got):
        for o in got:
            if o.status in ("disagree", "crash"):
                print(f"  {o.emitter} {o.case}: {o.status}: {o.message}", flush=True)
        if i % 100 == 0:
            print(f"{i}/{n} cases, {time.perf_counter() - start:.0f} s", file=sys.stderr)

    outcomes = sweep(cases, emitters, timeout=args.timeout, progress=progress)
    text = render(outcomes, len(cases))
    print(text)
    if args.write_docs:
        import os

        scope = f", every {args.every}th case" if args.every > 1 else ""
        stamp = (
            f"Written by `python -m tests.conformance.differential --write-docs` at commit "
            f"`{commit}`{scope} ({time.strftime('%Y-%m-%d', time.gmtime())}, "
            f"{time.perf_counter() - start:.0f} s at load average {os.getloadavg()[0]:.1f})."
        )
        write_docs(text, stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
