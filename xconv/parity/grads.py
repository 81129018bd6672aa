"""Gradient parity: compare the gradients of ``sum(outputs * fixed random cotangents)`` with
respect to inputs and weights, weights matched by the conversion's name map or name rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from xconv.parity.adapters import cpu_device, is_float, to_float64
from xconv.parity.metrics import Metrics, compare


def check_grads(
    ref, cand, oracle, arrays, ref_out, cand_dev, ref_dev, pol, seed, notes, grad_names=None
) -> list[Metrics]:
    rng = np.random.default_rng(seed + 1)
    cots = [rng.standard_normal(o.shape) if is_float(o) else None for o in ref_out]
    try:
        rg = ref.grads(arrays, cots, ref_dev)
        cg = cand.grads(arrays, cots, cand_dev)
    except Exception as e:
        m = Metrics(name="grads", passed=False, shape=(), dtype="-")
        m.error = f"gradient computation failed: {type(e).__name__}: {e}"
        return [m]
    if rg is None or cg is None:
        side = ref if rg is None else cand
        m = Metrics(name="grads", passed=False, shape=(), dtype="-")
        m.error = f"{side.describe()} cannot compute gradients"
        return [m]
    og = None
    if oracle is not None and pol.uses_oracle:
        try:
            og = oracle.grads(to_float64(arrays), cots, cpu_device(oracle))
        except Exception as e:
            notes.append(
                f"oracle gradients failed ({type(e).__name__}: {e}); gradients judged by dtype"
            )
    gpol = pol if og is not None or not pol.uses_oracle else pol.as_dtype_policy()
    out = []
    for i, (r, c) in enumerate(zip(rg.inputs, cg.inputs, strict=False)):
        if r is None or c is None:
            continue
        o = og.inputs[i] if og is not None else None
        out.append(compare(f"d/input_{i}", c, r, gpol, o))
    mapping, how, cand_sources = _grad_mapping(ref, cand, rg.params, cg.params, grad_names)
    notes.append(
        f"weight gradients: {len(mapping)} of {len(rg.params)} reference weight(s) matched by {how}"
    )
    lost_ref = [n for n in rg.params if n not in mapping]
    # A candidate-only leaf whose gradient is identically zero is not trained, and state
    # either side keeps out of differentiation (torch buffers) is not a weight.
    frozen = {_loose_param(n) for n in (*rg.frozen, *cg.frozen)}
    lost_ref = [n for n in lost_ref if _loose_param(n) not in frozen]
    # A candidate leaf the conversion made from reference state (nnx BatchStat from a torch
    # running_mean buffer) is not a weight either.
    lost_cand = sorted(
        n
        for n in set(cg.params) - set(mapping.values())
        if _loose_param(n) not in frozen
        and _loose_param(cand_sources.get(n, n)) not in frozen
        and np.any(np.asarray(cg.params[n], dtype=np.float64) != 0)
    )
    if lost_ref or lost_cand:
        what = (
            f"{len(lost_ref)} reference weight gradient(s) {lost_ref[:6]} and "
            f"{len(lost_cand)} candidate one(s) {lost_cand[:6]} are not matched by name"
        )
        if grad_names is None:
            m = Metrics(name="d/<weights>", passed=False, shape=(), dtype="-")
            m.error = f"{what} by {how}; pass grad_names={{reference name: candidate name}}"
            out.append(m)
        else:
            notes.append(f"{what} (outside grad_names, not compared)")
    for rn, cn in mapping.items():
        r, c = rg.params[rn], _to_layout(cg.params[cn], rg.params[rn].shape)
        o = og.params.get(rn) if og is not None else None
        out.append(compare(f"d/{rn}", c, r, gpol, o))
    return out


def _grad_mapping(
    ref, cand, ref_names, cand_names, explicit: Mapping[str, str] | None
) -> tuple[dict[str, str], str, dict[str, str]]:
    """Reference weight name -> candidate weight name, how it was found, and the candidate's
    source names where its conversion recorded them. The mapping comes from ``explicit``
    (``grad_names``, name rules for the rest); else the name map of the conversion one side
    comes from (:meth:`Adapter.source_names`: ``xconv.to_jax`` / ``to_torch`` weight names,
    ``SOURCE_NAMES`` of a generated Flax module), with no guessing; else the name rules of
    :func:`match_param_names` when neither side records one."""
    if explicit is not None:
        return match_param_names(ref_names, cand_names, explicit), "grad_names (and name rules)", {}
    out: dict[str, str] = {}
    recorded = cand.source_names(list(cand_names))
    if recorded is not None:
        sources, where = recorded
        for cn, source in sources.items():
            rn = _same_name(source, ref_names)
            if rn is not None and rn not in out:
                out[rn] = cn
        return out, f"the conversion's name map ({where})", sources
    recorded = ref.source_names(list(ref_names))
    if recorded is not None:
        sources, where = recorded
        taken: set[str] = set()
        for rn, source in sources.items():
            cn = _same_name(source, cand_names)
            if cn is not None and cn not in taken:
                out[rn] = cn
                taken.add(cn)
        return out, f"the conversion's name map ({where})", {}
    rules = match_param_names(ref_names, cand_names, None)
    return rules, "name rules (no conversion name map on either side)", {}


def _same_name(source: str, names) -> str | None:
    """``source`` as spelled among ``names``: itself, or with ``/`` for ``.`` and without a
    leading ``params`` collection (the spellings of one name, not a guess at another)."""
    dotted = source.replace("/", ".")
    for n in (source, dotted, dotted.removeprefix("params.")):
        if n in names:
            return n
    return None


def match_param_names(
    ref_names: Sequence[str], cand_names: Sequence[str], explicit: Mapping[str, str] | None
) -> dict[str, str]:
    """Reference weight name -> candidate weight name: ``explicit`` entries, then equal
    names, then names equal up to separators (``/``, ``.``, and the ``_`` of generated Flax
    module names), a ``params.`` prefix, an nnx ``.value`` suffix and the role's spelling
    (Flax ``kernel``/``scale``/``embedding`` for torch ``weight``). Names that become
    ambiguous under these rules match nothing."""
    cand_set = set(cand_names)
    out: dict[str, str] = {}
    for r, c in (explicit or {}).items():
        if r in ref_names and c in cand_set:
            out[r] = c
    used = set(out.values())
    for r in ref_names:
        if r not in out and r in cand_set and r not in used:
            out[r] = r
            used.add(r)
    loose: dict[str, str | None] = {}
    for c in cand_names:
        if c not in used:
            key = _loose_param(c)
            loose[key] = None if key in loose else c  # ambiguous names match nothing
    for r in ref_names:
        if r not in out:
            hit = loose.get(_loose_param(r))
            if hit is not None and hit not in used:
                out[r] = hit
                used.add(hit)
    return out


def _loose_param(name: str) -> str:
    parts = [p for p in name.replace("/", ".").split(".") if p]
    if parts and parts[0] == "params":
        parts = parts[1:]
    if parts and parts[-1] == "value":
        parts = parts[:-1]
    if parts and parts[-1] in ("kernel", "scale", "embedding"):
        parts[-1] = "weight"
    # Generated Flax modules flatten ``blocks.0.conv`` to ``blocks_0_conv``.
    return ".".join(parts).replace("_", ".")


def _to_layout(c: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A candidate weight gradient in the reference's layout: Flax ``[spatial..., I, O]``
    (or ``[I, O]``) to torch ``[O, I, spatial...]`` when that is what makes shapes agree."""
    if c.shape == tuple(shape) or c.ndim != len(shape) or c.ndim < 2:
        return c
    perm = (c.ndim - 1, c.ndim - 2, *range(c.ndim - 2))
    moved = np.transpose(c, perm)
    return moved if moved.shape == tuple(shape) else c
