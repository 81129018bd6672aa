"""``to_flax(..., partitioning=)``: partitioned Flax output.

The Flax emitter writes the module and its variables tree; this module adds, as data, what
sharding needs, and nothing to the module's layers:

* a ``# --- Sharding`` section appended to ``model.py``: ``LOGICAL_AXES`` (variable path ->
  logical axis names, from :mod:`xconv.sharding.axes`), ``PARTITIONING`` and ``RULES`` (the
  strategy's rule table in ``flax.linen.partitioning`` format), ``shardings(mesh)`` built with
  ``nn.logical_to_mesh_sharding``, and ``load(out_dir=None, mesh=None, rules=RULES)``;
* the weights as an Orbax checkpoint (``variables.orbax/``) which ``load(mesh=...)`` restores
  straight into each device's shard (target shardings; no host copy of the whole tree).

Without a mesh everything is inert: ``load()`` returns ``(Model(), variables)`` as before.
"""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xconv.converters.codegen import write_dir_atomic
from xconv.sharding.axes import leaves, logical_axes
from xconv.sharding.rules import ShardingError, resolve_rules

FORMATS = ("msgpack", "orbax")
ORBAX_DIR = "variables.orbax"

_SECTION = '''

# --- Sharding (written by xconv.sharding; inert without a mesh) ---------------------------

#: Logical axis names of every variable: "collection/path" -> one name (or None) per dim.
LOGICAL_AXES = {{
{axes}
}}
#: The partitioning strategy and its rule table: logical axis -> mesh axes (first match
#: wins; ``flax.linen.partitioning`` format). The mesh axes are ``MESH_AXES``.
PARTITIONING = {strategy}
RULES = (
{rules}
)
MESH_AXES = ("data", "model")


def make_mesh(shape):
    """A ``("data", "model")`` mesh over the visible devices from ``"2x4"`` or ``(2, 4)``."""
    import numpy as np

    dims = tuple(int(d) for d in (shape.split("x") if isinstance(shape, str) else shape))
    devices = jax.devices()
    if len(dims) != 2 or dims[0] * dims[1] != len(devices):
        raise ValueError(f"mesh {{shape!r}} does not cover the {{len(devices)}} visible devices")
    return jax.sharding.Mesh(np.array(devices).reshape(dims), MESH_AXES)


def shardings(mesh, shapes, rules=RULES):
    """``{{path: NamedSharding}}`` for ``mesh`` (``shapes``: path -> shape); a dimension its
    mesh axes do not divide stays replicated."""
    from flax.linen import logical_to_mesh_sharding
    from jax.sharding import NamedSharding, PartitionSpec

    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    out = {{}}
    for path, axes in LOGICAL_AXES.items():
        if path not in shapes:
            continue
        spec = logical_to_mesh_sharding(PartitionSpec(*axes), mesh, rules).spec
        fitted = []
        for dim, entry in zip(shapes[path], tuple(spec) + (None,) * len(axes), strict=False):
            group = entry if isinstance(entry, tuple) else (entry,)
            n = 1
            for a in group:
                n *= sizes[a] if a else 1
            fitted.append(entry if dim % n == 0 else None)
        out[path] = NamedSharding(mesh, PartitionSpec(*fitted))
    return out


def _nest(flat):
    tree = {{}}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {{}})
        node[leaf] = value
    return tree


def _merge(into, tree):
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _restore(out_dir, mesh, rules):
    """The saved variables as a nested dict: on the host, or (with ``mesh``) restored from
    Orbax straight into each device's shard by ``shardings(mesh)``. A checkpoint streamed
    in parts (``{orbax}/part-NNNNN``, one per input shard) is restored part by part."""
    import numpy as np
    import orbax.checkpoint as ocp

    ckpt = ocp.PyTreeCheckpointer()
    root = out_dir / "{orbax}"
    tree = {{}}
    for part in sorted(root.glob("part-*")) or [root]:
        meta = ckpt.metadata(part)
        meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        flat = {{
            "/".join(str(getattr(k, "key", k)) for k in keys): m
            for keys, m in jax.tree_util.tree_flatten_with_path(meta)[0]
        }}
        if mesh is None:  # host arrays, whatever devices wrote the checkpoint
            args = _nest({{p: ocp.RestoreArgs(restore_type=np.ndarray) for p in flat}})
            restored = ckpt.restore(part, args=ocp.args.PyTreeRestore(restore_args=args))
            _merge(tree, jax.tree_util.tree_map(jnp.asarray, restored))
            continue
        placed = shardings(mesh, {{p: tuple(m.shape) for p, m in flat.items()}}, rules)
        target = _nest(
            {{p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=placed[p]) for p, m in flat.items()}}
        )
        args = ocp.checkpoint_utils.construct_restore_args(target)
        _merge(tree, ckpt.restore(part, args=ocp.args.PyTreeRestore(restore_args=args)))
    return tree

'''

