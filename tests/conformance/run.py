"""Run the ONNX backend conformance suite against xconv backends.

python -m tests.conformance.run --backend jax --backend onnxruntime --write-docs
python -m tests.conformance.run --backend jax --pattern conv --failures
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.conformance.backends import BACKENDS
from tests.conformance.harness import KINDS, load_cases, run_backend, write_coverage

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", action="append", choices=sorted(BACKENDS), help="repeatable")
    p.add_argument("--kind", action="append", choices=KINDS, help="repeatable; default all")
    p.add_argument("--pattern", help="only cases whose name contains this")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    p.add_argument("--failures", action="store_true", help="print every non-passing case")
    p.add_argument("--json", type=Path, help="write per-case results here")
    p.add_argument("--write-docs", action="store_true", help="write docs/coverage.md")
    args = p.parse_args(argv)
    backends = args.backend or ["onnxruntime", "roundtrip", "jax", "torch"]
    cases = load_cases(args.kind or KINDS, pattern=args.pattern)
    print(f"{len(cases)} cases", file=sys.stderr)
    reports = []
    for name in backends:
        start = time.perf_counter()
        report = run_backend(name, BACKENDS[name](), cases, timeout=args.timeout)
        reports.append(report)
        print(f"{report.summary()} in {time.perf_counter() - start:.0f}s")
        if args.failures:
            for r in report.results:
                if r.status != "pass":
                    print(f"  {r.status:5} {r.case}: {r.message[:200]}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {r.backend: {x.case: [x.status, x.message] for x in r.results} for r in reports},
                indent=1,
                sort_keys=True,
            )
        )
    if args.write_docs:
        write_coverage(reports, ROOT / "docs" / "coverage.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
