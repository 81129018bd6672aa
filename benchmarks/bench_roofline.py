"""How close the transformer and BERT-base paths of ``bench_throughput.py`` run to this CPU's
matmul peak: the arithmetic each path compiles to, its rate, and the rate of one plain matmul
of the model's feed-forward shape over back-to-back calls.

``bench_throughput.py`` asks xconv's paths for ≤ ×0.95 the hand-written Flax's time. A path
can only beat a function that computes the same thing by doing less arithmetic or by doing it
at a higher rate; this script measures both: XLA's flop count of each path's compiled function
(``Compiled.cost_analysis()``; the same count on every path says no path skips work) and each
path's GFLOP/s against the rate one ``jnp.dot`` sustains on the model's largest dense
layer (``(batch·128, d) @ (d, 4d)``), float32, one intra-op thread. If the hand-written Flax runs at
p % of that rate, a path computing its flops takes at least ×p/100 its time unless it runs
faster than that matmul.

    python benchmarks/bench_roofline.py            # writes benchmarks/roofline.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _doc  # noqa: E402
from benchmarks.bench_throughput import (  # noqa: E402
    JaxPath,
    _limit_threads,
    build_torch,
    interleaved_medians,
    jax_paths,
    make_input,
)

OUT_MD = Path(__file__).with_name("roofline.md")
#: model -> (batches, d_model); seq 128 for both.
MODELS = {"transformer": ((1, 16), 256), "bert": ((1, 4), 768)}
SEQ = 128
MODES = ("infer", "train")
#: Back-to-back matmul calls per peak estimate (one before and one after each cell's rounds).
PEAK_CALLS = 30


def flops(path: JaxPath, x, mode: str) -> float:
    """XLA's flop count of the path's compiled inference or SGD step."""
    fn, args = path.jitted(mode, x)
    cost = fn.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def matmul(tokens: int, d: int):
    """One jitted float32 ``(tokens, d) @ (d, 4d)``: the call and its flops."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    a = jax.device_put(jnp.asarray(rng.standard_normal((tokens, d)), jnp.float32))
    b = jax.device_put(jnp.asarray(rng.standard_normal((d, 4 * d)), jnp.float32))
    f = jax.jit(jnp.dot)
    jax.block_until_ready(f(a, b))
    return (lambda: jax.block_until_ready(f(a, b))), 2.0 * tokens * d * 4 * d


def peak_rate(call, count: float, calls: int = PEAK_CALLS) -> float:
    """The matmul's sustained rate (FLOP/s): the median of ``calls`` back-to-back calls, as
    a model's call runs its dots back to back."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return count / statistics.median(times)


def measure(repeat: int, models) -> list[dict]:
    import jax

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            batches, d = MODELS[name]
            module = build_torch(name)
            built = jax_paths(name, module, Path(tmp))
            for batch in batches:
                for mode in MODES:
                    peak_call, peak_flops = matmul(batch * SEQ, d)
                    peak = peak_rate(peak_call, peak_flops)
                    calls, counts = [], []
                    for path in built.values():
                        x = path.inputs(make_input(name, batch))
                        call = path.infer(x) if mode == "infer" else path.train(x)
                        call()  # compile
                        call()
                        calls.append(call)
                        counts.append(flops(path, x, mode))
                    times = interleaved_medians(calls, repeat)
                    peak = max(peak, peak_rate(peak_call, peak_flops))
                    for i, label in enumerate(built):
                        rows.append(
                            {
                                "model": name,
                                "batch": batch,
                                "mode": mode,
                                "path": label,
                                "gflop": counts[i] / 1e9,
                                "ms": 1e3 * times[i],
                                "gflops": counts[i] / times[i] / 1e9,
                                "of_peak": counts[i] / times[i] / peak,
                                "x_hand": times[i] / times[0],
                                "peak": peak / 1e9,
                                "peak_shape": f"({batch * SEQ}, {d}) @ ({d}, {4 * d})",
                            }
                        )
                    print(f"{name} b={batch} {mode}: done", file=sys.stderr)
            del built
            jax.clear_caches()
    return rows


def render(rows: list[dict], run: str) -> str:
    lines = [
        "# The transformer and BERT-base paths against the matmul peak",
        "",
        "Written by `benchmarks/bench_roofline.py`; do not edit by hand.",
        "",
        f"- run: {run}",
        "- float32, one intra-op thread; median of interleaved rounds of the paths' calls; "
        "GFLOP: XLA's count for the compiled call (inference, or the SGD step of "
        "`bench_throughput.py`); peak: the GFLOP/s of one jitted `jnp.dot` of the model's "
        f"feed-forward shape, the median of {PEAK_CALLS} back-to-back calls before the cell's "
        f"rounds or of {PEAK_CALLS} after, whichever is higher; ×hand: time ÷ the hand-written Flax's (< 1: faster)",
        "",
        "| model | batch | mode | path | GFLOP | ms | GFLOP/s | % of peak | ×hand | peak GFLOP/s "
        "(matmul) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['mode']} | {r['path']} | {r['gflop']:.2f} "
            f"| {r['ms']:.1f} | {r['gflops']:.0f} | {100 * r['of_peak']:.0f} % "
            f"| ×{r['x_hand']:.2f} | {r['peak']:.0f} {r['peak_shape']} |"
        )
    hand = [r for r in rows if r["path"] == "hand-written Flax"]
    if hand:
        lines += [
            "",
            "A path computing the hand-written Flax's flops at the matmul's rate would take "
            "×(its % of peak)/100 its time: the floor of ×hand for a path that does not skip "
            "work or beat a plain matmul.",
            "",
            "| model | batch | mode | hand-written Flax, % of peak | floor of ×hand "
            "| best xconv ×hand |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for h in hand:
            xconv = [
                r["x_hand"]
                for r in rows
                if r["path"] != h["path"]
                and (r["model"], r["batch"], r["mode"]) == (h["model"], h["batch"], h["mode"])
            ]
            best = f"×{min(xconv):.2f}" if xconv else "—"
            lines.append(
                f"| {h['model']} | {h['batch']} | {h['mode']} | {100 * h['of_peak']:.0f} % "
                f"| ×{h['of_peak']:.2f} | {best} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", type=Path, default=OUT_MD)
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    commit = _doc.commit_or_refuse("bench_roofline", args.out, OUT_MD)
    if commit is None:
        return 2
    _limit_threads(1)
    import jax

    load = _doc.load()
    rows = measure(args.repeat, models)
    run = _doc.run_stamp(commit, load, f"jax {jax.__version__}")
    _doc.write(args.out, render(rows, run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