_LOAD_LINEN = '''

def constrained(mesh, rules=RULES):
    """A context: every block of this file (a module class defined here, the root included)
    constrains its outputs to ``("batch", None, ...)`` with ``nn.with_logical_constraint``,
    so activations stay split over ``data`` between blocks whatever the parameters' split.
    Use around ``model.apply`` under ``jax.jit``; inert for a one-device mesh's numbers."""
    mesh = make_mesh(mesh) if isinstance(mesh, (str, tuple, list)) else mesh
    here = globals()

    def constrain(y):
        if not hasattr(y, "ndim") or y.ndim == 0:
            return y
        names = ("batch",) + (None,) * (y.ndim - 1)
        return nn.with_logical_constraint(y, names, rules=rules, mesh=mesh)

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        block = here.get(type(context.module).__name__) is type(context.module)
        if not block or context.method_name != "__call__":
            return out
        return jax.tree_util.tree_map(constrain, out)

    return nn.intercept_methods(interceptor)


def load(out_dir=None, mesh=None, rules=RULES):
    """Return ``(model, variables)``; run with ``model.apply(variables, *inputs)``.

    With ``mesh`` (a ``jax.sharding.Mesh`` with axes ``MESH_AXES``, or ``"2x4"``), every
    variable is restored from the Orbax checkpoint directly into its shards on the mesh
    (``shardings(mesh)``): no host holds the whole tree. Run under ``jax.jit``.
    """
    out_dir = Path(out_dir or Path(__file__).parent).absolute()
    if not (out_dir / "{orbax}").exists():
        if mesh is not None:
            raise FileNotFoundError(f"{{out_dir / '{orbax}'}}: sharded loading needs Orbax")
        return _load_msgpack(out_dir)
    mesh = make_mesh(mesh) if isinstance(mesh, (str, tuple, list)) else mesh
    return Model(), _restore(out_dir, mesh, rules)
'''

_LOAD_NNX = '''

def load(out_dir=None, mesh=None, rules=RULES):
    """Return the model with its variables loaded; call ``model(*inputs)``.

    With ``mesh`` (a ``jax.sharding.Mesh`` with axes ``MESH_AXES``, or ``"2x4"``), every
    parameter and batch statistic is restored from the Orbax checkpoint directly into its
    shards on the mesh (``shardings(mesh)``, by ``LOGICAL_AXES``): the module is built
    abstractly (``nnx.eval_shape``), so no host holds the whole state. Run under ``nnx.jit``.
    """
    out_dir = Path(out_dir or Path(__file__).parent).absolute()
    if not (out_dir / "{orbax}").exists():
        if mesh is not None:
            raise FileNotFoundError(f"{{out_dir / '{orbax}'}}: sharded loading needs Orbax")
        return _load_msgpack(out_dir)
    mesh = make_mesh(mesh) if isinstance(mesh, (str, tuple, list)) else mesh
    saved = _restore(out_dir, mesh, rules)
    stored = nnx.Any(nnx.Param, nnx.BatchStat)
    abstract = nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, stored, ...)
    if jax.tree_util.tree_leaves(rest):
        # Rng streams and the like: small, made by one jitted build whose parameter
        # initialisers XLA drops as dead code; replicated on the mesh beside the state.
        spec = jax.sharding.PartitionSpec()
        out = None if mesh is None else jax.sharding.NamedSharding(mesh, spec)
        rest = jax.jit(
            lambda: nnx.state(Model(rngs=nnx.Rngs(0)), nnx.Not(stored)), out_shardings=out
        )()
    nnx.replace_by_pure_dict(state, saved)
    return nnx.merge(graphdef, state, rest)
'''


