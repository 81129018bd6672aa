"""Training parity: N optimizer steps of a torch run and of its conversion, side by side.

:func:`check_training` trains a copy of the torch module with its optimizer (and scheduler,
clipping) and the converted model with :func:`~xconv.training.from_torch_optimizer` /
:func:`~xconv.training.from_torch_loss`, on the same batches, and compares after every step:
the loss, each parameter, and at the end the optimizer state and the BatchNorm running
statistics. The report names the first step and the first tensor that part.

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
from xconv.training.names import Leaf, match_leaves


@dataclass
class Divergence:
    """Where the two runs first part: the step (1-based), what, which tensor, how much."""

    step: int
    what: str  # "loss", "param", "optimizer_state", "running_stat"
    name: str
    rel_diff: float


@dataclass
class TrainingReport:
    """Per-step losses of both runs and how far the trained state ended apart.

    Relative differences are ``max|a - b| / max|b|`` per tensor (torch is ``b``); the loss's
    is ``|a - b| / |b|``.
    """

    steps: int
    tol: float
    state_tol: float
    torch_losses: list[float]
    candidate_losses: list[float]
    loss_rel_diff: list[float]
    params: dict[str, float] = field(default_factory=dict)
    optimizer_state: dict[str, float] = field(default_factory=dict)
    running_stats: dict[str, float] = field(default_factory=dict)
    param_drift: list[float] = field(default_factory=list)  # max over params, per step
    first_divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)

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
    import jax
    import jax.numpy as jnp

    if isinstance(candidate, (str, Path)):
        candidate = _load_folder(Path(candidate))
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
    state_tol: float = 1e-3,
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
        state_tol: Largest relative difference (per tensor, ``max|a-b| / max|b|``) allowed for
            the parameters after each step, and the optimizer state and running statistics at
            the end.
        clip_grad_norm: torch's ``clip_grad_norm_(params, max_norm)`` before each step.
        clip_grad_value: torch's ``clip_grad_value_(params, v)`` before each step.
        channel_axis: Class axis of the converted model's output (-1 for NHWC outputs).

    Returns:
        A :class:`TrainingReport`; ``report.passed`` is False at the first loss or tensor past
        its tolerance, named in ``report.first_divergence``.
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
    param_names = {n for n, _ in module.named_parameters()}

    train_step = make_train_step(cand.apply, tx, jloss)
    others = cand.others
    report = TrainingReport(steps, tol, state_tol, [], [], [], notes=notes)
    for i in range(steps):
        inputs, target = batches[i % len(batches)]
        t_inputs = tuple(torch.as_tensor(x) for x in _as_tuple(inputs))
        t_target = torch.as_tensor(target)
        loss = _torch_step(
            module, opt, sched, loss_fn, t_inputs, t_target, clip_grad_norm, clip_grad_value
        )
        j_inputs = tuple(_np(x) for x in t_inputs)
        params, others, opt_state, jl = train_step(
            params, others, opt_state, j_inputs, _np(t_target)
        )
        _record_step(report, i + 1, float(loss.item()), float(jl))
        _record_params(report, i + 1, _param_diffs(module, leaves, params, prefix))

    # End state: optimizer buffers and running statistics.
    report.optimizer_state = _optimizer_state_diffs(
        opt, opt_state, module, leaves, prefix, spec.group_names
    )
    report.running_stats = _running_stat_diffs(module, others, leaves, param_names)
    for what, table in (("optimizer_state", report.optimizer_state),
                        ("running_stat", report.running_stats)):  # fmt: skip
        _diverged(report, steps, what, table, state_tol)
    return report


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
    leaves = match_leaves(state_entries, cand.variables, what="the candidate's variables")
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


def _diverged(
    report: TrainingReport, step: int, what: str, table: dict[str, float], tol: float
) -> None:
    """Name the first entry of ``table`` past ``tol`` as the first divergence, unless one is
    already named."""
    if report.first_divergence is None:
        bad = [(k, v) for k, v in table.items() if not v <= tol]
        if bad:
            report.first_divergence = Divergence(step, what, bad[0][0], bad[0][1])


def _record_step(report: TrainingReport, step: int, tl: float, cl: float) -> None:
    """Record step ``step``'s torch and candidate losses and their relative difference."""
    report.torch_losses.append(tl)
    report.candidate_losses.append(cl)
    d = abs(cl - tl) / abs(tl) if tl != 0 else abs(cl - tl)
    report.loss_rel_diff.append(d if np.isfinite(d) else float("inf"))
    if report.first_divergence is None and not d <= report.tol:
        report.first_divergence = Divergence(step, "loss", "loss", d)


def _record_params(report: TrainingReport, step: int, step_params: dict[str, float]) -> None:
    """Record step ``step``'s parameter differences (the report keeps the last step's)."""
    report.param_drift.append(max(step_params.values(), default=0.0))
    _diverged(report, step, "param", step_params, report.state_tol)
    report.params = step_params


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


def _param_diffs(module, leaves, params, prefix) -> dict[str, float]:
    """Each torch parameter's relative difference from its converted leaf in ``params``."""
    flat = _flat(params)
    step_params = {}
    for name, t in module.named_parameters():
        leaf = leaves[name]
        step_params[name] = _rel(leaf.to_torch(flat[leaf.path[len(prefix) :]]), _np(t))
    return step_params


def _optimizer_state_diffs(opt, opt_state, module, leaves, prefix, group_names):
    """Each optimizer slot (``param/slot``) against torch's: relative difference (absolute
    for the step count)."""
    slots = _slot_arrays(opt_state, leaves, prefix, group_names)
    opt_diffs = {}
    by_param = dict(module.named_parameters())
    for key, got in slots.items():
        name, _, slot = key.rpartition("/")
        st = opt.state.get(by_param[name], {})
        if slot == "step":
            if "step" in st:
                opt_diffs[key] = abs(float(got) - float(st["step"]))
            continue
        if st.get(slot) is not None:
            opt_diffs[key] = _rel(got, _np(st[slot]))
    return opt_diffs


def _running_stat_diffs(module, others, leaves, param_names) -> dict[str, float]:
    """Each non-parameter state entry (running statistics) against its converted leaf."""
    stats = {}
    flat_others = _flat(others)
    for name, t in module.state_dict().items():
        if name in param_names or name not in leaves:
            continue
        got = flat_others.get(leaves[name].path)
        if got is not None:
            stats[name] = _rel(leaves[name].to_torch(got), _np(t))
    return stats


def _flat(tree) -> dict[tuple[str, ...], Any]:
    from xconv.training.names import flatten_tree

    return {k: np.asarray(v) for k, v in flatten_tree(tree).items()}


__all__ = ["Divergence", "TrainingReport", "check_training"]
