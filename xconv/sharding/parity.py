"""The parity checker's mesh runner: the candidate runs sharded, jitted over a mesh.

``check_parity(reference, candidate, inputs, mesh=...)`` wraps the candidate adapter in
:class:`MeshAdapter`: its params keep the shardings they were placed with
(``xconv.to_jax(mesh=)``, a generated ``load(mesh=)``), or are placed by ``rules`` (names from
the tree's leaf names, or from ``SOURCE_NAMES``/the IR when the candidate records them); the
inputs are split over ``data`` along the batch dimension; ``jax.jit`` runs it on the mesh.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from xconv.parity.adapters import Adapter
from xconv.sharding.axes import leaves
from xconv.sharding.place import batch_sharding, describe_tree, is_sharded_tree, place, plan
from xconv.sharding.rules import ShardingError, make_mesh


class MeshAdapter(Adapter):
    """A JAX-family adapter run over a mesh."""

    def __init__(self, inner: Any, mesh: Any, rules: Any = None) -> None:
        if not hasattr(inner, "params") or not hasattr(inner, "_call"):
            raise ShardingError(
                f"mesh=: the candidate must be a JAX or Flax model, not {inner.describe()}"
            )
        self.inner = inner
        self.framework = inner.framework
        self.mesh = make_mesh(mesh)
        self.rules = rules
        self.notes: list[str] = []
        params = inner.params
        if is_sharded_tree(params) and all(
            x.sharding.mesh == self.mesh for x in leaves(params).values() if hasattr(x, "sharding")
        ):
            self.params = params
            self.notes.append("parameters keep the shardings they were placed with")
        elif rules is None and _generated(inner) is not None:
            # A module xconv.to_flax wrote with partitioning: its own table and shardings().
            gen = _generated(inner)
            shapes = {"/".join(p): tuple(x.shape) for p, x in leaves(params).items()}
            placed = gen["shardings"](self.mesh, shapes)
            self.params = _place_by_path(params, placed, self.mesh, self.notes)
            self.notes.append(
                f"parameters placed by the module's own RULES "
                f"(PARTITIONING={gen.get('PARTITIONING')!r})"
            )
        else:
            model = getattr(getattr(inner, "fn", None), "model", None)
            module = getattr(inner, "module", None)
            p = plan(
                params,
                self.mesh,
                rules,
                model=model,
                source_names=_source_names(module),
                strip_collection=module is not None,
            )
            self.params = place(params, p)
            self.notes.extend(p.notes)
        import jax

        self._jit = jax.jit(lambda params, *xs: inner._call(params, list(xs)))

    @property
    def name(self) -> str:
        d, m = self.mesh.devices.shape
        return f"mesh:{d}x{m}"

    def describe(self) -> str:
        return f"{self.inner.describe()} on mesh {self.name[5:]} (data x model)"

    def devices(self) -> list[str]:
        return [self.name]

    def output_names(self, n: int) -> list[str]:
        return self.inner.output_names(n)

    def input_specs(self):
        return self.inner.input_specs()

    def source_names(self, names):
        return self.inner.source_names(names)

    def oracle(self):
        return self.inner.oracle()

    def dot_precision(self, device, inputs):
        from xconv.parity.precision import jax_device_precision, jaxpr_dot_depth

        precision = jax_device_precision(self.mesh.devices.flat[0])
        if precision == "float32":
            return "float32", 1
        return precision, jaxpr_dot_depth(self.inner._call, self.inner.params, list(inputs))

    def precision_context(self, request):
        return self.inner.precision_context(request)

    def run(self, inputs, device):
        import jax

        xs = [
            jax.device_put(np.asarray(x), batch_sharding(self.mesh, x, self.rules)) for x in inputs
        ]
        if self._jit is not None:
            try:
                out = self._jit(self.params, *xs)
            except jax.errors.JAXTypeError as e:  # shapes computed from values: not traceable
                self._jit = None
                self.notes.append(
                    f"the candidate is not jit-traceable ({type(e).__name__}); it ran op by op "
                    "on the sharded arrays (each op still partitioned over the mesh)"
                )
        if self._jit is None:
            out = self.inner._call(self.params, xs)
        return [np.asarray(o) for o in jax.tree_util.tree_leaves(out)]

    def input_notes(self, inputs) -> list[str]:
        notes = []
        data = dict(zip(self.mesh.axis_names, self.mesh.devices.shape, strict=True))["data"]
        for i, x in enumerate(inputs):
            spec = batch_sharding(self.mesh, x, self.rules).spec
            if data > 1 and np.ndim(x) and (not spec or spec[0] is None):
                notes.append(
                    f"input {i}: batch {np.shape(x)[0]} does not divide data={data}: "
                    "replicated (no data parallelism)"
                )
        return notes

    def report(self) -> dict[str, Any]:
        """``{"shape": {...}, "params": {path: spec}}`` for ``ParityReport.mesh``."""
        shape = dict(
            zip(self.mesh.axis_names, (int(s) for s in self.mesh.devices.shape), strict=True)
        )
        return {"shape": shape, "params": describe_tree(self.params)}


def _globals(module: Any) -> dict[str, Any]:
    """The globals of the file a Flax module's class is defined in (also when that file was
    imported from a path without a ``sys.modules`` entry)."""
    import inspect

    if module is None:
        return {}
    for attr in ("__call__", "setup"):
        fn = type(module).__dict__.get(attr)
        if fn is not None:
            return getattr(inspect.unwrap(fn), "__globals__", {})
    return {}


def _generated(inner: Any) -> dict[str, Any] | None:
    """The generated file's globals when it carries a sharding section, else None."""
    g = _globals(getattr(inner, "module", None))
    ok = isinstance(g.get("LOGICAL_AXES"), dict) and callable(g.get("shardings"))
    return g if ok else None


