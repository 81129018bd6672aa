"""The ai.onnx.preview.training ops written once: the optimizers Adagrad, Adam and Momentum
against ``xp``, and for Gradient the part that is no framework's: which nodes ``y`` depends
on, and running them in graph order.

The optimizers run through a kernel's ``run(fn, *arrays)`` (``fn(xp, *arrays)`` in the
backend's namespace, or numpy when every input is static). Their inputs are ``R`` (learning
rate), ``T`` (update count) and equally long groups of tensors (``X...``, ``G...``, ...);
each group member is updated on its own, every output in its input's dtype. ``T`` is run-time
data in a training loop, so the T == 0 branches are ``xp.where``, never Python.

Gradient's differentiation stays with each runtime (``jax.vjp``, ``torch.autograd``): it
builds a :class:`GradientPlan` here and re-runs the plan's nodes through :func:`run_plan`
with its own handlers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import onnx_ir as ir

from xconv.converters.ops.arrays import astype

DOMAIN = "ai.onnx.preview.training"
MODES = ("standard", "nesterov")


class TrainingKernel(Protocol):
    """What a backend provides for the optimizer ops."""

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the backend's namespace (numpy for static inputs)."""


def _groups(ctx, data: Sequence[Any], n_groups: int, names: str) -> int:
    """The length of each of the ``n_groups`` groups after ``R, T``."""
    if len(data) < 2 + n_groups or (len(data) - 2) % n_groups:
        raise ctx.error(
            f"expects R, T and {n_groups} equally long groups of tensors ({names}), got "
            f"{len(data)} inputs; pass 2 + {n_groups}*n inputs for n optimized tensors"
        )
    return (len(data) - 2) // n_groups


def _scalars(xp, r, t):
    """``R`` and ``T`` as 0-d arrays (exporters may hand over 1-element vectors) and ``T`` in
    ``R``'s type."""
    r, t = xp.reshape(r, ()), xp.reshape(t, ())
    return r, t, astype(xp, t, r.dtype)


def _split(values: Sequence[Any], n: int) -> list[Sequence[Any]]:
    return [values[k : k + n] for k in range(0, len(values), n)]


def adagrad(xp, r, t, *tensors, decay_factor: float, epsilon: float, norm_coefficient: float):
    """Adagrad's update of every (X, G, H): the new X's, then the new H's."""
    r, t, tf = _scalars(xp, r, t)
    xs, gs, hs = _split(tensors, len(tensors) // 3)
    rate = r / (1 + tf * decay_factor)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs, strict=True):
        g_reg = norm_coefficient * x + g
        h_new = h + g_reg * g_reg
        x_new = x - rate * g_reg / (xp.sqrt(h_new) + epsilon)
        new_x.append(astype(xp, x_new, x.dtype))
        new_h.append(astype(xp, h_new, h.dtype))
    return (*new_x, *new_h)


def adam(
    xp,
    r,
    t,
    *tensors,
    alpha: float,
    beta: float,
    epsilon: float,
    norm_coefficient: float,
    norm_coefficient_post: float,
):
    """Adam's update of every (X, G, V, H): the new X's, V's, then H's."""
    r, t, tf = _scalars(xp, r, t)
    xs, gs, vs, hs = _split(tensors, len(tensors) // 4)
    # Bias correction only after the first step (T > 0); at T == 0 the corrected rate is
    # 0 / 0, which the where discards.
    corrected = r * xp.sqrt(1 - beta**tf) / (1 - alpha**tf)
    rate = xp.where(t > 0, corrected, r)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs, strict=True):
        g_reg = norm_coefficient * x + g
        v_new = alpha * v + (1 - alpha) * g_reg
        h_new = beta * h + (1 - beta) * (g_reg * g_reg)
        x_new = (1 - norm_coefficient_post) * (x - rate * (v_new / (xp.sqrt(h_new) + epsilon)))
        new_x.append(astype(xp, x_new, x.dtype))
        new_v.append(astype(xp, v_new, v.dtype))
        new_h.append(astype(xp, h_new, h.dtype))
    return (*new_x, *new_v, *new_h)


def momentum(xp, r, t, *tensors, alpha: float, beta: float, mode: str, norm_coefficient: float):
    """Momentum's update of every (X, G, V): the new X's, then the new V's."""
    r, t, _ = _scalars(xp, r, t)
    xs, gs, vs = _split(tensors, len(tensors) // 3)
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs, strict=True):
        g_reg = norm_coefficient * x + g
        # The gradient's coefficient is 1 at the first step (T == 0).
        v_new = alpha * v + xp.where(t > 0, beta * g_reg, g_reg)
        step = v_new if mode == "standard" else g_reg + alpha * v_new
        new_x.append(astype(xp, x - r * step, x.dtype))
        new_v.append(astype(xp, v_new, v.dtype))
    return (*new_x, *new_v)


