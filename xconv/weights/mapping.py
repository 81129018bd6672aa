"""torch ``state_dict`` <-> Flax variables, through the IR's weight annotations.

The IR from :func:`xconv.from_torch` names every weight by its ``state_dict`` key and marks it
with ``xconv.role`` / ``xconv.layout``; the anchor node of its layer carries the layer kind.
:mod:`xconv.weights.flax_names` turns ``(scope, role, kind)`` into the Flax variable path and
the kernel layout transform. A layer the Flax emitter cannot write natively becomes a generated
submodule whose weights are raw parameters named after their role; a weight outside any layer
is one raw top-level parameter. Blocks of the source's module tree nest these paths
(``params/layer1_0/conv1/kernel``). Where each weight went is read off the emitter's own record
for the template model (``xconv.converters.flax.source.emitter.generate_with_records``, run by
:func:`xconv.weight_template.build_weight_map` and handed to :func:`map_weights`), so the map always matches the ``model.py`` that
:func:`xconv.to_flax` writes; every entry is verified by value.

torch keeps state Flax has no variable for (``xconv.role`` ``num_batches``, i.e. BatchNorm's
``num_batches_tracked``). It is carried in a side map (:meth:`WeightMap.side_state`), never
in the Flax variables, so the variables are exactly what the generated module expects. Going
back, :func:`flax_to_torch` takes that side map; without it the template's value is used
(``0`` for a freshly built module: Flax does not count batches).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.errors import WeightsError
from xconv.ir.metadata import LAYOUT, ROLE, get_layer, get_scope
from xconv.weights.flax_names import (
    DROPPED_ROLES,
    flax_kernel_layout,
    flax_path,
    from_flax_kernel,
    kernel_permutation,
    module_name,
    raw_param_name,
    to_flax_kernel,
)
from xconv.weights.io import SEP, flatten, to_numpy, unflatten

Path_ = tuple[str, ...]


@dataclass(frozen=True)
class Entry:
    """One source weight and where it lives in Flax.

    Attributes:
        source: The torch ``state_dict`` key (the IR initializer name).
        path: Flax variable path, collection first for linen (``("params", "fc", "kernel")``).
        layout: The IR kernel layout permuted into Flax's (``OIHW`` -> ``HWIO``), or None when
            the array is stored as it is.
        shape: The source shape.
        dtype: The source dtype name.
    """

    source: str
    path: Path_
    layout: str | None
    shape: tuple[int, ...]
    dtype: str

    @property
    def flax_name(self) -> str:
        return SEP.join(self.path)

    def to_flax(self, array: np.ndarray) -> np.ndarray:
        return to_flax_kernel(array, self.layout) if self.layout else array

    def to_source(self, array: np.ndarray) -> np.ndarray:
        return from_flax_kernel(array, self.layout) if self.layout else array

    @property
    def flax_shape(self) -> tuple[int, ...]:
        if not self.layout:
            return self.shape
        perm = kernel_permutation(self.layout, flax_kernel_layout(self.layout))
        return tuple(self.shape[i] for i in perm)


@dataclass
class WeightMap:
    """The full source <-> Flax correspondence for one model.

    Attributes:
        entries: Source weights that are Flax variables, by source name (the primary
            variable, the one read back by :func:`flax_to_torch`).
        copies: Further variables holding a source weight: a weight tied to two layers (an
            embedding reused as the LM head) can become two Flax variables.
        side: Source weights Flax has no variable for (``num_batches_tracked``, and weights
            the graph never reads), with the template's values.
        template: Flax leaves that come from no source weight (buffers stored as
            ``constants``), with the template's values, by Flax name.
        unmapped: Initializers found in no Flax variable, with the reason. Those that are
            checkpoint entries (``state_keys``, or with an ``xconv.role``) are also in ``side``;
            the rest (a non-persistent buffer folded into the code) are not expected.
        api: ``"linen"`` or ``"nnx"``.
    """

    entries: dict[str, Entry]
    copies: list[Entry] = field(default_factory=list)
    side: dict[str, np.ndarray] = field(default_factory=dict)
    template: dict[str, np.ndarray] = field(default_factory=dict)
    unmapped: dict[str, str] = field(default_factory=dict)
    api: str = "linen"
    #: The template's value of each entry's Flax variable (fills gaps when not strict).
    defaults: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.by_flax = {e.flax_name: e for e in [*self.entries.values(), *self.copies]}
        self._copies: dict[str, list[Entry]] = {}
        for e in self.copies:
            self._copies.setdefault(e.source, []).append(e)

    def targets(self, source: str) -> list[Entry]:
        """Every Flax variable the source weight ``source`` becomes (primary first)."""
        primary = self.entries.get(source)
        return [primary, *self._copies.get(source, [])] if primary else []

    @property
    def source_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {k: e.shape for k, e in self.entries.items()}
        shapes.update({k: tuple(v.shape) for k, v in self.side.items()})
        return shapes

    @property
    def flax_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {e.flax_name: e.flax_shape for e in self.by_flax.values()}
        shapes.update({k: tuple(v.shape) for k, v in self.template.items()})
        return shapes

    def side_state(self, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The entries of ``state_dict`` Flax keeps no variable for (``num_batches_tracked``)."""
        return {k: to_numpy(state_dict[k]) for k in self.side if k in state_dict}


