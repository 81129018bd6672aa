"""``torch.optim.lr_scheduler`` schedulers as optax schedules.

A schedule here is a function of the scheduler's epoch counter (``last_epoch``): the
optimizer step taken while the scheduler stands at epoch ``e`` uses ``schedule(e)``, as
torch's ``optimizer.step(); scheduler.step()`` loop does. The converted optimizer state
carries the counter (:class:`~xconv.training.transforms.TorchState` ``lr_step``), so a run
converted mid-way continues from the scheduler's current step. Each scheduler is written in
its closed form (torch's recursive ``get_lr`` equals it up to rounding; the tests compare both
over three times the schedule's length). The counter advances once per optimizer step: a
scheduler stepped once per epoch needs its counts (``T_max``, ``step_size``) in steps.
``OneCycleLR(cycle_momentum=True)`` also anneals the momentum (``betas[0]`` or ``momentum``);
:func:`momentum_for` gives that schedule, which the converted optimizer reads each step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from xconv.errors import UnsupportedAttributeError

Schedule = Callable[[Any], Any]

SUPPORTED = (
    "StepLR",
    "MultiStepLR",
    "ExponentialLR",
    "CosineAnnealingLR",
    "LinearLR",
    "ConstantLR",
    "OneCycleLR",
    "PolynomialLR",
    "SequentialLR",
)


def _f(e):
    return jnp.asarray(e).astype(jnp.result_type(float))


def _step_lr(s, base) -> Schedule:
    return lambda e: base * s.gamma ** (jnp.asarray(e) // s.step_size).astype(_f(e).dtype)


def _multistep_lr(s, base) -> Schedule:
    milestones = sorted(s.milestones.elements())

    def fn(e):
        n = sum((jnp.asarray(e) >= m).astype(_f(e).dtype) for m in milestones)
        return base * s.gamma**n

    return fn


def _exponential_lr(s, base) -> Schedule:
    return lambda e: base * s.gamma ** _f(e)


def _cosine_lr(s, base) -> Schedule:
    def fn(e):
        return s.eta_min + (base - s.eta_min) * (1 + jnp.cos(math.pi * _f(e) / s.T_max)) / 2

    return fn


def _linear_lr(s, base) -> Schedule:
    def fn(e):
        t = jnp.minimum(_f(e), s.total_iters)
        return base * (s.start_factor + (s.end_factor - s.start_factor) * t / s.total_iters)

    return fn


def _constant_lr(s, base) -> Schedule:
    return lambda e: jnp.where(jnp.asarray(e) < s.total_iters, base * s.factor, base)


def _polynomial_lr(s, base) -> Schedule:
    def fn(e):
        return base * (1.0 - jnp.minimum(_f(e), s.total_iters) / s.total_iters) ** s.power

    return fn


def _one_cycle(s, group: int, start_key: str, end_key: str) -> Schedule:
    """OneCycleLR's annealing between the param group's ``phase[start_key]`` and
    ``phase[end_key]`` values (``start_lr`` / ``end_lr``, or the momentum pair)."""
    g = s.optimizer.param_groups[group]
    cos = s._anneal_func_type == "cos"

    def anneal(start, end, pct):
        if cos:
            return end + (start - end) / 2.0 * (jnp.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    bounds, start_step = [], 0.0
    for p in s._schedule_phases:
        bounds.append((start_step, p["end_step"], g[p[start_key]], g[p[end_key]]))
        start_step = p["end_step"]

    def fn(e):
        # torch takes the first phase whose end the step has not passed; the last phase
        # takes every step past the others.
        e = _f(e)
        start, end, lo, hi = bounds[-1]
        out = anneal(lo, hi, (e - start) / (end - start))
        for start, end, lo, hi in reversed(bounds[:-1]):
            out = jnp.where(e <= end, anneal(lo, hi, (e - start) / (end - start)), out)
        return out

    return fn


def _one_cycle_lr(s, group: int) -> Schedule:
    return _one_cycle(s, group, "start_lr", "end_lr")


def momentum_for(scheduler: Any, group: int = 0) -> tuple[str, Schedule] | None:
    """The momentum a scheduler sets on param group ``group`` each step, as ``(key,
    schedule)``: ``OneCycleLR(cycle_momentum=True)`` anneals ``betas[0]`` (``key`` "betas",
    optimizers with betas) or ``momentum`` (SGD, RMSprop) between ``max_momentum`` and
    ``base_momentum``, in step with the learning rate. None for a scheduler that leaves the
    momentum alone (also the children of a ``SequentialLR`` other than OneCycleLR)."""
    kind = type(scheduler).__name__
    if kind == "SequentialLR":
        if any(momentum_for(sub, group) for sub in scheduler._schedulers):
            raise UnsupportedAttributeError(
                "a OneCycleLR(cycle_momentum=True) inside a SequentialLR sets the momentum only "
                "while it runs; use cycle_momentum=False there"
            )
        return None
    if kind != "OneCycleLR" or not scheduler.cycle_momentum:
        return None
    key = "betas" if scheduler.use_beta1 else "momentum"
    return key, _one_cycle(scheduler, group, "start_momentum", "end_momentum")


def _sequential_lr(s, base, group: int) -> Schedule:
    subs = [schedule_for(sub, group, base=base) for sub in s._schedulers]
    milestones = list(s._milestones)

    def fn(e):
        e = jnp.asarray(e)
        out = subs[-1](e - milestones[-1])
        for i in range(len(milestones) - 1, -1, -1):
            start = milestones[i - 1] if i > 0 else 0
            out = jnp.where(e < milestones[i], subs[i](e - start), out)
        return out

    return fn


_SIMPLE = {
    "StepLR": _step_lr,
    "MultiStepLR": _multistep_lr,
    "ExponentialLR": _exponential_lr,
    "CosineAnnealingLR": _cosine_lr,
    "LinearLR": _linear_lr,
    "ConstantLR": _constant_lr,
    "PolynomialLR": _polynomial_lr,
}


def schedule_for(scheduler: Any, group: int = 0, *, base: float | None = None) -> Schedule:
    """The learning rate of param group ``group`` as a function of the scheduler's epoch.

    Raises:
        UnsupportedAttributeError: a scheduler optax cannot follow exactly (``LambdaLR`` and
            ``MultiplicativeLR`` run arbitrary Python each step; ``ReduceLROnPlateau`` reads
            the validation metric), naming it and listing the supported ones.
    """
    kind = type(scheduler).__name__
    if kind in ("LambdaLR", "MultiplicativeLR"):
        lambdas = getattr(scheduler, "lr_lambdas", [])
        fn = lambdas[group] if group < len(lambdas) else None
        name = getattr(fn, "__qualname__", repr(fn))
        raise UnsupportedAttributeError(
            f"{kind} runs the Python function {name!r} every step, which has no exact optax "
            f"form; rewrite it with one of {', '.join(SUPPORTED)} (or pass an optax schedule "
            "yourself)."
        )
    if kind == "OneCycleLR":
        return _one_cycle_lr(scheduler, group)
    if base is None:
        bases = getattr(scheduler, "base_lrs", None)
        base = bases[group] if bases else scheduler.optimizer.param_groups[group]["initial_lr"]
    if kind == "SequentialLR":
        return _sequential_lr(scheduler, base, group)
    if kind in _SIMPLE:
        return _SIMPLE[kind](scheduler, base)
    raise UnsupportedAttributeError(
        f"learning-rate scheduler {kind} has no optax conversion; supported: "
        f"{', '.join(SUPPORTED)}."
    )
