"""torch state_dict <-> Flax variables: bit-exact round trips and parity with the generated
``model.py`` (the variables load into it and give torch's outputs)."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
import torch

from fixtures import torch_models
from xconv.converters.flax.source.emitter import generate, to_flax
from xconv.converters.torch.importer.trace import from_torch
from xconv.errors import WeightsError
from xconv.weight_template import build_weight_map, flax_to_torch, torch_to_flax
from xconv.weights import io

FIXTURES = ["mlp", "resnet", "conv_zoo", "norm_zoo", "transformer", "mha_weights", "seq_model"]


def _weight_map(model_ir):
    """The map; a lost Flax handler is a failure, never an expected one."""
    return build_weight_map(model_ir)


@pytest.fixture(scope="module")
def traced():
    cache = {}

    def get(name):
        if name not in cache:
            module, inputs = torch_models.FIXTURES[name]()
            cache[name] = (module, inputs, from_torch(module, inputs))
        return cache[name]

    return get


def _new_state(module: torch.nn.Module, seed: int = 3) -> dict[str, torch.Tensor]:
    """Different weights of the same shapes (so nothing passes by matching the template)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in module.state_dict().items():
        if v.is_floating_point():
            noise = torch.randn(v.shape, generator=gen, dtype=v.dtype)
            out[k] = (v * (1 + 0.1 * noise)).abs() if k.endswith("running_var") else v + 0.1 * noise
        else:
            out[k] = v + 5  # num_batches_tracked
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_round_trip_bit_exact(traced, name):
    module, _, model_ir = traced(name)
    state = _new_state(module)
    wmap = _weight_map(model_ir)
    assert set(wmap.unmapped) <= {"position_ids"}  # transformer's non-persistent buffer
    variables = torch_to_flax(state, wmap)
    back = flax_to_torch(variables, wmap, side_state=wmap.side_state(state))
    assert set(back) == set(state)
    for k, t in state.items():
        ref = io.to_numpy(t)
        assert back[k].dtype == ref.dtype, k
        assert back[k].shape == ref.shape, k
        assert np.array_equal(back[k], ref), k


@pytest.mark.parametrize("name", FIXTURES)
def test_variables_match_emitter(traced, name):
    """With the template's own weights the map reproduces the emitter's variables exactly."""
    module, _, model_ir = traced(name)
    _weight_map(model_ir)
    _, expected = generate(model_ir)
    got = torch_to_flax(module.state_dict(), model_ir)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    flat_got, flat_want = io.flatten(got), io.flatten(expected)
    for k in flat_want:
        assert flat_got[k].dtype == flat_want[k].dtype, k
        assert np.array_equal(flat_got[k], flat_want[k]), k


