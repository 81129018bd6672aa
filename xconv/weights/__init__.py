"""Checkpoint files in and out, torch <-> Flax name and layout maps, weights-only conversion.

* :mod:`xconv.weights.io`: read / write torch, safetensors (sharded), msgpack, Orbax, npz.
* :mod:`xconv.weights.flax_names`: the (scope, role) <-> Flax variable path rule.
* :mod:`xconv.weights.mapping`: ``torch_to_flax`` / ``flax_to_torch`` over a weight map.
* :mod:`xconv.weights.convert`: ``convert_weights``, shard by shard, with a strict key report.

This layer imports no converter: the weight map is built from what the converters produce
(the torch importer's IR, the Flax source emitter's variables and records), and
:mod:`xconv.weight_template` runs them. From the IR or a template factory, call
``xconv.weight_template.torch_to_flax`` / ``flax_to_torch`` / ``convert_weights``.

Framework imports (torch, flax, orbax, safetensors) happen lazily inside the functions.
"""

from __future__ import annotations

from xconv.weights.convert import Template, WeightsReport, convert_weights
from xconv.weights.io import iter_checkpoint, read_checkpoint, write_checkpoint
from xconv.weights.mapping import WeightMap, flax_to_torch, map_weights, torch_to_flax

__all__ = [
    "Template",
    "WeightMap",
    "WeightsReport",
    "convert_weights",
    "flax_to_torch",
    "iter_checkpoint",
    "map_weights",
    "read_checkpoint",
    "torch_to_flax",
    "write_checkpoint",
]
