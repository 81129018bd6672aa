"""NonMaxSuppression, the string ops, ImageDecoder and the ai.onnx.preview.training optimizers
(Adagrad, Adam, Momentum), all written once in ``converters/ops``, and Gradient: the nodes ``y``
depends on (:func:`xconv.converters.ops.training.gradient_plan`) re-run under ``jax.vjp``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xconv.converters.jax.kernel import KERNEL
from xconv.converters.jax.registry import REQUIRED, builtin
from xconv.converters.ops import image, nms, strings, training
from xconv.converters.ops.context import find_handler, handler_errors

nms.register_nms(builtin, np.asarray)
# JAX has no string arrays: the string ops run on numpy object arrays.
strings.register_string_ops(builtin, "JAX", np.asarray)
image.register_image_ops(builtin, np.asarray)
training.register_training_ops(builtin, KERNEL, REQUIRED)


@builtin(
    "Gradient", domain=training.DOMAIN, since=1, attrs={"xs": REQUIRED, "y": REQUIRED, "zs": None}
)
def gradient(ctx, *inputs, xs, y, zs):
    """Gradient(xs values..., zs values...) -> d(sum y)/dx for each x in xs.

    The nodes between xs/zs and y (which may read only those values and constants) are
    re-run under ``jax.vjp`` with a ones cotangent, as the spec's all-ones seed.
    """
    from xconv.converters.jax.context import JaxContext
    from xconv.converters.jax.registry import registry

    plan = training.gradient_plan(ctx, len(inputs), xs, y, zs)
    n = len(xs)
    # Each node keeps its graph position, so a random op folds in the key it did forward.
    position = {node: i for i, node in enumerate(ctx.node.graph)}

    def run_node(node, args):
        handler, version = find_handler(registry, plan.opsets, node)
        sub_ctx = JaxContext(node, version, ctx.run_subgraph, ctx.rng, position[node])
        with handler_errors(node):  # an error names the node it came from
            outs = handler.fn(sub_ctx, *args, **handler.parse_attributes(node))
        return outs if isinstance(outs, tuple) else (outs,)

    def forward(*x_values):
        out = training.run_plan(ctx, plan, [*x_values, *inputs[n:]], run_node, lambda a: a)
        return jnp.asarray(out)

    out, vjp = jax.vjp(forward, *(jnp.asarray(v) for v in inputs[:n]))
    return tuple(vjp(jnp.ones_like(out)))