def _load_generated(tmp_path, model_ir, name):
    out = to_flax(model_ir, tmp_path / name)
    spec = importlib.util.spec_from_file_location(f"xconv_gen_weights_{name}", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", FIXTURES)
def test_parity_generated_module(traced, tmp_path, name):
    """A new torch checkpoint, mapped, runs in the generated Flax module like torch does."""
    module, inputs, model_ir = traced(name)
    _weight_map(model_ir)
    state = _new_state(module)
    mod = _load_generated(tmp_path, model_ir, name)
    flax_model, template_vars = mod.load(tmp_path / name)
    variables = torch_to_flax(state, model_ir)
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(template_vars)
    out = flax_model.apply(variables, *[np.asarray(x) for x in inputs])

    fresh, _ = torch_models.FIXTURES[name]()
    fresh.load_state_dict(state)
    with torch.no_grad():
        ref = fresh.eval()(*inputs)
    ref = ref if isinstance(ref, tuple) else (ref,)
    out = out if isinstance(out, tuple) else (out,)
    assert len(out) == len(ref)
    for o, r in zip(out, ref, strict=True):
        r = r.numpy()
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(np.asarray(o), r, rtol=1e-4, atol=1e-4 * scale)
    # the template's weights differ: the comparison above really used the checkpoint
    before = flax_model.apply(template_vars, *[np.asarray(x) for x in inputs])
    before = before if isinstance(before, tuple) else (before,)
    assert not np.allclose(np.asarray(before[0]), ref[0].numpy(), atol=1e-3)


def test_num_batches_tracked_side_state(traced):
    module, _, model_ir = traced("resnet")
    state = _new_state(module)
    wmap = build_weight_map(model_ir)
    variables = torch_to_flax(state, wmap)
    flat = io.flatten(variables)
    assert not any("num_batches" in k for k in flat)
    assert set(variables) == {"params", "batch_stats"}
    assert (
        flax_to_torch(variables, wmap, side_state=wmap.side_state(state))["bn1.num_batches_tracked"]
        == 5
    )
    # without the side state the template's value (a fresh module's 0) is used
    assert flax_to_torch(variables, wmap)["bn1.num_batches_tracked"] == 0


def test_kernel_layouts(traced):
    module, _, model_ir = traced("conv_zoo")
    variables = torch_to_flax(module.state_dict(), model_ir)["params"]
    w = module.state_dict()
    np.testing.assert_array_equal(variables["conv"]["kernel"], w["conv.weight"].permute(2, 3, 1, 0))
    np.testing.assert_array_equal(
        variables["conv3d"]["kernel"], w["conv3d.weight"].permute(2, 3, 4, 1, 0)
    )
    np.testing.assert_array_equal(
        variables["conv1d"]["kernel"], w["conv1d.weight"].permute(2, 1, 0)
    )
    # layers written as generated submodules keep the torch layout (IOHW transposed conv)
    np.testing.assert_array_equal(variables["up"]["kernel"], w["up.weight"])


def test_strict_mapping_errors(traced):
    module, _, model_ir = traced("mlp")
    state = dict(module.state_dict())
    del state["fc1.bias"]
    state["fc9.weight"] = torch.zeros(2)
    with pytest.raises(WeightsError) as err:
        torch_to_flax(state, model_ir)
    assert "missing key: fc1.bias" in str(err.value)
    assert "unexpected key: fc9.weight" in str(err.value)


def test_nnx_variables(traced, tmp_path):
    module, inputs, model_ir = traced("mlp")
    state = _new_state(module)
    variables = torch_to_flax(state, model_ir, api="nnx")
    assert set(variables) == {"fc1", "fc2", "fc3"}
    back = flax_to_torch(variables, model_ir, api="nnx")
    assert all(np.array_equal(back[k], state[k].numpy()) for k in state)


def test_nnx_parity(traced, tmp_path):
    """nnx: the mapped variables load into the generated nnx module and match torch."""
    from flax import nnx

    module, inputs, model_ir = traced("resnet")
    state = _new_state(module)
    out = to_flax(model_ir, tmp_path / "nnx", api="nnx")
    spec = importlib.util.spec_from_file_location("xconv_gen_weights_nnx", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.load(out)
    graph_state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    nnx.replace_by_pure_dict(graph_state, torch_to_flax(state, model_ir, api="nnx"))
    nnx.update(model, graph_state)
    fresh, _ = torch_models.make_resnet()
    fresh.load_state_dict(state)
    with torch.no_grad():
        ref = fresh.eval()(*inputs).numpy()
    got = np.asarray(model(*[np.asarray(x) for x in inputs]))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_weights_layer_takes_a_map_and_names_where_to_build_one(traced):
    """xconv.weights runs no converter: given the IR instead of a WeightMap it says to build
    the map with xconv.weight_template; given the map it agrees with the IR-taking wrapper."""
    from xconv.weights import mapping

    module, _, model_ir = traced("mlp")
    state = module.state_dict()
    with pytest.raises(TypeError, match="xconv.weight_template.build_weight_map"):
        mapping.torch_to_flax(state, model_ir)
    wmap = build_weight_map(model_ir)
    got, want = mapping.torch_to_flax(state, wmap), torch_to_flax(state, model_ir)
    assert io.flatten(got).keys() == io.flatten(want).keys()
    for k, v in io.flatten(want).items():
        np.testing.assert_array_equal(io.flatten(got)[k], v)
