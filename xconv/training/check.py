"""Training parity: N optimizer steps of a torch run and of its conversion, side by side.

:func:`check_training` trains a copy of the torch module with its optimizer (and scheduler,
clipping), a float64 copy of both (the oracle), and the converted model with
:func:`~xconv.training.from_torch_optimizer` / :func:`~xconv.training.from_torch_loss`, on
the same batches, and compares after every step: the loss (relative, ``tol``), and each
parameter, optimizer slot and BatchNorm running statistic element by element under the parity
oracle policy (:mod:`xconv.training.oracle`). The report names the first step, tensor and
element that part, the bound and why.

Which converted leaf holds each torch tensor is read from the conversion's name record
(``SOURCE_SCOPES`` / ``SOURCE_NAMES`` of a generated ``model.py``, ``weight_names`` of a
``to_jax`` function); a candidate whose recorded leaves hold other values than the module's
is reported as stale (:class:`~xconv.training.names.StaleWeightsError`).

Dropout: the two sides cannot draw the same masks, so dropout is switched off on the torch
copy (``nn.Dropout*.p = 0``, ``nn.MultiheadAttention.dropout = 0``) and the converted model
runs deterministic; the report says so. A model with both dropout and BatchNorm needs the
converted model's train mode (for batch statistics) with its dropout on: that is refused.
"""

from __future__ import annotations

import copy
import html
import importlib.util
import json
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xconv.errors import ConversionError
from xconv.training.names import Leaf, match_leaves, match_recorded
from xconv.training.oracle import Float64Twin, Judge, float64_blocker


@dataclass
class Divergence:
    """Where the two runs first part: the step (1-based), what, which tensor, how much, and
    (for a tensor) the element furthest outside its bound, the bound and why."""

    step: int
    what: str  # "loss", "param", "optimizer_state", "running_stat"
    name: str
    rel_diff: float
    #: The worst element: index, cand, ref (torch), oracle (float64 torch), err, bound.
    element: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    def __str__(self) -> str:
        return f"step {self.step}, {self.what} {self.name}: {self.why or self.rel_diff}"


@dataclass
class TrainingReport:
    """Per-step losses of both runs and how far the trained state ended apart.

    Relative differences are ``max|a - b| / max|b|`` per tensor (torch is ``b``); the loss's
    is ``|a - b| / |b|``. ``excess`` is each tensor's largest error over its bound over all
    steps (above 1 fails), under the policy ``policy`` describes.
    """

    steps: int
    tol: float
    state_tol: float | None
    torch_losses: list[float]
    candidate_losses: list[float]
    loss_rel_diff: list[float]
    params: dict[str, float] = field(default_factory=dict)
    optimizer_state: dict[str, float] = field(default_factory=dict)
    running_stats: dict[str, float] = field(default_factory=dict)
    param_drift: list[float] = field(default_factory=list)  # max over params, per step
    first_divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)
    policy: str = ""
    excess: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def max_loss_rel_diff(self, first: int | None = None) -> float:
        diffs = self.loss_rel_diff[:first] if first else self.loss_rel_diff
        return max(diffs, default=0.0)

    def to_json(self) -> str:
        data = asdict(self)
        data["passed"] = self.passed
        return json.dumps(data, indent=2, sort_keys=True)

    def to_html(self) -> str:
        """A small page: verdict, the two loss curves (inline SVG), the worst tensors."""
        verdict = "passed" if self.passed else f"FAILED: {self.first_divergence}"
        rows = sorted(
            [*self.params.items(), *self.optimizer_state.items(), *self.running_stats.items()],
            key=lambda kv: -kv[1],
        )[:20]
        table = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.3e}</td></tr>" for k, v in rows)
        return (
            "<!doctype html><meta charset='utf-8'><title>xconv training parity</title>"
            f"<h1>Training parity: {html.escape(verdict)}</h1>"
            f"<p>{self.steps} steps; max loss relative difference "
            f"{self.max_loss_rel_diff():.3e} (tolerance {self.tol:g}).</p>"
            f"{_svg(self.torch_losses, self.candidate_losses)}"
            f"<p>{'<br>'.join(html.escape(n) for n in self.notes)}</p>"
            "<table><tr><th>tensor</th><th>relative difference</th></tr>"
            f"{table}</table>"
        )