def _layer_kinds(graph: ir.Graph) -> dict[str, str]:
    """``{scope: layer kind}`` from the anchors' ``xconv.layer``."""
    kinds: dict[str, str] = {}
    for node in graph.all_nodes():
        meta = get_layer(node)
        scope = get_scope(node)
        if meta and scope:
            kinds.setdefault(scope, meta["kind"])
    return kinds


def _weight_scopes(value: ir.Value, kinds: Mapping[str, str]) -> list[str]:
    """The layer scopes of a weight: its consumers' (a tied weight has several), else its
    name's module prefix."""
    scopes = [get_scope(use.node) for use in value.uses()]
    scopes = list(dict.fromkeys(sc for sc in scopes if sc in kinds))
    prefix = value.name.rpartition(".")[0]
    if not scopes and prefix in kinds:
        scopes.append(prefix)
    return scopes


def _candidates(
    value: ir.Value, kinds: Mapping[str, str], recorded: Mapping[str, list[Path_]]
) -> list[tuple[Path_, str | None]]:
    role = value.metadata_props.get(ROLE)
    layout = value.metadata_props.get(LAYOUT)
    is_kernel = bool(role == "kernel" and layout and "O" in layout and "I" in layout)
    out: list[tuple[Path_, str | None]] = []
    # Where the emitter says it put this weight (the module tree's nested path); the
    # predicted flat paths below stay as candidates for a value it deduplicated.
    for path in recorded.get(value.name, []):
        if is_kernel:
            out.append((path, layout))
        out.append((path, None))
    for scope in _weight_scopes(value, kinds) if role else []:
        try:
            path = flax_path(scope, role, kinds[scope])
        except KeyError:
            path = None
        is_kernel = role == "kernel" and layout and "O" in layout and "I" in layout
        if path is not None:
            out.append((path, layout if is_kernel else None))
        # A layer with no native Flax counterpart: a generated submodule, raw role-named params.
        out.append((("params", module_name(scope), raw_param_name(role)), None))
    out.append((("params", raw_param_name(value.name)), None))
    # A source buffer the emitter stores as a non-trainable constant.
    out.append((("constants", raw_param_name(value.name)), None))
    return out


