"""A language model with 4-bit weights, as weight-only quantization writes it.

A tiny Llama (transformers, offline, random weights) is exported by ``torch.onnx.export`` and
its MatMul weights quantized by onnxruntime's ``MatMulNBitsQuantizer`` in QDQ form: each
weight an int4 / uint4 initializer, blocks of 32 rows with their scales (and zero points),
dequantized before its MatMul. Every xconv path must compute what onnxruntime computes on
that file: the torch and JAX runtimes, the written torch and Flax sources (the CLI, with its
parity report).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402
from onnxruntime.quantization import QuantFormat  # noqa: E402
from onnxruntime.quantization.matmul_nbits_quantizer import (  # noqa: E402
    DefaultWeightOnlyQuantConfig,
    MatMulNBitsQuantizer,
)

import xconv  # noqa: E402
from xconv.cli import main  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    module = _Logits(transformers.LlamaForCausalLM(config).eval())
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    return module, ids


@pytest.fixture(scope="module", params=[False, True], ids=["uint4-zero-points", "int4-symmetric"])
def quantized(request, llama, tmp_path_factory):
    """(path of the 4-bit model, ids, onnxruntime's logits, the float model's logits)."""
    module, ids = llama
    out = tmp_path_factory.mktemp("int4")
    torch.onnx.export(module, (ids,), str(out / "float.onnx"), dynamo=True, external_data=False)
    config = DefaultWeightOnlyQuantConfig(
        block_size=32,
        is_symmetric=request.param,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=("MatMul",),
    )
    quantizer = MatMulNBitsQuantizer(onnx.load(out / "float.onnx"), algo_config=config)
    quantizer.process()
    path = out / "model.onnx"
    onnx.save(quantizer.model.model, path)
    types = {init.data_type for init in quantizer.model.model.graph.initializer}
    assert (onnx.TensorProto.INT4 if request.param else onnx.TensorProto.UINT4) in types
    # onnxruntime as the file says: its optimizer would fuse each pair into MatMulNBits.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options)
    want = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[0]
    with torch.no_grad():
        full = module(ids).numpy()
    return path, ids, want, full


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=2e-5)


def test_the_runtimes_compute_the_4bit_model(quantized):
    import jax

    path, ids, want, full = quantized
    # The 4-bit weights change the logits: a path that read them as float would not match.
    assert np.abs(want - full).max() > 1e-2
    module, _ = xconv.to_torch(xconv.load(path))
    with torch.no_grad():
        _close(module(ids), want)
    fn, params = xconv.to_jax(xconv.load(path))
    _close(jax.jit(fn)(params, ids.numpy())[0], want)


def test_the_written_sources_compute_the_4bit_model(quantized, tmp_path):
    path, ids, want, _ = quantized
    source, state = xconv.to_torch_source(xconv.load(path), example_inputs=ids)
    namespace: dict = {}
    exec(compile(source, "model.py", "exec"), namespace)  # noqa: S102 - the written module
    model = namespace["Model"]()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})
    with torch.no_grad():
        _close(model.eval()(ids), want)
    for command in ("onnx-to-torch", "onnx-to-flax"):
        out = tmp_path / command
        result = CliRunner().invoke(main, [command, str(path), "-o", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads((out / "parity.json").read_text())
        assert report["passed"], report["verdict"]
    assert (
        "jnp.int4" in (tmp_path / "onnx-to-flax" / "model.py").read_text()
        or "jnp.uint4" in (tmp_path / "onnx-to-flax" / "model.py").read_text()
    )