def _svg(a: Sequence[float], b: Sequence[float], w: int = 640, h: int = 240) -> str:
    vals = [v for v in [*a, *b] if np.isfinite(v)]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0

    def line(ys, color, dash=""):
        n = max(len(ys) - 1, 1)
        pts = " ".join(f"{i * w / n:.1f},{h - (y - lo) / span * h:.1f}" for i, y in enumerate(ys))
        return f"<polyline fill='none' stroke='{color}' {dash} points='{pts}'/>"

    return (
        f"<svg width='{w}' height='{h}' viewBox='0 0 {w} {h}'>"
        + line(a, "#d62728")
        + line(b, "#1f77b4", "stroke-dasharray='4'")
        + "</svg><p>red: torch, blue dashed: converted</p>"
    )


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    diff = float(np.max(np.abs(a - b))) if b.size else 0.0
    return diff / scale if scale > 0 else diff


# ------------------------------------------------------------------ candidates


@dataclass
class _Candidate:
    """The converted model as ``apply(params, others, inputs) -> (output, others)``."""

    apply: Callable
    variables: dict  # full tree the torch state is matched against
    params: dict  # the trainable tree (at ``prefix`` in ``variables``)
    prefix: tuple[str, ...]
    others: dict  # the rest (batch statistics, constants), at the same paths as in variables
    kind: str
    #: Variable path -> the source weight name the conversion recorded (None: no record).
    sources: dict[tuple[str, ...], str] | None = None
    #: What to call the candidate in messages (its folder, or "the candidate's variables").
    origin: str = "the candidate's variables"


def _load_folder(path: Path):
    spec = importlib.util.spec_from_file_location(
        f"xconv_gen_{uuid.uuid4().hex}", path / "model.py"
    )
    if spec is None or spec.loader is None:
        raise ConversionError(f"{path} has no model.py (a torch-to-flax output folder)")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load(path)


def _candidate(candidate, *, batch_norm: bool) -> _Candidate:
    """The candidate as a :class:`_Candidate`, with the name record of its conversion."""
    origin = None
    if isinstance(candidate, (str, Path)):
        origin = f"{Path(candidate)}/"
        candidate = _load_folder(Path(candidate))
    cand = _as_candidate(candidate, batch_norm=batch_norm)
    cand.sources = _recorded_sources(candidate, cand)
    cand.origin = origin or cand.origin
    return cand


def _recorded_sources(candidate, cand: _Candidate) -> dict[tuple[str, ...], str] | None:
    """Variable path -> source weight name, from the conversion's record: ``SOURCE_NAMES``
    (completed by ``SOURCE_SCOPES``) of a generated Flax module, whose paths leave out the
    linen collection; the ``weight_names`` of a ``to_jax`` function, whose params nest each
    weight under its source name. None where the candidate records nothing."""
    from xconv.converters.flax.source_names import recorded_names
    from xconv.training.names import flatten_tree

    paths = list(flatten_tree(cand.variables))
    if cand.kind == "jax":
        names = set(getattr(candidate[0], "weight_names", None) or ())
        got = {p: ".".join(p) for p in paths if ".".join(p) in names}
        return got or None
    module = candidate if cand.kind == "nnx" else candidate[0]
    found = recorded_names(module)
    if found is None:
        return None
    names = found[1]
    skip = 1 if cand.kind == "linen" else 0  # the collection ("params", "batch_stats")
    got = {}
    for p in paths:
        source = names.get("/".join(p[skip:]))
        if source is not None:
            got[p] = source
    return got or None


