"""Localisation: find the first module scope whose output parts from the reference.

Both sides are reduced to a :class:`~xconv.parity.adapters.Trace`: scope name -> the
arrays leaving the scope (and entering it), in the order scopes complete. Torch fills it
with forward hooks on named modules, Flax with ``nn.intercept_methods``, and an IR-backed
side (``xconv.to_jax`` functions, ONNX models) from its node values: the nodes whose
``xconv.scope`` starts with a scope form its group, and the values that leave the group
are its outputs. Scopes are matched by name (``.`` and ``/`` both separate path parts).

The first divergence is the first scope, in completion order, whose output is out of
tolerance while its inputs are within it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from xconv.parity.metrics import Metrics, compare
from xconv.parity.policies import Policy

if TYPE_CHECKING:
    from xconv.parity.adapters import Trace

_SEP = re.compile(r"[./]")


def canonical_scope(name: str) -> str:
    """``Block_0/Conv_0`` and ``Block_0.Conv_0`` name the same scope."""
    return ".".join(p for p in _SEP.split(name) if p)


@dataclass
class ScopeGroup:
    """The nodes of one scope (and its sub-scopes): value names leaving and entering it."""

    name: str
    outputs: list[str]
    inputs: list[str]
    end: int


def scope_groups(graph: Any) -> list[ScopeGroup]:
    """Every scope prefix of the graph's nodes, ordered by where its last output is made.

    The last value that leaves a scope's node group (used outside it, or a graph output)
    is the scope's main output and is listed last in ``outputs``.
    """
    from xconv.ir.metadata import get_scope

    nodes = list(graph)
    members: dict[str, set[int]] = {}
    for i, node in enumerate(nodes):
        scope = get_scope(node)
        if not scope:
            continue
        parts = [p for p in _SEP.split(scope) if p]
        for j in range(1, len(parts) + 1):
            members.setdefault(".".join(parts[:j]), set()).add(i)
    index = {id(n): i for i, n in enumerate(nodes)}
    groups = []
    for name, idx in members.items():
        outputs: list[tuple[int, str]] = []
        inputs: list[str] = []
        for i in sorted(idx):
            node = nodes[i]
            for v in node.outputs:
                if not v.name:
                    continue
                escapes = v.is_graph_output() or any(
                    index.get(id(u.node)) not in idx for u in v.uses()
                )
                if escapes:
                    outputs.append((i, v.name))
            for v in node.inputs:
                if v is None or not v.name or v.is_initializer() or v.const_value is not None:
                    continue
                prod = v.producer()
                if prod is not None and (index.get(id(prod)) in idx or prod.op_type == "Constant"):
                    continue
                if v.name not in inputs:
                    inputs.append(v.name)
        if outputs:
            groups.append(ScopeGroup(name, [n for _, n in outputs], inputs, outputs[-1][0]))
    groups.sort(key=lambda g: (g.end, -len(g.name)))
    return groups


@dataclass
class ScopeResult:
    """How one scope's output compares (candidate vs reference, oracle-judged if available).

    Attributes:
        name: The scope (``layer1.0.conv1``).
        index: Position in completion order.
        output: Metrics of the scope's output.
        inputs_ok: Whether its inputs are within tolerance (None: not comparable).
        status: ``ok``, ``diverged`` (out of tolerance with inputs within it), ``contains``
            (an enclosing scope of the first divergence), ``propagated`` (out of tolerance,
            inputs already off) or ``incomparable``.
    """

    name: str
    index: int
    output: Metrics
    inputs_ok: bool | None = None
    status: str = "ok"
    input_metrics: list[Metrics] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "status": self.status,
            "inputs_ok": self.inputs_ok,
            "output": self.output.to_dict(),
        }


def to_ref_layout(c: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``c`` as an array of ``shape``: itself, or moved from channels-last (Flax, Keras) to
    channels-first (torch, the IR) when that is what makes the shapes agree."""
    if c.shape == shape:
        return c
    if c.ndim >= 3 and c.ndim == len(shape):
        moved = np.moveaxis(c, -1, 1)
        if moved.shape == shape:
            return moved
    return None


