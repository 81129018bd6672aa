"""``xconv inspect`` reads every file kind the converters read: a model file or folder becomes
the IR and its summary (op histogram, inputs, parameters); a weights-only file is summarised as
its tensors; a path of no known kind is refused (exit 2) with the list of what it reads."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from xconv.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from fixtures.torch_models import make_mlp

    d = tmp_path_factory.mktemp("kinds")
    module, (x,) = make_mlp()
    files = {
        "pt2": d / "m.pt2",
        "state_dict": d / "sd.pt",
        "pickled": d / "pickled.pt",
        "torchscript": d / "scripted.pt",
        "safetensors": d / "w.safetensors",
    }
    torch.export.save(torch.export.export(module, (x,)), files["pt2"])
    torch.save(module.state_dict(), files["state_dict"])
    torch.save(module, files["pickled"])
    torch.jit.save(torch.jit.script(module), files["torchscript"])
    from safetensors.torch import save_file

    save_file(module.state_dict(), files["safetensors"])
    n = sum(p.numel() for p in module.parameters())
    return files, f"{n:,}", tuple(x.shape)


def _graph(r, params: str) -> str:
    """The IR's parameter count (its initializers: the weights, and constants the graph
    holds such as a position-id buffer) after checking it is at least the module's."""
    assert r.exit_code == 0, r.output
    assert "opset ai.onnx" in r.output and re.search(r"Gemm|MatMul", r.output), r.output
    found = re.search(r"parameters\s*\(([\d,]+)\)", r.output)
    assert found, r.output
    assert int(found[1].replace(",", "")) >= int(params.replace(",", "")), r.output
    return found[1]


def test_torch_kinds(mlp_files, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pickled module's class lives in fixtures/
    files, params, shape = mlp_files
    shape_arg = ",".join(map(str, shape))
    counts = {
        _graph(_run("inspect", files["pt2"]), params),
        _graph(_run("inspect", files["pickled"], "--trust-pickle", "--input-shape", shape_arg),
               params),
        _graph(_run("inspect", files["torchscript"], "--trust-pickle", "--input-shape", shape_arg), params),
        _graph(_run("inspect", files["state_dict"], "--module", "fixtures.torch_models:make_mlp"),
               params),
    }  # fmt: skip
    assert len(counts) == 1, counts  # the same model, read from four kinds of file
    r = _run("inspect", files["pickled"])
    assert r.exit_code == 2 and "--trust-pickle" in r.output, r.output


@pytest.mark.parametrize("kind", ["state_dict", "safetensors"])
def test_weights_only_files(mlp_files, kind):
    files, params, _ = mlp_files
    r = _run("inspect", files[kind])
    assert r.exit_code == 0, r.output
    assert "weights only" in r.output and f"{params} parameters" in r.output, r.output
    assert re.search(r"fc\w*\s+│", r.output), r.output  # a scope row per layer


def test_flax_msgpack(tmp_path):
    serialization = pytest.importorskip("flax.serialization")
    tree = {"params": {"Dense_0": {"kernel": np.ones((3, 4), np.float32),
                                   "bias": np.zeros(4, np.float32)}}}  # fmt: skip
    path = tmp_path / "v.msgpack"
    path.write_bytes(serialization.msgpack_serialize(tree))
    r = _run("inspect", path)
    assert r.exit_code == 0, r.output
    assert "weights only (msgpack): 2 tensors, 16 parameters" in r.output, r.output


def test_save_pretrained_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch").manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16)  # fmt: skip
    model = transformers.BertModel(config)
    model.save_pretrained(tmp_path / "bert")
    r = _run("inspect", tmp_path / "bert")
    assert r.exit_code == 0, r.output
    n = sum(p.numel() for p in model.parameters())
    assert "(torch)" in r.output, r.output
    _graph(r, f"{n:,}")
    assert re.search(r"input_ids\s+│\s+int64\s+│\s+\[batch, seq\]", r.output), r.output


def test_keras_file(tmp_path):
    pytest.importorskip("tensorflow")
    pytest.importorskip("tf2onnx")
    from fixtures.tf_models import keras_sequential

    model, _ = keras_sequential()
    path = tmp_path / "m.keras"
    model.save(path)
    r = _run("inspect", path)
    assert r.exit_code == 0, r.output
    assert "(tf)" in r.output and re.search(r"MatMul|Gemm", r.output), r.output


def test_a_folder_of_no_known_kind_lists_what_inspect_reads(tmp_path):
    r = _run("inspect", tmp_path)
    assert r.exit_code == 2, r.output
    for kind in (".onnx", ".pt2", "save_pretrained", "SavedModel", ".safetensors", ".msgpack"):
        assert kind in r.output, kind
