"""``torch.optim`` optimizers (with their state, schedule and clipping) <-> optax.

:func:`from_torch_optimizer` turns a torch optimizer into an optax transform whose state holds
torch's per-parameter buffers at the paths (and in the layouts) of the converted variables;
:func:`to_torch_optimizer` writes such a state back into a torch optimizer for the module.
Each param group becomes one :func:`~xconv.training.transforms.torch_transform` inside an
``optax.multi_transform`` labelled ``group_<i>``; variables no torch parameter maps to
(buffers in ``to_jax`` params, constants) are labelled ``frozen`` and never change.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xconv.errors import ConversionError, UnsupportedAttributeError
from xconv.training.names import Leaf, flatten_tree, match_leaves

#: torch optimizer class -> (transform kind, hyper-parameters read from each group)
OPTIMIZERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "SGD": ("sgd", ("momentum", "dampening", "nesterov", "weight_decay", "maximize")),
    "Adam": ("adam", ("betas", "eps", "weight_decay", "amsgrad", "maximize")),
    "AdamW": ("adam", ("betas", "eps", "weight_decay", "amsgrad", "maximize")),
    "RMSprop": ("rmsprop", ("alpha", "eps", "weight_decay", "momentum", "centered", "maximize")),
    "Adagrad": (
        "adagrad",
        ("lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"),
    ),
    "Adamax": ("adamax", ("betas", "eps", "weight_decay", "maximize")),
    "NAdam": ("nadam", ("betas", "eps", "weight_decay", "momentum_decay", "maximize")),
    "RAdam": ("radam", ("betas", "eps", "weight_decay", "maximize")),
}

#: Param-group values a scheduler keeps there (OneCycleLR), carried so the torch optimizer
#: written back can resume that scheduler.
_SCHEDULER_KEYS = ("max_lr", "min_lr", "max_momentum", "base_momentum")

#: Group options that change the math but are not part of the converted rule.
_REJECT = {"differentiable": True, "capturable": True}

FROZEN = "frozen"


@dataclass(frozen=True)
class OptimizerSpec:
    """What was read from the torch optimizer: kind, per-group hyper-parameters, names."""

    torch_class: str
    kind: str
    groups: tuple[dict[str, Any], ...]
    group_names: tuple[tuple[str, ...], ...]  # torch parameter names per group


def _param_names(optimizer, model) -> list[list[str]]:
    if model is None:
        raise ConversionError(
            "from_torch_optimizer needs model= (the torch module the optimizer trains) to "
            "name its parameters"
        )
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in by_id:
                raise ConversionError(
                    f"param group {i} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the given model; pass the module the optimizer was built on"
                )
            names.append(by_id[id(p)])
        out.append(names)
    return out


def read_optimizer(optimizer, model) -> OptimizerSpec:
    """Read a torch optimizer's kind and groups, rejecting what cannot convert exactly."""
    cls = type(optimizer).__name__
    if cls not in OPTIMIZERS:
        raise UnsupportedAttributeError(
            f"torch optimizer {cls} has no optax conversion; supported: {', '.join(OPTIMIZERS)}"
        )
    kind, keys = OPTIMIZERS[cls]
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        for key, bad in _REJECT.items():
            if g.get(key) == bad:
                raise UnsupportedAttributeError(f"{cls} group {i}: {key}={bad} is not supported")
        if g.get("fused"):
            raise UnsupportedAttributeError(
                f"{cls} group {i}: fused=True runs a different kernel; use fused=False"
            )
        hp = {k: g[k] for k in keys if k in g}
        if kind == "adam":
            hp["decoupled"] = cls == "AdamW" or bool(g.get("decoupled_weight_decay", False))
        if kind in ("nadam", "radam"):
            hp["decoupled"] = bool(g.get("decoupled_weight_decay", False))
        if kind == "sgd" and g.get("nesterov") and (g["momentum"] <= 0 or g["dampening"] != 0):
            raise UnsupportedAttributeError("SGD nesterov needs momentum > 0 and dampening 0")
        if isinstance(g["lr"], float) is False and hasattr(g["lr"], "item"):
            hp["lr"] = float(g["lr"].item())
        else:
            hp["lr"] = float(g["lr"])
        hp["initial_lr"] = float(g.get("initial_lr", hp["lr"]))
        hp.update({k: float(g[k]) for k in _SCHEDULER_KEYS if k in g})
        groups.append(hp)
    return OptimizerSpec(
        cls, kind, tuple(groups), tuple(map(tuple, _param_names(optimizer, model)))
    )


