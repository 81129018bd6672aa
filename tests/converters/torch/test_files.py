"""PyTorch model files and example inputs: every kind loads, converts and matches torch."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnx_ir as ir  # noqa: E402

import xconv  # noqa: E402
from fixtures.make_fixtures import FACTORY, write_torch_files  # noqa: E402
from fixtures.torch_models import make_mlp  # noqa: E402
from xconv.converters.torch.importer.files import (  # noqa: E402
    example_inputs,
    input_from_spec,
    inputs_from_npz,
    load_torch_model,
)
from xconv.errors import ConversionError, InvalidModelError, WeightsError  # noqa: E402
from xconv.ir.metadata import LAYER, LAYOUT, ROLE  # noqa: E402


@functools.cache
def _files_dir():
    import tempfile
    from pathlib import Path

    return write_torch_files(Path(tempfile.mkdtemp(prefix="xconv-torch-files-")))


@pytest.fixture(scope="module")
def files():
    return _files_dir()


def _reference():
    module, inputs = make_mlp()
    with torch.no_grad():
        return inputs, module(*inputs).numpy(), set(module.state_dict())


def _check_converts(obj, inputs, *, layers=True):
    x, want, keys = _reference()
    model = xconv.from_torch(obj, inputs)
    weights = {k for k, v in model.graph.initializers.items() if ROLE in v.metadata_props}
    assert weights == keys
    if layers:
        assert sum(LAYER in n.metadata_props for n in model.graph) >= 3
    fn, params = xconv.to_jax(model)
    (got,) = fn(params, *[t.numpy() for t in inputs])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    return model


def test_files_are_small(files):
    for path in files.values():
        assert path.stat().st_size < 1_000_000, path


def test_pt2_with_its_example_inputs(files):
    program, inputs = load_torch_model(files["pt2"])
    assert isinstance(program, torch.export.ExportedProgram)
    assert len(inputs) == 1 and tuple(inputs[0].shape) == (4, 16)
    model = _check_converts(program, inputs)
    # Without module instances, scopes come from the program's module stack and the layer
    # hyper-parameters from the graph.
    scopes = {n.metadata_props.get("xconv.scope") for n in model.graph}
    assert {"fc1", "fc2", "fc3"} <= scopes
    gemm = next(n for n in model.graph if n.metadata_props.get("xconv.scope") == "fc2")
    assert json.loads(gemm.metadata_props[LAYER]) == {
        "kind": "dense", "in_features": 32, "out_features": 32, "use_bias": False}  # fmt: skip


def test_pt2_without_passing_inputs_uses_its_own(files):
    program, inputs = load_torch_model(files["pt2"])
    model = xconv.from_torch(program)
    assert [tuple(v.shape) for v in model.graph.inputs] == [tuple(inputs[0].shape)]


def test_torchscript(files):
    module, inputs = load_torch_model(files["torchscript"])
    assert isinstance(module, torch.jit.ScriptModule) and inputs is None
    x, _, _ = _reference()
    model = _check_converts(module, x, layers=False)
    # TorchScript loses the module stack but keeps class names: weights still get roles.
    props = model.graph.initializers["fc1.weight"].metadata_props
    assert (props[ROLE], props[LAYOUT]) == ("kernel", "OI")


@pytest.mark.parametrize("kind", ["state_dict", "safetensors"])
def test_state_dict_with_factory(files, kind):
    module, inputs = load_torch_model(files[kind], module_factory=FACTORY)
    assert isinstance(module, torch.nn.Module) and not module.training
    assert inputs is not None  # the fixture factory returns (module, inputs)
    _check_converts(module, inputs)


def test_state_dict_without_factory_is_explained(files):
    with pytest.raises(ConversionError, match="module factory"):
        load_torch_model(files["state_dict"])
    with pytest.raises(ConversionError, match="module factory"):
        load_torch_model(files["safetensors"])


def test_state_dict_that_does_not_fit(files):
    with pytest.raises(WeightsError, match="missing"):
        load_torch_model(files["state_dict"], module_factory="fixtures.torch_models:make_resnet")


def test_bad_factory_strings(files):
    with pytest.raises(ConversionError, match="package.module:function"):
        load_torch_model(files["state_dict"], module_factory="no_colon_here")
    with pytest.raises(ConversionError, match="cannot import"):
        load_torch_model(files["state_dict"], module_factory="no.such.module:make")


def test_pickled_module_needs_trust(files):
    with pytest.raises(ConversionError, match="--trust-pickle") as info:
        load_torch_model(files["pickled"])
    assert not isinstance(info.value, InvalidModelError)
    module, inputs = load_torch_model(files["pickled"], trust_pickle=True)
    assert isinstance(module, torch.nn.Module) and inputs is None
    x, _, _ = _reference()
    _check_converts(module, x)


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("missing.pt", None),
        ("garbage.pt", b"\x80\x04garbage-not-a-pickle" * 4),
        ("text.pth", b"hello world"),
        ("bad.pt2", b"PK\x03\x04 truncated zip"),
        ("bad.safetensors", b"\x00\x01\x02"),
        ("empty.bin", b""),
    ],
)
def test_corrupt_or_missing_files(tmp_path, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InvalidModelError) as info:
        load_torch_model(path)
    assert "\n" not in str(info.value)


def test_truncated_torchscript(tmp_path, files):
    data = files["torchscript"].read_bytes()
    path = tmp_path / "cut.pt"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelError):
        load_torch_model(path)


# -- example inputs ---------------------------------------------------------------------------


def test_inputs_from_specs():
    x = input_from_spec("2,3,8,8")
    assert x.dtype == torch.float32 and tuple(x.shape) == (2, 3, 8, 8)
    assert torch.equal(x, input_from_spec("2,3,8,8"))  # deterministic
    ids = input_from_spec("2,16:int64")
    assert ids.dtype == torch.int64 and tuple(ids.shape) == (2, 16)
    both = example_inputs(["2,3", "2,5"], ["float32", "int32"])
    assert [t.dtype for t in both] == [torch.float32, torch.int32]
    assert example_inputs(None) is None
    assert example_inputs(["2,3"], [])[0].dtype == torch.float32  # no dtype: float32
    with pytest.raises(ConversionError, match="bad input shape"):
        input_from_spec("2,three")
    with pytest.raises(ConversionError, match="unknown dtype"):
        input_from_spec("2,3", "complex7")
    with pytest.raises(ConversionError, match="dtype"):
        example_inputs(["2", "3", "4"], ["float32", "int64"])


def test_inputs_from_npz(files, tmp_path):
    (x,) = inputs_from_npz(files["npz"])
    want, _, _ = _reference()
    assert torch.equal(x, want[0])
    path = tmp_path / "two.npz"
    np.savez(path, np.zeros((2, 3), np.float32), np.ones((4,), np.int64))
    a, b = example_inputs(npz=path)
    assert tuple(a.shape) == (2, 3) and b.dtype == torch.int64
    with pytest.raises(InvalidModelError):
        inputs_from_npz(tmp_path / "nope.npz")


def test_spec_inputs_drive_a_conversion():
    module, _ = make_mlp()
    (x,) = example_inputs(["3,16"])
    model = xconv.from_torch(module, (x,))
    assert model.graph.inputs[0].shape == ir.Shape([3, 16])
