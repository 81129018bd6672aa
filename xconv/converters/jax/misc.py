"""NonMaxSuppression, the string ops (both written once in ``converters/ops``) and the
ai.onnx.preview.training optimizer ops (Adagrad, Adam, Momentum)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import nms, strings

TRAINING = "ai.onnx.preview.training"


nms.register_nms(builtin, np.asarray)
# JAX has no string arrays: the string ops run on numpy object arrays.
strings.register_string_ops(builtin, "JAX", np.asarray)


# ---------------------------------------------------------------- ai.onnx.preview.training


def _groups(ctx, data, n_groups: int):
    if len(data) < 2 or (len(data) - 2) % n_groups:
        raise ctx.error(
            f"expected R, T and {n_groups} equally long groups of tensors, got {len(data)} inputs"
        )
    r, t = (jnp.asarray(v).reshape(()) for v in data[:2])
    n = (len(data) - 2) // n_groups
    return r, t, [data[2 + k * n : 2 + (k + 1) * n] for k in range(n_groups)]


@builtin(
    "Adagrad",
    domain=TRAINING,
    since=1,
    attrs={"decay_factor": 0.0, "epsilon": 0.0, "norm_coefficient": 0.0},
)
def adagrad(ctx, *data, decay_factor, epsilon, norm_coefficient):
    """Adagrad(R, T, X..., G..., H...) -> (X_new..., H_new...)."""
    r, t, (xs, gs, hs) = _groups(ctx, data, 3)
    rate = r / (1 + t * decay_factor)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs, strict=True):
        g_reg = norm_coefficient * x + g
        h_new = h + g_reg * g_reg
        x_new = x - rate * g_reg / (jnp.sqrt(h_new) + epsilon)
        new_x.append(jnp.asarray(x_new).astype(jnp.asarray(x).dtype))
        new_h.append(jnp.asarray(h_new).astype(jnp.asarray(h).dtype))
    return (*new_x, *new_h)


@builtin(
    "Adam",
    domain=TRAINING,
    since=1,
    attrs={
        "alpha": 0.9,
        "beta": 0.999,
        "epsilon": 0.0,
        "norm_coefficient": 0.0,
        "norm_coefficient_post": 0.0,
    },
)
def adam(ctx, *data, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post):
    """Adam(R, T, X..., G..., V..., H...) -> (X_new..., V_new..., H_new...)."""
    r, t, (xs, gs, vs, hs) = _groups(ctx, data, 4)
    tf = t.astype(jnp.float32)
    # Bias correction only after the first step (T > 0).
    corrected = r * jnp.sqrt(1 - beta**tf) / (1 - alpha**tf)
    rate = jnp.where(t > 0, corrected, r)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs, strict=True):
        g_reg = norm_coefficient * x + g
        v_new = alpha * v + (1 - alpha) * g_reg
        h_new = beta * h + (1 - beta) * (g_reg * g_reg)
        x_new = (1 - norm_coefficient_post) * (x - rate * (v_new / (jnp.sqrt(h_new) + epsilon)))
        new_x.append(jnp.asarray(x_new).astype(jnp.asarray(x).dtype))
        new_v.append(jnp.asarray(v_new).astype(jnp.asarray(v).dtype))
        new_h.append(jnp.asarray(h_new).astype(jnp.asarray(h).dtype))
    return (*new_x, *new_v, *new_h)


@builtin(
    "Momentum",
    domain=TRAINING,
    since=1,
    attrs={"alpha": REQUIRED, "beta": REQUIRED, "mode": REQUIRED, "norm_coefficient": REQUIRED},
)
def momentum(ctx, *data, alpha, beta, mode, norm_coefficient):
    """Momentum(R, T, X..., G..., V...) -> (X_new..., V_new...); mode standard | nesterov."""
    if mode not in ("standard", "nesterov"):
        raise ctx.error(f"mode must be 'standard' or 'nesterov', got {mode!r}")
    r, t, (xs, gs, vs) = _groups(ctx, data, 3)
    # The gradient's coefficient is 1 at the first step (T == 0).
    beta_t = jnp.where(t > 0, beta, 1.0)
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs, strict=True):
        g_reg = norm_coefficient * x + g
        v_new = alpha * v + beta_t * g_reg
        step = v_new if mode == "standard" else g_reg + alpha * v_new
        new_x.append(jnp.asarray(x - r * step).astype(jnp.asarray(x).dtype))
        new_v.append(jnp.asarray(v_new).astype(jnp.asarray(v).dtype))
    return (*new_x, *new_v)


@builtin("Gradient", domain=TRAINING, since=1, attrs={"xs": REQUIRED, "y": REQUIRED, "zs": None})
def gradient(ctx, *inputs, xs, y, zs):
    """Gradient(xs values..., zs values...) -> d(sum y)/dx for each x in xs.

    The nodes between xs/zs and y (which may read only those values and constants) are
    re-run under ``jax.vjp`` with a ones cotangent, as the spec's all-ones seed.
    """
    from xconv.converters.jax.context import JaxContext
    from xconv.converters.jax.registry import registry

    names = [*xs, *(zs or ())]
    if len(inputs) != len(names):
        raise ctx.error(f"got {len(inputs)} inputs for xs + zs = {names}")
    graph = ctx.node.graph
    if graph is None:
        raise ctx.error("the Gradient node is not attached to a graph")
    sources = dict(zip(names, ctx.node.inputs, strict=True))
    producers = {v.name: n for n in graph for v in n.outputs}
    if y not in producers and y not in sources:
        raise ctx.error(f"y={y!r} is not computed in this graph")
    # Nodes that y depends on, stopping at xs/zs and constants.
    needed, stack = set(), [y]
    while stack:
        name = stack.pop()
        if name in sources or name not in producers or producers[name] in needed:
            continue
        node = producers[name]
        needed.add(node)
        stack.extend(v.name for v in node.inputs if v is not None and v.name)
    order = [n for n in graph if n in needed]

    def forward(*x_values):
        env = {sources[name]: v for name, v in zip(xs, x_values, strict=True)}
        env.update(
            {sources[name]: v for name, v in zip(names[len(xs) :], inputs[len(xs) :], strict=True)}
        )
        for index, node in enumerate(order):
            args = []
            for v in node.inputs:
                if v is None or not v.name:
                    args.append(None)
                elif v in env:
                    args.append(env[v])
                elif v.const_value is not None:
                    args.append(v.const_value.numpy())
                else:
                    raise ctx.error(
                        f"y depends on {v.name!r}, which is neither in xs/zs nor a constant"
                    )
            domain = "" if node.domain == "ai.onnx" else node.domain
            version = node.version or ctx.opset
            handler, reason = registry.lookup(domain, node.op_type, version)
            if handler is None:
                raise ctx.error(reason)
            sub_ctx = JaxContext(node, version, ctx.run_subgraph, ctx.rng, index)
            outs = handler.fn(sub_ctx, *args, **handler.parse_attributes(node))
            outs = outs if isinstance(outs, tuple) else (outs,)
            env.update(zip(node.outputs, outs, strict=False))
        if y in sources:
            return jnp.asarray(env[sources[y]])
        target = next(v for v in producers[y].outputs if v.name == y)
        return jnp.asarray(env[target])

    x_values = [jnp.asarray(v) for v in inputs[: len(xs)]]
    out, vjp = jax.vjp(forward, *x_values)
    return tuple(vjp(jnp.ones_like(out)))
