"""PyTorch registration of NonMaxSuppression, the string ops (StringConcat,
StringNormalizer, StringSplit, RegexFullMatch), ImageDecoder and the ai.onnx.preview.training
optimizers (Adagrad, Adam, Momentum), written once in ``converters/ops``; and Gradient: the
nodes ``y`` depends on (:func:`xconv.converters.ops.training.gradient_plan`) re-run under
``torch.autograd``.

NonMaxSuppression, the string ops and ImageDecoder run on concrete numpy values
(NonMaxSuppression's output length depends on the data; torch has no string tensors; Pillow
decodes the images); their numeric outputs come back as torch tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from xconv.converters.ops import image, nms, strings, training
from xconv.converters.ops.context import find_handler, handler_errors
from xconv.converters.torch.runtime.registry import REQUIRED, builtin
from xconv.converters.torch.runtime.xp import KERNEL, from_numpy

nms.register_nms(builtin, torch.from_numpy)
strings.register_string_ops(builtin, "torch", torch.from_numpy)
image.register_image_ops(builtin, torch.from_numpy)
training.register_training_ops(builtin, KERNEL, REQUIRED)


@builtin(
    "Gradient", domain=training.DOMAIN, since=1, attrs={"xs": REQUIRED, "y": REQUIRED, "zs": None}
)
def gradient(ctx, *inputs, xs, y, zs):
    """Gradient(xs values..., zs values...) -> d(sum y)/dx for each x in xs.

    The nodes between xs/zs and y (which may read only those values and constants) are
    re-run on copies of the inputs with grad enabled (also under ``torch.no_grad`` or
    ``torch.inference_mode``), and ``torch.autograd.grad`` seeds them with ones, as the
    spec's all-ones seed. An x that y does not depend on gets zeros.
    """
    from xconv.converters.torch.runtime.context import TorchContext
    from xconv.converters.torch.runtime.registry import registry

    plan = training.gradient_plan(ctx, len(inputs), xs, y, zs)
    n = len(xs)
    like = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
    for name, v in zip(xs, inputs[:n], strict=True):
        if not (torch.is_tensor(v) and (v.is_floating_point() or v.is_complex())):
            dtype = v.dtype if torch.is_tensor(v) else type(v).__name__
            raise ctx.error(
                f"x {name!r} must be a floating-point tensor to differentiate, got {dtype}"
            )

    def run_node(node, args):
        handler, version = find_handler(registry, plan.opsets, node)
        sub_ctx = TorchContext(
            node, version, ctx.run_subgraph, ctx.training, ctx.generator, ctx.buffers
        )
        with handler_errors(node):  # an error names the node it came from
            outs = handler.fn(sub_ctx, *args, **handler.parse_attributes(node))
        return outs if isinstance(outs, tuple) else (outs,)

    def constant(array):
        return from_numpy(np.array(array), like)  # a copy: initializers are read-only

    with torch.inference_mode(False), torch.enable_grad():
        # Copies: the inputs may be inference tensors, which autograd cannot record.
        x_values = [v.detach().clone().requires_grad_(True) for v in inputs[:n]]
        z_values = [v.clone() if torch.is_tensor(v) else v for v in inputs[n:]]
        out = training.run_plan(ctx, plan, [*x_values, *z_values], run_node, constant)
        if not (torch.is_tensor(out) and out.requires_grad):
            return tuple(torch.zeros_like(x).detach() for x in x_values)
        grads = torch.autograd.grad(
            out, x_values, grad_outputs=torch.ones_like(out), allow_unused=True
        )
    return tuple(
        torch.zeros_like(x).detach() if g is None else g
        for x, g in zip(x_values, grads, strict=True)
    )
