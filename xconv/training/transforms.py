"""optax transforms that follow ``torch.optim`` step for step.

optax's built-ins differ from torch in small ways that add up over a training run: Adam's
epsilon and bias correction (``optax.adam`` corrects the moments, torch the step size and the
square root), AdamW's decay (torch multiplies ``lr * weight_decay``), RMSprop's epsilon (optax
adds it inside the square root), NAdam's momentum decay schedule, RAdam's rectification
threshold (torch: ``rho_t > 5``), Adagrad's initial accumulator and ``lr_decay``, SGD's first
momentum step (torch copies the gradient, no dampening). Each transform here writes torch's
single-tensor update (``torch/optim/<name>.py``, ``_single_tensor_<name>``) once, in the
order torch does it (``lerp`` included), so a converted run continues torch's own curve.

A transform returns the whole parameter change, learning rate included (like
``optax.adam``): apply it with ``optax.apply_updates``. Its state is :class:`TorchState`:
``count`` is torch's per-parameter ``step``, ``lr_step`` the learning-rate scheduler's
``last_epoch`` (the schedule is called with it), ``slots`` torch's per-parameter buffers by
their torch names (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...), each a tree like
the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[jax.Array], jax.Array]


class TorchState(NamedTuple):
    """State of one torch-exact transform (one torch param group)."""

    count: jax.Array  # torch's per-parameter ``step`` (int32 scalar)
    lr_step: jax.Array  # the scheduler's ``last_epoch`` (int32 scalar)
    slots: dict[str, Any]  # torch buffer name -> tree like the parameters


def _lerp(start, end, weight):
    """``torch.lerp`` (its two-branch formula, so float32 rounding matches)."""
    diff = end - start
    return jnp.where(abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


def _one_minus_pow(b, step):
    """``1 - b**step``, the bias correction torch takes in Python's float64: as
    ``-expm1(step * log b)`` with ``log b`` in float64 where ``b`` is a Python number. In
    float32, ``1 - b**step`` cancels: with ``b = 0.999`` (float32 0.99900001) it is 1.3e-5 off
    at step 1, which moves each Adam step by 6e-6 of itself."""
    if isinstance(b, int | float) and 0 < b < 1:
        return -jnp.expm1(step * math.log(b))
    return 1 - b**step


def _lr(learning_rate: float | Schedule, lr_step: jax.Array):
    return learning_rate(lr_step) if callable(learning_rate) else learning_rate


# Each leaf rule: (hp, g, p, slots, step, lr) -> (new_param, slots). ``step`` is torch's step
# after its increment, as a float of the parameter's dtype.


def _sgd(hp, g, p, s, step, lr):
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    if "momentum_buffer" in s:  # momentum > 0 (it may follow a OneCycleLR schedule)
        # torch's first step copies the gradient into the buffer (no dampening).
        first = step <= 1
        buf = jnp.where(first, g, hp["momentum"] * s["momentum_buffer"] + (1 - hp["dampening"]) * g)
        s = {"momentum_buffer": buf}
        g = g + hp["momentum"] * buf if hp["nesterov"] else buf
    return p - lr * g, s


def _decay(hp, g, p, lr):
    """Weight decay as torch applies it: decoupled (AdamW-style, on the parameter) or L2
    (added to the gradient)."""
    if hp["weight_decay"]:
        if hp["decoupled"]:
            p = p * (1 - lr * hp["weight_decay"])
        else:
            g = g + hp["weight_decay"] * p
    return g, p


def _adam(hp, g, p, s, step, lr):
    b1, b2 = hp["betas"]
    g, p = _decay(hp, g, p, lr)
    m = _lerp(s["exp_avg"], g, 1 - b1)
    v = s["exp_avg_sq"] * b2 + (1 - b2) * g * g
    out = {"exp_avg": m, "exp_avg_sq": v}
    bc1 = _one_minus_pow(b1, step)
    bc2_sqrt = jnp.sqrt(_one_minus_pow(b2, step))
    if hp["amsgrad"]:
        vmax = jnp.maximum(s["max_exp_avg_sq"], v)
        out["max_exp_avg_sq"] = vmax
        denom = jnp.sqrt(vmax) / bc2_sqrt + hp["eps"]
    else:
        denom = jnp.sqrt(v) / bc2_sqrt + hp["eps"]
    return p - (lr / bc1) * (m / denom), out


def _adamax(hp, g, p, s, step, lr):
    b1, b2 = hp["betas"]
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    m = _lerp(s["exp_avg"], g, 1 - b1)
    u = jnp.maximum(s["exp_inf"] * b2, jnp.abs(g) + hp["eps"])
    clr = lr / _one_minus_pow(b1, step)
    return p - clr * (m / u), {"exp_avg": m, "exp_inf": u}


def _rmsprop(hp, g, p, s, step, lr):
    alpha = hp["alpha"]
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    sq = s["square_avg"] * alpha + (1 - alpha) * g * g
    out = {"square_avg": sq}
    if hp["centered"]:
        ga = _lerp(s["grad_avg"], g, 1 - alpha)
        out["grad_avg"] = ga
        avg = jnp.sqrt(sq - ga * ga)
    else:
        avg = jnp.sqrt(sq)
    avg = avg + hp["eps"]  # torch adds eps outside the square root
    if "momentum_buffer" in s:
        buf = s["momentum_buffer"] * hp["momentum"] + g / avg
        out["momentum_buffer"] = buf
        return p - lr * buf, out
    return p - lr * (g / avg), out


def _adagrad(hp, g, p, s, step, lr):
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    clr = lr / (1 + (step - 1) * hp["lr_decay"])
    acc = s["sum"] + g * g
    std = jnp.sqrt(acc) + hp["eps"]
    return p - clr * (g / std), {"sum": acc}


def _nadam(hp, g, p, s, step, lr):
    b1, b2 = hp["betas"]
    bc2 = _one_minus_pow(b2, step)
    g, p = _decay(hp, g, p, lr)
    mu = b1 * (1.0 - 0.5 * (0.96 ** (step * hp["momentum_decay"])))
    mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * hp["momentum_decay"])))
    # torch keeps mu_product as a float32 scalar tensor (its default scalar dtype), and reads
    # it back as a Python float.
    mp_dtype = s["mu_product"].dtype
    mu_product = (s["mu_product"] * jnp.asarray(mu, mp_dtype)).astype(mp_dtype)
    mp = mu_product.astype(p.dtype)
    m = _lerp(s["exp_avg"], g, 1 - b1)
    v = s["exp_avg_sq"] * b2 + (1 - b2) * g * g
    denom = jnp.sqrt(v / bc2) + hp["eps"]
    mu_product_next = mp * mu_next
    p = p + (-lr * (1.0 - mu) / (1.0 - mp)) * (g / denom)
    p = p + ((-lr * mu_next) / (1.0 - mu_product_next)) * (m / denom)
    return p, {"exp_avg": m, "exp_avg_sq": v, "mu_product": mu_product}


def _radam(hp, g, p, s, step, lr):
    b1, b2 = hp["betas"]
    g, p = _decay(hp, g, p, lr)
    m = _lerp(s["exp_avg"], g, 1 - b1)
    v = s["exp_avg_sq"] * b2 + (1 - b2) * g * g
    bc1 = _one_minus_pow(b1, step)
    bc2 = _one_minus_pow(b2, step)
    corrected = m / bc1
    rho_inf = 2 / (1 - b2) - 1
    rho_t = _rho_t(b2, step)
    # torch's threshold: rectify only when rho_t > 5 (the variance is tractable).
    safe_rho = jnp.where(rho_t > 5.0, rho_t, 10.0)
    rect = (
        (safe_rho - 4) * (safe_rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * safe_rho)
    ) ** 0.5
    adaptive = (bc2**0.5) / (jnp.sqrt(v) + hp["eps"])
    rectified = corrected * lr * adaptive * rect
    new_p = jnp.where(rho_t > 5.0, p - rectified, p - corrected * lr)
    return new_p, {"exp_avg": m, "exp_avg_sq": v}


_RHO_TABLE = 4096


def _rho_t(b2: float, step):
    """RAdam's ``rho_t``: a difference of two numbers near ``rho_inf`` (~2000), which torch
    takes in Python double. In float32 it would lose ~1e-4 absolute right where ``rho_t``
    crosses 5, so the first steps come from a float64 table, rounded once."""
    import numpy as np

    t = np.arange(_RHO_TABLE, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        table = (2 / (1 - b2) - 1) - 2 * t * b2**t / (1 - b2**t)
    table[0] = 0.0
    formula = (2 / (1 - b2) - 1) - 2 * step * (b2**step) / (1 - b2**step)
    idx = jnp.clip(step.astype(jnp.int32), 0, _RHO_TABLE - 1)
    return jnp.where(step < _RHO_TABLE, jnp.asarray(table, step.dtype)[idx], formula)


#: torch optimizer -> (leaf rule, {slot name: initial value or None for zeros}) given hp.
RULES: dict[str, Callable] = {
    "sgd": _sgd,
    "adam": _adam,
    "adamax": _adamax,
    "rmsprop": _rmsprop,
    "adagrad": _adagrad,
    "nadam": _nadam,
    "radam": _radam,
}


def slot_names(kind: str, hp: Mapping[str, Any]) -> dict[str, str]:
    """``{torch buffer name: how it starts}`` (``zeros``, ``scalar_one``, ``initial_acc``)."""
    if kind == "sgd":
        return {"momentum_buffer": "zeros"} if hp["momentum"] else {}
    if kind == "adam":
        out = {"exp_avg": "zeros", "exp_avg_sq": "zeros"}
        if hp["amsgrad"]:
            out["max_exp_avg_sq"] = "zeros"
        return out
    if kind == "adamax":
        return {"exp_avg": "zeros", "exp_inf": "zeros"}
    if kind == "rmsprop":
        out = {"square_avg": "zeros"}
        if hp["momentum"] > 0:
            out["momentum_buffer"] = "zeros"
        if hp["centered"]:
            out["grad_avg"] = "zeros"
        return out
    if kind == "adagrad":
        return {"sum": "initial_acc"}
    if kind == "nadam":
        return {"exp_avg": "zeros", "exp_avg_sq": "zeros", "mu_product": "scalar_one"}
    if kind == "radam":
        return {"exp_avg": "zeros", "exp_avg_sq": "zeros"}
    raise KeyError(kind)


def _init_slot(how: str, p, hp):
    if how == "scalar_one":  # NAdam's mu_product: a float32 scalar in torch
        return jnp.ones((), jnp.float32)
    if how == "initial_acc":
        return jnp.full_like(p, hp["initial_accumulator_value"])
    return jnp.zeros_like(p)


def torch_transform(
    kind: str,
    hp: Mapping[str, Any],
    learning_rate: float | Schedule,
    momentum: tuple[str, Schedule] | None = None,
) -> optax.GradientTransformation:
    """One torch param group's update rule as an optax transform.

    Args:
        kind: ``sgd``, ``adam`` (``hp["decoupled"]`` for AdamW), ``adamax``, ``rmsprop``,
            ``adagrad``, ``nadam``, ``radam``.
        hp: The group's hyper-parameters under torch's names (``betas``, ``eps``, ...).
        learning_rate: A constant, or a schedule called with the scheduler's ``last_epoch``.
        momentum: ``(key, schedule)`` when the scheduler also sets the momentum each step
            (``OneCycleLR(cycle_momentum=True)``): ``hp["betas"][0]`` (key ``betas``) or
            ``hp["momentum"]`` becomes ``schedule(last_epoch)``, as torch reads the group's
            current value in each step.
    """
    rule = RULES[kind]
    hp = dict(hp)
    slots = slot_names(kind, hp)

    def init_fn(params):
        return TorchState(
            count=jnp.zeros((), jnp.int32),
            lr_step=jnp.zeros((), jnp.int32),
            slots={
                name: jax.tree_util.tree_map(lambda p, h=how: _init_slot(h, p, hp), params)
                for name, how in slots.items()
            },
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(f"the torch {kind} transform needs params (weight decay, AdamW)")
        count = state.count + 1
        lr = _lr(learning_rate, state.lr_step)
        step_hp = hp
        if momentum is not None:
            key, schedule = momentum
            m = schedule(state.lr_step)
            step_hp = {**hp, key: (m, *hp["betas"][1:]) if key == "betas" else m}
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        p_leaves = treedef.flatten_up_to(params)
        s_leaves = {k: treedef.flatten_up_to(v) for k, v in state.slots.items()}
        new_updates, new_slots = [], {k: [] for k in slots}
        for i, (g, p) in enumerate(zip(leaves, p_leaves, strict=True)):
            if hp.get("maximize"):
                g = -g
            step = count.astype(p.dtype)
            lr_p = jnp.asarray(lr, p.dtype)
            new_p, s = rule(step_hp, g, p, {k: v[i] for k, v in s_leaves.items()}, step, lr_p)
            new_updates.append((new_p - p).astype(p.dtype))
            for k in slots:
                new_slots[k].append(s[k].astype(s_leaves[k][i].dtype))
        slots_out = {k: treedef.unflatten(v) for k, v in new_slots.items()}
        return treedef.unflatten(new_updates), TorchState(count, state.lr_step + 1, slots_out)

    return optax.GradientTransformation(init_fn, update_fn)


class ClipState(NamedTuple):
    pass


def clip_grad_norm(max_norm: float, norm_type: float = 2.0) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_norm_`` as an optax transform.

    torch scales every gradient by ``min(1, max_norm / (total_norm + 1e-6))`` (always, not
    only when the norm is above ``max_norm``; optax's ``clip_by_global_norm`` has no 1e-6).
    """

    def update_fn(updates, state, params=None):
        leaves = jax.tree_util.tree_leaves(updates)
        if norm_type == float("inf"):
            total = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in leaves]))
        else:
            norms = jnp.stack([jnp.linalg.norm(g.ravel(), ord=norm_type) for g in leaves])
            total = jnp.linalg.norm(norms, ord=norm_type)
        coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
        return jax.tree_util.tree_map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: ClipState(), update_fn)