def _pick(
    cands: list[np.ndarray], refs: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The pair to compare: main outputs, else the first pair whose shapes agree."""
    if not cands or not refs:
        return None
    # Torch hooks list a module's outputs in return order (main first); IR groups list
    # escaping values in graph order (main last). Try the natural pairings, then any; where
    # several outputs share a shape (a rotary embedding's cos and sin), the closest pair.
    for c in (cands[-1], cands[0]):
        fits = [
            (ri, r, m) for ri, r in enumerate(refs) if (m := to_ref_layout(c, r.shape)) is not None
        ]
        if len(fits) > 1:
            fits.sort(key=lambda f: _distance(f[2], f[1]))
        if fits:
            ri, r, moved = fits[0]
            return moved, r, ri
    return None


def _other_pairs(
    cands: list[np.ndarray], refs: list[np.ndarray], main_ref: int
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The reference's other outputs, each with the closest candidate output of its shape."""
    out = []
    for ri, r in enumerate(refs):
        if ri == main_ref:
            continue
        fits = [m for c in cands if (m := to_ref_layout(c, r.shape)) is not None]
        if fits:
            out.append((min(fits, key=lambda m, r=r: _distance(m, r)), r, ri))
    return out


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    """A scale-free distance for choosing between same-shape outputs (NaN: far)."""
    if a.dtype.kind not in "fc" or b.dtype.kind not in "fc":
        return float(not np.array_equal(a, b))
    with np.errstate(invalid="ignore", over="ignore"):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        d = float(np.nanmax(np.abs(a64 - b64))) if a.size else 0.0
        scale = float(np.nanmax(np.abs(b64))) if b.size else 0.0
    return d / scale if scale > 0 and np.isfinite(d) else (0.0 if d == 0 else float("inf"))


def _loose(name: str) -> str:
    """Emitted Flax modules flatten ``blocks.0.conv`` to ``blocks_0_conv``."""
    return name.replace("_", ".")


def match_scopes(ref: Trace, cand: Trace) -> dict[str, str]:
    """Reference scope -> candidate scope: by canonical name, then with ``_`` as a separator."""
    out = {s: s for s in ref.order if s in cand.outputs}
    loose: dict[str, str | None] = {}
    for s in cand.outputs:
        if s not in out.values():
            key = _loose(s)
            loose[key] = None if key in loose else s  # ambiguous names match nothing
    for s in ref.order:
        if s not in out:
            hit = loose.get(_loose(s))
            if hit is not None:
                out[s] = hit
    return out


def _pairs(cands: list[np.ndarray], refs: list[np.ndarray]) -> list[tuple[int, int]]:
    """Match inputs by position when shapes agree (up to channels-last), else greedily."""

    def fits(c: np.ndarray, r: np.ndarray) -> bool:
        return to_ref_layout(c, r.shape) is not None

    if len(cands) == len(refs) and all(fits(c, r) for c, r in zip(cands, refs, strict=True)):
        return [(i, i) for i in range(len(cands))]
    used: set[int] = set()
    out = []
    for i, c in enumerate(cands):
        for j, r in enumerate(refs):
            if j not in used and fits(c, r):
                used.add(j)
                out.append((i, j))
                break
    return out


def _oracle_for(oracle: Trace | None, name: str, r: np.ndarray, which: str) -> np.ndarray | None:
    if oracle is None:
        return None
    arrays = (oracle.outputs if which == "out" else oracle.inputs).get(name) or []
    for a in reversed(arrays) if which == "out" else arrays:
        if a.shape == r.shape:
            return a
    return None


def localize(
    ref: Trace,
    cand: Trace,
    policy: Policy,
    oracle: Trace | None = None,
) -> tuple[list[ScopeResult], str | None, str | None]:
    """Compare scope outputs; return ``(results, first divergent scope, note)``."""
    mapping = match_scopes(ref, cand)
    common = [s for s in ref.order if s in mapping]
    if not common:
        return [], None, "no module scope is shared by both sides; cannot localise"
    results = []
    first = None
    first_bad = None
    for i, name in enumerate(common):
        cname = mapping[name]
        picked = _pick(cand.outputs[cname], ref.outputs[name])
        if picked is None:
            shapes = [a.shape for a in cand.outputs[cname]]
            m = Metrics(name=name, passed=False, shape=shapes[-1] if shapes else (), dtype="?")
            m.error = "no output of the same shape on both sides"
            results.append(ScopeResult(name, i, m, None, "incomparable"))
            continue
        pairs = [picked] + _other_pairs(cand.outputs[cname], ref.outputs[name], picked[2])
        outs_m = []
        for c, r, ri in pairs:
            o = None
            if oracle is not None:
                outs = oracle.outputs.get(name) or []
                o = (
                    outs[ri]
                    if ri < len(outs) and outs[ri].shape == r.shape
                    else _oracle_for(oracle, name, r, "out")
                )
            outs_m.append(compare(name, c, r, policy, o, logits=False, check_dtype=False))
        # A scope with several outputs (attention output and weights) fails on any of them.
        m = next((x for x in outs_m if not x.passed), outs_m[0])
        in_metrics = []
        cins = cand.inputs.get(cname, [])
        for ci, rj in _pairs(cins, ref.inputs.get(name, [])):
            rin = ref.inputs[name][rj]
            oin = None
            if oracle is not None:
                olist = oracle.inputs.get(name) or []
                oin = olist[rj] if rj < len(olist) and olist[rj].shape == rin.shape else None
            in_metrics.append(
                compare(
                    f"{name}<in{ci}>",
                    to_ref_layout(cins[ci], rin.shape),
                    rin,
                    policy,
                    oin,
                    logits=False,
                    check_dtype=False,
                )
            )
        inputs_ok = all(x.passed for x in in_metrics) if in_metrics else None
        status = "ok"
        if not m.passed:
            status = "propagated" if inputs_ok is False else "diverged"
            if first_bad is None:
                first_bad = name
            if first is None and inputs_ok is not False:
                first = name
            elif status == "diverged" and inputs_ok is None:
                # Inputs unknown, downstream of the first divergence: assume propagation.
                status = "propagated"
        results.append(ScopeResult(name, i, m, inputs_ok, status, in_metrics))
    if first is not None:
        for r in results:
            if r.status != "ok" and r.name != first and first.startswith(r.name + "."):
                r.status = "contains"
    note = None
    if first is None and first_bad is not None:
        note = (
            f"outputs part outside every matched scope: the first scope out of tolerance, "
            f"{first_bad!r}, already receives inputs out of tolerance"
        )
    return results, first, note
