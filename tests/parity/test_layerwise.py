"""Layerwise parity: a float64 oracle run one block at a time, per-block verdicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import xconv
from xconv.parity.layerwise import float64_program, run_layerwise, split_program


class Norm(nn.Module):
    """RMSNorm as transformers writes it: computes in float32 whatever the input dtype."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.compute = torch.float32

    def forward(self, x):
        h = x.to(self.compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = Norm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.norm = Norm(d)
        self.head = nn.Linear(d, 50)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.fixture(scope="module")
def program():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 7))
    return torch.export.export(Net().eval(), (ids,), strict=False)


def _ids(program):
    return [program.example_inputs[0][0].numpy()]


def test_blocks_follow_the_repeated_container(program):
    blocks = split_program(program)
    names = [b.name for b in blocks]
    assert names[1:4] == ["layers.0", "layers.1", "layers.2"], names
    assert "embed" in names[0] and "head" in names[-1]
    assert blocks[2].weights == (
        "layers.1.norm.weight",
        "layers.1.up.weight",
        "layers.1.up.bias",
        "layers.1.down.weight",
        "layers.1.down.bias",
    )
    assert blocks[2].inputs == blocks[1].outputs


def test_float64_program_is_the_double_model(program):
    ids = program.example_inputs[0][0]
    (out,) = float64_program(program)(ids)
    assert out.dtype == torch.float64
    net = Net()
    net.load_state_dict(program.state_dict)
    for m in net.modules():  # a true float64 model (the float32 pins moved to float64)
        if isinstance(m, Norm):
            m.compute = torch.float64
    expected = net.double().eval()(ids)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_layerwise_passes_a_correct_conversion(program):
    model = xconv.from_torch(program)
    result = run_layerwise(program, model, _ids(program))
    assert result.passed and result.first_divergence is None
    assert [b.block.name for b in result.blocks][1:4] == ["layers.0", "layers.1", "layers.2"]
    assert all(m.passed for b in result.blocks for m in b.outputs)
    (oracle,) = result.oracle_outputs
    (whole,) = float64_program(program)(program.example_inputs[0][0])
    np.testing.assert_allclose(oracle, whole.numpy(), rtol=1e-12, atol=1e-12)


def test_layerwise_names_the_first_bad_block(program):
    model = xconv.from_torch(program)
    w = model.graph.initializers["layers.1.down.weight"]
    w.const_value = xconv_tensor(w.const_value.numpy() * 1.001)
    result = run_layerwise(program, model, _ids(program))
    assert not result.passed
    assert result.first_divergence == "layers.1"
    assert [b.passed for b in result.blocks][1:3] == [True, False]


def xconv_tensor(arr):
    import onnx_ir as ir

    return ir.Tensor(np.ascontiguousarray(arr, dtype=np.float32))


def test_check_parity_layerwise_and_exported_program_oracle(program):
    fn, params = xconv.to_jax(xconv.from_torch(program))
    whole = xconv.check_parity(program, (fn, params), _ids(program), devices="cpu")
    assert whole.passed, whole.notes
    assert whole.policy.startswith("oracle"), whole.policy
    assert not any("noise" in n for n in whole.notes), whole.notes
    report = xconv.check_parity(program, (fn, params), _ids(program), devices="cpu", layerwise=True)
    assert report.passed and report.policy.startswith("oracle")
    assert [s.name for s in report.scopes][1:4] == ["layers.0", "layers.1", "layers.2"]
    assert any("block by block" in n for n in report.notes)
    # A wrong candidate fails the whole-model verdict too (the chained oracle judges it).
    bad = dict(params)
    bad = jax_scale(params, "head", 1.01)
    failed = xconv.check_parity(program, (fn, bad), _ids(program), devices="cpu", layerwise=True)
    assert not failed.passed


def jax_scale(params, key, factor):
    import jax

    out = dict(params)
    out[key] = jax.tree_util.tree_map(lambda a: a * factor, params[key])
    return out


