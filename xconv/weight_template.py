"""The weights-only commands' template: a torch module traced and its weights mapped.

``xconv weights torch-to-flax`` / ``flax-to-torch`` predict where each torch weight goes in the
generated Flax ``model.py`` by running the converters on a template module: the torch importer
traces it to the IR, the Flax source emitter writes it, and :mod:`xconv.weights.mapping` reads
the map off the emitter's records. The converters run here, in the layer that may import them
(beside :mod:`xconv.pipeline`), so :mod:`xconv.weights` imports none: it takes the
:class:`~xconv.weights.mapping.WeightMap` / :class:`~xconv.weights.convert.Template` built here.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.errors import ConversionError, UsageError
from xconv.weights import convert as _convert
from xconv.weights import mapping as _mapping
from xconv.weights.convert import Template, WeightsReport
from xconv.weights.mapping import WeightMap


def build_weight_map(
    model_ir: ir.Model, *, api: str = "linen", state_keys: Collection[str] | None = None
) -> WeightMap:
    """Map every weight of ``model_ir`` to the variable the Flax emitter gives it.

    The emitter is run on the template (``model_ir`` with its own weights) and its variables
    and records handed to :func:`xconv.weights.mapping.map_weights`.

    Args:
        model_ir: The IR from ``xconv.from_torch``.
        api: ``"linen"`` or ``"nnx"``.
        state_keys: The source module's ``state_dict`` keys. Initializers outside it (a
            non-persistent buffer) are template constants, not expected in a checkpoint.
            Default: every initializer is a state_dict entry.
    """
    from xconv.converters.flax.source.emitter import generate_with_records

    _, variables, records = generate_with_records(model_ir, api=api)
    return _mapping.map_weights(model_ir, variables, records, api=api, state_keys=state_keys)


def build_template(
    template_factory: Any, example_inputs: Sequence[Any] | None = None, api: str = "linen"
) -> Template:
    """Build the torch module, trace it, and map its weights."""
    from xconv.converters.torch.importer.files import resolve_factory
    from xconv.converters.torch.importer.trace import from_torch

    built = resolve_factory(template_factory)()
    inputs = None
    if isinstance(built, tuple) and len(built) == 2:
        built, inputs = built
    if example_inputs is not None:
        inputs = example_inputs
    if inputs is None:
        raise UsageError(
            "the template module needs example inputs to be traced: let the factory return "
            "(module, inputs), or",
            missing=[("--input-shape", "each input's shape (example_inputs=)")],
        )
    if not isinstance(inputs, tuple | list):
        inputs = (inputs,)
    model_ir = from_torch(built, tuple(inputs))
    state = built.state_dict()
    keys = set(state)
    wmap = build_weight_map(model_ir, api=api, state_keys=keys)
    ptrs = {state[k].data_ptr(): k for k in wmap.entries if state[k].numel()}
    aliases = {
        k: ptrs[t.data_ptr()]
        for k, t in state.items()
        if k not in wmap.entries and k not in wmap.side and t.numel() and t.data_ptr() in ptrs
    }
    return Template(wmap, aliases, list(state))


def _weight_map(model: ir.Model | WeightMap, api: str) -> WeightMap:
    return model if isinstance(model, WeightMap) else build_weight_map(model, api=api)


def torch_to_flax(
    state_dict: Mapping[str, Any],
    model_ir: ir.Model | WeightMap,
    *,
    api: str = "linen",
    strict: bool = True,
) -> dict[str, Any]:
    """:func:`xconv.weights.mapping.torch_to_flax` from the IR (``xconv.from_torch``) or its
    prebuilt :class:`WeightMap`; ``api`` (``"linen"`` or ``"nnx"``) lays out a map built here."""
    return _mapping.torch_to_flax(state_dict, _weight_map(model_ir, api), strict=strict)


def flax_to_torch(
    variables: Mapping[str, Any],
    model_ir: ir.Model | WeightMap,
    *,
    api: str = "linen",
    side_state: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> dict[str, np.ndarray]:
    """:func:`xconv.weights.mapping.flax_to_torch` from the IR of the torch module or its
    :class:`WeightMap`; ``api`` is the Flax API the variables are laid out for."""
    return _mapping.flax_to_torch(
        variables, _weight_map(model_ir, api), side_state=side_state, strict=strict
    )


def convert_weights(
    checkpoint: str | os.PathLike,
    template_factory: Any,
    *,
    direction: str = "torch-to-flax",
    example_inputs: Sequence[Any] | None = None,
    api: str = "linen",
    **options: Any,
) -> WeightsReport:
    """:func:`xconv.weights.convert.convert_weights` from a template factory.

    Args:
        checkpoint: The checkpoint file (see :func:`xconv.weights.convert.convert_weights`).
        template_factory: ``"pkg.mod:factory"`` or a callable building the torch module (or
            ``(module, example_inputs)``), or a :class:`Template` from :func:`build_template`
            (convert many checkpoints with one trace).
        direction: ``"torch-to-flax"`` or ``"flax-to-torch"``.
        example_inputs: Inputs to trace the template with, when the factory gives none.
        api: Flax API the variables are laid out for (``"linen"`` or ``"nnx"``).
        **options: ``out``, ``format``, ``strict``, ``trust_pickle``, ``max_shard_bytes``,
            ``mesh``, ``partitioning``, as :func:`xconv.weights.convert.convert_weights` takes.
    """
    if direction not in _convert.DIRECTIONS:
        raise ConversionError(
            f"unknown direction {direction!r}; choose one of {list(_convert.DIRECTIONS)}"
        )
    if isinstance(template_factory, Template):
        template = template_factory  # prebuilt: convert many checkpoints with one trace
    else:
        template = build_template(template_factory, example_inputs, api)
    return _convert.convert_weights(checkpoint, template, direction=direction, **options)


__all__ = [
    "Template",
    "build_template",
    "build_weight_map",
    "convert_weights",
    "flax_to_torch",
    "torch_to_flax",
]
