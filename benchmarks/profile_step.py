"""Where a jitted step spends its time: per-op device times of one model's step on each JAX path.

    python benchmarks/profile_step.py --model bert --batch 128 --dtype bf16 --out DIR
    python benchmarks/profile_step.py --model bert --batch 128 --dtype bf16 --out DIR \\
        --paths to_jax,hand --freeze embeddings

The models, inputs, loss and SGD step are ``bench_throughput.py``'s. For each path (xconv
``to_jax``, the generated Flax, the hand-written Flax) and variant (as is; with the parameters
whose key matches ``--freeze`` held fixed, so the step takes no gradient for them):

* the step's median time over ``--repeat`` calls after its compile and a warm-up;
* the ops that took the most device time over ``--profiled`` steps under ``jax.profiler``
  (on a GPU the kernels on its streams, by HLO fusion or library kernel name, or its
  ``XLA Ops`` line where the trace has one; on a CPU, every XLA thread's events);
* the step's optimized HLO (``DIR/<path>-<dtype>-<mode>[-frozen-<regex>].hlo.txt``), where
  those names are defined.

Everything goes to ``DIR/profile.json`` and is printed. A diagnostic for a ratio that
``throughput.md`` cannot explain; it writes no table of the docs.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_throughput as bt  # noqa: E402

#: --paths names -> bench_throughput.jax_paths keys.
PATHS = {
    "to_jax": "xconv to_jax",
    "to_jax_other": "xconv to_jax (other layout)",
    "flax": "xconv generated Flax",
    "hand": "hand-written Flax",
}


def make_step(path, freeze: str | None, mode: str, x):
    """``path`` (a ``bench_throughput.JaxPath``) with the params whose key matches ``freeze``
    held fixed: its jitted inference or SGD step (the table's) and the arguments for ``x``,
    and the keys held fixed."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten_with_path(path.params)
    keys = [jax.tree_util.keystr(p) for p, _ in leaves]
    frozen_at = {i for i, k in enumerate(keys) if freeze and re.search(freeze, k)}
    trained = [leaf for i, (_, leaf) in enumerate(leaves) if i not in frozen_at]
    frozen = [leaf for i, (_, leaf) in enumerate(leaves) if i in frozen_at]

    def full(t, z):
        t, z = iter(t), iter(z)
        return treedef.unflatten([next(z if i in frozen_at else t) for i in range(len(keys))])

    held = bt.JaxPath(
        lambda t, zf, x: path.apply(full(t, zf[0]), zf[1], x), trained, (frozen, path.fixed)
    )
    fn, args = held.jitted(mode, x)
    return fn, args, [keys[i] for i in sorted(frozen_at)]


def device_ops(trace_dir: str, top: int) -> dict:
    """The trace's device op times: ``{"line": ..., "total_ms": ..., "ops": [[name, ms, n]]}``
    summed over the traced steps."""
    from jax.profiler import ProfileData

    path, *_ = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = ProfileData.from_file(path)
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    line_name = None
    lines = []
    for plane in [p for p in data.planes if p.name.startswith("/device:")][:1]:
        lines = [(plane.name, line) for line in plane.lines]
        # XLA's op names where the trace has them, else the kernels on the streams.
        ops = [pl for pl in lines if pl[1].name == "XLA Ops"]
        for plane_name, line in ops or [pl for pl in lines if pl[1].name.startswith("Stream")]:
            line_name = f"{plane_name} {line.name}"
            for e in line.events:
                totals[e.name][0] += e.duration_ns / 1e6
                totals[e.name][1] += 1
    if not totals:  # a CPU: the XLA threads' events
        for plane in data.planes:
            if plane.name != "/host:CPU":
                continue
            for line in plane.lines:
                if line.name.startswith("tf_XLA"):
                    line_name = "/host:CPU tf_XLA*"
                    for e in line.events:
                        if not e.name.startswith(("ThreadpoolListener", "ThunkExecutor", "Slinky")):
                            totals[e.name][0] += e.duration_ns / 1e6
                            totals[e.name][1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "line": line_name,
        "device_lines": [f"{p} {line.name}" for p, line in lines],
        "total_ms": round(sum(v[0] for v in totals.values()), 3),
        "ops": [[k, round(v[0], 3), v[1]] for k, v in ranked[:top]],
    }


def profile(step, args_, out: Path, label: str, repeat: int, profiled: int, top: int) -> dict:
    import jax

    from benchmarks._timing import median_seconds

    start = time.perf_counter()
    compiled = step.lower(*args_).compile()  # once: the calls and the HLO text share it
    call = lambda: jax.block_until_ready(compiled(*args_))  # noqa: E731
    call()
    compile_s = time.perf_counter() - start
    seconds = median_seconds(call, warmup=1, repeat=repeat, min_time=0.0)
    (out / f"{label}.hlo.txt").write_text(compiled.as_text())
    trace = tempfile.mkdtemp(prefix="xconv_profile_")
    jax.profiler.start_trace(trace)
    for _ in range(profiled):
        call()
    jax.profiler.stop_trace()
    ops = device_ops(trace, top)
    return {"first_call_s": round(compile_s, 3), "median_s": seconds, **ops}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert", choices=sorted(bt.MODELS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--mode", default="train", choices=("train", "infer"))
    parser.add_argument("--paths", default="to_jax,flax,hand", help=f"of {','.join(PATHS)}")
    parser.add_argument(
        "--freeze", action="append", default=[], help="regex: also run with these held fixed"
    )
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import jax

    args.out.mkdir(parents=True, exist_ok=True)
    wanted = args.paths.split(",")
    if set(wanted) - set(PATHS):
        parser.error(f"--paths: {sorted(set(wanted) - set(PATHS))} not among {list(PATHS)}")
    result = {
        "argv": sys.argv[1:],
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "runs": {},
    }
    module = bt.build_torch(args.model)
    paths = bt.jax_paths(args.model, module, Path(tempfile.mkdtemp()), args.dtype)
    x_np = bt.make_input(args.model, args.batch)
    for name in wanted:
        path = paths[PATHS[name]]
        x = path.inputs(x_np)
        for freeze in (None, *args.freeze):
            label = f"{name}-{args.dtype}-{args.mode}"
            if freeze:  # a file name: the regex's other characters as _
                label += "-frozen-" + re.sub(r"[^\w.-]+", "_", freeze)
            try:
                step, step_args, frozen_keys = make_step(path, freeze, args.mode, x)
                run = profile(
                    step, step_args, args.out, label, args.repeat, args.profiled, args.top
                )
                run["frozen"] = len(frozen_keys)
            except Exception as e:  # noqa: BLE001 - the other runs still go
                run = {"error": f"{type(e).__name__}: {e}"[:500]}
            result["runs"][label] = run
            print(f"== {label}: {json.dumps({k: v for k, v in run.items() if k != 'ops'})}")
            for op, ms, n in run.get("ops", [])[: args.top]:
                print(f"   {ms:10.3f} ms  x{n:<5} {op}")
            (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    medians = {k: v.get("median_s") for k, v in result["runs"].items()}
    print("medians:", {k: round(v, 5) for k, v in medians.items() if v})
    return 0


if __name__ == "__main__":
    sys.exit(main())
