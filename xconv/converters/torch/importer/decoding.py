"""A causal LM as one cached decoding step: the function a converted LM generates with.

``from_torch(model, generate=True)`` converts :class:`CachedStep` instead of the model's plain
forward. Its inputs are ``input_ids`` ``(batch, seq)``, ``cache_position`` ``(seq,)`` (the
cache slots the tokens are written to), ``attention_mask`` ``(batch, max_length)`` (0 at a
left-padded row's padding slots; a token's position is the count of unmasked slots before
it) and, per decoder layer ``i``, ``key_i`` / ``value_i`` of shape ``(batch, kv_heads, max_length, head_dim)``;
its outputs are the logits ``(batch, seq, vocab)`` and the updated ``key_i`` / ``value_i``.
Prefill (many tokens) and decode (one token) are the same call, and batch, seq and
``max_length`` stay symbolic, so one conversion serves any prompt and cache length.

The step runs the model's own attention, RoPE and masking code against transformers'
``StaticCache``, whose layers are made functional: ``update`` writes the new keys and values
with an out-of-place ``scatter`` (no input is mutated, so the exported graph is a pure
function of its inputs) and the cache length is read from the cache inputs' shape, so the
mask is built over ``max_length`` symbolically.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from xconv.errors import ConversionError

#: ``model.metadata_props`` key of the step's description (JSON): ``layers`` (key / value
#: heads and head sizes per layer), ``eos_token_id``, ``pad_token_id``, ``vocab_size``.
GENERATE = "xconv.generate"
#: Example sizes the step is traced at: distinct from each other and from the model's head
#: counts and widths, since torch.export gives dimensions of one example size one symbol.
_BATCH, _SEQ, _MAX_LENGTH = 2, 7, 13


def cache_layout(model: nn.Module) -> list[dict[str, int]]:
    """Per decoder layer ``{"key_heads", "key_dim", "value_heads", "value_dim"}``, read from
    the cache one forward of two tokens fills (so GQA/MQA, partial head sizes and models
    that size their heads their own way are read, not guessed)."""
    ids = torch.zeros((1, 2), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    cache = getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if cache is None or not layers:
        raise ConversionError(
            f"{type(model).__name__} returned no key/value cache (past_key_values): generate=True "
            "takes a transformers causal LM (a *ForCausalLM class) that caches its attention"
        )
    layout = []
    for i, layer in enumerate(layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            raise ConversionError(
                f"layer {i} of {type(model).__name__}'s cache ({type(layer).__name__}) holds no "
                "(batch, heads, seq, head_dim) keys: only attention caches convert with "
                "generate=True (recurrent or linear-attention layers do not)"
            )
        layout.append(
            {
                "key_heads": int(keys.shape[1]),
                "key_dim": int(keys.shape[3]),
                "value_heads": int(values.shape[1]),
                "value_dim": int(values.shape[3]),
            }
        )
    return layout


def _sliding_windows(config: Any) -> list[int]:
    """The sliding windows of the model's layers (empty when every layer attends fully)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    if window is None:
        return []
    if types and not any("sliding" in str(t) for t in types):
        return []
    return [int(window)]


