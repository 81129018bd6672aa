"""Meshes and rule tables: logical axis name -> mesh axes, per strategy.

A *logical axis* names what a parameter dimension means (``embed``, ``mlp``, ``heads``,
``vocab``, ``conv_out``...); a *rule table* maps each logical name to mesh axes, in Flax's
format (``flax.linen.partitioning``: a sequence of ``(logical, mesh_axis | tuple | None)``,
first match wins, a mesh axis used once per array). The mesh always has the axes
``("data", "model")``: ``"2x4"`` is data=2, model=4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xconv.errors import ConversionError

MESH_AXES = ("data", "model")

#: Every logical name xconv writes, with what it means.
LOGICAL = {
    "batch": "the batch dimension of inputs and activations",
    "embed": "the model (hidden) width: embedding features, dense input/output of that width",
    "mlp": "the hidden width of a feed-forward block (or another dense width)",
    "heads": "attention projections: heads x head_dim",
    "vocab": "the vocabulary (embedding rows, LM head outputs)",
    "conv_in": "convolution input channels",
    "conv_out": "convolution output channels",
    "norm": "features of a normalisation layer (scale, bias, running statistics)",
}

Rules = tuple[tuple[str, Any], ...]

_BOTH = ("data", "model")

#: Built-in strategies. FSDP shards every parameter over all devices along one dimension
#: (``embed`` or ``conv_out``), batch over ``data``; TP (Megatron-style) shards the wide
#: dimensions (``mlp``, ``heads``, ``vocab``, ``conv_out``) over ``model``; FSDP+TP does both,
#: the ``embed``/``conv_in`` dimension over ``data``.
STRATEGIES: dict[str, Rules] = {
    "fsdp": (
        ("batch", "data"),
        ("embed", _BOTH),
        ("conv_out", _BOTH),
        ("mlp", None),
        ("heads", None),
        ("vocab", None),
        ("conv_in", None),
        ("norm", None),
    ),
    "tp": (
        ("batch", "data"),
        ("embed", None),
        ("mlp", "model"),
        ("heads", "model"),
        ("vocab", "model"),
        ("conv_out", "model"),
        ("conv_in", None),
        ("norm", None),
    ),
    "fsdp+tp": (
        ("batch", "data"),
        ("embed", "data"),
        ("mlp", "model"),
        ("heads", "model"),
        ("vocab", "model"),
        ("conv_out", "model"),
        ("conv_in", "data"),
        ("norm", None),
    ),
}


class ShardingError(ConversionError):
    """A mesh, rule table or partitioning the sharding code cannot use."""


def resolve_rules(rules: str | Sequence[Sequence[Any]] | None) -> Rules:
    """A strategy name or a user table -> a validated rule table (``None`` -> ``"fsdp+tp"``)."""
    if rules is None:
        rules = "fsdp+tp"
    if isinstance(rules, str):
        if rules not in STRATEGIES:
            raise ShardingError(
                f"unknown partitioning {rules!r}; choose one of {sorted(STRATEGIES)} or pass a "
                "rule table ((logical_axis, mesh_axis | None), ...)"
            )
        return STRATEGIES[rules]
    out = []
    try:
        pairs = [tuple(r) for r in rules]
    except TypeError:
        raise ShardingError(f"rules must be a strategy name or pairs, not {rules!r}") from None
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], str):
            raise ShardingError(f"rule {pair!r}: expected (logical_axis, mesh_axis | None)")
        logical, target = pair
        if logical not in LOGICAL:
            raise ShardingError(
                f"rule {pair!r} names the unknown logical axis {logical!r}; known: "
                f"{sorted(LOGICAL)}"
            )
        axes = target if isinstance(target, (tuple, list)) else (target,)
        for ax in axes:
            if ax is not None and ax not in MESH_AXES:
                raise ShardingError(
                    f"rule {pair!r} names the unknown mesh axis {ax!r}; the mesh axes are "
                    f"{MESH_AXES}"
                )
        out.append((logical, tuple(target) if isinstance(target, list) else target))
    return tuple(out)


def read_rules(spec: Any) -> str | Rules | None:
    """What ``--partitioning`` names -> a strategy name or a validated rule table.

    ``spec`` is a strategy name (``"fsdp"``, ``"tp"``, ``"fsdp+tp"``), a JSON file (a list of
    ``[logical_axis, mesh_axis | [mesh_axes] | null]`` pairs, or an object ``{logical_axis:
    mesh_axis}``), or ``pkg.mod:RULES`` / ``path/to/file.py:RULES`` naming a rule table (or a
    function returning one) in Python, the table the Python API's ``rules=`` takes. Anything
    else (a missing file, bad JSON, an unknown logical or mesh axis) is a
    :class:`ShardingError`. Tables and ``None`` pass through (validated).
    """
    if spec is None:
        return None
    if not isinstance(spec, str):
        return resolve_rules(spec)
    if spec in STRATEGIES:
        return spec
    where = spec
    if spec.lower().endswith(".json"):
        import json
        from pathlib import Path

        path = Path(spec)
        if not path.is_file():
            raise ShardingError(f"partitioning rules file {spec!r} does not exist")
        try:
            table = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardingError(f"partitioning rules file {spec!r} is not valid JSON: {e}") from e
        if isinstance(table, dict):
            table = list(table.items())
    elif ":" in spec:
        from xconv.factories import resolve_attr

        try:
            table = resolve_attr(spec, "partitioning rules", "RULES")
        except ConversionError as e:
            raise ShardingError(f"partitioning rules {spec!r}: {e}") from e
        if callable(table):
            table = table()
    else:
        raise ShardingError(
            f"unknown partitioning {spec!r}: give a strategy ({', '.join(sorted(STRATEGIES))}), "
            "a rules file (.json) or pkg.mod:RULES naming a rule table"
        )
    if isinstance(table, str):
        return read_rules(table) if table in STRATEGIES else resolve_rules(table)
    try:
        pairs = [
            (r[0], tuple(r[1]) if isinstance(r[1], list) else r[1])
            if isinstance(r, (list, tuple)) and len(r) == 2
            else r
            for r in table
        ]
    except TypeError:
        raise ShardingError(
            f"partitioning rules {where!r}: expected pairs (logical_axis, mesh_axis | None), "
            f"not {type(table).__name__}"
        ) from None
    try:
        return resolve_rules(pairs)
    except ShardingError as e:
        raise ShardingError(f"partitioning rules {where!r}: {e}") from None


def parse_mesh_shape(spec: str | Sequence[int]) -> tuple[int, int]:
    """``"2x4"`` or ``(2, 4)`` -> ``(data, model)``."""
    try:
        dims = (
            tuple(int(p) for p in spec.lower().split("x"))
            if isinstance(spec, str)
            else tuple(int(p) for p in spec)
        )
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 2 or min(dims) < 1:
        raise ShardingError(f"mesh {spec!r}: expected DATAxMODEL, e.g. '2x4' or (2, 4)")
    return dims  # type: ignore[return-value]


def make_mesh(spec: Any):
    """A ``jax.sharding.Mesh`` with axes ``("data", "model")`` from ``"2x4"``, a shape, or a
    Mesh (returned as is after checking its axis names)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != MESH_AXES:
            raise ShardingError(
                f"the mesh has axes {tuple(spec.axis_names)}; xconv's rules use {MESH_AXES} "
                "(build it with xconv.sharding.make_mesh('DATAxMODEL'))"
            )
        return spec
    data, model = parse_mesh_shape(spec)
    devices = jax.devices()
    if data * model != len(devices):
        raise ShardingError(
            f"mesh {data}x{model} needs {data * model} devices; JAX sees {len(devices)} "
            f"({devices[0].platform}). On CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={data * model} before JAX starts"
        )
    return Mesh(np.array(devices).reshape(data, model), MESH_AXES)


def mesh_spec(
    axes: Sequence[str | None], shape: Sequence[int], rules: Rules, mesh: Any
) -> tuple[tuple[Any, ...], list[str]]:
    """Logical axes of one array -> (PartitionSpec entries, notes), Flax's resolution (first
    rule whose mesh axes are all unused in this array) plus a divisibility check: a dimension
    the mesh axes do not divide stays replicated, with a note."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    used: set[str] = set()
    spec: list[Any] = []
    notes: list[str] = []
    for dim, name in zip(shape, axes, strict=True):
        chosen = None
        for logical, target in rules:
            if logical != name:
                continue
            group = tuple(a for a in (target if isinstance(target, tuple) else (target,)) if a)
            if not group:
                break
            if used.intersection(group):
                continue
            n = 1
            for a in group:
                n *= sizes[a]
            if n > 1 and dim % n:
                notes.append(
                    f"dimension {dim} ({name}) is not divisible by {'x'.join(group)}={n}: replicated"
                )
                break
            chosen = group[0] if len(group) == 1 else group
            used.update(group)
            break
        spec.append(chosen)
    return tuple(spec), notes
