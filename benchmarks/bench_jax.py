"""Speed of the JAX backend: jitted xconv JAX function vs onnxruntime vs torch eager.

Same model (fixtures: ResNet-style CNN and a transformer), same inputs, one process, batch 1
and 32. Reported as ratios against torch eager (higher = faster than torch).

    python benchmarks/bench_jax.py [--repeat 20]     # writes benchmarks/jax_backend.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _doc  # noqa: E402
from benchmarks._timing import median_seconds  # noqa: E402

OUT_MD = Path(__file__).with_name("jax_backend.md")
MODELS = {"resnet": "ResNet-style CNN 3×32×32", "transformer": "transformer, 2 layers, seq 10"}


def _batched(example, batch: int):
    import torch

    out = []
    for t in example:
        shape = (batch, *t.shape[1:])
        if t.dtype.is_floating_point:
            out.append(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
        else:
            hi = int(t.max()) + 1
            out.append(torch.randint(0, hi, shape, generator=torch.Generator().manual_seed(0)))
    return tuple(out)


def bench(name: str, factory, batch: int, repeat: int) -> dict[str, float]:
    import jax
    import onnxruntime as ort
    import torch

    import xconv

    module, example = factory()
    inputs = _batched(example, batch)
    model = xconv.from_torch(module, inputs)
    fn, params = xconv.to_jax(model)
    jitted = jax.jit(fn)
    np_inputs = [t.numpy() for t in inputs]
    jax_inputs = [jax.numpy.asarray(x) for x in np_inputs]
    with tempfile.TemporaryDirectory() as tmp:
        path = xconv.save(model, Path(tmp) / "m.onnx")
        opts = ort.SessionOptions()
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feed = dict(zip(names, np_inputs, strict=True))

    def run_torch():
        with torch.inference_mode():
            module(*inputs)

    def run_jax():
        jax.block_until_ready(jitted(params, *jax_inputs))

    def run_ort():
        sess.run(None, feed)

    # Same numbers before timing anything.
    with torch.inference_mode():
        ref = module(*inputs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    got = np.asarray(jitted(params, *jax_inputs)[0])
    err = float(np.max(np.abs(got - ref.numpy())))
    t_torch = median_seconds(run_torch, repeat=repeat)
    t_jax = median_seconds(run_jax, repeat=repeat)
    t_ort = median_seconds(run_ort, repeat=repeat)
    return {
        "torch_ms": t_torch * 1e3,
        "xconv_jax_ms": t_jax * 1e3,
        "ort_ms": t_ort * 1e3,
        "jax_vs_torch": t_torch / t_jax,
        "jax_vs_ort": t_ort / t_jax,
        "max_abs_err": err,
    }


def render(rows: list[dict], run: str) -> str:
    lines = [
        "# The JAX backend against onnxruntime and torch eager",
        "",
        "Written by `benchmarks/bench_jax.py`; do not edit by hand.",
        "",
        f"- run: {run}",
        "- the jitted `xconv.to_jax` function, onnxruntime on the same IR saved as `.onnx`, and "
        "torch eager: same weights and inputs, one process, CPU; each time the median of "
        "`--repeat` calls after warm-up; ratio = peer time / xconv time (> 1: xconv faster); "
        "max err: the JAX function's max |Δ| against torch",
        "",
        "| model (batch) | torch ms | ort ms | xconv-jax ms | jax vs torch | jax vs ort "
        "| max err vs torch |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {MODELS[r['model']]} ({r['batch']}) | {r['torch_ms']:.3f} | {r['ort_ms']:.3f} "
            f"| {r['xconv_jax_ms']:.3f} | {r['jax_vs_torch']:.2f}× | {r['jax_vs_ort']:.2f}× "
            f"| {r['max_abs_err']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", type=Path, default=OUT_MD)
    args = p.parse_args(argv)
    commit = _doc.commit_or_refuse("bench_jax", args.out, OUT_MD)
    if commit is None:
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import jax
    import onnxruntime as ort
    import torch

    from fixtures.torch_models import make_resnet, make_transformer

    load = _doc.load()
    rows = []
    for name, factory in (("resnet", make_resnet), ("transformer", make_transformer)):
        for batch in (1, 32):
            rows.append({"model": name, "batch": batch, **bench(name, factory, batch, args.repeat)})
            print(f"{name} b={batch}: done", file=sys.stderr)
    versions = f"jax {jax.__version__}, onnxruntime {ort.__version__}, torch {torch.__version__}"
    _doc.write(args.out, render(rows, _doc.run_stamp(commit, load, versions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