def _set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _labels(params: Mapping[str, Any], spec: OptimizerSpec, leaves: Mapping[str, Leaf], prefix):
    labels: dict = {}
    for path in flatten_tree(params):
        _set_path(labels, path, FROZEN)
    for gi, names in enumerate(spec.group_names):
        for name in names:
            _set_path(labels, leaves[name].path[len(prefix) :], f"group_{gi}")
    return labels


def _params_of(variables: Mapping[str, Any]) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """The trainable tree: linen's ``params`` collection, else the tree itself."""
    if "params" in variables and isinstance(variables["params"], Mapping):
        return variables["params"], ("params",)
    return variables, ()


def build_tx(
    kind: str,
    groups,
    labels,
    learning_rates,
    clip_grad_norm=None,
    clip_grad_value=None,
    accumulate_steps: int = 1,
    momenta=None,
):
    """The optax transform of a read optimizer: one :func:`torch_transform` per group in a
    ``multi_transform`` over ``labels`` (``group_<i>`` / ``frozen``), after the clipping.
    ``momenta``: per group, None or the ``(key, schedule)`` of a momentum-cycling scheduler."""
    import jax
    import optax

    from xconv.training.transforms import torch_transform

    transforms: dict[str, optax.GradientTransformation] = {FROZEN: optax.set_to_zero()}
    for gi, hp in enumerate(groups):
        momentum = momenta[gi] if momenta else None
        transforms[f"group_{gi}"] = torch_transform(kind, hp, learning_rates[gi], momentum)
    chain = []
    frozen_mask = jax.tree_util.tree_map(lambda label: label == FROZEN, labels)
    if clip_grad_norm is not None or clip_grad_value is not None:
        from xconv.training.transforms import clip_grad_norm as norm_clip
        from xconv.training.transforms import clip_grad_value as value_clip

        # Only the optimizer's parameters count towards torch's norm.
        chain.append(optax.masked(optax.set_to_zero(), frozen_mask))
        if clip_grad_value is not None:
            chain.append(value_clip(clip_grad_value))
        if clip_grad_norm is not None:
            max_norm, norm_type = (
                clip_grad_norm if isinstance(clip_grad_norm, tuple) else (clip_grad_norm, 2.0)
            )
            chain.append(norm_clip(max_norm, norm_type))
    chain.append(optax.multi_transform(transforms, labels))
    tx = optax.chain(*chain) if len(chain) > 1 else chain[0]
    if accumulate_steps > 1:
        from xconv.training.transforms import accumulate_gradients

        tx = accumulate_gradients(tx, accumulate_steps)
    return tx


