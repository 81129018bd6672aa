"""Flax fixtures -> PyTorch, eval and train mode, through the runtime and the readable source.

Each fixture of ``fixtures/flax_models.py`` (linen and nnx: MLP, CNN with BatchNorm,
transformer block with attention / LayerNorm / GELU / Embed / Dropout) goes through
``xconv.from_flax`` and then ``xconv.to_torch`` (runtime) and ``xconv.to_torch_source``
(generated ``nn.Module``). Eval: outputs match the Flax module. Train: BatchNorm normalises
with batch statistics and updates the running statistics with Flax's rule (biased variance,
momentum ``1 - flax_momentum``); dropout sits where Flax's is, with its rate: with the same
dropout mask forced on both sides the train-mode outputs match.
"""

from __future__ import annotations

import contextlib
import functools

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xconv  # noqa: E402
from fixtures import flax_models as fm  # noqa: E402
from tests.torch_source import load_generated  # noqa: E402

LINEN = ["linen_mlp", "linen_cnn", "linen_transformer"]
NNX = ["nnx_mlp", "nnx_cnn", "nnx_transformer"]
ATOL = RTOL = 1e-5


@functools.cache
def _converted(name: str):
    module, variables, xs = fm.build(name)
    return xconv.from_flax(module, variables, xs), xs


def _build(name: str):
    """A fresh fixture (nnx modules are stateful: train mode updates them)."""
    return fm.build(name)


def _source_module(tmp_path, model):
    return load_generated(model, tmp_path)


def _runtime_module(model):
    built = xconv.to_torch(model)
    return built[0] if isinstance(built, tuple) else built


def _run(module, xs):
    with torch.no_grad():
        out = module(*[torch.from_numpy(np.asarray(x)) for x in xs])
    out = out[0] if isinstance(out, tuple | list) else out
    return out.numpy()


def _flax_eval(name):
    module, variables, xs = _build(name)
    return np.asarray(module.apply(variables, *xs) if variables is not None else module(*xs))


@pytest.mark.parametrize("route", ["runtime", "source"])
@pytest.mark.parametrize("name", LINEN + NNX)
def test_eval_parity(tmp_path, name, route):
    model, xs = _converted(name)
    module = _source_module(tmp_path, model)[0] if route == "source" else _runtime_module(model)
    module.eval()
    np.testing.assert_allclose(_run(module, xs), _flax_eval(name), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["linen_cnn", "nnx_cnn", "linen_transformer", "nnx_transformer"])
def test_source_uses_native_layers(tmp_path, name):
    model, _ = _converted(name)
    _, source = _source_module(tmp_path, model)
    if name.endswith("cnn"):
        assert source.count("nn.Conv2d(") == 2
        assert source.count("= BiasedVarBatchNorm2d(") == 2  # Flax's running-variance rule
        # channels-first between layers: one transpose at the input, one before the flatten
        assert source.count(".permute(0, 3, 1, 2)") == 1
        assert source.count(".permute(0, 2, 3, 1)") == 1
    else:
        assert "nn.Embedding(50, 32)" in source
        assert source.count("nn.LayerNorm(") == (3 if name.startswith("linen") else 2)
        assert "nn.MultiheadAttention(32, 4" in source
        assert "nn.Dropout(0.1)" in source


def _flax_train_cnn(name):
    """Flax train-mode output and the updated running statistics {bn: (mean, var)}."""
    module, variables, xs = _build(name)
    if variables is not None:
        out, updates = module.clone(train=True).apply(variables, *xs, mutable=["batch_stats"])
        stats = {k: (b["mean"], b["var"]) for k, b in updates["batch_stats"].items()}
    else:
        module.train()
        out = module(*xs)
        stats = {
            k: (getattr(module, k).mean[...], getattr(module, k).var[...]) for k in ("bn1", "bn2")
        }
    return np.asarray(out), {k: (np.asarray(m), np.asarray(v)) for k, (m, v) in stats.items()}


@pytest.mark.parametrize("route", ["runtime", "source"])
@pytest.mark.parametrize("name", ["linen_cnn", "nnx_cnn"])
def test_train_mode_batch_norm(tmp_path, name, route):
    model, xs = _converted(name)
    module = _source_module(tmp_path, model)[0] if route == "source" else _runtime_module(model)
    module.train()
    ref, stats = _flax_train_cnn(name)
    np.testing.assert_allclose(_run(module, xs), ref, atol=1e-4, rtol=1e-4)
    state = module.state_dict()
    for bn, (mean, var) in stats.items():
        suffix = ("running_mean", "running_var") if route == "source" else ("mean", "var")
        np.testing.assert_allclose(state[f"{bn}.{suffix[0]}"].numpy(), mean, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(state[f"{bn}.{suffix[1]}"].numpy(), var, atol=1e-6, rtol=1e-5)
    module.eval()  # and back: eval mode uses the updated running statistics
    assert not any(m.training for m in module.modules())


@contextlib.contextmanager
def _forced_dropout(mask: np.ndarray):
    """Make Flax (linen and nnx) and torch dropout apply ``mask`` (kept units) in train mode."""
    from flax import linen as nn
    from flax import nnx

    def flax_drop(rate, x):
        return jnp.where(jnp.asarray(mask), x / (1.0 - rate), 0.0)

    def linen_hook(next_fun, args, kwargs, context):
        m = context.module
        if isinstance(m, nn.Dropout) and context.method_name == "__call__":
            deterministic = nn.merge_param(
                "deterministic", m.deterministic, kwargs.get("deterministic")
            )
            return args[0] if deterministic else flax_drop(m.rate, args[0])
        return next_fun(*args, **kwargs)

    original_nnx = nnx.Dropout.__call__

    def nnx_call(self, x, *a, **k):
        return x if self.deterministic else flax_drop(self.rate, x)

    original_torch = torch.nn.functional.dropout

    def torch_drop(x, p=0.5, training=True, inplace=False):
        if not training:
            return x
        return torch.where(torch.from_numpy(mask), x / (1.0 - p), torch.zeros((), dtype=x.dtype))

    nnx.Dropout.__call__ = nnx_call
    torch.nn.functional.dropout = torch_drop
    try:
        with nn.intercept_methods(linen_hook):
            yield
    finally:
        nnx.Dropout.__call__ = original_nnx
        torch.nn.functional.dropout = original_torch


@pytest.mark.parametrize("name", ["linen_transformer", "nnx_transformer"])
def test_train_mode_dropout_same_mask(tmp_path, name):
    model, xs = _converted(name)
    module, _ = _source_module(tmp_path, model)
    module.train()
    mask = np.random.default_rng(3).random((2, 7, 32)) >= 0.1
    flax_module, variables, _ = _build(name)
    with _forced_dropout(mask):
        if variables is not None:
            ref = flax_module.clone(train=True).apply(variables, *xs)
        else:
            flax_module.train()
            ref = flax_module(*xs)
        out = _run(module, xs)
    np.testing.assert_allclose(out, np.asarray(ref), atol=ATOL, rtol=RTOL)
    # the mask matters: eval mode (no dropout) gives another result
    module.eval()
    assert np.abs(_run(module, xs) - np.asarray(ref)).max() > 1e-3


def test_runtime_dropout_is_active_in_train_mode():
    model, xs = _converted("nnx_transformer")
    module = _runtime_module(model)
    module.train()
    torch.manual_seed(0)
    a, b = _run(module, xs), _run(module, xs)
    assert np.abs(a - b).max() > 1e-3  # fresh masks each call
    module.eval()
    np.testing.assert_allclose(_run(module, xs), _flax_eval("nnx_transformer"), atol=ATOL)
