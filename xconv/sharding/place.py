"""Placing a converted model on a mesh: shardings from rules, a sharded ``to_jax``, and the
mesh runner the parity checker uses.

JAX's SPMD partitioner does the work: params are ``jax.Array`` s with ``NamedSharding`` s,
inputs are split over ``data`` along the batch dimension, and ``jax.jit`` partitions the
computation. Nothing here partitions by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xconv.sharding.axes import Axes, Path, leaves, logical_axes
from xconv.sharding.rules import ShardingError, make_mesh, mesh_spec, resolve_rules


def _nest(flat: Mapping[Path, Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


@dataclass
class Plan:
    """Per-leaf logical axes and mesh specs for one tree on one mesh."""

    mesh: Any
    rules: tuple
    axes: dict[Path, Axes]
    specs: dict[Path, tuple]
    notes: list[str] = field(default_factory=list)

    def shardings(self) -> dict:
        """Nested ``NamedSharding`` tree matching the planned tree."""
        from jax.sharding import NamedSharding, PartitionSpec

        return _nest(
            {p: NamedSharding(self.mesh, PartitionSpec(*s)) for p, s in self.specs.items()}
        )

    def describe(self) -> dict[str, str]:
        """``{"a/b/kernel": "P(None, 'model')  [embed, mlp]"}`` for reports."""
        out = {}
        for p, s in sorted(self.specs.items()):
            names = ", ".join(str(a) for a in self.axes[p])
            out["/".join(p)] = f"P{tuple(s)!r}  [{names}]"
        return out


def plan(
    tree: Any,
    mesh: Any,
    rules: Any = None,
    *,
    model: Any = None,
    source_names: Mapping[str, str] | None = None,
    strip_collection: bool = False,
    perms: Mapping[str, tuple[int, ...]] | None = None,
) -> Plan:
    """Logical axes (from ``model``'s metadata and the tree) resolved against ``rules`` on
    ``mesh`` (a Mesh or ``"2x4"``)."""
    mesh = make_mesh(mesh)
    table = resolve_rules(rules)
    axes, notes = logical_axes(
        tree,
        model=model,
        source_names=source_names,
        strip_collection=strip_collection,
        perms=perms,
    )
    specs = {}
    for path, leaf in leaves(tree).items():
        shape = tuple(int(d) for d in getattr(leaf, "shape", ()))
        spec, why = mesh_spec(axes[path], shape, table, mesh)
        specs[path] = spec
        notes.extend(f"{'/'.join(path)}: {w}" for w in why)
    return Plan(mesh, table, axes, specs, notes)


def place(tree: Any, p: Plan) -> Any:
    """``jax.device_put`` each leaf with its sharding (one leaf at a time)."""
    import jax

    sh = leaves(p.shardings())
    return _nest({path: jax.device_put(leaf, sh[path]) for path, leaf in leaves(tree).items()})


def batch_sharding(mesh: Any, x: Any, rules: Any = None):
    """Inputs split over the mesh axes ``batch`` maps to (along dim 0) when they divide it,
    else replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    shape = tuple(getattr(x, "shape", ()))
    if not shape:
        return NamedSharding(mesh, PartitionSpec())
    spec, _ = mesh_spec(("batch",) + (None,) * (len(shape) - 1), shape, resolve_rules(rules), mesh)
    return NamedSharding(mesh, PartitionSpec(*spec))


class ShardedFunction:
    """``fn(params, *inputs)`` jitted over a mesh.

    ``in_shardings``: the params' shardings (``plan.shardings()``) and, per input, the batch
    split over ``data`` (replicated when the batch does not divide). ``out_shardings`` are
    left to the SPMD partitioner (outputs come back as sharded ``jax.Array`` s; ``np.asarray``
    gathers them). Attributes of the wrapped ``xconv.to_jax`` function (``model``,
    ``output_names``...) are forwarded.
    """

    def __init__(self, fn: Any, plan: Plan) -> None:
        import jax

        self.fn = fn
        self.plan = plan
        self.mesh = plan.mesh
        self._jit = jax.jit(lambda params, *xs: fn(params, *xs))

    def __getattr__(self, name: str) -> Any:
        if name in ("fn", "plan", "mesh", "_jit"):
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __call__(self, params: Any, *inputs: Any) -> Any:
        import jax

        xs = [jax.device_put(x, batch_sharding(self.mesh, x, self.plan.rules)) for x in inputs]
        return self._jit(params, *xs)


def to_jax_sharded(model: Any, fn: Any, params: Any, mesh: Any, rules: Any = None):
    """``(ShardedFunction, params placed on mesh)`` for ``xconv.to_jax(model, mesh=, rules=)``."""
    p = plan(params, mesh, rules, model=model, perms=getattr(fn, "kernel_perms", None))
    try:
        placed = place(params, p)
    except ShardingError:
        raise
    except Exception as e:  # a JAX refusal must not surface as a traceback
        raise ShardingError(
            f"placing the params on the mesh failed: {type(e).__name__}: {e}"
        ) from e
    return ShardedFunction(fn, p), placed


def is_sharded_tree(tree: Any) -> bool:
    """Whether every array leaf is a ``jax.Array`` with a ``NamedSharding``."""
    from jax.sharding import NamedSharding

    ls = [x for x in leaves(tree).values() if hasattr(x, "shape")]
    return bool(ls) and all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in ls)


def describe_tree(tree: Any) -> dict[str, str]:
    """``{"a/b/kernel": "PartitionSpec(...)"}`` of an already-placed tree."""
    return {
        "/".join(p): repr(tuple(x.sharding.spec))
        for p, x in sorted(leaves(tree).items())
        if hasattr(getattr(x, "sharding", None), "spec")
    }