def map_weights(
    model_ir: ir.Model,
    variables: Mapping[str, Any],
    records: Sequence[Any],
    *,
    api: str = "linen",
    state_keys: Collection[str] | None = None,
) -> WeightMap:
    """Map every weight of ``model_ir`` to the variable the Flax emitter gave it.

    ``variables`` and ``records`` are what the Flax source emitter produced for the template
    (``model_ir`` with its own weights): the caller runs the emitter
    (:func:`xconv.weight_template.build_weight_map`), so this layer imports no converter. Each
    weight's predicted path (:mod:`xconv.weights.flax_names`) is accepted only when that
    variable holds exactly the weight's (layout-transformed) values.

    Args:
        model_ir: The IR from ``xconv.from_torch``.
        variables: The emitter's variables for ``model_ir`` (nested).
        records: The emitter's records (each with ``source`` and ``path``).
        api: ``"linen"`` or ``"nnx"``.
        state_keys: The source module's ``state_dict`` keys. Initializers outside it (a
            non-persistent buffer) are template constants, not expected in a checkpoint.
            Default: every initializer is a state_dict entry.
    """
    flat: dict[Path_, np.ndarray] = {tuple(k.split(SEP)): v for k, v in flatten(variables).items()}
    recorded: dict[str, list[Path_]] = {}
    for rec in records:
        if rec.source:
            # linen paths start with the collection, as the candidates below do
            recorded.setdefault(rec.source, []).append(
                rec.path if api == "linen" else ("params", *rec.path)
            )
    kinds = _layer_kinds(model_ir.graph)
    claimed: set[Path_] = set()
    entries: dict[str, Entry] = {}
    copies: list[Entry] = []
    side: dict[str, np.ndarray] = {}
    unmapped: dict[str, str] = {}
    for name, value in model_ir.graph.initializers.items():
        if value.const_value is None:
            continue
        arr = value.const_value.numpy()
        if state_keys is not None and name not in state_keys:
            continue  # not a checkpoint entry: its Flax leaf stays a template constant
        if value.metadata_props.get(ROLE) in DROPPED_ROLES:
            side[name] = np.array(arr)
            continue
        found: list[Entry] = []
        for path, layout in _candidates(value, kinds, recorded):
            key = path if api == "linen" else path[1:]
            got = flat.get(key)
            if key in claimed or got is None or any(e.path == key for e in found):
                continue
            want = to_flax_kernel(arr, layout) if layout else arr
            if got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want):
                found.append(Entry(name, key, layout, tuple(arr.shape), arr.dtype.name))
        if not found:
            entry = _by_value(name, arr, value, flat, claimed)
            found = [entry] if entry is not None else []
        if not found:
            unmapped[name] = "not found in the Flax variables (unused by the graph or folded)"
            if state_keys is not None or ROLE in value.metadata_props:
                side[name] = np.array(arr)  # a checkpoint entry with no Flax home: kept aside
            continue
        claimed.update(e.path for e in found)
        entries[name] = found[0]
        copies.extend(found[1:])
    template = {SEP.join(k): v for k, v in flat.items() if k not in claimed}
    defaults = {SEP.join(k): v for k, v in flat.items() if k in claimed}
    return WeightMap(entries, copies, side, template, unmapped, api, defaults)


def _by_value(name, arr, value, flat, claimed) -> Entry | None:
    """Fallback when a name was deduplicated by the emitter: the one unclaimed equal leaf."""
    layout = value.metadata_props.get(LAYOUT)
    options = [None] + ([layout] if layout and "O" in layout and "I" in layout else [])
    found = []
    for lay in options:
        want = to_flax_kernel(arr, lay) if lay else arr
        for key, got in flat.items():
            if key in claimed or got.shape != want.shape or got.dtype != want.dtype:
                continue
            if np.array_equal(got, want):
                found.append(Entry(name, key, lay, tuple(arr.shape), arr.dtype.name))
    return found[0] if len({e.path for e in found}) == 1 else None


@dataclass
class KeyReport:
    """What ``load_state_dict(strict=True)`` would say about a set of keys."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def message(self, what: str) -> str:
        """One headline, then one line per bad key."""
        counts = [
            f"{len(keys)} {label}"
            for label, keys in (
                ("missing", self.missing),
                ("unexpected", self.unexpected),
                ("mis-shaped", self.mismatched),
            )
            if keys
        ]
        lines = [f"{what} does not fit the model: {', '.join(counts)} key(s)"]
        lines += [f"  missing key: {k}" for k in self.missing]
        lines += [f"  unexpected key: {k}" for k in self.unexpected]
        lines += [
            f"  shape mismatch: {k}: checkpoint {g} vs model {w}" for k, g, w in self.mismatched
        ]
        lines.append("Pass strict=False (--no-strict) to skip these keys.")
        return "\n".join(lines)


def check_keys(
    shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> KeyReport:
    """Compare checkpoint ``{name: shape}`` against the model's expected ``{name: shape}``."""
    return KeyReport(
        missing=sorted(set(expected) - set(shapes)),
        unexpected=sorted(set(shapes) - set(expected)),
        mismatched=sorted(
            (k, tuple(shapes[k]), tuple(expected[k]))
            for k in set(shapes) & set(expected)
            if tuple(shapes[k]) != tuple(expected[k])
        ),
    )