def _py(value: Any) -> str:
    if isinstance(value, tuple):
        inner = ", ".join(_py(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def section(
    axes: dict[tuple[str, ...], tuple], strategy: str | None, rules: tuple, api: str = "linen"
) -> str:
    """The ``# --- Sharding`` section of ``model.py`` (deterministic: sorted paths)."""
    axes_lines = "\n".join(
        f"    {_py('/'.join(p))}: {_py(tuple(ax))}," for p, ax in sorted(axes.items())
    )
    rule_lines = "\n".join(f"    ({_py(k)}, {_py(v)})," for k, v in rules)
    return (_SECTION + (_LOAD_NNX if api == "nnx" else _LOAD_LINEN)).format(
        axes=axes_lines, strategy=_py(strategy), rules=rule_lines, orbax=ORBAX_DIR
    )


def _source_names(source: str) -> Mapping[str, str]:
    """``SOURCE_NAMES`` of the generated source completed by its ``SOURCE_SCOPES`` (the
    emitter lists only the names the scopes do not predict), or {}."""
    from xconv.converters.flax.source_names import SourceNames

    tables: dict[str, dict] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in ("SOURCE_NAMES", "SOURCE_SCOPES"):
                tables[name] = dict(ast.literal_eval(node.value))
    return SourceNames(tables.get("SOURCE_NAMES", {}), tables.get("SOURCE_SCOPES", {}))


_LOAD = re.compile(r"^def load\(", re.M)


def partitioned_source(
    source: str, variables: Any, model: Any, partitioning: Any, api: str = "linen"
) -> str:
    """``source`` with its ``load`` renamed ``_load_msgpack`` and the sharding section added."""
    if partitioning is None:
        strategy, rules = None, ()
    else:
        rules = resolve_rules(partitioning)
        strategy = partitioning if isinstance(partitioning, str) else "custom"
    axes, _ = logical_axes(
        variables,
        model=model,
        source_names=_source_names(source),
        strip_collection=api == "linen",  # nnx state has no collection level
    )
    if len(_LOAD.findall(source)) != 1:
        raise ShardingError("the generated Flax source has no single top-level load()")
    source = _LOAD.sub("def _load_msgpack(", source)
    return source.rstrip("\n") + "\n" + section(axes, strategy, rules, api)


def write_orbax(variables: Any, path: Path) -> None:
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer().save(Path(path).absolute(), variables)


def to_flax(
    model: Any,
    out_dir: str | os.PathLike,
    *,
    api: str = "linen",
    options: Any = None,
    partitioning: Any = None,
    format: str | None = None,
) -> Path:
    """:func:`xconv.converters.flax.source.emitter.to_flax` plus sharding.

    Args:
        partitioning: ``None``, ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` or a rule table
            ``((logical_axis, mesh_axis | tuple | None), ...)``: written into ``model.py``
            with ``LOGICAL_AXES``; implies ``format="orbax"``.
        format: ``"msgpack"`` (default without partitioning) or ``"orbax"``.

    Without either, this is exactly the emitter's ``to_flax``.
    """
    from xconv.converters.flax.source import emitter as flax_emitter

    if format not in (None, *FORMATS):
        raise ShardingError(f"unknown weights format {format!r}; choose one of {FORMATS}")
    if partitioning is None and format in (None, "msgpack"):
        return flax_emitter.to_flax(model, out_dir, api=api, options=options)
    if format == "msgpack":
        raise ShardingError("partitioning= writes an Orbax checkpoint; drop format='msgpack'")
    if api not in ("linen", "nnx"):
        raise ShardingError(f"partitioning/Orbax output supports api='linen' or 'nnx', not {api!r}")
    if partitioning is not None:
        resolve_rules(partitioning)  # bad rules fail before any work
    source, variables = flax_emitter.generate(model, api=api, options=options)
    source = partitioned_source(source, variables, model, partitioning, api)
    meta = {"api": api, "format": 1, "weights": "orbax"}
    if partitioning is not None:
        meta["partitioning"] = partitioning if isinstance(partitioning, str) else "custom"
    return _write(Path(out_dir), source, variables, meta)


def _write(out: Path, source: str, variables: Any, meta: dict) -> Path:
    """Write into a temp sibling, then one rename: nothing half-written on failure."""
    files = {
        "model.py": source.encode("utf-8"),
        "xconv.json": json.dumps(meta, sort_keys=True).encode("utf-8"),
    }
    return write_dir_atomic(out, files, write=lambda tmp: write_orbax(variables, tmp / ORBAX_DIR))


__all__ = ["leaves", "partitioned_source", "section", "to_flax"]
