"""Sharding as metadata (DESIGN.md rule 13): logical axis names per parameter, a rule table
per strategy, and placement on JAX meshes by JAX's own SPMD partitioner.

* :mod:`xconv.sharding.rules`: meshes (``"2x4"`` -> axes ``data``, ``model``) and rule tables
  (``fsdp``, ``tp``, ``fsdp+tp`` or a user table);
* :mod:`xconv.sharding.axes`: logical axis names per leaf of an emitted variables tree, from
  the IR's weight metadata;
* :mod:`xconv.sharding.place`: shardings, sharded ``to_jax``, the parity checker's mesh runner;
* :mod:`xconv.sharding.flax`: ``to_flax(..., partitioning=)``: the rule table written into the
  generated ``model.py``, an Orbax checkpoint, and ``load(out_dir, mesh=)``;
* :mod:`xconv.sharding.stream`: weights streamed into an Orbax checkpoint placed on a mesh;
* :mod:`xconv.sharding.torch`: FSDP2 ``fully_shard`` over generated torch source.

Imported lazily: ``import xconv.sharding`` loads no framework.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "STRATEGIES": ("xconv.sharding.rules", "STRATEGIES"),
    "ShardingError": ("xconv.sharding.rules", "ShardingError"),
    "make_mesh": ("xconv.sharding.rules", "make_mesh"),
    "resolve_rules": ("xconv.sharding.rules", "resolve_rules"),
    "read_rules": ("xconv.sharding.rules", "read_rules"),
    "logical_axes": ("xconv.sharding.axes", "logical_axes"),
    "plan": ("xconv.sharding.place", "plan"),
    "place": ("xconv.sharding.place", "place"),
    "to_flax": ("xconv.sharding.flax", "to_flax"),
    "write_sharded_orbax": ("xconv.sharding.stream", "write_sharded_orbax"),
    "fully_shard_generated": ("xconv.sharding.torch", "fully_shard_generated"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'xconv.sharding' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