def from_torch_optimizer(
    optimizer,
    variables: Mapping[str, Any],
    *,
    scheduler=None,
    model=None,
    clip_grad_norm: float | tuple[float, float] | None = None,
    clip_grad_value: float | None = None,
    accumulate_steps: int = 1,
):
    """A torch optimizer (and its scheduler) as an optax transform with torch's state.

    Args:
        optimizer: A ``torch.optim`` optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax,
            NAdam, RAdam), fresh or mid-run.
        variables: The converted variables (``torch-to-flax``'s ``{"params", "batch_stats"}``
            or ``to_jax``'s params), holding the module's current weights. The transform
            updates ``variables["params"]`` when present, else the whole tree.
        scheduler: A ``torch.optim.lr_scheduler`` scheduler of ``optimizer``; the schedule
            continues from its ``last_epoch``.
        model: The torch module the optimizer trains (names its parameters).
        clip_grad_norm: ``max_norm`` or ``(max_norm, norm_type)``: torch's
            ``clip_grad_norm_`` over all of the optimizer's parameters, before the step.
        clip_grad_value: torch's ``clip_grad_value_`` before the step.
        accumulate_steps: Step every ``k`` calls on the mean gradient (``optax.MultiSteps``),
            as torch accumulating ``loss / k`` over ``k`` micro-batches.

    Returns:
        ``(tx, opt_state)``: ``updates, opt_state = tx.update(grads, opt_state, params)``
        then ``optax.apply_updates(params, updates)`` is torch's ``optimizer.step()``
        (then ``scheduler.step()``).
    """
    from xconv.training.schedules import momentum_for, schedule_for

    spec = read_optimizer(optimizer, model)
    params, prefix = _params_of(variables)
    leaves = _trainable_leaves(spec, variables, model, prefix)
    labels = _labels(params, spec, leaves, prefix)
    schedules = [
        schedule_for(scheduler, gi) if scheduler is not None else hp["lr"]
        for gi, hp in enumerate(spec.groups)
    ]
    momenta = [
        momentum_for(scheduler, gi) if scheduler is not None else None
        for gi in range(len(spec.groups))
    ]
    tx = build_tx(
        spec.kind,
        spec.groups,
        labels,
        schedules,
        clip_grad_norm,
        clip_grad_value,
        accumulate_steps,
        momenta=momenta,
    )
    last_epoch = int(scheduler.last_epoch) if scheduler is not None else 0
    state = _with_torch_state(tx.init(params), optimizer, spec, leaves, prefix, last_epoch)
    tx = _torch_optax_class()(tx.init, tx.update)
    tx.spec, tx.leaves, tx.prefix = spec, leaves, prefix
    tx.schedules = (
        [schedule_for(scheduler, gi) for gi in range(len(spec.groups))] if scheduler else None
    )
    tx.momenta = momenta if any(momenta) else None
    return tx, state


def _trainable_leaves(spec, variables: Mapping[str, Any], model, prefix) -> dict[str, Any]:
    """Each torch parameter the optimizer trains -> its leaf in ``variables``, which must lie
    under the trainable ``prefix``."""
    named = dict(model.named_parameters())
    wanted = {n: named[n] for names in spec.group_names for n in names}
    leaves = match_leaves(wanted, variables, what="the variables")
    for name, leaf in leaves.items():
        if leaf.path[: len(prefix)] != prefix:
            raise ConversionError(
                f"torch parameter {name!r} maps to {'/'.join(leaf.path)}, outside the "
                f"trainable {'/'.join(prefix) or 'tree'}"
            )
    return leaves


def _with_torch_state(state, optimizer, spec, leaves, prefix, last_epoch: int):
    """The optax state ``state`` with each param group's state filled from torch's."""
    import jax
    import optax

    def fill_groups(s):
        if not isinstance(s, optax.MultiTransformState):
            return s
        inner = dict(s.inner_states)
        for label, masked in inner.items():
            if label.startswith("group_"):
                gi = int(label.split("_")[1])
                filled = _group_state(
                    optimizer, spec, leaves, prefix, gi, masked.inner_state, last_epoch
                )
                inner[label] = masked._replace(inner_state=filled)
        return s._replace(inner_states=inner)

    return jax.tree_util.tree_map(
        fill_groups, state, is_leaf=lambda x: isinstance(x, optax.MultiTransformState)
    )


def _group_state(optimizer, spec, leaves, prefix, gi: int, s, last_epoch: int):
    """Param group ``gi``'s ``TorchState`` ``s`` with torch's step count and slots."""
    import jax.numpy as jnp

    from xconv.training.transforms import TorchState, slot_names

    torch_state = optimizer.state
    group_params = optimizer.param_groups[gi]["params"]
    steps = set()
    slots = dict(s.slots)
    for name, p in zip(spec.group_names[gi], group_params, strict=True):
        st = torch_state.get(p, {})
        if "step" in st:
            steps.add(int(float(st["step"])))
        else:  # SGD keeps no step; a momentum buffer means it has stepped
            steps.add(1 if st.get("momentum_buffer") is not None else 0)
        leaf = leaves[name]
        rel = leaf.path[len(prefix) :]
        for slot in slot_names(spec.kind, spec.groups[gi]):
            if st.get(slot) is None:
                continue
            value = st[slot].detach().cpu().numpy().copy()  # jax may alias numpy
            value = value if value.ndim == 0 else leaf.to_flax(value)
            slots[slot] = _replace(slots[slot], rel, value)
    if len(steps) > 1:
        raise ConversionError(
            f"param group {gi} has parameters at different steps {sorted(steps)}; torch "
            "updated only some of them (no gradient), which one optax state cannot hold"
        )
    count = steps.pop() if steps else 0
    return TorchState(jnp.asarray(count, jnp.int32), jnp.asarray(last_epoch, jnp.int32), slots)


