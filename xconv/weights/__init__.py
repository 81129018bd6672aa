"""Checkpoint files in and out, torch <-> Flax name and layout maps, weights-only conversion.

* :mod:`xconv.weights.io`: read / write torch, safetensors (sharded), msgpack, Orbax, npz.
* :mod:`xconv.weights.flax_names`: the (scope, role) <-> Flax variable path rule.
* :mod:`xconv.weights.mapping`: ``torch_to_flax`` / ``flax_to_torch`` over the IR's annotations.
* :mod:`xconv.weights.convert`: ``convert_weights``, shard by shard, with a strict key report.

Framework imports (torch, flax, orbax, safetensors) happen lazily inside the functions.
"""

from __future__ import annotations

from xconv.weights.convert import WeightsReport, convert_weights
from xconv.weights.io import iter_checkpoint, read_checkpoint, write_checkpoint
from xconv.weights.mapping import WeightMap, build_weight_map, flax_to_torch, torch_to_flax

__all__ = [
    "WeightMap",
    "WeightsReport",
    "build_weight_map",
    "convert_weights",
    "flax_to_torch",
    "iter_checkpoint",
    "read_checkpoint",
    "torch_to_flax",
    "write_checkpoint",
]
