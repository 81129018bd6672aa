"""Hand-written Flax (linen) models for ``bench_throughput.py``: what a Flax user would write.

ResNet (basic or bottleneck blocks, transformers' ``ResNetForImageClassification`` layout),
BERT (transformers' ``BertModel`` without pooler, post-LN) and a pre-LN transformer encoder
(``nn.MultiheadAttention``-style fused in-projection). Channels-last images (NHWC), as Flax
code is written; ``dtype`` is the compute dtype, parameters stay float32 (``param_dtype``).

``load_torch(variables, state_dict, ...)`` fills a model's variables from the torch
``state_dict`` of the same architecture, so the benchmark runs the same weights on every path
and the parity of this model against torch can be checked like any other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Dtype = Any


class ConvBN(nn.Module):
    """Conv (no bias, torch-style symmetric padding) + batch norm + optional ReLU."""

    features: int
    kernel: int = 3
    strides: int = 1
    act: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        p = self.kernel // 2
        x = nn.Conv(
            self.features,
            (self.kernel, self.kernel),
            (self.strides, self.strides),
            padding=((p, p), (p, p)),
            use_bias=False,
            dtype=self.dtype,
            name="convolution",
        )(x)
        x = nn.BatchNorm(
            use_running_average=True, epsilon=1e-5, dtype=self.dtype, name="normalization"
        )(x)
        return nn.relu(x) if self.act else x


class BasicBlock(nn.Module):
    features: int
    strides: int = 1
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        residual = x
        if x.shape[-1] != self.features or self.strides != 1:
            residual = ConvBN(
                self.features, 1, self.strides, act=False, dtype=self.dtype, name="shortcut"
            )(x)
        y = ConvBN(self.features, 3, self.strides, dtype=self.dtype, name="layer_0")(x)
        y = ConvBN(self.features, 3, act=False, dtype=self.dtype, name="layer_1")(y)
        return nn.relu(y + residual)


class Bottleneck(nn.Module):
    features: int
    strides: int = 1
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        residual = x
        if x.shape[-1] != self.features or self.strides != 1:
            residual = ConvBN(
                self.features, 1, self.strides, act=False, dtype=self.dtype, name="shortcut"
            )(x)
        y = ConvBN(self.features // 4, 1, dtype=self.dtype, name="layer_0")(x)
        y = ConvBN(self.features // 4, 3, self.strides, dtype=self.dtype, name="layer_1")(y)
        y = ConvBN(self.features, 1, act=False, dtype=self.dtype, name="layer_2")(y)
        return nn.relu(y + residual)


class Stage(nn.Module):
    block: Callable[..., nn.Module]
    features: int
    depth: int
    strides: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = self.block(
                self.features, self.strides if i == 0 else 1, dtype=self.dtype, name=f"layers_{i}"
            )(x)
        return x


class Stem(nn.Module):
    features: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = ConvBN(self.features, 7, 2, dtype=self.dtype, name="embedder")(x)
        return nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))


class ResNet(nn.Module):
    """ResNet classifier on NHWC images; logits in float32."""

    depths: Sequence[int] = (3, 4, 6, 3)
    hidden_sizes: Sequence[int] = (256, 512, 1024, 2048)
    embedding_size: int = 64
    bottleneck: bool = True
    num_classes: int = 1000
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        block = Bottleneck if self.bottleneck else BasicBlock
        x = Stem(self.embedding_size, dtype=self.dtype, name="embedder")(x.astype(self.dtype))
        for i, (features, depth) in enumerate(zip(self.hidden_sizes, self.depths, strict=True)):
            x = Stage(
                block, features, depth, 1 if i == 0 else 2, dtype=self.dtype, name=f"stages_{i}"
            )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype, name="classifier_1")(x)
        return x.astype(jnp.float32)


def _attention(q, k, v, heads: int, dtype: Dtype):
    b, s, d = q.shape
    split = lambda t: t.reshape(b, s, heads, d // heads)  # noqa: E731
    out = nn.dot_product_attention(split(q), split(k), split(v), dtype=dtype)
    return out.reshape(b, s, d)


class BertSelfAttention(nn.Module):
    hidden: int
    heads: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        dense = lambda name: nn.Dense(self.hidden, dtype=self.dtype, name=name)  # noqa: E731
        return _attention(
            dense("query")(x), dense("key")(x), dense("value")(x), self.heads, self.dtype
        )


class BertLayer(nn.Module):
    hidden: int
    heads: int
    intermediate: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        ln = lambda name: nn.LayerNorm(epsilon=1e-12, dtype=self.dtype, name=name)  # noqa: E731
        a = BertSelfAttention(self.hidden, self.heads, self.dtype, name="attention_self")(x)
        a = nn.Dense(self.hidden, dtype=self.dtype, name="attention_output_dense")(a)
        x = ln("attention_output_LayerNorm")(a + x)
        h = nn.gelu(
            nn.Dense(self.intermediate, dtype=self.dtype, name="intermediate_dense")(x),
            approximate=False,
        )
        h = nn.Dense(self.hidden, dtype=self.dtype, name="output_dense")(h)
        return ln("output_LayerNorm")(h + x)


class Bert(nn.Module):
    """BERT encoder on token ids; returns the last hidden state (float32)."""

    vocab_size: int = 30522
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids):
        s = input_ids.shape[1]
        embed = lambda n, name: nn.Embed(n, self.hidden, dtype=self.dtype, name=name)  # noqa: E731
        x = (
            embed(self.vocab_size, "embeddings_word_embeddings")(input_ids)
            + embed(self.max_positions, "embeddings_position_embeddings")(jnp.arange(s))[None]
            + embed(self.type_vocab_size, "embeddings_token_type_embeddings")(
                jnp.zeros_like(input_ids)
            )
        )
        x = nn.LayerNorm(epsilon=1e-12, dtype=self.dtype, name="embeddings_LayerNorm")(x)
        for i in range(self.layers):
            x = BertLayer(
                self.hidden, self.heads, self.intermediate, self.dtype, name=f"encoder_layer_{i}"
            )(x)
        return x.astype(jnp.float32)


class PreLNBlock(nn.Module):
    d: int
    heads: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln1")(x)
        q, k, v = jnp.split(
            nn.Dense(3 * self.d, dtype=self.dtype, name="attn_in_proj")(h), 3, axis=-1
        )
        x = x + nn.Dense(self.d, dtype=self.dtype, name="attn_out_proj")(
            _attention(q, k, v, self.heads, self.dtype)
        )
        h = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln2")(x)
        h = nn.Dense(self.d, dtype=self.dtype, name="ff2")(
            nn.gelu(nn.Dense(4 * self.d, dtype=self.dtype, name="ff1")(h), approximate=False)
        )
        return x + h


class Encoder(nn.Module):
    """Pre-LN transformer encoder on (batch, seq, d) float inputs, final LayerNorm."""

    d: int = 256
    heads: int = 4
    layers: int = 4
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = x.astype(self.dtype)
        for i in range(self.layers):
            x = PreLNBlock(self.d, self.heads, self.dtype, name=f"layers_{i}")(x)
        return nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="norm")(x).astype(jnp.float32)


# --- weights from torch --------------------------------------------------------------------

_LEAF = {
    "kernel": "weight",
    "scale": "weight",
    "embedding": "weight",
    "bias": "bias",
    "mean": "running_mean",
    "var": "running_var",
}


_MODULE_RENAMES = (
    ("attention_self", "attention.self"),
    ("attention_output_", "attention.output."),
    ("embeddings_", "embeddings."),
    ("encoder_layer", "encoder.layer"),
    ("intermediate_dense", "intermediate.dense"),
    ("output_dense", "output.dense"),
    ("output_LayerNorm", "output.LayerNorm"),
    ("attn_out_proj", "attn.out_proj"),
    ("attn_in_proj", "attn.in_proj"),
)


def torch_key(path: Sequence[str]) -> str:
    """Flax variable path -> torch ``state_dict`` key: ``stages_0`` -> ``stages.0``,
    ``attention_self`` -> ``attention.self``, ``attn_in_proj/kernel`` -> ``attn.in_proj_weight``."""
    *mods, leaf = path
    parts = []
    for m in mods:
        m = re.sub(r"_(\d+)", r".\1", m)
        for a, b in _MODULE_RENAMES:
            m = m.replace(a, b)
        parts.append(m)
    if parts and parts[-1] == "attn.in_proj":  # torch keeps the fused projection unwrapped
        return ".".join(parts) + "_" + _LEAF[leaf]
    return ".".join([*parts, _LEAF[leaf]])


def load_torch(variables: Any, state_dict: dict, prefix: str = "") -> Any:
    """``variables`` (a template from ``init``) filled from a torch ``state_dict``: kernels
    transposed to Flax's layout (OIHW -> HWIO, (out, in) -> (in, out))."""
    flat = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(variables)[0]:
        names = [k.key for k in key_path]
        key = prefix + torch_key(names[1:])
        if key not in state_dict:
            raise KeyError(f"{'/'.join(names)}: no {key!r} in the torch state_dict")
        value = state_dict[key].detach().cpu().numpy()
        if names[-1] == "kernel":
            value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T
        if value.shape != leaf.shape:
            raise ValueError(f"{key}: torch {value.shape} vs Flax {leaf.shape}")
        flat[tuple(names)] = jnp.asarray(value, dtype=leaf.dtype)
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[tuple(k.key for k in p)], variables)


def from_torch_state(
    module: nn.Module, example: np.ndarray, state_dict: dict, prefix: str = ""
) -> Any:
    """Init ``module`` on ``example`` (shapes only) and load the torch weights."""
    template = jax.eval_shape(module.init, jax.random.PRNGKey(0), example)
    template = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), template)
    return load_torch(template, state_dict, prefix)


def resnet_state(state_dict: dict) -> dict:
    """transformers ``ResNetForImageClassification`` keys as :class:`ResNet` names them."""
    return {
        k.removeprefix("resnet.").replace("encoder.stages.", "stages."): v
        for k, v in state_dict.items()
    }