def _as_candidate(candidate, *, batch_norm: bool) -> _Candidate:
    import jax
    import jax.numpy as jnp

    try:
        from flax import linen, nnx
    except ImportError:  # pragma: no cover - flax is part of the jax extra
        linen = nnx = None
    if nnx is not None and isinstance(candidate, nnx.Module):
        # RNG streams (dropout keys) stay as they are: the run is deterministic.
        graphdef, params, rngs, rest = nnx.split(candidate, nnx.Param, nnx.RngState, ...)
        params_d = jax.tree_util.tree_map(jnp.asarray, params.to_pure_dict())
        rest_d = jax.tree_util.tree_map(jnp.asarray, rest.to_pure_dict())

        def apply_nnx(p, others, inputs):
            ps, rs = nnx.State(params), nnx.State(rest)
            nnx.replace_by_pure_dict(ps, p)
            nnx.replace_by_pure_dict(rs, others)
            model = nnx.merge(graphdef, ps, rngs, rs)
            out = model(*inputs, train=batch_norm)
            return out, nnx.split(model, nnx.Param, nnx.RngState, ...)[3].to_pure_dict()

        return _Candidate(apply_nnx, _merge(params_d, rest_d), params_d, (), rest_d, "nnx")
    if not (isinstance(candidate, tuple) and len(candidate) == 2):
        raise ConversionError(
            "candidate must be a torch-to-flax output folder, (flax_module, variables), an nnx "
            f"module, or (fn, params) from xconv.to_jax; got {type(candidate).__name__}"
        )
    first, tree = candidate
    tree = jax.tree_util.tree_map(jnp.asarray, dict(tree))
    if linen is not None and isinstance(first, linen.Module):
        module = first
        others = {k: v for k, v in tree.items() if k != "params"}
        mutable = ["batch_stats"] if batch_norm and "batch_stats" in others else False

        def apply_linen(p, others, inputs):
            variables = {"params": p, **others}
            if mutable:
                out, upd = module.apply(variables, *inputs, train=True, mutable=mutable)
                return out, {**others, **upd}
            return module.apply(variables, *inputs, train=False), others

        return _Candidate(apply_linen, tree, tree["params"], ("params",), others, "linen")
    if callable(first):
        if batch_norm:
            raise ConversionError(
                "the (fn, params) of xconv.to_jax is the module's eval-mode graph: its "
                "BatchNorm uses running statistics, not batch statistics; check a BatchNorm "
                "model with its torch-to-flax output (folder or (flax_module, variables))"
            )
        fn = first

        def apply_fn(p, others, inputs):
            out = fn(p, *inputs)
            return (out[0] if isinstance(out, tuple) and len(out) == 1 else out), others

        return _Candidate(apply_fn, tree, tree, (), {}, "jax")
    raise ConversionError(f"unsupported candidate {type(first).__name__}")


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ------------------------------------------------------------------ torch side


def _dropout_off(module) -> list[str]:
    from torch import nn

    changed = []
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            changed.append(name)
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            m.dropout = 0.0
            changed.append(name)
    return changed


