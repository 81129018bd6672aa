"""torch -> Flax -> torch through the full conversions: the original state_dict comes back.

Each torch fixture goes ``xconv.from_torch`` -> ``xconv.to_flax`` (a written ``model.py`` +
``variables.msgpack``, linen and nnx) -> the generated module loaded as a user would ->
``xconv.from_flax`` -> ``xconv.to_torch_source``. The generated ``model.py`` records the source
names (``SOURCE_SCOPES`` / ``SOURCE_NAMES``), so the final state_dict has the original keys,
dtypes and values bit for bit, the final module reproduces the original in eval and train
mode, and the CLI route (``xconv torch-to-flax`` then ``xconv flax-to-torch``) does the same.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import uuid
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("flax")

import xconv  # noqa: E402
from fixtures.torch_models import FIXTURES  # noqa: E402


def _exec_file(path):
    spec = importlib.util.spec_from_file_location(f"gen_{uuid.uuid4().hex}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _round_trip(name: str, api: str, tmp: str):
    module, inputs = FIXTURES[name]()
    module.eval()
    out = xconv.to_flax(xconv.from_torch(module, inputs), f"{tmp}/{name}_{api}", api=api)
    loaded = _exec_file(out / "model.py").load(out)
    xs = tuple(x.numpy() for x in inputs)
    if api == "linen":
        back = xconv.from_flax(loaded[0], loaded[1], xs)
    else:
        back = xconv.from_flax(loaded, None, xs)
    source, state = xconv.to_torch_source(back)
    path = out.parent / f"{name}_{api}_torch.py"
    path.write_text(source)
    gen = _exec_file(path).Model()
    gen.load_state_dict(state)
    return module, inputs, gen, state


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("round_trip"))


def _outputs(module, inputs):
    with torch.no_grad():
        out = module(*inputs)
    return [o.numpy() for o in (out if isinstance(out, tuple | list) else (out,))]


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_state_dict_and_outputs_come_back(tmp, name, api):
    module, inputs, gen, state = _round_trip(name, api, tmp)
    want = module.state_dict()
    assert sorted(state) == sorted(want)
    for key, value in want.items():
        assert state[key].dtype == value.dtype, key
        assert torch.equal(state[key], value), key
    gen.eval()
    for got, ref in zip(_outputs(gen, inputs), _outputs(module, inputs), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    if name == "resnet":  # the torch source's classes come back, blocks as instances
        source = (Path(tmp) / f"{name}_{api}_torch.py").read_text()
        assert "class BasicBlock(nn.Module):" in source
        assert "for block in (self.layer1[0], self.layer1[1]):" in source
        flax_src = (Path(tmp) / f"{name}_{api}" / "model.py").read_text()
        # the block with a downsample branch is the same class, with fields
        assert "class BasicBlockDownsample" not in flax_src
        if api == "nnx":  # nnx's list idiom: variables under layer1/0/..., loaded above
            assert (
                "self.layer1 = nnx.List([BasicBlock(8, 8, rngs=rngs) for _ in range(2)])"
                in flax_src
            )
            # differing blocks too long for one line: the list built a run at a time
            first = "BasicBlock(8, 16, strides=2, downsample=True, rngs=rngs)"
            assert f"self.layer2 = nnx.List([{first}])\n" in flax_src
            assert "self.layer2.append(BasicBlock(16, 16, rngs=rngs))\n" in flax_src
        else:
            assert "self.layer1 = [BasicBlock(8) for _ in range(2)]" in flax_src
            assert (
                "self.layer2 = [BasicBlock(16, strides=2, downsample=True), BasicBlock(16)]"
                in flax_src
            )
        # consecutive stages with one loop body: one loop over both lists
        assert "for block in (*self.layer1, *self.layer2):" in flax_src


def _at_batch(inputs, batch: int):
    """Inputs like ``inputs`` with ``batch`` rows (ids within the example's range)."""
    g = torch.Generator().manual_seed(batch)
    out = []
    for x in inputs:
        shape = (batch, *x.shape[1:])
        if x.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g, dtype=x.dtype))
        else:
            out.append(torch.randint(0, int(x.max()) + 1, shape, generator=g, dtype=x.dtype))
    return tuple(out)


@pytest.mark.parametrize("api", ["linen", "nnx"])
@pytest.mark.parametrize("name", ["transformer", "resnet"])
def test_generated_flax_runs_at_another_batch(tmp, name, api):
    """The generated model is not tied to the example's batch (2): its reshapes read the
    leading dims from their input (``jnp.reshape(q, (*q.shape[:2], 4, 8))``), so at batch 3
    it matches the torch module at batch 3; attention inputs are named q, k, v."""
    module, inputs, _, _ = _round_trip(name, api, tmp)
    assert all(x.shape[0] == 2 for x in inputs)  # the example batch this test moves off
    out = Path(tmp) / f"{name}_{api}"
    src = (out / "model.py").read_text()
    reshapes = [ln for ln in src.splitlines() if "reshape(" in ln]
    assert reshapes and not [ln for ln in reshapes if "(2, " in ln]
    if name == "transformer":
        assert "q, k, v = jnp.split(self.qkv(x), [32, 64], axis=-1)" in src
        assert "jnp.reshape(q, (*q.shape[:2], 4, 8))" in src
        assert "= jax.nn.dot_product_attention(q, k, v, is_causal=True)" in src
    loaded = _exec_file(out / "model.py").load(out)
    xs = _at_batch(inputs, 3)
    args = [x.numpy() for x in xs]
    got = loaded[0].apply(loaded[1], *args) if api == "linen" else loaded(*args)
    got = got if isinstance(got, tuple | list) else (got,)
    want = _outputs(module, xs)
    assert got[0].shape[0] == 3
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_train_mode_after_round_trip(tmp, api):
    """BatchNorm is torch's again (unbiased running-variance update), momentum 0.1."""
    module, inputs, gen, _ = _round_trip("resnet", api, tmp)
    ref_module, _ = FIXTURES["resnet"]()
    ref_module.train()
    gen.train()
    np.testing.assert_allclose(
        _outputs(gen, inputs)[0], _outputs(ref_module, inputs)[0], rtol=1e-4, atol=1e-4
    )
    got, want = gen.state_dict(), ref_module.state_dict()
    for key in want:
        if key.endswith(("running_mean", "running_var")):
            np.testing.assert_allclose(got[key].numpy(), want[key].numpy(), rtol=1e-5, atol=1e-6)


def test_cli_round_trip(tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from xconv.cli import main

    module, inputs = FIXTURES["resnet"]()
    module.eval()
    pt2 = tmp_path / "resnet.pt2"
    torch.export.save(torch.export.export(module, inputs), pt2)
    runner = CliRunner()
    r = runner.invoke(main, ["torch-to-flax", str(pt2), "-o", str(tmp_path / "flax")])
    assert r.exit_code == 0, r.output
    shape = ",".join(str(d) for d in inputs[0].shape)
    r = runner.invoke(
        main,
        [
            "flax-to-torch",
            str(tmp_path / "flax" / "variables.msgpack"),
            "--module",
            f"{tmp_path / 'flax' / 'model.py'}:Model",
            "--input-shape",
            shape,
            "-o",
            str(tmp_path / "torch"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "torch" / "parity.json").read_text())["passed"] is True
    state = load_file(str(tmp_path / "torch" / "weights.safetensors"))
    want = module.state_dict()
    assert sorted(state) == sorted(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
