"""Sharded vs unsharded on a simulated 8-device CPU mesh; sharded (Orbax) vs msgpack loading.

A correctness vehicle, not a speed claim: 8 "devices" forced onto the same CPU cores
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) share the cores, so the step-time
ratio measures the SPMD partitioner's overhead (collectives, smaller ops), not a speedup.

1. Step time: a residual MLP (``tests.parity.models.DeepMLP``) converted from torch to Flax,
   one jitted forward + backward + SGD step, unsharded (one device) vs placed by each
   strategy on a 2x4 mesh (batch over ``data``). Median seconds; ratio sharded / unsharded.
2. Loading: peak host RSS above the post-import baseline (``/proc/self/clear_refs`` resets
   the high-water mark) of the generated ``load()`` reading ``variables.msgpack`` (whole file,
   then arrays) vs ``load(mesh="2x4")`` restoring the Orbax checkpoint into fsdp shards.

Each measurement runs in its own child process.

    python benchmarks/bench_shard.py [--width 1024] [--depth 8] [--write benchmarks/shard.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._memory import rss_kib  # noqa: E402

STRATEGIES = ("fsdp", "tp", "fsdp+tp")


def _import(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_bench", path / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def child_load(folder: str, mesh: str | None) -> dict:
    import jax

    gen = _import(Path(folder))
    jax.numpy.zeros(1).block_until_ready()  # backend up before the baseline
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    base = rss_kib("VmRSS")
    _, variables = gen.load(folder) if mesh is None else gen.load(folder, mesh=mesh)
    jax.block_until_ready(variables)
    peak = rss_kib("VmHWM")
    n = sum(x.nbytes for x in jax.tree_util.tree_leaves(variables))
    return {"peak_above_base_mib": (peak - base) / 1024, "weights_mib": n / 2**20}


def child_step(folder: str, mesh: str | None, batch: int, repeat: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from benchmarks._timing import median_seconds

    gen = _import(Path(folder))
    model, variables = gen.load(folder, mesh=mesh)
    x = np.random.default_rng(0).standard_normal((batch, 32)).astype(np.float32)
    if mesh is not None:
        from xconv.sharding.place import batch_sharding
        from xconv.sharding.rules import make_mesh

        x = jax.device_put(x, batch_sharding(make_mesh(mesh), x))
    tx = optax.sgd(1e-3, momentum=0.9)
    state = jax.jit(tx.init)(variables["params"])

    @jax.jit
    def step(params, state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    params = variables["params"]

    def run():
        jax.block_until_ready(step(params, state, x))

    return {"step_s": median_seconds(run, warmup=2, repeat=repeat)}


def _child(*args: str) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def convert(root: Path, width: int, depth: int) -> dict[str, Path]:
    import torch

    import xconv
    from tests.parity.models import DeepMLP

    torch.manual_seed(0)
    net = DeepMLP(width=width, depth=depth)
    model = xconv.from_torch(net, (torch.randn(8, 32),))
    out = {"msgpack": xconv.to_flax(model, root / "msgpack")}
    for s in STRATEGIES:
        out[s] = xconv.to_flax(model, root / s, partitioning=s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--child", nargs="+", default=None)
    a = ap.parse_args()
    if a.child:
        kind, folder, *rest = a.child
        mesh = None if rest[0] == "none" else rest[0]
        res = (
            child_load(folder, mesh)
            if kind == "load"
            else child_step(folder, mesh, a.batch, a.repeat)
        )
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory() as tmp:
        dirs = convert(Path(tmp), a.width, a.depth)
        step = {"unsharded": _child("step", str(dirs["fsdp"]), "none")}
        for s in STRATEGIES:
            step[s] = _child("step", str(dirs[s]), "2x4")
        load = {
            "msgpack": _child("load", str(dirs["msgpack"]), "none"),
            "orbax": _child("load", str(dirs["fsdp"]), "none"),
            "orbax_fsdp_2x4": _child("load", str(dirs["fsdp"]), "2x4"),
        }
    text = render(a, step, load)
    print(text)
    if a.write:
        a.write.write_text(text)


def render(a, step: dict, load: dict) -> str:
    base = step["unsharded"]["step_s"]
    lines = [
        "# Sharding on a simulated 8-device CPU mesh",
        "",
        "Written by `python benchmarks/bench_shard.py "
        f"--width {a.width} --depth {a.depth} --batch {a.batch} --write benchmarks/shard.md`.",
        "8 forced CPU devices share this machine's cores: the step-time ratio is the SPMD",
        "partitioner's overhead on one host (a correctness vehicle), not a speed claim.",
        "",
        f"DeepMLP width {a.width}, depth {a.depth} (torch -> Flax), batch {a.batch}; one jitted",
        "forward + backward + SGD step, median seconds.",
        "",
        "| placement | step s | ratio to unsharded |",
        "|---|---|---|",
        f"| unsharded (1 device) | {base:.4f} | 1.00 |",
        *(
            f"| {s} on 2x4 | {step[s]['step_s']:.4f} | {step[s]['step_s'] / base:.2f} |"
            for s in STRATEGIES
        ),
        "",
        "Loading the same weights: peak host RSS above the post-import baseline. On this",
        "simulated mesh the 8 devices *are* host memory, so the placed shards themselves count",
        "towards host RSS: the sharded load's point here is that it restores each shard",
        "directly (no whole-tree host copy before placement), not a lower host peak.",
        "",
        "| load | weights MiB | peak above base MiB | ratio to weights |",
        "|---|---|---|---|",
    ]
    names = {
        "msgpack": "`load()` from variables.msgpack",
        "orbax": "`load()` from Orbax, no mesh",
        "orbax_fsdp_2x4": '`load(mesh="2x4")` from Orbax, fsdp shards',
    }
    for k, v in load.items():
        w, p = v["weights_mib"], v["peak_above_base_mib"]
        lines.append(f"| {names[k]} | {w:.1f} | {p:.1f} | {p / w:.2f} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
