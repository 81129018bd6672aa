"""Cost of ``xconv.check_parity`` versus running both sides plus the float64 oracle once.

Fixture: a small CNN (torch reference) and its IR conversion run by ``xconv.to_jax``.
Everything is warmed up first (compile and first-call costs excluded); times are medians.
The budget is: a passing check costs at most 3x (reference + candidate + oracle) per input
set it runs (by default five: the example, two random draws, zeros and a large-magnitude
set). The cost of a failing check (which also traces every scope on the three sides) is
reported too.

    python benchmarks/bench_parity.py [--repeats 5] [--blocks 6] [--size 32]   # writes parity.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _doc  # noqa: E402

OUT_MD = Path(__file__).with_name("parity.md")
BUDGET = 3.0


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import jax
    import torch

    import xconv
    from tests.parity.models import SmallCNN, cnn_ir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (noise control)")
    p.add_argument("--out", type=Path, default=OUT_MD)
    args = p.parse_args(argv)
    commit = _doc.commit_or_refuse("bench_parity", args.out, OUT_MD)
    if commit is None:
        return 2
    torch.set_num_threads(args.threads)
    load = _doc.load()

    torch.manual_seed(0)
    net = SmallCNN(c=args.channels, blocks=args.blocks)
    shape = (args.batch, 3, args.size, args.size)
    x = np.random.default_rng(0).uniform(-1, 1, shape).astype(np.float32)
    fn, params = xconv.to_jax(cnn_ir(net, shape))
    net64 = copy.deepcopy(net).double()
    xt, xt64 = torch.from_numpy(x), torch.from_numpy(x.astype(np.float64))

    def run_ref():
        with torch.no_grad():
            net(xt).numpy()

    def run_oracle():
        with torch.no_grad():
            net64(xt64).numpy()

    def run_cand():
        jax.block_until_ready(fn(params, x))

    sets = []

    def check():
        report = xconv.check_parity(net, (fn, params), x, devices="cpu")
        sets[:] = [s["name"] for s in report.input_sets]
        if not report.passed:
            raise SystemExit("benchmark fixture unexpectedly fails parity:\n" + report.summary())

    bad_fn, bad_params = xconv.to_jax(cnn_ir(net, shape, bn_eps={"blocks.1.bn": 1e-3}))

    def check_failing():
        report = xconv.check_parity(net, (bad_fn, bad_params), x, devices="cpu")
        if report.first_divergence != "blocks.1.bn":
            raise SystemExit("localisation failed:\n" + report.summary())

    for f in (run_ref, run_oracle, run_cand, check, check_failing):
        f()  # warm-up
    # Interleave the baseline and the check so both see the same machine load; the ratio
    # is the median of per-round ratios.
    rounds = []
    for _ in range(args.repeats):
        t_ref = _median(run_ref, 1)
        t_oracle = _median(run_oracle, 1)
        t_cand = _median(run_cand, 1)
        t_check = _median(check, 1)
        rounds.append((t_ref, t_oracle, t_cand, t_check))
    t_ref, t_oracle, t_cand, t_check = (statistics.median(r[i] for r in rounds) for i in range(4))
    ratio = statistics.median(r[3] / (r[0] + r[1] + r[2]) for r in rounds)
    t_fail = _median(check_failing, max(1, args.repeats // 2))
    baseline = t_ref + t_oracle + t_cand
    fixture = f"SmallCNN c={args.channels} blocks={args.blocks}, input {list(shape)}"
    lines = [
        "# The cost of a parity check",
        "",
        "Written by `benchmarks/bench_parity.py`; do not edit by hand.",
        "",
        f"- run: {_doc.run_stamp(commit, load, f'jax {jax.__version__}, torch {torch.__version__}')}",
        f"- fixture: {fixture} (`tests/parity/models.py`), torch float32 reference, its float64 "
        f"twin as the oracle, the candidate `xconv.to_jax`; torch on {args.threads} thread(s); "
        "everything warmed up first (compile and first calls excluded)",
        f"- passing check: median of {args.repeats} interleaved rounds (reference, oracle, "
        "candidate, check); the ratio is the median of the rounds' ratios. Failing check (a "
        "BatchNorm epsilon off in `blocks.1.bn`, localised by tracing every scope on the three "
        "sides): median of its own calls",
        "",
        f"The check ran {len(sets)} input sets ({', '.join(sets)}): reference, oracle and "
        "candidate each run once per set, so its floor is "
        f"×{len(sets)} the one-set baseline.",
        "",
        "| call | ms | × (reference + oracle + candidate, one set) | per input set |",
        "|---|---:|---:|---:|",
        f"| reference (torch float32) | {t_ref * 1e3:.1f} | | |",
        f"| oracle (torch float64) | {t_oracle * 1e3:.1f} | | |",
        f"| candidate (xconv to_jax) | {t_cand * 1e3:.1f} | | |",
        f"| reference + oracle + candidate | {baseline * 1e3:.1f} | ×1.00 | |",
        f"| `check_parity`, passing | {t_check * 1e3:.1f} | ×{ratio:.2f} "
        f"| ×{ratio / len(sets):.2f} |",
        f"| `check_parity`, failing and localised | {t_fail * 1e3:.1f} "
        f"| ×{t_fail / baseline:.2f} | |",
        "",
        f"Budget for a passing check: ×{BUDGET:g} per input set: "
        + ("met." if ratio / len(sets) <= BUDGET else f"**over** (×{ratio / len(sets):.2f})."),
    ]
    _doc.write(args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