def _has_batch_norm(module) -> bool:
    from torch import nn

    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _np(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _slot_arrays(opt_state, leaves: dict[str, Leaf], prefix, group_names) -> dict[str, Any]:
    """``{"<param>/<slot>": array in torch layout}`` from the converted optimizer state."""
    import jax
    import optax

    from xconv.training.transforms import TorchState

    out: dict[str, Any] = {}
    found = []
    jax.tree_util.tree_map(
        lambda s: found.append(s) if isinstance(s, optax.MultiTransformState) else None,
        opt_state,
        is_leaf=lambda s: isinstance(s, optax.MultiTransformState),
    )
    for part in found:
        for label, masked in part.inner_states.items():
            inner = getattr(masked, "inner_state", masked)
            if not isinstance(inner, TorchState) or not label.startswith("group_"):
                continue
            gi = int(label.split("_")[1])
            for name in group_names[gi]:
                leaf = leaves[name]
                for slot, tree in inner.slots.items():
                    node = tree
                    for key in leaf.path[len(prefix) :]:
                        node = node[key]
                    arr = np.asarray(node)
                    out[f"{name}/{slot}"] = arr if arr.ndim == 0 else leaf.to_torch(arr)
                out[f"{name}/step"] = np.asarray(inner.count)
    return out


def make_train_step(apply: Callable, tx, loss: Callable) -> Callable:
    """The jitted ``(params, others, opt_state, inputs, target) -> (params, others, opt_state,
    loss)`` of a converted model: forward (``apply(params, others, inputs) -> (output,
    others)``), loss, gradient, optimizer update."""
    import jax
    import optax

    def train_step(params, others, opt_state, inputs, target):
        def objective(p):
            out, new_others = apply(p, others, inputs)
            return loss(out, target), new_others

        (value, new_others), grads = jax.value_and_grad(objective, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_others, opt_state, value

    return jax.jit(train_step)


def check_training(
    torch_module,
    optimizer,
    loss_fn,
    candidate,
    batches: Iterable[tuple[Any, Any]],
    *,
    steps: int | None = None,
    scheduler=None,
    tol: float = 1e-4,
    state_tol: float | None = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    channel_axis: int = 1,
) -> TrainingReport:
    """Train the torch module and its conversion side by side and compare them.

    Args:
        torch_module: The source module (trained as a deep copy, with its optimizer and
            scheduler: the caller's objects are left untouched).
        optimizer: Its ``torch.optim`` optimizer (fresh or mid-run).
        loss_fn: A ``torch.nn`` loss module (see :mod:`xconv.training.losses`), called as
            ``loss_fn(output, target)``.
        candidate: The converted model holding the module's current weights: a
            ``torch-to-flax`` output folder, ``(flax_module, variables)``, an nnx module, or
            ``(fn, params)`` from ``xconv.to_jax``.
        batches: ``(inputs, target)`` pairs (torch tensors or numpy arrays; ``inputs`` a tensor
            or a tuple); cycled when ``steps`` is longer.
        steps: Number of optimizer steps (default: one per batch).
        scheduler: The optimizer's LR scheduler, stepped after each optimizer step.
        tol: Largest relative loss difference allowed at any step.
        state_tol: None (default): parameters, optimizer slots and running statistics are
            judged after every step, element by element, against a float64 run of the torch
            module (the parity oracle policy, :mod:`xconv.training.oracle`). A number: judged
            against torch's float32 run instead, ``|a - b| <= state_tol * max|b|`` per tensor
            (also the rule, at 1e-3, when the float64 run cannot be made: a float64 module,
            a forward that pins float32).
        clip_grad_norm: torch's ``clip_grad_norm_(params, max_norm)`` before each step.
        clip_grad_value: torch's ``clip_grad_value_(params, v)`` before each step.
        channel_axis: Class axis of the converted model's output (-1 for NHWC outputs).

    Returns:
        A :class:`TrainingReport`; ``report.passed`` is False at the first loss or tensor past
        its bound, named in ``report.first_divergence`` (step, tensor, element, bound, why).

    Raises:
        StaleWeightsError: the candidate holds other weights than the module (converted
            before the module trained on, or from another module): re-run the conversion.
    """
    import torch

    from xconv.training.losses import from_torch_loss

    batches, steps = _batches_and_steps(batches, steps)
    module, opt, sched = copy.deepcopy((torch_module, optimizer, scheduler))
    module.train()
    batch_norm = _has_batch_norm(module)
    notes = _train_mode_notes(module, batch_norm)

    cand = _candidate(candidate, batch_norm=batch_norm)
    leaves, spec, tx, opt_state = _optimizer_side(
        module, opt, sched, cand, clip_grad_norm, clip_grad_value
    )
    params, prefix = cand.params, cand.prefix
    jloss = from_torch_loss(loss_fn, channel_axis=channel_axis)
    twin, judge = _oracle(module, opt, sched, loss_fn, state_tol, notes)

    train_step = make_train_step(cand.apply, tx, jloss)
    others = cand.others
    report = TrainingReport(steps, tol, state_tol, [], [], [], notes=notes)
    clip = (clip_grad_norm, clip_grad_value)
    for i in range(steps):
        inputs, target = batches[i % len(batches)]
        t_inputs = tuple(torch.as_tensor(x) for x in _as_tuple(inputs))
        t_target = torch.as_tensor(target)
        loss = _torch_step(module, opt, sched, loss_fn, t_inputs, t_target, *clip)
        twin = _twin_step(twin, t_inputs, t_target, clip, notes, judge)
        j_inputs = tuple(_np(x) for x in t_inputs)
        params, others, opt_state, jl = train_step(
            params, others, opt_state, j_inputs, _np(t_target)
        )
        _record_step(report, i + 1, float(loss.item()), float(jl))
        got = _candidate_tensors(module, leaves, params, prefix, others, opt_state, spec)
        oracle = None if twin is None else _torch_tensors(twin.module, twin.opt, leaves)
        _judge_step(report, judge, i + 1, got, _torch_tensors(module, opt, leaves), oracle)
    report.policy = judge.describe()
    report.excess = dict(judge.excess)
    return report


def _oracle(module, opt, sched, loss_fn, state_tol, notes) -> tuple[Float64Twin | None, Judge]:
    """The float64 twin of the torch run and the oracle policy, or (None, the explicit
    ``state_tol`` rule) where the user set one or no twin can be made."""
    from xconv.parity.policies import Policy

    if state_tol is not None:
        notes.append(f"tensors judged at state_tol={state_tol:g} (max|a-b| / max|b| per tensor)")
        return None, Judge(None, state_tol)
    blocker = float64_blocker(module)
    if blocker is not None:
        notes.append(f"no float64 oracle ({blocker}): tensors judged at state_tol=1e-3")
        return None, Judge(None, 1e-3)
    return Float64Twin(module, opt, sched, loss_fn), Judge(Policy(), 1e-3)


def _twin_step(twin, t_inputs, t_target, clip, notes, judge) -> Float64Twin | None:
    """One step of the float64 twin; a twin that cannot run (a forward that pins float32) is
    dropped at its first step, with a note, and the judge falls back to ``state_tol``."""
    if twin is None:
        return None
    try:
        inputs = tuple(Float64Twin.cast(x) for x in t_inputs)
        _torch_step(twin.module, twin.opt, twin.sched, twin.loss_fn, inputs,
                    Float64Twin.cast(t_target), *clip)  # fmt: skip
    except (RuntimeError, TypeError, ValueError) as e:
        notes.append(
            f"no float64 oracle (the float64 copy of the torch run failed: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}): tensors judged at "
            "state_tol=1e-3 per tensor"
        )
        judge.policy = None
        return None
    return twin


def _batches_and_steps(batches: Iterable[tuple[Any, Any]], steps: int | None):
    """The batches as a list and the number of steps (default: one per batch), both checked."""
    batches = list(batches)
    if not batches:
        raise ConversionError("check_training needs at least one (inputs, target) batch")
    steps = len(batches) if steps is None else int(steps)
    if steps < 1:
        raise ConversionError(f"steps must be >= 1, got {steps}")
    return batches, steps


def _optimizer_side(module, opt, sched, cand, clip_grad_norm, clip_grad_value):
    """The candidate's leaf for each torch state entry, the optimizer's spec, and the optax
    transform with its state converted from ``opt``'s."""
    from xconv.training.optimizers import from_torch_optimizer, read_optimizer

    state_entries = {
        k: v for k, v in module.state_dict().items() if not k.endswith("num_batches_tracked")
    }
    if cand.sources:
        leaves = match_recorded(state_entries, cand.variables, cand.sources, what=cand.origin)
    else:
        leaves = match_leaves(state_entries, cand.variables, what=cand.origin)
    spec = read_optimizer(opt, module)
    tx, opt_state = from_torch_optimizer(
        opt,
        cand.variables if cand.prefix else cand.params,
        scheduler=sched,
        model=module,
        clip_grad_norm=clip_grad_norm,
        clip_grad_value=clip_grad_value,
    )
    return leaves, spec, tx, opt_state


def _record_step(report: TrainingReport, step: int, tl: float, cl: float) -> None:
    """Record step ``step``'s torch and candidate losses and their relative difference."""
    report.torch_losses.append(tl)
    report.candidate_losses.append(cl)
    d = abs(cl - tl) / abs(tl) if tl != 0 else abs(cl - tl)
    report.loss_rel_diff.append(d if np.isfinite(d) else float("inf"))
    if report.first_divergence is None and not d <= report.tol:
        why = (
            f"torch {tl:.7g}, candidate {cl:.7g}: relative difference {d:.3g} > tol {report.tol:g}"
        )
        report.first_divergence = Divergence(step, "loss", "loss", d, why=why)


def _train_mode_notes(module, batch_norm: bool) -> list[str]:
    """Switch the torch copy's dropout off (refused beside BatchNorm) and say how both sides
    train."""
    notes = []
    dropped = _dropout_off(module)
    if dropped:
        if batch_norm:
            raise ConversionError(
                f"the module has dropout ({', '.join(dropped[:5])}) and BatchNorm: the converted "
                "model's train mode (batch statistics) would also draw dropout masks torch "
                "cannot share; set the dropout rates to 0 to check training"
            )
        notes.append(
            f"dropout off on both sides (torch copy: {', '.join(dropped)} set to p=0; the "
            "converted model runs deterministic)"
        )
    else:
        notes.append("no dropout modules (functional dropout in forward code is not switched off)")
    if batch_norm:
        notes.append("BatchNorm in train mode on both sides (batch statistics, running stats)")
    return notes


def _torch_step(module, opt, sched, loss_fn, t_inputs, t_target, clip_grad_norm, clip_grad_value):
    """One torch training step (clipping, optimizer, scheduler); the loss tensor."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss = loss_fn(module(*t_inputs), t_target)
    loss.backward()
    if clip_grad_value is not None:
        torch.nn.utils.clip_grad_value_(module.parameters(), clip_grad_value)
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad_norm)
    opt.step()
    if sched is not None:
        with warnings.catch_warnings():
            # The deep copy re-wraps optimizer.step, which torch mistakes for a misuse.
            warnings.filterwarnings("ignore", message=".*optimizer.step\\(\\)")
            sched.step()
    return loss


_WHATS = {"param": "params", "optimizer_state": "optimizer_state", "running_stat": "running_stats"}


def _torch_tensors(module, opt, leaves) -> dict[str, dict[str, np.ndarray]]:
    """A torch run's parameters, optimizer slots (``param/slot``; ``param/step`` as an
    integer) and the running statistics the candidate holds, by kind."""
    params = dict(module.named_parameters())
    slots: dict[str, np.ndarray] = {}
    for name, p in params.items():
        for slot, v in opt.state.get(p, {}).items():
            if hasattr(v, "detach"):
                arr = _np(v)
                slots[f"{name}/{slot}"] = arr.astype(np.int64) if slot == "step" else arr
    stats = {
        name: _np(t)
        for name, t in module.state_dict().items()
        if name not in params and name in leaves
    }
    return {
        "param": {n: _np(t) for n, t in params.items()},
        "optimizer_state": slots,
        "running_stat": stats,
    }


def _candidate_tensors(module, leaves, params, prefix, others, opt_state, spec):
    """The candidate's parameters, optimizer slots and running statistics, in torch layout
    under torch's names (:func:`_torch_tensors`)."""
    flat, flat_others = _flat(params), _flat(others)
    slots = _slot_arrays(opt_state, leaves, prefix, spec.group_names)
    for key in [k for k in slots if k.endswith("/step")]:
        slots[key] = np.asarray(slots[key]).astype(np.int64)
    names = [n for n, _ in module.named_parameters()]
    stats = {}
    for name, leaf in leaves.items():
        got = flat_others.get(leaf.path)
        if name not in names and got is not None:
            stats[name] = leaf.to_torch(got)
    return {
        "param": {n: leaves[n].to_torch(flat[leaves[n].path[len(prefix) :]]) for n in names},
        "optimizer_state": slots,
        "running_stat": stats,
    }


def _judge_step(report: TrainingReport, judge: Judge, step: int, cand, ref, oracle) -> None:
    """Judge every tensor after step ``step``; record the relative differences (the report
    keeps the last step's) and the first divergence (the worst tensor of the first kind that
    fails)."""
    for what, attr in _WHATS.items():
        table: dict[str, float] = {}
        failed = []
        for key, got in cand[what].items():
            want = ref[what].get(key)
            if want is None:
                continue
            truth = None if oracle is None else oracle[what].get(key)
            m = judge.judge(key, got, want, truth)
            table[key] = _rel(got, want)
            if not m.passed:
                failed.append(m)
        setattr(report, attr, table)
        if what == "param":
            report.param_drift.append(max(table.values(), default=0.0))
        if failed and report.first_divergence is None:
            worst = max(failed, key=lambda m: m.severity)
            report.first_divergence = Divergence(
                step, what, worst.name, table[worst.name], judge.element(worst), judge.why(worst)
            )


def _flat(tree) -> dict[tuple[str, ...], Any]:
    from xconv.training.names import flatten_tree

    return {k: np.asarray(v) for k, v in flatten_tree(tree).items()}


__all__ = ["Divergence", "TrainingReport", "check_training"]