class _FunctionalLayer:
    """What a transformers cache layer must answer during one forward, over given tensors.

    A ``StaticLayer`` (its class, so transformers' isinstance checks hold) with
    ``keys`` / ``values`` the step's inputs and ``cumulative_length`` the first slot written;
    ``update`` returns new tensors instead of writing in place.
    """

    @staticmethod
    def attach(
        layer: Any,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        layer.keys, layer.values = keys, values
        layer.is_initialized = True
        layer.device = keys.device
        layer.batch_size, layer.num_heads = keys.shape[0], keys.shape[1]
        layer.k_head_dim, layer.v_head_dim = keys.shape[3], values.shape[3]
        layer.max_cache_len = keys.shape[2]  # symbolic: the mask spans the cache inputs
        layer.cumulative_length = start

        def update(key_states, value_states, *args, **kwargs):
            layer.keys = _write(layer.keys, slots, key_states)
            layer.values = _write(layer.values, slots, value_states)
            return layer.keys, layer.values

        layer.update = update


def _write(cache: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``cache`` with ``states`` written at ``slots`` along the length axis, out of place.

    A ``scatter`` along axis 2 (ONNX ScatterElements): ``index_copy`` exports as a ScatterND
    on the length axis moved to the front, a transpose of the whole cache before and after
    every write."""
    index = slots.view(1, 1, -1, 1).expand(states.shape)
    return cache.scatter(2, index, states.to(cache.dtype))


class CachedStep(nn.Module):
    """``model`` as one cached step (see the module docstring); ``forward`` is made per model
    with one named argument per cache tensor, so the converted model's arguments are named."""

    def __init__(self, model: nn.Module, layout: list[dict[str, int]]) -> None:
        super().__init__()
        self.model = model
        self.layout = layout

    def step(
        self,
        input_ids: torch.Tensor,
        cache_position: torch.Tensor,
        attention_mask: torch.Tensor,
        *cache: torch.Tensor,
    ):
        from transformers.cache_utils import StaticCache, StaticLayer

        # Built at a placeholder length: each layer then takes the cache inputs' (symbolic) one.
        static = StaticCache(config=self.model.config, max_cache_len=_MAX_LENGTH)
        if len(static.layers) != len(self.layout):
            raise ConversionError(
                f"transformers' StaticCache has {len(static.layers)} layers for "
                f"{type(self.model).__name__}, its cache {len(self.layout)}"
            )
        for i in range(len(static.layers)):
            # Every layer a full-attention one: a sliding layer's ring-buffer bookkeeping is
            # not written; a window at least as long as the cache masks nothing.
            layer = static.layers[i] = StaticLayer(max_cache_len=_MAX_LENGTH)
            _FunctionalLayer.attach(
                layer, cache[2 * i], cache[2 * i + 1], cache_position[0], cache_position
            )
        # Each row's positions count its unmasked slots, as transformers' generate numbers a
        # left-padded row (a padding slot at 1, masked out as a key).
        mask = attention_mask.to(torch.long)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        positions = positions.index_select(1, cache_position)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=static,
            use_cache=True,
        )
        return (out.logits, *[t for layer in static.layers for t in (layer.keys, layer.values)])


def cache_names(n_layers: int) -> list[str]:
    return [name for i in range(n_layers) for name in (f"key_{i}", f"value_{i}")]


def step_module(model: nn.Module) -> tuple[CachedStep, tuple[torch.Tensor, ...], dict[str, Any]]:
    """The cached step of a transformers causal LM, its example inputs and its description
    (stored as :data:`GENERATE`). Refuses, naming the reason, a model that is not a causal LM
    or has no attention cache. A sliding-window model converts with its window as the
    longest cache (its ring-buffer cache past the window is not written)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise ConversionError(
            f"generate=True takes a transformers causal LM (a *ForCausalLM with a config and "
            f"generate()), got {type(model).__name__}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ConversionError(
            f"{type(model).__name__} is an encoder-decoder model: generate=True converts decoder-only "
            "causal LMs"
        )
    # A sliding window at least as long as the cache masks nothing: the step attends fully and
    # the generated model refuses a cache longer than the window (or than the positions).
    windows = _sliding_windows(config)
    positions = getattr(config, "max_position_embeddings", None)
    limits = [*windows, *([int(positions)] if positions else [])]
    was_training = model.training
    model.eval()
    try:
        layout = cache_layout(model)
    finally:
        model.train(was_training)
    step = CachedStep(model, layout)
    # from_torch restores the training flag of the module it converts: the model's, not the
    # new wrapper's (True), or every submodule of the model would be left in training mode.
    step.training = was_training
    names = cache_names(len(layout))
    namespace: dict[str, Any] = {}
    arguments = ", ".join(names)
    exec(  # noqa: S102 (a fixed template over identifiers made here)
        f"def forward(self, input_ids, cache_position, attention_mask, {arguments}):\n"
        f"    return self.step(input_ids, cache_position, attention_mask, {arguments})\n",
        namespace,
    )
    step.forward = namespace["forward"].__get__(step)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(vocab, 2), (_BATCH, _SEQ), generator=generator)
    cache = []
    for entry in layout:
        for heads, dim in ((entry["key_heads"], entry["key_dim"]),
                           (entry["value_heads"], entry["value_dim"])):  # fmt: skip
            cache.append(torch.zeros((_BATCH, heads, _MAX_LENGTH, dim), dtype=dtype))
    # The second row left-padded by two slots, so the traced step reads the mask as data.
    mask = torch.ones((_BATCH, _MAX_LENGTH), dtype=torch.long)
    mask[1, :2] = 0
    example = (ids, torch.arange(_SEQ), mask, *cache)
    generation = getattr(model, "generation_config", None)
    description = {
        "layers": layout,
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_id": _token(getattr(generation, "eos_token_id", None), config, "eos_token_id"),
        "pad_token_id": _token(getattr(generation, "pad_token_id", None), config, "pad_token_id"),
        "vocab_size": vocab,
        "max_length": min(limits) if limits else None,
        "sliding_window": min(windows) if windows else None,
    }
    return step, example, description


def _token(value: Any, config: Any, name: str) -> int | None:
    if value is None:
        value = getattr(config, name, None)
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return None if value is None else int(value)


def rename_cache_dims(model: Any) -> None:
    """Name the symbolic dims of the step's IR by role: the cache length ``max_length``
    (the importer's role guess reads a float rank-4 input's dim 2 as ``height``)."""
    import onnx_ir as ir

    graph = model.graph
    first = next((v for v in graph.inputs if v.name == "key_0"), None)
    if first is None or first.shape is None:
        return
    dim = first.shape[2]
    if not isinstance(dim, ir.SymbolicDim) or not dim.value:
        return
    old = dim.value

    def rename(value: ir.Value) -> None:
        if value.shape is None:
            return
        dims = list(value.shape.dims)
        if any(isinstance(d, ir.SymbolicDim) and d.value == old for d in dims):
            value.shape = ir.Shape(
                [
                    ir.SymbolicDim("max_length")
                    if isinstance(d, ir.SymbolicDim) and d.value == old
                    else d
                    for d in dims
                ]
            )

    for value in graph.inputs:
        rename(value)
    for value in graph.outputs:
        rename(value)
    for node in graph.all_nodes() if hasattr(graph, "all_nodes") else graph:
        for value in node.outputs:
            rename(value)


def describe(model: Any, description: dict[str, Any]) -> None:
    model.metadata_props[GENERATE] = json.dumps(description, sort_keys=True)


def read(model: Any) -> dict[str, Any] | None:
    """The step description of a model converted with ``generate=True``, else ``None``."""
    raw = model.metadata_props.get(GENERATE)
    return json.loads(raw) if raw else None