def _place_by_path(params: Any, shardings: dict[str, Any], mesh: Any, notes: list[str]) -> Any:
    """``params`` (a nested dict or an nnx ``State``) placed by path; leaves the table does
    not name (an nnx module's rng streams) are replicated on the mesh."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())
    missing: list[str] = []

    def put(keys, x):
        # Dict keys only: an nnx Variable adds an attribute key (".value") below its name.
        path = "/".join(str(k.key) for k in keys if isinstance(k, jax.tree_util.DictKey))
        if path not in shardings:
            missing.append(path)
        return jax.device_put(x, shardings.get(path, replicated))

    placed = jax.tree_util.tree_map_with_path(put, params)
    if missing:
        notes.append(f"{len(missing)} leaves outside LOGICAL_AXES replicated ({missing[0]}, ...)")
    return placed


def _source_names(module: Any) -> dict[str, str] | None:
    """``SOURCE_NAMES`` of the generated file a Flax module comes from, completed by its
    ``SOURCE_SCOPES``, if any."""
    from xconv.converters.flax.source_names import SourceNames

    g = _globals(module)
    names, scopes = g.get("SOURCE_NAMES"), g.get("SOURCE_SCOPES", {})
    if not isinstance(names, dict):
        return None
    return SourceNames(names, scopes if isinstance(scopes, dict) else {})


def wrap_for_mesh(cand: Adapter, mesh: Any, rules: Any, arrays, notes: list[str]) -> MeshAdapter:
    """The mesh adapter for ``cand``; what it did goes into ``notes`` (the report's notes,
    shared, so run-time fallbacks are reported too)."""
    try:
        m = MeshAdapter(cand, mesh, rules)
    except ShardingError:
        raise
    except Exception as e:
        raise ShardingError(f"mesh=: cannot place the candidate: {type(e).__name__}: {e}") from e
    shape = " x ".join(
        f"{a}={s}" for a, s in zip(m.mesh.axis_names, m.mesh.devices.shape, strict=True)
    )
    specs = [x.sharding.spec for x in leaves(m.params).values() if hasattr(x, "sharding")]
    n = sum(1 for spec in specs if any(e is not None for e in spec))
    notes.append(
        f"candidate sharded over mesh {shape}: {n} of {len(specs)} parameters split, "
        "inputs' batch over data"
    )
    notes.extend([*m.notes, *m.input_notes(arrays)])
    m.notes = notes
    return m


__all__ = ["MeshAdapter", "wrap_for_mesh"]


class LayerwisePlacement:
    """Places the layerwise checker's candidate blocks on a mesh (``IRBlocks(placement=)``).

    The meta-device route's parity runs the converted IR block by block, each block's
    weights read from the checkpoint when it runs; with a mesh, each weight is put on the
    mesh with the sharding its logical axes (from the IR) and ``rules`` give, each block
    input is split over ``data`` along the batch (replicated when the batch does not divide
    it), and every op of the block runs partitioned over the mesh (eager, op by op).
    """

    def __init__(self, model: Any, names: Any, mesh: Any, rules: Any = None) -> None:
        """``names``: the initializers of ``model`` (an ``onnx_ir.Model``) that get sharded;
        any other weight a block reads is replicated."""
        self.mesh = make_mesh(mesh)
        self.rules = rules
        inits = model.graph.initializers
        shapes = {
            n: _Shape(tuple(int(d) for d in inits[n].shape))
            for n in names
            if n in inits and inits[n].shape is not None
        }
        p = plan(shapes, self.mesh, rules, model=model)
        self.specs = {path[0]: tuple(spec) for path, spec in p.specs.items()}
        self.axes = {path[0]: ax for path, ax in p.axes.items()}
        self.notes = list(p.notes)
        self._batch_note = False

    def weight(self, name: str, data: Any) -> Any:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        spec = self.specs.get(name, ())
        return jax.device_put(data, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def input(self, x: Any) -> Any:
        import jax

        x = np.asarray(x)
        sharding = batch_sharding(self.mesh, x, self.rules)
        data = dict(zip(self.mesh.axis_names, self.mesh.devices.shape, strict=True))["data"]
        if data > 1 and x.ndim and not self._batch_note and sharding.spec[:1] in ((), (None,)):
            self._batch_note = True
            self.notes.append(
                f"block input of shape {x.shape}: batch {x.shape[0]} does not divide "
                f"data={data}: replicated (no data parallelism)"
            )
        return jax.device_put(x, sharding)

    def report(self) -> dict[str, Any]:
        """``{"shape": {...}, "params": {name: spec}}`` (as ``ParityReport.mesh``)."""
        shape = dict(
            zip(self.mesh.axis_names, (int(s) for s in self.mesh.devices.shape), strict=True)
        )
        return {"shape": shape, "params": {n: repr(s) for n, s in sorted(self.specs.items())}}


class _Shape:
    """A leaf's shape alone (what the logical-axes naming looks at)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.ndim = len(shape)
