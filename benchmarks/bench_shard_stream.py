"""Peak host memory of the meta-device route writing a multi-shard Llama checkpoint.

``xconv torch-to-flax --module transformers:LlamaForCausalLM --config ... --weights
'model-*.safetensors'`` writes the Flax weights one input shard at a time: as safetensors
shards (no ``--partitioning``), or, with ``--partitioning fsdp --mesh 2x4``, as Orbax parts
placed on the mesh (``xconv.sharding.stream.stream_orbax_parts``). Each child process traces
the model on fake weights first (not measured; nor are imports and one tiny Orbax save that
starts Orbax's thread pools), then resets the peak-RSS mark
(``/proc/self/clear_refs``) and measures the write step alone: peak RSS above the post-trace
baseline, against the checkpoint's size and its largest input shard. Then
``load(out_dir, mesh="2x4")`` restores the parts (peak above its own baseline).

On 8 forced CPU devices the devices *are* host memory, so placed arrays count towards RSS.
The route drops each part after writing it and hands its memory back
(``xconv.sharding.stream.release_host_memory``); whether the peak then follows the largest
part or the checkpoint is what this measures. (Before that, 186 MiB in 9 shards peaked at
1.03x the checkpoint: the parts were freed, malloc's in-use bytes stayed flat, but glibc
kept the freed pages in its per-thread arenas.) The load average is recorded beside the
timings.

    python benchmarks/bench_shard_stream.py [--params 5e7] [--write benchmarks/shard_stream.md]
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

from benchmarks._memory import reset_peak, rss_kib, warm_mesh_orbax  # noqa: E402

LLAMA = "transformers:LlamaForCausalLM"


def child_write(ckpt: str, out: str, sharded: bool) -> dict:
    import time

    from xconv.checkpoint import CheckpointOptions, _staging, _write_flax, from_checkpoint

    options = CheckpointOptions(
        parity="none",
        early=False,
        partitioning="fsdp" if sharded else None,
        mesh="2x4" if sharded else None,
    )
    traced = from_checkpoint(LLAMA, ckpt, config=Path(ckpt) / "config.json")
    _, parent, stage = _staging(out)
    if sharded:  # fixed costs (imports, Orbax's thread pools) before the baseline
        warm_mesh_orbax(parent)
    base = reset_peak()
    t = time.perf_counter()
    report, _ = _write_flax(traced, stage, options, lambda msg: None)
    seconds = time.perf_counter() - t
    peak = rss_kib("VmHWM")
    res = {"peak_above_base_mib": (peak - base) / 1024, "seconds": seconds, "stage": str(stage)}
    if report.sharding is not None:
        res["largest_part_mib"] = report.sharding["largest_part_bytes"] / 2**20
        res["parts"] = len(report.sharding["parts"])
    return res


def child_load(folder: str) -> dict:
    import importlib.util

    import jax

    spec = importlib.util.spec_from_file_location("gen_stream", Path(folder) / "model.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    jax.numpy.zeros(1).block_until_ready()
    base = reset_peak()
    _, variables = gen.load(folder, mesh="2x4")
    jax.block_until_ready(variables)
    peak = rss_kib("VmHWM")
    return {"peak_above_base_mib": (peak - base) / 1024}


def _child(*args: str) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=5e7)
    ap.add_argument("--shard-mb", type=float, default=25.0)
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--child", nargs="+", default=None)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "write":
            res = child_write(rest[0], rest[1], rest[2] == "sharded")
        else:
            res = child_load(rest[0])
        print(json.dumps(res))
        return
    from benchmarks.make_checkpoint import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        make_checkpoint(ckpt, a.params, dtype="float32", shard_size=int(a.shard_mb * 1e6))
        shards = sorted(ckpt.glob("model-*.safetensors"))
        sizes = {
            "total_mib": sum(p.stat().st_size for p in shards) / 2**20,
            "largest_shard_mib": max(p.stat().st_size for p in shards) / 2**20,
            "shards": len(shards),
        }
        write = {
            "safetensors": _child("write", str(ckpt), str(Path(tmp) / "st"), "plain"),
            "orbax_parts": _child("write", str(ckpt), str(Path(tmp) / "ob"), "sharded"),
        }
        load = _child("load", write["orbax_parts"]["stage"])
    sizes["load_average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = render(a, sizes, write, load)
    print(text)
    if a.write:
        a.write.write_text(text)


def render(a, sizes: dict, write: dict, load: dict) -> str:
    total = sizes["total_mib"]
    lines = [
        "# Meta-device route: streaming a checkpoint into shards, peak host memory",
        "",
        f"Written by `python benchmarks/bench_shard_stream.py --params {a.params:g} "
        f"--shard-mb {a.shard_mb:g} --write benchmarks/shard_stream.md`.",
        "",
        f"Llama checkpoint (`benchmarks/make_checkpoint.py`), float32, {total:.1f} MiB in "
        f"{sizes['shards']} shards (largest {sizes['largest_shard_mib']:.1f} MiB). The write "
        "step after the trace (which is not measured); peak RSS above the post-trace "
        "baseline. 8 forced CPU devices: placed arrays are host memory too.",
        "",
        f"Load average (1, 5, 15 min) after the run: {sizes['load_average']}.",
        "",
        "| write | seconds | peak above base MiB | peak / checkpoint | peak / largest shard |",
        "|---|---|---|---|---|",
    ]
    names = {
        "safetensors": "safetensors shards (no `--partitioning`)",
        "orbax_parts": "Orbax parts, fsdp on 2x4 (`--partitioning fsdp --mesh 2x4`)",
    }
    for k, v in write.items():
        p = v["peak_above_base_mib"]
        big = sizes["largest_shard_mib"]
        lines.append(
            f"| {names[k]} | {v['seconds']:.1f} | {p:.1f} | {p / total:.2f} | {p / big:.2f} |"
        )
    o = write["orbax_parts"]
    lines += [
        "",
        f"Orbax parts: {o['parts']} (one per input shard, computed buffers in one more), "
        f"largest {o['largest_part_mib']:.1f} MiB. "
        f'`load(out_dir, mesh="2x4")` of those parts: peak {load["peak_above_base_mib"]:.1f} '
        f"MiB above its baseline ({load['peak_above_base_mib'] / total:.2f} x the checkpoint; "
        "the restored, placed tree is itself host memory here).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
