"""The conversion commands end to end: files written, parity checked, failures clean."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

import xconv
from xconv.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("jax")


@pytest.fixture(scope="module")
def resnet_pt2(tmp_path_factory):
    from fixtures.torch_models import make_resnet

    module, inputs = make_resnet()
    path = tmp_path_factory.mktemp("pt2") / "resnet.pt2"
    torch.export.save(torch.export.export(module, inputs), path)
    return path, module, inputs


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_torch_to_flax_cli_writes_everything_and_passes_parity(resnet_pt2, tmp_path, api):
    path, module, inputs = resnet_pt2
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["torch-to-flax", str(path), "-o", str(out), "--api", api])
    assert r.exit_code == 0, r.output
    names = {p.name for p in out.iterdir()}
    assert {"model.py", "variables.msgpack", "model.onnx", "parity.json", "parity.html"} <= names
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] is True
    source = (out / "model.py").read_text()
    assert "Conv(" in source and "BatchNorm(" in source
    # The written module reproduces torch outside xconv too.
    from xconv.pipeline import _load_generated

    loaded = _load_generated(out / "model.py").load(out)
    x = np.asarray(inputs[0])
    got = loaded[0].apply(loaded[1], x) if api == "linen" else loaded(x)
    with torch.no_grad():
        want = module(*inputs).numpy()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_torch_to_jax_and_onnx(resnet_pt2, tmp_path):
    path, module, inputs = resnet_pt2
    for target in ("jax", "onnx"):
        out = tmp_path / target
        r = CliRunner().invoke(main, [f"torch-to-{target}", str(path), "-o", str(out)])
        assert r.exit_code == 0, r.output
        assert json.loads((out / "parity.json").read_text())["passed"] is True
        assert (out / "model.onnx").is_file()
    from xconv.pipeline import _load_generated

    fn, params = _load_generated(tmp_path / "jax" / "model.py").load(tmp_path / "jax")
    with torch.no_grad():
        want = module(*inputs).numpy()
    np.testing.assert_allclose(np.asarray(fn(params, inputs[0].numpy())[0]), want, rtol=1e-4,
                               atol=1e-5)  # fmt: skip


def test_onnx_target_is_written_canonical_and_keeps_the_state(resnet_pt2, tmp_path):
    """Under a dynamic batch the exporter reads the batch with Shape/Squeeze/Concat before each
    reshape; the onnx target writes them folded (onnxruntime does not fold them itself), and
    keeps the state no node reads (BatchNorm's num_batches_tracked)."""
    import onnx
    import onnxruntime as ort

    from xconv.converters.onnx.io import UNUSED_STATE

    _, module, inputs = resnet_pt2
    batch = torch.export.Dim("batch", min=1)
    path = tmp_path / "resnet.pt2"
    torch.export.save(torch.export.export(module, inputs, dynamic_shapes=({0: batch},)), path)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["torch-to-onnx", str(path), "-o", str(out), "--dynamic-batch"])
    assert r.exit_code == 0, r.output
    proto = onnx.load(out / "model.onnx")
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"Shape", "Squeeze", "Concat"}, ops
    assert any(name.endswith("num_batches_tracked") for name in module.state_dict())
    stored = {t.name for t in proto.graph.initializer} | set(
        json.loads({p.key: p.value for p in proto.metadata_props}.get(UNUSED_STATE, "{}"))
    )
    for name in module.state_dict():
        assert name in stored, name
    x = torch.randn(5, *inputs[0].shape[1:], generator=torch.Generator().manual_seed(3))
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = module(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_state_dict_with_module_factory(tmp_path):
    from fixtures.torch_models import make_mlp

    module, _ = make_mlp()
    ckpt = tmp_path / "mlp.pt"
    torch.save(module.state_dict(), ckpt)
    out = tmp_path / "mlp_flax"
    r = CliRunner().invoke(main, ["torch-to-flax", str(ckpt), "--module",
                                  "fixtures.torch_models:make_mlp", "--input-shape", "3,16",
                                  "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    report = json.loads((out / "parity.json").read_text())
    assert report["passed"] is True
    # The oracle held throughout: no downgrade, no warning, and the closing line says so.
    assert report["downgrades"] == [] and "warning:" not in r.output
    assert r.output.strip().splitlines()[-1] == "parity passed (oracle policy)"


def test_onnx_to_flax_checks_against_onnxruntime(tmp_path):
    from xconv.demo import build_demo_model

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    out = tmp_path / "demo_flax"
    r = CliRunner().invoke(main, ["onnx-to-flax", str(path), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "parity.json").read_text())["passed"] is True


def test_parity_failure_exits_nonzero_and_names_the_scope(tmp_path, monkeypatch):
    from fixtures.torch_models import make_mlp

    module, inputs = make_mlp()
    import xconv.pipeline as conv

    real = conv._emit_jax

    def broken(model, stage, options):
        loader = real(model, stage, options)

        def load(where):
            fn, params = loader(where)
            params["fc3"]["weight"] = params["fc3"]["weight"] * 1.01
            return fn, params

        return load

    monkeypatch.setitem(conv._EMITTERS, "jax", broken)
    result = xconv.convert(module, source_kind="torch", target="jax", out_dir=tmp_path / "o",
                           example_inputs=inputs)  # fmt: skip
    assert not result.passed
    assert result.parity.first_divergence == "fc3"
    assert json.loads((tmp_path / "o" / "parity.json").read_text())["passed"] is False


def test_failed_conversion_leaves_nothing(tmp_path):
    out = tmp_path / "never"
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"PK\x03\x04 truncated")
    r = CliRunner().invoke(main, ["torch-to-flax", str(bad), "-o", str(out)])
    assert r.exit_code == xconv.InvalidModelError.exit_code, r.output
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [bad]
    # A path that is not there is a usage error, refused before any work.
    r = CliRunner().invoke(main, ["torch-to-flax", str(tmp_path / "missing.pt2"), "-o", str(out)])
    assert r.exit_code == 2 and "does not exist" in r.output, r.output
    assert not out.exists()


def test_no_inputs_for_a_state_dict_is_a_clear_error(tmp_path):
    from fixtures.torch_models import make_mlp

    ckpt = tmp_path / "mlp.pt"
    torch.save(make_mlp()[0].state_dict(), ckpt)

    def factory():
        return make_mlp()[0]

    with pytest.raises(xconv.ConversionError, match="--input-shape"):
        xconv.convert(ckpt, source_kind="torch", target="onnx", out_dir=tmp_path / "o",
                      options=xconv.ConvertOptions(module_factory=factory))  # fmt: skip


def test_flax_to_onnx_from_a_variables_file(tmp_path):
    from flax import serialization

    from fixtures.flax_models import linen_mlp

    module, variables, inputs = linen_mlp()
    path = tmp_path / "vars.msgpack"
    path.write_bytes(serialization.msgpack_serialize(variables))
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["flax-to-onnx", str(path), "--module",
                                  "fixtures.flax_models:linen_mlp", "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads((out / "parity.json").read_text())["passed"] is True


def test_onnx_and_flax_to_torch(tmp_path):
    from flax import serialization

    from fixtures.flax_models import linen_cnn
    from xconv.demo import build_demo_model

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    r = CliRunner().invoke(main, ["onnx-to-torch", str(path), "-o", str(tmp_path / "t1")])
    assert r.exit_code == 0, r.output
    source = (tmp_path / "t1" / "model.py").read_text()
    assert "nn.Conv2d(" in source and "nn.BatchNorm2d(" in source and "nn.Linear(" in source

    module, variables, _ = linen_cnn()
    vars_path = tmp_path / "cnn.msgpack"
    vars_path.write_bytes(serialization.msgpack_serialize(variables))
    out = tmp_path / "t2"
    r = CliRunner().invoke(main, ["flax-to-torch", str(vars_path), "--module",
                                  "fixtures.flax_models:linen_cnn", "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads((out / "parity.json").read_text())["passed"] is True
    from xconv.pipeline import _load_generated

    torch_module = _load_generated(out / "model.py").load(out)
    assert isinstance(torch_module, torch.nn.Module)


def test_tf_to_flax_and_torch_from_a_keras_file(tmp_path):
    pytest.importorskip("tensorflow")
    from fixtures.tf_models import keras_cnn

    built = keras_cnn()
    model = built[0] if isinstance(built, tuple) else built
    path = tmp_path / "cnn.keras"
    model.save(path)
    for target in ("flax", "torch"):
        out = tmp_path / target
        r = CliRunner().invoke(main, [f"tf-to-{target}", str(path), "-o", str(out)])
        assert r.exit_code == 0, r.output
        assert json.loads((out / "parity.json").read_text())["passed"] is True


@pytest.mark.slow
def test_keras_applications_mobilenet_to_flax_and_torch(tmp_path):
    """keras.applications built with weights=None (no download), as a new user would, its
    batch norm statistics set from a batch (left at their initial values, its softmax is
    constant and the parity check rightly calls the comparison vacuous)."""
    keras = pytest.importorskip("keras")
    from benchmarks.zoo import calibrate_batch_norm

    model = keras.applications.MobileNetV2(input_shape=(64, 64, 3), alpha=0.35, weights=None)
    calibrate_batch_norm(model, np.random.RandomState(0).rand(4, 64, 64, 3).astype(np.float32))
    path = tmp_path / "mobilenet_v2.keras"
    model.save(path)
    for target in ("flax", "torch"):
        out = tmp_path / target
        r = CliRunner().invoke(main, [f"tf-to-{target}", str(path), "-o", str(out)])
        assert r.exit_code == 0, r.output
        assert json.loads((out / "parity.json").read_text())["passed"] is True
