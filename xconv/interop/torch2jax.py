"""Turn a PyTorch module or function into a pure JAX function, through the IR.

The module is traced once (``xconv.from_torch``: ``torch.export`` then the ONNX exporter) and
the IR is interpreted as JAX (``xconv.to_jax``). The result has no torch in its call path:
it works under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` like any JAX function.

Signature choice: a module's weights become an explicit argument, ``fn(params, *inputs)``,
with ``params`` a flat dict keyed by the module's ``state_dict`` names (``"fc1.weight"``,
``"bn1.running_mean"``), the same keys as ``torch.func.functional_call`` and the PyPI
``torch2jax`` package take. A flat dict is a JAX pytree, so ``jax.grad(loss)(params, x)``
returns gradients under the very names torch uses for ``named_parameters()``, and an
optimizer (optax) updates it as is. Only floating-point entries are params (so ``jax.grad``
takes the dict whole); integer buffers such as ``num_batches_tracked`` stay constants. A plain function has no weights, so its result is just
``fn(*inputs)`` (tensors it closes over are folded in as constants).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from xconv.errors import ConversionError, WeightsError


@dataclass(frozen=True, eq=False)
class TorchAsJax:
    """A traced torch module as JAX: ``fn(params, *inputs)``; see :func:`torch2jax`.

    Attributes:
        jax_fn: The IR interpreted as JAX (``xconv.to_jax``), taking nested params and
            returning a flat tuple of outputs.
        out_spec: The JAX treedef of the module's output (a single tensor, a tuple, a
            dict, ...), or ``None`` to return the flat tuple.
        model: The IR model (``onnx_ir.Model``) the function interprets.
        constants: Non-float weights (BatchNorm's ``num_batches_tracked``), held fixed so
            that ``params`` is all floats and ``jax.grad`` takes it whole.
    """

    jax_fn: Any
    out_spec: Any
    model: Any

    constants: Mapping[str, Any]

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.jax_fn.weight_names if n not in self.constants)

    def __call__(self, params: Mapping[str, Any], *inputs: Any) -> Any:
        from xconv.ir.naming import nest

        names = self.param_names
        if set(params) != set(names):
            missing = sorted(set(names) - set(params))
            unexpected = sorted(set(params) - set(names))
            raise WeightsError(
                f"params do not match the module: missing {missing}, unexpected {unexpected}; "
                "pass the dict torch2jax returned (keys are state_dict names)"
            )
        weights = {**self.constants, **params}
        outputs = self.jax_fn(nest(weights) if weights else {}, *inputs)
        return _unflatten(outputs, self.out_spec)


@dataclass(frozen=True, eq=False)
class _BoundFunction:
    """A torch function with no weights as JAX: ``fn(*inputs)``."""

    inner: TorchAsJax
    params: Mapping[str, Any]

    @property
    def model(self) -> Any:
        return self.inner.model

    def __call__(self, *inputs: Any) -> Any:
        return self.inner(self.params, *inputs)


def torch2jax(
    fn_or_module: Callable[..., Any],
    *example_inputs: Any,
    dynamic_batch: bool = False,
    static: bool = False,
) -> Any:
    """Convert a PyTorch module or function to a JAX function through the IR.

    The module is traced in eval mode (inference semantics: dropout off, batch norm on its
    running statistics), with every input dimension symbolic unless the module fixes it
    (``static``: at the shapes of ``example_inputs``).

    Args:
        fn_or_module: An ``nn.Module``, or a function of tensors.
        *example_inputs: Positional example inputs (torch tensors or numpy arrays) to trace.
        dynamic_batch: Require dimension 0 of every input to stay symbolic (any batch size).
        static: Trace at the example shapes (see :func:`xconv.from_torch`).

    Returns:
        For a module, ``(fn, params)``: ``fn(params, *inputs)`` returns the module's output
        structure (one array, or a tuple/list/dict of arrays) and ``params`` is a flat dict of
        JAX arrays keyed by ``state_dict`` names: the parameters and the floating-point
        persistent buffers (BatchNorm running statistics); integer buffers are constants
        inside ``fn``. For a function, ``fn(*inputs)``.

    Raises:
        ConversionError: No example inputs, or the module cannot be traced or translated.
    """
    from torch import nn

    from xconv.converters.jax.interpreter import to_jax
    from xconv.converters.torch.importer.trace import from_torch
    from xconv.ir.naming import flatten

    if not example_inputs:
        raise ConversionError("torch2jax needs example inputs to trace the module or function")
    if isinstance(fn_or_module, nn.Module):
        module = fn_or_module
    elif callable(fn_or_module):
        module = _FunctionModule(fn_or_module)
    else:
        raise ConversionError(
            f"torch2jax takes an nn.Module or a function, got {type(fn_or_module).__name__}"
        )
    model = from_torch(module, example_inputs, dynamic_batch=dynamic_batch, static=static)
    jax_fn, nested = to_jax(model, kernel_layout="onnx")  # params as torch stores them
    weights = flatten(nested, jax_fn.weight_names) if jax_fn.weight_names else {}
    params = {k: v for k, v in weights.items() if _is_float(v)}
    constants = {k: v for k, v in weights.items() if k not in params}
    spec = _out_spec(module, example_inputs, len(jax_fn.output_names))
    converted = TorchAsJax(jax_fn, spec, model, constants)
    if isinstance(fn_or_module, nn.Module):
        return converted, params
    return _BoundFunction(converted, params)


def _is_float(x: Any) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def _function_module_class() -> type:
    from torch import nn

    class FunctionModule(nn.Module):
        def __init__(self, fn: Callable[..., Any]) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, *args: Any) -> Any:
            return self.fn(*args)

    return FunctionModule


def _FunctionModule(fn: Callable[..., Any]) -> Any:  # noqa: N802 - reads as a class
    return _function_module_class()(fn)


def _out_spec(module: Any, example_inputs: tuple[Any, ...], n_outputs: int) -> Any:
    """The JAX treedef of the module's output, or ``None`` when it does not map 1:1."""
    import jax
    import numpy as np
    import torch
    from torch.utils import _pytree

    args = tuple(
        torch.from_numpy(np.array(a)) if isinstance(a, np.ndarray | np.generic) else a
        for a in example_inputs
    )
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(*args)
    finally:
        module.train(was_training)
    leaves, spec = _pytree.tree_flatten(out)
    if len(leaves) != n_outputs or not all(isinstance(x, torch.Tensor) for x in leaves):
        return None
    # The same structure as a JAX treedef, so the call path needs no torch.
    return jax.tree_util.tree_structure(_pytree.tree_unflatten([0] * n_outputs, spec))


def _unflatten(outputs: tuple[Any, ...], spec: Any) -> Any:
    import jax

    if spec is None:
        return outputs
    return jax.tree_util.tree_unflatten(spec, outputs)
