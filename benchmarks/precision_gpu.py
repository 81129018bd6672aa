"""Parity of float32 conversions at the accelerator's own matmul precision (issue 57).

Run on a machine with a GPU or TPU (a few minutes on an H100)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/precision_gpu.py --out OUT/precision.json

For each model (the headline BERT-base and ResNet-50 of ``bench_scale``, and the parity suites'
small CNN / transformer / tiny Llama) it converts with ``xconv.from_torch`` and checks the
``to_jax`` candidate on every device at the default precision and at ``precision="highest"``,
then the same candidate on the CPU with the accelerator's rounding simulated
(``tests/parity/simulate.py``). Each row prints its precision, ``L``, verdict and worst
``err / bound``; ``excess * DOT_FACTOR`` is the error at the worst element in ``u sqrt(L)``
units, to compare with the simulated value and with ``DOT_FACTOR`` (8): real hardware that
truncates to TF32 should read about twice the simulation. Everything right must pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def models(names):
    import torch

    from benchmarks import bench_scale
    from fixtures.torch_models import FIXTURES
    from tests.parity import models as small

    out = {}
    if "bert" in names:
        out["BERT-base"] = bench_scale.bert_base()
    if "resnet50" in names:
        out["ResNet-50"] = bench_scale.resnet50()
    if "cnn" in names:
        out["SmallCNN"] = (small.SmallCNN(), (torch.randn(2, 3, 12, 12),))
    if "transformer" in names:
        out["transformer"] = FIXTURES["transformer"]()
    return out


def rows(report, kind):
    from xconv.parity.policies import DOT_FACTOR

    found = []
    for r in report.matrix:
        ex = max((m.excess or 0.0 for m in r.outputs), default=None)
        found.append(
            {
                "check": kind,
                "device": r.device,
                "inputs": r.inputs,
                "precision": r.precision,
                "L": r.dot_depth,
                "passed": r.passed,
                "error": r.error,
                "excess": ex,
                "u_sqrtL_units": None
                if ex is None or r.precision == "float32"
                else ex * DOT_FACTOR,
            }
        )
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="cnn,transformer,resnet50,bert")
    args = ap.parse_args()
    import jax

    import xconv
    from tests.parity.simulate import simulated_accelerator

    accel = [d for d in jax.devices() if d.platform != "cpu"]
    print("devices", jax.devices(), [getattr(d, "device_kind", "") for d in accel], flush=True)
    results = []
    for name, (module, inputs) in models(args.models.split(",")).items():
        module = module.eval()
        xs = tuple(np.asarray(a) for a in inputs)
        t = time.perf_counter()
        model = xconv.from_torch(module, inputs)
        cand = xconv.to_jax(model)
        for kind, kw in (("default", {}), ("highest", {"precision": "highest"})):
            rep = xconv.check_parity(module, cand, xs, intermediates=False, **kw)
            results += [{"model": name, **r} for r in rows(rep, kind)]
            print(name, kind, "PASSED" if rep.passed else "FAILED", flush=True)
        sim = "tpu" if accel and accel[0].platform == "tpu" else "gpu"
        with simulated_accelerator(sim):
            rep = xconv.check_parity(module, xconv.to_jax(model), xs, intermediates=False)
        results += [{"model": name, **r} for r in rows(rep, "simulated")]
        for r in results:
            if r["model"] == name:
                print(" ", {k: v for k, v in r.items() if k != "model"}, flush=True)
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
