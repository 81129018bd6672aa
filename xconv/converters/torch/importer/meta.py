"""Trace a torch module without its weights: parameters as fake tensors, buffers real.

A checkpoint larger than memory cannot be loaded to trace the model. Here the module is built
with every parameter created on the ``meta`` device (no bytes), then swapped for a
``FakeTensor`` on the CPU (shape, dtype and device, no storage) so ``torch.export`` traces it
as it would the real module. Buffers are built for real: the non-persistent ones (rotary
``inv_freq``, ``position_ids``) are not in a checkpoint and are small, so they are computed by
the module's own constructor. The IR's weights are then lazy references into the checkpoint
(:func:`xconv.weights.lazy.attach`): nothing is read until a target is written.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xconv.errors import ConversionError


@dataclass
class MetaModule:
    """A module whose parameters hold no data, and what the checkpoint must provide.

    Attributes:
        module: The module (parameters are fake CPU tensors; buffers are real).
        expected: ``{state_dict key: (shape, numpy dtype name)}`` of the checkpoint entries.
        tied: ``{key: key it shares storage with}`` for parameters registered twice (an
            embedding reused as the LM head): a checkpoint may store one of them.
        config: The config object the module was built from (None for a bare factory).
        build: Rebuilds the module the same way, with empty parameters (for the parity
            check, which loads one block's weights at a time).
    """

    module: nn.Module
    expected: dict[str, tuple[tuple[int, ...], str]]
    tied: dict[str, str]
    config: Any
    build: Callable[[], nn.Module]


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block is created on the meta device."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_config(factory: Any, config: str | os.PathLike | Mapping | None) -> Any:
    """The config object ``factory`` takes: a transformers class's ``config_class`` built from
    the JSON, else the JSON dict itself (None without a config)."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        data = dict(config)
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConversionError(f"cannot read the config {path}: {e}") from e
    config_class = getattr(factory, "config_class", None)
    if config_class is None:
        return data
    cfg = config_class.from_dict(data)
    # The traced forward returns logits only; a KV cache object is not an exportable output.
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    return cfg


def _dtype_of(config: Any) -> torch.dtype | None:
    raw = None
    for key in ("dtype", "torch_dtype"):
        raw = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if raw is not None:
            break
    if raw is None:
        return None
    if isinstance(raw, torch.dtype):
        return raw
    value = getattr(torch, str(raw).removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def build_meta_module(
    factory: Callable[..., Any],
    config: Any = None,
    *,
    dtype: torch.dtype | None = None,
) -> MetaModule:
    """Build ``factory(config)`` (or ``factory()``) with no parameter data.

    Args:
        factory: A module class taking the config (transformers ``LlamaForCausalLM``), or a
            function returning the module (or ``(module, example_inputs)``).
        config: What :func:`load_config` returned.
        dtype: Parameter dtype (default: the config's ``torch_dtype``, else the factory's).
    """
    dtype = dtype or _dtype_of(config)

    def build() -> nn.Module:
        previous = torch.get_default_dtype()
        if dtype is not None and dtype.is_floating_point:
            torch.set_default_dtype(dtype)
        try:
            with params_on_meta():
                built = factory(config) if config is not None else factory()
        except Exception as e:
            raise ConversionError(
                f"building {getattr(factory, '__name__', factory)} failed: {e}"
            ) from e
        finally:
            torch.set_default_dtype(previous)
        module = built[0] if isinstance(built, tuple) else built
        if not isinstance(module, nn.Module):
            raise ConversionError(
                f"the module factory returned {type(module).__name__}, not an nn.Module"
            )
        return module.eval()

    module = build()
    if dtype is not None:
        for _, p in module.named_parameters():
            if p.dtype.is_floating_point and p.dtype != dtype:
                p.data = p.data.to(dtype)
    tied = _tied(module)
    expected: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        expected[name] = (tuple(tensor.shape), _numpy_name(tensor.dtype))
    fakeify(module)
    return MetaModule(module, expected, tied, config, build)


def _tied(module: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
            tied.setdefault(first[id(p)], name)
        else:
            first[id(p)] = name
    return tied


def _numpy_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fakeify(module: nn.Module) -> None:
    """Replace every meta parameter by a FakeTensor on the CPU (ties kept)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    done: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                with mode:
                    fake = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                done[id(p)] = nn.Parameter(fake, requires_grad=False)
            mod._parameters[key] = done[id(p)]


def linear_weights(module: nn.Module) -> set[str]:
    """State-dict keys of every ``nn.Linear`` weight: a torch ``(out, in)`` matrix that a Flax
    ``Dense`` stores as its ``(in, out)`` kernel.

    Only a guess that lets the weights stream while the module is still being traced
    (:class:`xconv.weights.stream.EarlyStream`); the layout the emitter actually chose is
    compared with it afterwards, and a disagreement means the weights are streamed again.
    """
    keys = set()
    for prefix, mod in module.named_modules(remove_duplicate=False):
        if isinstance(mod, nn.Linear) and mod.weight is not None and mod.weight.dim() == 2:
            keys.add(f"{prefix}.weight" if prefix else "weight")
    return keys


def default_inputs(config: Any, input_shapes: tuple[str, ...] = ()) -> tuple[Any, ...] | None:
    """Token ids ``(1, 8)`` for a config with a vocabulary, else None (inputs needed)."""
    if input_shapes:
        from xconv.converters.torch.importer.files import example_inputs

        return tuple(example_inputs(list(input_shapes), ["float32"]))
    vocab = (
        config.get("vocab_size")
        if isinstance(config, Mapping)
        else getattr(config, "vocab_size", None)
    )
    if vocab:
        generator = torch.Generator().manual_seed(0)
        return (torch.randint(0, int(vocab), (1, 8), generator=generator),)
    return None


__all__ = [
    "MetaModule",
    "build_meta_module",
    "default_inputs",
    "fakeify",
    "linear_weights",
    "load_config",
    "params_on_meta",
]
