"""Peak host memory of streaming a multi-shard checkpoint into Orbax parts on 8 forced CPU
devices (``test_stream_memory.py`` runs this in its own process).

A 12-shard checkpoint of one 8 MiB tensor per shard (a stack of bias-free ``nn.Linear``)
goes through both sharded writers: the meta-device route's ``stream_orbax_parts`` (targets
planned from the checkpoint index) and the weights-only path (``convert_weights(...,
mesh="2x4")``, i.e. ``write_sharded_orbax``). For each: peak RSS above the baseline taken
just before the write (``/proc/self/clear_refs`` resets the mark), the checkpoint's size
and its largest part, and the written values read back.

    python -m tests.sharding.stream_memory_worker OUT.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks._memory import peak_above_mib, reset_peak, warm_mesh_orbax

LAYERS, WIDTH = 12, 1448  # 12 shards x 8 MiB float32 (1448 = 8 x 181)


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)
        )

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def make_checkpoint(folder: Path) -> dict[str, np.ndarray]:
    """One safetensors shard per layer and its ``model.safetensors.index.json``."""
    from safetensors.numpy import save_file

    folder.mkdir()
    rng = np.random.default_rng(0)
    weight_map, first = {}, {}
    for i in range(LAYERS):
        name, shard = f"layers.{i}.weight", f"model-{i + 1:05d}-of-{LAYERS:05d}.safetensors"
        w = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32)
        save_file({name: w}, str(folder / shard))
        weight_map[name] = shard
        if i < 2:
            first[name] = w
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return first


def main(dest: str) -> None:
    import jax

    from xconv.sharding.flax import ORBAX_DIR  # noqa: F401  (import costs before the baseline)
    from xconv.sharding.stream import OrbaxParts, stream_orbax_parts
    from xconv.weight_template import build_template, convert_weights
    from xconv.weights.shards import CheckpointIndex
    from xconv.weights.stream import Planned, Target

    out: dict = {"devices": len(jax.devices())}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt = root / "ckpt"
        first = make_checkpoint(ckpt)
        shards = sorted(ckpt.glob("*.safetensors"))
        out["total_mib"] = sum(p.stat().st_size for p in shards) / 2**20
        out["largest_shard_mib"] = max(p.stat().st_size for p in shards) / 2**20
        # Fixed costs before any baseline: jax on the mesh, Orbax's thread pools.
        warm_mesh_orbax(root)

        # The meta-device route: Dense kernels (in, out), transposed from torch's (out, in).
        index = CheckpointIndex(str(ckpt / "model.safetensors.index.json"))
        targets = [
            Target(f"layers_{i}/kernel", (WIDTH, WIDTH), "float32",
                   Planned(f"layers.{i}.weight", (WIDTH, WIDTH), np.float32).T)
            for i in range(LAYERS)
        ]  # fmt: skip
        axes = {t.name: ("embed", "mlp") for t in targets}
        base = reset_peak()
        written = stream_orbax_parts(targets, index, root / "meta", axes, "2x4", "fsdp")
        peak = peak_above_mib(base)
        reader = OrbaxParts(root / "meta")
        out["meta"] = {
            "peak_mib": peak,
            "parts": len(written["parts"]),
            "largest_part_mib": written["largest_part_bytes"] / 2**20,
            "specs": {k: list(v) for k, v in list(written["specs"].items())[:2]},
            "values_equal": all(
                np.array_equal(reader.read(f"layers_{i}/kernel"), first[f"layers.{i}.weight"].T)
                for i in range(2)
            ),
        }
        del reader, written

        # The weights-only path: convert_weights(..., mesh="2x4").
        template = build_template(lambda: (Stack(), (torch.zeros(1, WIDTH),)), None, "linen")
        base = reset_peak()
        convert_weights(ckpt / "model.safetensors.index.json", template,
                        out=root / "weights.orbax", format="orbax", mesh="2x4",
                        partitioning="fsdp")  # fmt: skip
        peak = peak_above_mib(base)
        parts = sorted(p.name for p in (root / "weights.orbax").iterdir())
        reader = OrbaxParts(root / "weights.orbax")
        name = next(n for n in reader._where if n.endswith("kernel"))
        from xconv.weights.io import iter_shards

        back = {k: v for shard in iter_shards(root / "weights.orbax") for k, v in shard.items()}
        out["weights"] = {
            "peak_mib": peak,
            "parts": len(parts),
            "names": len(reader._where),
            "kernel_shape": list(reader.read(name).shape),
            # Read back by the weights reader (flax-to-torch's input): torch's weight, transposed.
            "values_equal": np.array_equal(
                back["params/layers_0/kernel"], first["layers.0.weight"].T
            ),
        }
    Path(dest).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:2])
