"""``xconv torch-to-* FOLDER`` where FOLDER is ``model.save_pretrained(...)``: config.json +
safetensors, recognised from ``architectures`` with no other flag; inputs from the config.

Tiny configs with random weights, built offline. Each conversion must exit 0 and write the
full output set with ``parity.json`` passed; the folder's model is then rebuilt here with
transformers and its outputs compared with the written ``model.onnx`` (onnxruntime) on the
inputs the command says it used.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from click.testing import CliRunner  # noqa: E402

from xconv.cli import main  # noqa: E402
from xconv.converters.torch.importer.hub import example_inputs, load_folder  # noqa: E402

_COMMON = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 2,
           "intermediate_size": 64}  # fmt: skip


def _model(name: str):
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    tf = transformers
    if name == "bert":
        return tf.BertModel(tf.BertConfig(num_hidden_layers=2, max_position_embeddings=16,
                                          **_COMMON))  # fmt: skip
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_head=2, n_layer=2,
                                                n_positions=16, bos_token_id=0,
                                                eos_token_id=0))  # fmt: skip
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, num_key_value_heads=1,
                                                  max_position_embeddings=16,
                                                  **_COMMON))  # fmt: skip
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(image_size=16, patch_size=8, hidden_size=32,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64))  # fmt: skip
    raise ValueError(name)


def _saved(name: str, where, **kw):
    module = _model(name).eval()
    folder = where / name
    module.save_pretrained(folder, **kw)
    return folder, module


def _run(*args: str):
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "200"})


def _reference(module, folder) -> list[np.ndarray]:
    config = json.loads((folder / "config.json").read_text())
    inputs, _ = example_inputs(config)
    module.config.use_cache = False
    with torch.no_grad():
        out = module(*inputs)
    return [t.numpy() for t in out.to_tuple() if isinstance(t, torch.Tensor)], inputs


@pytest.mark.parametrize(
    ("name", "target"),
    [("bert", "flax"), ("gpt2", "flax"), ("llama", "flax"), ("bert", "jax"), ("llama", "onnx")],
)
def test_save_pretrained_folder_converts_with_no_flag(tmp_path, name, target):
    folder, module = _saved(name, tmp_path)
    out = tmp_path / "out"
    r = _run(f"torch-to-{target}", str(folder), "-o", str(out))
    assert r.exit_code == 0, r.output
    written = {p.name for p in out.iterdir()}
    expected = {"model.onnx", "parity.json", "parity.html"}
    if target == "flax":
        expected |= {"model.py", "variables.msgpack"}
    assert expected <= written, written
    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] is True
    # The written model.onnx reproduces the transformers model on the config's inputs.
    import onnxruntime as ort

    want, inputs = _reference(module, folder)
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=True)}
    got = session.run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_inputs_come_from_the_config():
    ids, what = example_inputs({"vocab_size": 50, "max_position_embeddings": 4})
    assert ids[0].shape == (2, 4) and ids[0].dtype == torch.int64 and int(ids[0].max()) < 50
    assert what == "input_ids 2x4 int64"
    ids, _ = example_inputs({"vocab_size": 50, "n_positions": 1024})
    assert ids[0].shape == (2, 8)
    pixels, what = example_inputs({"image_size": 16, "num_channels": 1})
    assert pixels[0].shape == (2, 1, 16, 16) and what == "pixel_values 2x1x16x16 float32"
    assert example_inputs({"hidden_size": 8})[0] is None


def test_vision_folder_and_sharded_checkpoint(tmp_path):
    folder, module = _saved("vit", tmp_path, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    loaded, inputs, description = load_folder(folder)
    assert type(loaded).__name__ == "ViTModel"
    assert "pixel_values 2x3x16x16" in description
    state = module.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_weights_that_do_not_fit_exit_6(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = _saved("bert", tmp_path)
    weights = load_file(folder / "model.safetensors")
    dropped = sorted(weights)[3]
    del weights[dropped]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    r = _run("torch-to-onnx", str(folder), "-o", str(tmp_path / "out"), "--no-check")
    assert r.exit_code == 6, r.output
    assert "missing" in r.output and dropped in r.output
    assert not (tmp_path / "out").exists()


_CUSTOM_CONFIG = """from transformers import BertConfig


class CustomConfig(BertConfig):
    model_type = "xconv_custom_bert"
"""
_CUSTOM_MODEL = """from transformers import BertModel

from .configuration_custom import CustomConfig


class CustomModel(BertModel):
    config_class = CustomConfig
"""


def test_remote_code_needs_trust_code_and_folders_without_config(tmp_path):
    folder, _ = _saved("bert", tmp_path)
    (folder / "configuration_custom.py").write_text(_CUSTOM_CONFIG)
    (folder / "modeling_custom.py").write_text(_CUSTOM_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="xconv_custom_bert", architectures=["CustomModel"], auto_map={
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModel": "modeling_custom.CustomModel",
    })  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    r = _run("torch-to-flax", str(folder), "-o", str(tmp_path / "out"))
    assert r.exit_code == 2, r.output
    assert "--trust-code" in r.output and "auto_map" in r.output
    assert not (tmp_path / "out").exists()
    r = _run("torch-to-onnx", str(folder), "-o", str(tmp_path / "out"), "--trust-code")
    assert r.exit_code == 0, r.output
    assert "torch CustomModel" in r.output  # the folder's class, run as the reference
    assert json.loads((tmp_path / "out" / "parity.json").read_text())["passed"] is True
    (tmp_path / "plain").mkdir()
    r = _run("torch-to-flax", str(tmp_path / "plain"))
    assert r.exit_code == 2 and "save_pretrained" in r.output, r.output