def test_cli_pipeline_layerwise_from_a_pt2(program, tmp_path):
    from xconv.pipeline import ConvertOptions, convert

    pt2 = tmp_path / "net.pt2"
    torch.export.save(program, pt2)
    result = convert(
        str(pt2),
        source_kind="torch",
        target="flax",
        out_dir=tmp_path / "out",
        options=ConvertOptions(parity="layerwise", devices="cpu"),
    )
    assert result.passed and result.parity.policy.startswith("oracle")
    assert [s.name for s in result.parity.scopes][1:4] == ["layers.0", "layers.1", "layers.2"]
    assert set(result.timings) >= {"load", "import", "emit", "model.onnx", "parity"}
    # The whole-model route on a .pt2 uses the graph's float64 oracle, not the noise fallback.
    whole = convert(
        str(pt2),
        source_kind="torch",
        target="onnx",
        out_dir=tmp_path / "onnx",
        options=ConvertOptions(parity="whole", devices="cpu"),
    )
    assert whole.passed and whole.parity.policy.startswith("oracle"), whole.parity.notes
    assert not whole.parity.scopes


def _release_path(monkeypatch):
    """Make the tiny model take the large-model route: IR weights in model.onnx.data, the
    source run ahead and released before the candidate loads."""
    import xconv.pipeline as pipeline

    monkeypatch.setattr(pipeline, "EXTERNAL_BYTES", 0)
    return pipeline


def test_pipeline_layerwise_from_an_nn_module_releases_the_source(tmp_path, monkeypatch):
    import onnx_ir as ir

    pipeline = _release_path(monkeypatch)
    torch.manual_seed(0)
    net = Net().eval()
    ids = torch.randint(0, 50, (2, 7))
    result = pipeline.convert(
        net,
        source_kind="torch",
        target="flax",
        out_dir=tmp_path / "out",
        example_inputs=(ids,),
        options=pipeline.ConvertOptions(parity="layerwise", devices="cpu"),
    )
    assert result.passed and result.parity.policy.startswith("oracle"), result.parity.notes
    assert [s.name for s in result.parity.scopes][1:4] == ["layers.0", "layers.1", "layers.2"]
    assert len(result.parity.input_sets) >= 3  # every set replayed from the run ahead
    # The IR's weights now read from the written file, at its final place.
    value = result.model.graph.initializers["layers.1.up.weight"]
    assert isinstance(value.const_value, ir.ExternalTensor)
    assert str(value.const_value.base_dir) == str(tmp_path / "out")
    np.testing.assert_array_equal(
        value.const_value.numpy(), net.layers[1].up.weight.detach().numpy()
    )


def test_released_source_still_judges_a_wrong_candidate(tmp_path, monkeypatch):
    pipeline = _release_path(monkeypatch)
    emit = pipeline._EMITTERS["flax"]

    def wrong(model, stage, options):
        load = emit(model, stage, options)

        def load_wrong(where):
            module, variables = load(where)
            params = variables["params"]
            key = next(k for k in sorted(params) if "head" in k)
            params[key] = {n: np.asarray(a) * 1.01 for n, a in params[key].items()}
            return module, variables

        return load_wrong

    monkeypatch.setitem(pipeline._EMITTERS, "flax", wrong)
    torch.manual_seed(0)
    result = pipeline.convert(
        Net().eval(),
        source_kind="torch",
        target="flax",
        out_dir=tmp_path / "out",
        example_inputs=(torch.randint(0, 50, (2, 7)),),
        options=pipeline.ConvertOptions(parity="layerwise", devices="cpu"),
    )
    assert not result.passed
    assert result.parity.first_divergence is None  # the IR's blocks are right: the files are not
    out = result.parity.outputs[0]
    assert out.error is None and not out.passed  # judged on numbers, against the replayed source