@functools.cache
def _torch_optax_class():
    import optax

    class TorchOptax(optax.GradientTransformation):
        """An optax transform that remembers the torch optimizer it came from (its kind,
        groups, parameter names and layouts), so :func:`to_torch_optimizer` can go back."""

    return TorchOptax


def to_torch_optimizer(tx, opt_state, module):
    """The torch optimizer (with its per-parameter state) equal to an optax one.

    Args:
        tx: A transform from :func:`from_torch_optimizer` (it records the torch class,
            groups and parameter layouts).
        opt_state: Its current state (after any number of optax steps).
        module: The torch module holding the trained parameters (load them first, e.g. with
            ``xconv.weights.flax_to_torch``).

    Returns:
        A ``torch.optim`` optimizer over ``module``'s parameters whose ``step()`` continues
        the optax run: each group's ``lr`` is the schedule's value at the state's scheduler
        step (``initial_lr`` the schedule's base), and ``optimizer.xconv_last_epoch`` is that
        step: build the scheduler on the returned optimizer, then set its ``last_epoch`` to
        it (what the tests check).
    """
    import numpy as np
    import torch

    from xconv.training.check import _slot_arrays

    spec = getattr(tx, "spec", None)
    if spec is None:
        raise ConversionError(
            "to_torch_optimizer needs the transform returned by from_torch_optimizer (it "
            "records the torch optimizer's class, groups and parameter layouts)"
        )
    named = dict(module.named_parameters())
    missing = [n for names in spec.group_names for n in names if n not in named]
    if missing:
        raise ConversionError(f"the module has no parameter(s) {', '.join(missing[:5])}")
    slots = _slot_arrays(opt_state, tx.leaves, tx.prefix, spec.group_names)
    last_epoch = _lr_step(opt_state)
    groups = []
    for gi, hp in enumerate(spec.groups):
        g = {k: v for k, v in hp.items() if k != "decoupled"}
        if tx.schedules:
            g["lr"] = float(np.asarray(tx.schedules[gi](last_epoch)))
        momentum = (getattr(tx, "momenta", None) or [None] * len(spec.groups))[gi]
        if momentum is not None:
            key, schedule = momentum
            m = float(np.asarray(schedule(last_epoch)))
            g[key] = (m, *g["betas"][1:]) if key == "betas" else m
        if spec.kind in ("nadam", "radam") or (spec.kind == "adam" and spec.torch_class == "Adam"):
            g["decoupled_weight_decay"] = hp["decoupled"]
        groups.append({"params": [named[n] for n in spec.group_names[gi]], **g})
    opt = getattr(torch.optim, spec.torch_class)(groups)
    for names in spec.group_names:
        for name in names:
            p = named[name]
            step = int(slots.get(f"{name}/step", 0))
            if step == 0:
                continue
            st = {}
            for key, value in slots.items():
                pname, _, slot = key.rpartition("/")
                if pname != name or slot == "step":
                    continue
                t = torch.from_numpy(np.array(value))
                st[slot] = t if t.ndim == 0 else t.to(p.dtype)
            if spec.kind != "sgd":
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
            opt.state[p] = st
    opt.xconv_last_epoch = last_epoch
    return opt


def _lr_step(opt_state) -> int:
    import jax

    from xconv.training.transforms import TorchState

    found = []
    jax.tree_util.tree_map(
        lambda s: found.append(int(s.lr_step)) if isinstance(s, TorchState) else None,
        opt_state,
        is_leaf=lambda s: isinstance(s, TorchState),
    )
    return max(found, default=0)


def _replace(tree, rel: tuple[str, ...], value):
    import jax.numpy as jnp

    node = dict(tree)
    if len(rel) == 1:
        old = node[rel[0]]
        node[rel[0]] = jnp.asarray(value, dtype=old.dtype).reshape(old.shape)
        return node
    node[rel[0]] = _replace(node[rel[0]], rel[1:], value)
    return node


__all__ = ["OPTIMIZERS", "from_torch_optimizer", "read_optimizer", "to_torch_optimizer"]