def clip_grad_value(clip_value: float) -> optax.GradientTransformation:
    """``torch.nn.utils.clip_grad_value_``: clamp every gradient to ``[-v, v]``."""
    return optax.clip(clip_value)


class AccumulateState(NamedTuple):
    mini_step: jax.Array  # micro-batches accumulated so far (int32 scalar)
    grads: Any  # running sum of grad / k, like torch's .grad
    inner: Any


def accumulate_gradients(
    inner: optax.GradientTransformation, every: int
) -> optax.GradientTransformation:
    """Gradient accumulation as torch does it: ``.grad`` sums ``grad / k`` over ``k``
    micro-batches (``(loss / k).backward()``), then one ``optimizer.step()``; the other calls
    change nothing. (``optax.MultiSteps`` keeps a running mean, which rounds differently.)"""

    def init_fn(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return AccumulateState(jnp.zeros((), jnp.int32), zeros, inner.init(params))

    def update_fn(updates, state, params=None):
        acc = jax.tree_util.tree_map(lambda a, g: a + g / every, state.grads, updates)

        def step(_):
            new, inner_state = inner.update(acc, state.inner, params)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, acc)
            return new, AccumulateState(jnp.zeros((), jnp.int32), zeros, inner_state)

        def wait(_):
            zeros = jax.tree_util.tree_map(jnp.zeros_like, updates)
            return zeros, AccumulateState(state.mini_step + 1, acc, state.inner)

        return jax.lax.cond(state.mini_step + 1 >= every, step, wait, None)

    return optax.GradientTransformation(init_fn, update_fn)
