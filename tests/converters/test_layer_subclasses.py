"""A layer is emitted as a native layer only when it computes that layer.

Subclasses of standard layers that override their forward (an embedding that scales its output,
a layer norm over channels-first data, a weight-standardised conv, a clamped linear) and user
classes that only share a framework's layer name must keep their traced body: the generated
Flax (and torch source) must equal the source framework, not the plain base layer.
"""

from __future__ import annotations

import importlib.util
import json
import uuid

import numpy as np
import pytest

import xconv
from xconv.ir.metadata import LAYER, SCOPE

RTOL, ATOL = 1e-4, 1e-5


def _import(path):
    spec = importlib.util.spec_from_file_location(f"sub_{uuid.uuid4().hex}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _first(out):
    return np.asarray(out[0] if isinstance(out, tuple | list) else out)


def _marked(model) -> dict[str, str]:
    return {
        n.metadata_props.get(SCOPE, ""): json.loads(n.metadata_props[LAYER])["kind"]
        for n in model.graph
        if LAYER in n.metadata_props
    }


def _linen(model, tmp_path, *inputs):
    out = xconv.to_flax(model, tmp_path / "linen")
    flax_model, variables = _import(out / "model.py").load(out)
    return _first(flax_model.apply(variables, *inputs))


def _torch_source(model, *inputs):
    import torch

    source, state = xconv.to_torch_source(model)
    namespace: dict = {}
    exec(compile(source, "generated", "exec"), namespace)
    generated = namespace["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        out = generated(*[torch.from_numpy(np.asarray(a)) for a in inputs])
    return (out[0] if isinstance(out, tuple | list) else out).numpy()


def _close(got, want):
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_torch_subclasses_keep_their_forward(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("flax")
    from torch import nn

    class ScaledEmbedding(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 3.0

    class ChannelsFirstLayerNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    class StandardisedConv(nn.Conv2d):
        def forward(self, x):
            w = self.weight
            w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True))
            return nn.functional.conv2d(x, w, self.bias, self.stride, self.padding)

    class ClampedLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x).clamp(-0.5, 0.5)

    class Plain(nn.Linear):  # keeps nn.Linear's forward: still a dense layer
        pass

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = ScaledEmbedding(20, 8)
            self.conv = StandardisedConv(8, 8, 3, padding=1)
            self.norm = ChannelsFirstLayerNorm(8)
            self.clamped = ClampedLinear(8, 8)
            self.plain = Plain(8, 8)

        def forward(self, ids):
            e = self.emb(ids)
            b, s, c = e.shape
            x = self.norm(self.conv(e.transpose(1, 2).reshape(b, c, 2, s // 2)))
            return self.plain(self.clamped(x.flatten(2).transpose(1, 2)))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.norm.weight.normal_()
        net.norm.bias.normal_()
    ids = torch.randint(0, 20, (2, 8))
    with torch.no_grad():
        want = net(ids).numpy()
    model = xconv.from_torch(net, (ids,))
    assert _marked(model) == {"plain": "dense"}
    _close(_linen(model, tmp_path, ids.numpy()), want)
    _close(_torch_source(model, ids.numpy()), want)


def test_flax_subclasses_keep_their_call(tmp_path):
    jax = pytest.importorskip("jax")
    pytest.importorskip("torch")
    import flax.linen as nn
    import jax.numpy as jnp

    class ScaledEmbed(nn.Embed):
        def __call__(self, ids):
            return super().__call__(ids) * 3.0

    class Dense(nn.Module):  # a user class that only shares Flax's name
        features: int

        @nn.compact
        def __call__(self, x):
            k = self.param("kernel", nn.initializers.normal(1.0), (x.shape[-1], self.features))
            return jnp.tanh(x @ k) * 2.0

    class WideDense(nn.Dense):  # keeps Flax's __call__: still a dense layer
        pass

    class Net(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return WideDense(8)(Dense(8)(ScaledEmbed(20, 8)(ids)))

    net = Net()
    ids = np.random.RandomState(0).randint(0, 20, (2, 8)).astype(np.int32)
    variables = net.init(jax.random.PRNGKey(0), ids)
    want = np.asarray(net.apply(variables, ids))
    model = xconv.from_flax(net, variables, (ids,))
    assert _marked(model) == {"WideDense_0": "dense"}
    _close(_linen(model, tmp_path, ids), want)
    _close(_torch_source(model, ids), want)


def test_keras_subclasses_keep_their_call(tmp_path):
    keras = pytest.importorskip("keras")
    pytest.importorskip("tensorflow")
    pytest.importorskip("torch")
    pytest.importorskip("flax")

    class ScaledDense(keras.layers.Dense):
        def call(self, x):
            return super().call(x) * 3.0

    class Dense(keras.layers.Dense):  # overrides call under Keras's own name
        def call(self, x):
            return keras.ops.tanh(super().call(x)) * 2.0

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,), batch_size=2)
    x = ScaledDense(8, name="scaled")(inputs)
    x = Dense(8, name="tanh")(x)
    outputs = keras.layers.Dense(4, name="plain")(x)
    net = keras.Model(inputs, outputs)
    xs = np.random.RandomState(0).randn(2, 6).astype(np.float32)
    want = np.asarray(net(xs))
    model = xconv.from_tf(net, (xs,))
    assert set(_marked(model).values()) == {"dense"}
    assert [s for s in _marked(model) if "plain" in s]
    assert not [s for s in _marked(model) if "scaled" in s or "tanh" in s]
    _close(_linen(model, tmp_path, xs), want)
    _close(_torch_source(model, xs), want)