def register_training_ops(builtin: Callable[..., Any], k: TrainingKernel, required: Any) -> None:
    """Register Adagrad, Adam and Momentum with a backend registry's ``builtin``."""

    @builtin(
        "Adagrad",
        domain=DOMAIN,
        since=1,
        attrs={"decay_factor": 0.0, "epsilon": 0.0, "norm_coefficient": 0.0},
    )
    def adagrad_op(ctx, *data, **attrs):
        """Adagrad(R, T, X..., G..., H...) -> (X_new..., H_new...)."""
        _groups(ctx, data, 3, "X, G, H")
        return k.run(lambda xp, *a: adagrad(xp, *a, **attrs), *data)

    @builtin(
        "Adam",
        domain=DOMAIN,
        since=1,
        attrs={
            "alpha": 0.9,
            "beta": 0.999,
            "epsilon": 0.0,
            "norm_coefficient": 0.0,
            "norm_coefficient_post": 0.0,
        },
    )
    def adam_op(ctx, *data, **attrs):
        """Adam(R, T, X..., G..., V..., H...) -> (X_new..., V_new..., H_new...)."""
        _groups(ctx, data, 4, "X, G, V, H")
        return k.run(lambda xp, *a: adam(xp, *a, **attrs), *data)

    @builtin(
        "Momentum",
        domain=DOMAIN,
        since=1,
        attrs={"alpha": required, "beta": required, "mode": required, "norm_coefficient": required},
    )
    def momentum_op(ctx, *data, **attrs):
        """Momentum(R, T, X..., G..., V...) -> (X_new..., V_new...); mode standard |
        nesterov."""
        if attrs["mode"] not in MODES:
            raise ctx.error(f"mode must be one of {MODES}, got {attrs['mode']!r}")
        _groups(ctx, data, 3, "X, G, V")
        return k.run(lambda xp, *a: momentum(xp, *a, **attrs), *data)


# ------------------------------------------------------------------------------- Gradient


@dataclass(frozen=True)
class GradientPlan:
    """What a Gradient node differentiates.

    Attributes:
        sources: Each name in ``xs`` then ``zs`` -> its position among the node's inputs.
        nodes: The nodes ``y`` depends on (stopping at ``sources`` and constants), in graph
            order.
        y: The name of the value differentiated.
        opsets: The graph's opset imports, for looking up each node's handler.
    """

    sources: dict[str, int]
    nodes: tuple[ir.Node, ...]
    y: str
    opsets: dict[str, int]


def gradient_plan(ctx, n_inputs: int, xs: Sequence[str], y: str, zs: Sequence[str] | None):
    """The :class:`GradientPlan` of the Gradient node ``ctx.node`` (with ``n_inputs``
    inputs); an error naming the node when the attributes and inputs disagree."""
    names = [*xs, *(zs or ())]
    if n_inputs != len(names):
        raise ctx.error(f"got {n_inputs} inputs for xs + zs = {names}; pass one input per name")
    graph = ctx.node.graph
    if graph is None:
        raise ctx.error("the Gradient node is not attached to a graph")
    sources = {name: i for i, name in enumerate(names)}
    producers = {v.name: n for n in graph for v in n.outputs}
    if y not in producers and y not in sources:
        raise ctx.error(f"y={y!r} is neither computed in this graph nor one of xs/zs {names}")
    needed: set[ir.Node] = set()
    stack = [y]
    while stack:
        name = stack.pop()
        if name in sources or name not in producers or producers[name] in needed:
            continue
        node = producers[name]
        needed.add(node)
        stack.extend(v.name for v in node.inputs if v is not None and v.name)
    nodes = tuple(n for n in graph if n in needed)
    return GradientPlan(sources, nodes, y, dict(graph.opset_imports))


def run_plan(
    ctx,
    plan: GradientPlan,
    values: Sequence[Any],
    run_node: Callable[[ir.Node, list[Any]], tuple[Any, ...]],
    constant: Callable[[Any], Any],
) -> Any:
    """``y`` computed from ``values`` (one per xs/zs name) by the plan's nodes.

    ``run_node(node, args)`` runs one node with the backend's handler; ``constant(array)``
    turns an initializer's numpy value into what the handlers take. A node reading a value
    that is neither a source, a constant nor computed by the plan is an error naming it.
    """
    env = {name: values[i] for name, i in plan.sources.items()}
    for node in plan.nodes:
        args = []
        for v in node.inputs:
            if v is None or not v.name:
                args.append(None)
            elif v.name in env:
                args.append(env[v.name])
            elif v.const_value is not None:
                args.append(constant(v.const_value.numpy()))
            else:
                raise ctx.error(
                    f"y={plan.y!r} depends on {v.name!r}, which is neither in xs/zs "
                    f"{list(plan.sources)} nor a constant; list it in xs or zs"
                )
        outs = run_node(node, args)
        env.update((v.name, out) for v, out in zip(node.outputs, outs, strict=False))
    return env[plan.y]