def _weight_map(model: WeightMap) -> WeightMap:
    if not isinstance(model, WeightMap):
        raise TypeError(
            f"expected a WeightMap, got {type(model).__name__}: build one from the IR with "
            "xconv.weight_template.build_weight_map, or call xconv.weight_template."
            "torch_to_flax / flax_to_torch, which take the IR"
        )
    return model


def torch_to_flax(
    state_dict: Mapping[str, Any],
    weight_map: WeightMap,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """A torch ``state_dict`` as the Flax variables the generated ``model.py`` expects (laid out
    for the map's ``api``: linen ``{"params": ..., "batch_stats": ...}`` or the nnx module tree).

    Args:
        state_dict: ``{key: tensor or array}`` with the source module's keys.
        weight_map: The source module's :class:`WeightMap` (from the IR:
            :func:`xconv.weight_template.build_weight_map`).
        strict: Raise :class:`WeightsError` on missing / unexpected / mis-shaped keys;
            otherwise the template's values fill what is missing.

    Returns:
        A nested dict of numpy arrays. ``num_batches_tracked`` is not in it: see
        :meth:`WeightMap.side_state`.
    """
    wmap = _weight_map(weight_map)
    report = check_keys({k: tuple(np.shape(v)) for k, v in state_dict.items()}, wmap.source_shapes)
    if strict and not report.ok:
        raise WeightsError(report.message("the state_dict"))
    flat = dict(wmap.template)
    bad = {k for k, _, _ in report.mismatched}
    for entry in wmap.by_flax.values():
        name = entry.source
        if name in state_dict and name not in bad:
            flat[entry.flax_name] = entry.to_flax(to_numpy(state_dict[name]))
        else:
            flat[entry.flax_name] = None  # filled from the template below
    flat = {k: wmap.defaults[k] if v is None else v for k, v in flat.items()}
    return unflatten(dict(sorted(flat.items())))


def flax_to_torch(
    variables: Mapping[str, Any],
    weight_map: WeightMap,
    *,
    side_state: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> dict[str, np.ndarray]:
    """Flax variables back to the torch ``state_dict`` (original names, layouts and dtypes).

    Args:
        variables: The nested variables (as from :func:`torch_to_flax` or ``model.py``'s
            ``load``), or their flat ``/``-joined form.
        weight_map: The torch module's :class:`WeightMap`.
        side_state: torch-only entries (``num_batches_tracked``) from
            :meth:`WeightMap.side_state`; without them the template's values are used.
        strict: Raise :class:`WeightsError` on missing / unexpected / mis-shaped variables.

    Returns:
        ``{state_dict key: np.ndarray}`` in the IR's initializer order.
    """
    wmap = _weight_map(weight_map)
    flat = flatten(variables)
    report = check_keys({k: tuple(v.shape) for k, v in flat.items()}, wmap.flax_shapes)
    if strict and not report.ok:
        raise WeightsError(report.message("the Flax variables"))
    bad = {k for k, _, _ in report.mismatched}
    out: dict[str, np.ndarray] = {}
    for name, entry in wmap.entries.items():
        if entry.flax_name in flat and entry.flax_name not in bad:
            # The stored dtype is kept (a bf16 checkpoint stays bf16), never silently cast.
            out[name] = entry.to_source(flat[entry.flax_name])
    side = dict(wmap.side)
    if side_state:
        side.update({k: to_numpy(v) for k, v in side_state.items() if k in side})
    out.update(side)
    return out


__all__ = [
    "Entry",
    "KeyReport",
    "WeightMap",
    "check_keys",
    "flax_to_torch",
    "map_weights",
    "torch_to_flax",
]
