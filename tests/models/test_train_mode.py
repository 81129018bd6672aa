"""Train mode of a converted ResNet-style CNN: batch-statistics outputs and running statistics.

The fixture (``fixtures/torch_models.py:make_resnet``) goes through ``xconv.from_torch`` then
``xconv.to_flax`` (linen and nnx); the generated module is run with ``train=True`` and compared
with torch's ``module.train()`` forward and its updated ``running_mean`` / ``running_var``.

Conventions checked:

* momentum: torch ``running = (1 - m) * running + m * batch`` with ``m = 0.1``; Flax
  ``running = m' * running + (1 - m') * batch``: the emitter writes ``momentum = 1 - m = 0.9``.
* variance: both normalise with the biased batch variance; torch updates ``running_var`` with
  the unbiased one (``n / (n - 1)``), Flax with the biased one. ``nn.BatchNorm`` has no option
  for the unbiased update, so the generated module's ``running_var`` drifts from torch's by
  ``m * var_batch / (n - 1)`` per step (see ``test_running_var_torch_convention``).
"""

from __future__ import annotations

import functools
import importlib.util
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from fixtures.torch_models import make_resnet  # noqa: E402

# Train-mode batch statistics over a 2x3x32x32 batch: float32 reductions in a different order.
RTOL, ATOL = 1e-4, 1e-4


@functools.cache
def _ir():
    module, args = make_resnet()
    return xconv.from_torch(module, args)


def _generated(tmp_path, api: str):
    out = xconv.to_flax(_ir(), tmp_path / f"resnet_{api}_{uuid.uuid4().hex[:8]}", api=api)
    spec = importlib.util.spec_from_file_location(f"gen_{uuid.uuid4().hex}", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load(out)


def _torch_train_step():
    """torch's train-mode output, and every BatchNorm's running stats after one step."""
    module, (x,) = make_resnet()
    module.train()
    with torch.no_grad():
        y = module(x).numpy()
    stats = {
        name: (m.running_mean.numpy().copy(), m.running_var.numpy().copy())
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.BatchNorm2d)
    }
    return x.numpy(), y, stats


@functools.cache
def _bn_inputs():
    """The input each BatchNorm saw in the torch train step (to compute its batch variance)."""
    module, (x,) = make_resnet()
    module.train()
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, inp[0].detach()))
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.BatchNorm2d)
    ]
    with torch.no_grad():
        module(x)
    for h in hooks:
        h.remove()
    return seen


def _flax_path(scope: str) -> tuple[str, ...]:
    """The generated linen module tree's path of a torch scope: blocks nest, a container
    index joins its container's name as linen names list elements (``layer1.0.bn1`` ->
    ``("layer1_0", "bn1")``)."""
    out: list[str] = []
    for part in scope.split("."):
        if part.isdigit() and out:
            out[-1] += f"_{part}"
        else:
            out.append(part)
    return tuple(out)


def _flax_key(scope: str) -> str:
    return "/".join(_flax_path(scope))


def _norm_stats(tree, prefix=()) -> dict:
    """``{path: {"mean", "var"}}`` of every BatchNorm in a nested batch_stats tree."""
    if "mean" in tree:
        return {"/".join(prefix): tree}
    out = {}
    for k, v in tree.items():
        out.update(_norm_stats(v, (*prefix, k)))
    return out


def _linen_train(tmp_path):
    model, variables = _generated(tmp_path, "linen")
    x, y, stats = _torch_train_step()
    out, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    stats_tree = jax.tree_util.tree_map(np.asarray, updates["batch_stats"])
    return np.asarray(out), _norm_stats(stats_tree), y, stats


def _writable(model):
    """Re-home the loaded variables as jax arrays (the generated ``load`` leaves numpy ones)."""
    from flax import nnx

    state = nnx.state(model)
    nnx.update(model, jax.tree_util.tree_map(jax.numpy.asarray, state))
    return model


def _nnx_train(tmp_path):
    from flax import nnx

    model = _writable(_generated(tmp_path, "nnx"))
    x, y, stats = _torch_train_step()
    out = np.asarray(model(x, train=True))
    got = {}
    for name in stats:
        bn = model
        for attr in _flax_path(name):
            if hasattr(bn, attr):
                bn = getattr(bn, attr)
            else:  # the model's repeated blocks are an nnx.List: layer1[0].bn1
                base, index = attr.rsplit("_", 1)
                bn = getattr(bn, base)[int(index)]
        assert isinstance(bn.mean, nnx.BatchStat)
        got[_flax_key(name)] = {"mean": np.asarray(bn.mean[...]), "var": np.asarray(bn.var[...])}
    return out, got, y, stats


_RUNNERS = {"linen": _linen_train, "nnx": _nnx_train}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One train step per API (each generation takes seconds), shared by the tests."""
    cache = {}

    def run(api):
        if api not in cache:
            cache[api] = _RUNNERS[api](tmp_path_factory.mktemp(api))
        return cache[api]

    return run


def test_nnx_loaded_module_runs_in_train_mode(tmp_path):
    model = _generated(tmp_path, "nnx")
    _, (x,) = make_resnet()
    out = model(x.numpy(), train=True)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_train_output_uses_batch_statistics(trained, api):
    out, _, want, _ = trained(api)
    assert out.shape == want.shape
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    # Guard: the eval-mode output differs, so the test really exercises batch statistics.
    module, (x,) = make_resnet()
    with torch.no_grad():
        eval_out = module(x).numpy()
    assert np.abs(eval_out - want).max() > 1e-2


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_eval_output_after_train_flag_default(tmp_path, api):
    """``train`` defaults to False: running statistics, as torch's eval()."""
    module, (x,) = make_resnet()
    with torch.no_grad():
        want = module(x).numpy()
    if api == "linen":
        model, variables = _generated(tmp_path, api)
        got = np.asarray(model.apply(variables, x.numpy()))
    else:
        got = np.asarray(_generated(tmp_path, api)(x.numpy()))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_running_mean_matches_torch(trained, api):
    _, got, _, stats = trained(api)
    assert set(got) == {_flax_key(n) for n in stats}
    for name, (mean, _) in stats.items():
        np.testing.assert_allclose(got[_flax_key(name)]["mean"], mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_running_var_torch_convention(trained, api):
    """torch's running_var update uses the unbiased batch variance; the generated module
    keeps that convention (plain Flax BatchNorm would use the biased one)."""
    _, got, _, stats = trained(api)
    for name, (_, var) in stats.items():
        np.testing.assert_allclose(got[_flax_key(name)]["var"], var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_conv_zoo_train_output(tmp_path, api):
    """BatchNorm1d / BatchNorm3d (and GroupNorm, conv variants) in train mode, dropout-free."""
    from fixtures.torch_models import make_conv_zoo

    module, args = make_conv_zoo()
    out = xconv.to_flax(xconv.from_torch(module, args), tmp_path / "zoo", api=api)
    spec = importlib.util.spec_from_file_location(f"gen_{uuid.uuid4().hex}", out / "model.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    module.train()
    with torch.no_grad():
        want = [o.numpy() for o in module(*args)]
    arrays = [a.numpy() for a in args]
    if api == "linen":
        model, variables = gen.load(out)
        got, updates = model.apply(variables, *arrays, train=True, mutable=["batch_stats"])
        assert set(updates["batch_stats"]) == {"bn1d", "bn3d"}
    else:
        got = _writable(gen.load(out))(*arrays, train=True)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), w, rtol=RTOL, atol=ATOL)
