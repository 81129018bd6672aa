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
from xconv.errors import (  # noqa: E402
    ConversionError,
    InvalidModelError,
    UsageError,
    WeightsError,
)
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
    # torch.jit.load runs the archive's code: only with the trust flag, named in the refusal.
    with pytest.raises(UsageError, match="--trust-pickle") as info:
        load_torch_model(files["torchscript"])
    assert info.value.exit_code == 2
    module, inputs = load_torch_model(files["torchscript"], trust_pickle=True)
    assert isinstance(module, torch.jit.ScriptModule)
    x, _, _ = _reference()
    # A traced archive records its example inputs' shapes and dtypes.
    assert [(t.shape, t.dtype) for t in inputs] == [(t.shape, t.dtype) for t in x]
    model = _check_converts(module, x, layers=False)
    # TorchScript loses the module stack but keeps class names: weights still get roles.
    props = model.graph.initializers["fc1.weight"].metadata_props
    assert (props[ROLE], props[LAYOUT]) == ("kernel", "OI")
    # The interpreter fixes every size it reads: a symbolic batch is refused with the way out.
    with pytest.raises(ConversionError, match=r"--dynamic-batch.*\.pt2"):
        xconv.from_torch(module, x, dynamic_batch=True)
    # The generated torch source names the source class (it said 'main_graph').
    source, _ = xconv.to_torch_source(model, example_inputs=x)
    assert "'fixtures.torch_models.MLP'" in source.split('"""')[1], source[:300]


def test_traced_transformer_encoder(tmp_path):
    """A traced nn.TransformerEncoder reads sizes as tensors (aten::size -> NumToTensor ->
    Int): through TS2EPConverter every dimension was symbolic and torch.onnx refused the
    data-dependent size arithmetic; traced through the interpreter it converts, at the
    recorded input shape, and matches torch."""
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 8)
    path = tmp_path / "encoder.pt"
    torch.jit.trace(encoder, (x,), check_trace=False).save(str(path))
    module, inputs = load_torch_model(path, trust_pickle=True)
    assert [tuple(t.shape) for t in inputs] == [(2, 5, 8)]
    model = xconv.from_torch(module, (x,))
    assert model.graph.name == "torch.nn.modules.transformer.TransformerEncoder"
    fn, params = xconv.to_jax(model)
    (got,) = fn(params, x.numpy())
    with torch.no_grad():
        want = encoder(x).numpy()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_torch_onnx_failure_is_summarised():
    """torch.onnx's error was cut at its first line, "... Next steps:"; now its headline and
    the exception that stopped it, with xconv's next step. (A traced convolution's
    aten._convolution, which the TorchScript route decomposes, is left in to make it fail.)"""
    from xconv.converters.torch.importer.trace import _export, _ScriptRoot, _to_ir

    traced = torch.jit.trace(torch.nn.Conv2d(1, 1, 1).eval(), (torch.randn(1, 1, 2, 2),))
    program = _export(_ScriptRoot(traced), (torch.randn(1, 1, 2, 2),), False)
    with pytest.raises(ConversionError) as info:
        _to_ir(program)
    text = str(info.value)
    assert "Next steps:" not in text and "\x1b[" not in text and "\n" not in text, text
    assert "aten._convolution" in text and text.endswith("which names the node"), text


@pytest.mark.parametrize("kind", ["state_dict", "safetensors"])
def test_state_dict_with_factory(files, kind):
    module, inputs = load_torch_model(files[kind], module_factory=FACTORY)
    assert isinstance(module, torch.nn.Module) and not module.training
    assert inputs is not None  # the fixture factory returns (module, inputs)
    _check_converts(module, inputs)


def test_state_dict_without_factory_is_explained(files):
    for kind in ("state_dict", "safetensors"):
        with pytest.raises(UsageError, match="--module pkg.mod:factory") as info:
            load_torch_model(files[kind])
        assert info.value.exit_code == 2
        assert "--input-shape" not in str(info.value)  # the caller has inputs
        with pytest.raises(UsageError) as info:
            load_torch_model(files[kind], need_inputs=True)
        assert [flag.split()[0] for flag, _ in info.value.missing] == ["--module", "--input-shape"]


def test_state_dict_that_does_not_fit(files):
    with pytest.raises(WeightsError, match="missing"):
        load_torch_model(files["state_dict"], module_factory="fixtures.torch_models:make_resnet")


def test_bad_factory_strings(files):
    with pytest.raises(ConversionError, match="package.module:function"):
        load_torch_model(files["state_dict"], module_factory="no_colon_here")
    with pytest.raises(ConversionError, match="cannot import"):
        load_torch_model(files["state_dict"], module_factory="no.such.module:make")


def test_pickled_module_needs_trust(files):
    with pytest.raises(UsageError, match="--trust-pickle") as info:
        load_torch_model(files["pickled"], need_inputs=True)
    assert info.value.exit_code == 2
    assert [flag for flag, _ in info.value.missing] == ["--trust-pickle", "--input-shape"]
    module, inputs = load_torch_model(files["pickled"], trust_pickle=True)
    assert isinstance(module, torch.nn.Module) and inputs is None
    x, _, _ = _reference()
    _check_converts(module, x)


def test_pt2_with_a_pickled_payload_needs_trust(files, tmp_path):
    """torch.export.load falls back to a full unpickle for sample inputs the weights-only
    unpickler refuses: a crafted .pt2 ran os.system through the old loader."""
    import io
    import os
    import zipfile

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buf = io.BytesIO()
    torch.save(Payload(), buf)
    crafted = tmp_path / "crafted.pt2"
    with zipfile.ZipFile(files["pt2"]) as src, zipfile.ZipFile(crafted, "w") as dst:
        for info in src.infolist():
            inputs = info.filename.endswith("sample_inputs/model.pt")
            dst.writestr(info, buf.getvalue() if inputs else src.read(info.filename))
    with pytest.raises(UsageError, match="sample_inputs/model.pt") as info:
        load_torch_model(crafted)
    assert info.value.exit_code == 2 and [f for f, _ in info.value.missing] == ["--trust-pickle"]
    assert not marker.exists()


def test_pickled_module_whose_class_is_not_importable(tmp_path, monkeypatch):
    import importlib
    import sys

    code = tmp_path / "code"
    code.mkdir()
    (code / "user_net.py").write_text("import torch\nclass Net(torch.nn.Linear):\n    pass\n")
    monkeypatch.syspath_prepend(str(code))
    net = importlib.import_module("user_net").Net(2, 2)
    torch.save(net, tmp_path / "net.pt")
    monkeypatch.delitem(sys.modules, "user_net")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(code)])
    with pytest.raises(InvalidModelError, match="run xconv from the folder holding"):
        load_torch_model(tmp_path / "net.pt", trust_pickle=True)


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
        load_torch_model(path, trust_pickle=True)


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
    with pytest.raises(ConversionError, match="bad shape"):
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
    assert [str(d) for d in model.graph.inputs[0].shape] == ["batch", "16"]
    assert xconv.from_torch(module, (x,), static=True).graph.inputs[0].shape == ir.Shape([3, 16])
