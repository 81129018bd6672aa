"""Speed of the JAX backend: jitted xconv JAX function vs onnxruntime vs torch eager.

Same model (fixtures: ResNet-style CNN and a transformer), same inputs, one process, batch 1
and 32. Reported as ratios against torch eager (higher = faster than torch).

    python benchmarks/bench_jax.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._timing import median_seconds  # noqa: E402


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fixtures.torch_models import make_resnet, make_transformer

    print(
        f"{'model':12} {'batch':>5} {'torch ms':>9} {'ort ms':>8} {'xconv-jax ms':>12} "
        f"{'jax/torch':>9} {'jax/ort':>8} {'max err':>8}"
    )
    for name, factory in (("resnet", make_resnet), ("transformer", make_transformer)):
        for batch in (1, 32):
            r = bench(name, factory, batch, args.repeat)
            print(
                f"{name:12} {batch:5d} {r['torch_ms']:9.3f} {r['ort_ms']:8.3f} "
                f"{r['xconv_jax_ms']:12.3f} {r['jax_vs_torch']:8.2f}x {r['jax_vs_ort']:7.2f}x "
                f"{r['max_abs_err']:8.1e}"
            )
    print("ratios: >1 means the jitted xconv JAX function is faster than the peer.")


if __name__ == "__main__":
    main()
