"""IR -> readable PyTorch source: structure, numbers against the source module, validity."""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

import xconv  # noqa: E402
from fixtures.torch_models import FIXTURES  # noqa: E402
from xconv.converters.torch.source.emitter import to_torch_source  # noqa: E402
from xconv.converters.torch.source.write import write_torch  # noqa: E402
from xconv.errors import UnsupportedOpError  # noqa: E402
from xconv.ir.builder import GraphBuilder  # noqa: E402
from xconv.ir.layers import mark_layer  # noqa: E402

#: Fixtures whose scopes are module paths: generated state_dict == original, bit-exact.
PARITY = ["mlp", "resnet", "conv_zoo", "transformer", "mha_weights", "norm_zoo"]

_CACHE: dict[str, tuple] = {}


def _converted(name: str):
    if name not in _CACHE:
        module, inputs = FIXTURES[name]()
        _CACHE[name] = (module, inputs, xconv.from_torch(module, inputs))
    return _CACHE[name]


def _exec(source: str):
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    return ns["Model"]


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _ruff(path) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff") or str(__import__("pathlib").Path(sys.executable).parent / "ruff")
    return subprocess.run(
        [
            ruff,
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "E,F,I,B,UP,SIM",
            "--ignore",
            "E501",
            str(path),
        ],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("name", PARITY)
def test_fixture_parity_and_state_dict(name):
    module, inputs, model = _converted(name)
    source, state = to_torch_source(model)
    gen = _exec(source)()
    ref = module.state_dict()
    assert sorted(state) == sorted(ref)
    for key, value in ref.items():
        assert state[key].dtype == value.dtype, key
        assert torch.equal(state[key], value), key
    gen.load_state_dict(state)
    gen.eval()
    with torch.no_grad():
        want, got = _as_tuple(module(*inputs)), _as_tuple(gen(*inputs))
    assert len(want) == len(got)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5)


def test_structure_resnet_and_transformer():
    src_resnet, _ = to_torch_source(_converted("resnet")[2])
    for text in ("nn.Conv2d(", "nn.BatchNorm2d(", "nn.Linear(", "class BasicBlock(nn.Module):"):
        assert text in src_resnet
    # the block's layers live in its class, its channel count a field; torch's defaults are
    # not spelled out; the variant with a downsample is its own class; blocks run in a loop
    assert "    def __init__(self, channels: int):" in src_resnet
    assert "self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)" in src_resnet
    assert 'add_module("1", BasicBlock(16))' in src_resnet
    assert "class BasicBlockDownsample(nn.Module):" in src_resnet
    assert "for block in (self.layer1[0], self.layer1[1]):" in src_resnet
    assert "nn.BatchNorm2d(8)\n" in src_resnet and "groups=1" not in src_resnet
    assert "F.max_pool2d(" in src_resnet
    src_tr, _ = to_torch_source(_converted("transformer")[2])
    for text in ("nn.Embedding(", "nn.LayerNorm(", "nn.MultiheadAttention(", "nn.Dropout("):
        assert text in src_tr
    assert 'F.gelu(linear_10, approximate="tanh")' in src_tr or 'approximate="tanh"' in src_tr
    assert "F.gelu(linear_4)" in src_tr or "F.gelu(" in src_tr
    assert "F.scaled_dot_product_attention(" in src_tr and "is_causal=True" in src_tr
    # one class per source module class; a variant differing in structure gets its own
    assert "class SelfAttentionBlock(nn.Module):" in src_tr
    assert "class EncoderLayer(nn.Module):" in src_tr and "class EncoderLayer2(" in src_tr
    assert "self.self_attn = SelfAttentionBlock()" in src_tr
    # locals are named by role, never the exporter's
    assert "x = x + attn" in src_tr
    assert not re.search(r"\b(linear|getitem|add|layer_norm)_\d+\b", src_tr)


def test_deterministic_and_ruff_clean(tmp_path):
    model = _converted("transformer")[2]
    a, _ = to_torch_source(model)
    b, _ = to_torch_source(model)
    assert a == b
    out = write_torch(model, tmp_path / "tr")
    first = (out / "model.py").read_bytes()
    write_torch(model, tmp_path / "tr")
    assert (out / "model.py").read_bytes() == first
    result = _ruff(out / "model.py")
    assert result.returncode == 0, result.stdout + result.stderr


def test_written_dir_loads_and_matches(tmp_path):
    module, inputs, model = _converted("resnet")
    out = write_torch(model, tmp_path / "resnet")
    assert (out / "model.py").exists()
    assert (out / "weights.pt").exists() or (out / "weights.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers
    text = (out / "model.py").read_text()
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert all(line.split()[1].split(".")[0] in {"torch", "numpy", "pathlib"} for line in imports)
    spec = importlib.util.spec_from_file_location("gen_resnet", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    gen = mod.load(out)
    assert not gen.training
    with torch.no_grad():
        np.testing.assert_allclose(
            gen(*inputs).numpy(), module(*inputs).numpy(), rtol=1e-5, atol=1e-5
        )


def test_train_mode_batch_norm_updates_running_stats():
    module, inputs, model = _converted("resnet")
    source, state = to_torch_source(model)
    gen = _exec(source)()
    gen.load_state_dict(state)
    ref = copy.deepcopy(module)
    ref.train()
    gen.train()
    x = inputs[0] * 2 + 0.3
    with torch.no_grad():
        np.testing.assert_allclose(gen(x).numpy(), ref(x).numpy(), rtol=1e-4, atol=1e-5)
    got, want = gen.state_dict(), ref.state_dict()
    assert not torch.equal(got["bn1.running_mean"], state["bn1.running_mean"])
    for key in want:
        if "running" in key or "num_batches" in key:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)
    gen.eval()  # back to eval: running stats used, dropout off
    assert not gen.bn1.training


def test_recurrent_layers_are_written_and_ruff_clean(tmp_path):
    """torch's LSTM and GRU (bidirectional, two layers) as ONNX's recurrent ops: written as
    calls of the generated _lstm / _gru, matching the module, ruff-clean."""
    module, inputs, model = _converted("seq_model")
    out = write_torch(model, tmp_path / "seq")
    text = (out / "model.py").read_text()
    assert "def _lstm(" in text and "def _gru(" in text and "def _rnn_scan(" in text
    assert _ruff(out / "model.py").returncode == 0, _ruff(out / "model.py").stdout
    spec = importlib.util.spec_from_file_location("gen_seq", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with torch.no_grad():
        got, want = mod.load(out)(*inputs), module(*inputs)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_unsupported_ops_listed_before_writing(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 3])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    nodes = [
        onnx.helper.make_node("ImageDecoder", ["x"], ["a"]),
        onnx.helper.make_node("GlobalLpPool", ["a"], ["y"]),
    ]
    graph = onnx.helper.make_graph(nodes, "g", [x], [y])
    model = xconv.load(
        onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23)])
    )
    with pytest.raises(UnsupportedOpError) as err:
        write_torch(model, tmp_path / "out")
    assert "ImageDecoder" in str(err.value) and "GlobalLpPool" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["input", "initializer"])
def test_float4_written_as_the_runtime_holds_it(tmp_path, where):
    """float4e2m1 is written as the torch runtime holds it (``torch.float4_e2m1fn_x2``, one
    code a byte): a float4 input or initializer (FP4 weights) cast to float and multiplied
    gives to_torch's numbers and the reference's, and the weight is a float4 buffer under
    to_torch's state_dict key."""
    import ml_dtypes
    from onnx.reference import ReferenceEvaluator

    from xconv.converters.torch.runtime.dtypes import to_tensor

    w = np.array([[0.5, -1.0], [6.0, 2.0]]).astype(ml_dtypes.float4_e2m1fn)
    h = onnx.helper
    nodes = [h.make_node("Cast", ["w"], ["wf"], to=onnx.TensorProto.FLOAT),
             h.make_node("MatMul", ["x", "wf"], ["y"])]  # fmt: skip
    inputs = [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])]
    inits = [onnx.numpy_helper.from_array(w, "w")]
    if where == "input":
        inputs.append(h.make_tensor_value_info("w", onnx.TensorProto.FLOAT4E2M1, [2, 2]))
        inits = []
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    graph = h.make_graph(nodes, "g", inputs, [y], inits)
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)])
    model = xconv.load(proto)
    x = np.array([[1.0, 2.0], [-3.0, 0.25]], np.float32)
    feeds = {"x": x, **({"w": w} if where == "input" else {})}
    (want,) = ReferenceEvaluator(proto).run(None, feeds)
    out = write_torch(model, tmp_path / "out")
    spec = importlib.util.spec_from_file_location("float4_model", out / "model.py")
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    written = generated.load(out)
    runtime, _ = xconv.to_torch(model)
    args = [to_tensor(feeds[k]) for k in ("x", "w") if k in feeds]
    with torch.no_grad():
        got, ref = written(*args), runtime(*args)
    np.testing.assert_array_equal(got.numpy(), ref.numpy())
    np.testing.assert_array_equal(got.numpy(), want)
    if where == "initializer":
        assert written.w.dtype == runtime.state_dict()["w"].dtype == torch.float4_e2m1fn_x2
        written.load_state_dict(runtime.state_dict())


def _flax_style_model(relu_scope: str | None = None):
    """A Flax-like IR: Dense kernel IO, Conv kernel HWIO (channels-first activations)."""
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    x = b.input("x", np.float32, (2, 3, 8, 8))
    k_hwio = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    kc = b.weight("Conv_0/kernel", k_hwio, role="kernel", layout="HWIO")
    bc = b.weight("Conv_0/bias", rng.standard_normal(4).astype(np.float32), role="bias")
    perm = b.op("Transpose", [kc], {"perm": [3, 2, 0, 1]}, scope="Conv_0")
    y = b.op("Conv", [x, perm, bc], {"pads": [1, 1, 1, 1]}, scope="Conv_0")
    mark_layer(
        y.producer(),
        "conv",
        ndim=2,
        in_channels=3,
        out_channels=4,
        kernel_size=[3, 3],
        strides=[1, 1],
        padding=[[1, 1], [1, 1]],
        dilations=[1, 1],
        groups=1,
        use_bias=True,
    )
    y = b.op("Relu", [y], scope=relu_scope)
    y = b.op("GlobalAveragePool", [y])
    y = b.op("Flatten", [y], {"axis": 1})
    k_io = rng.standard_normal((4, 5)).astype(np.float32)
    kd = b.weight("Dense_0/kernel", k_io, role="kernel", layout="IO")
    bd = b.weight("Dense_0/bias", rng.standard_normal(5).astype(np.float32), role="bias")
    mm = b.op("MatMul", [y, kd], scope="Dense_0")
    mark_layer(mm.producer(), "dense", in_features=4, out_features=5, use_bias=True)
    out = b.op("Add", [mm, bd], scope="Dense_0")
    return b.build([out]), k_hwio, k_io


@pytest.mark.parametrize("relu_scope", [None, "Conv_0"])
def test_flax_layouts_transposed_into_torch_layouts(relu_scope):
    model, k_hwio, k_io = _flax_style_model(relu_scope)
    source, state = to_torch_source(model)
    if relu_scope is None:
        assert "nn.Conv2d(3, 4, 3, padding=1)" in source
        np.testing.assert_array_equal(state["Conv_0.weight"].numpy(), k_hwio.transpose(3, 2, 0, 1))
    else:  # an activation inside the layer's scope: the body stays inline ops
        assert "nn.Conv2d(" not in source and "F.conv2d(" in source
        assert "torch.relu(" in source
        np.testing.assert_array_equal(state["Conv_0.kernel"].numpy(), k_hwio)
    assert "nn.Linear(4, 5)" in source
    np.testing.assert_array_equal(state["Dense_0.weight"].numpy(), k_io.T)
    gen = _exec(source)()
    gen.load_state_dict(state)
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    import onnx_ir as ir
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(ir.to_proto(model)).run(None, {"x": x})[0]
    with torch.no_grad():
        got = gen(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_flax_repeated_blocks_become_one_class_in_a_loop(tmp_path):
    """Flax -> torch source: the Flax module tree (``xconv.modules``) gives one class per Flax
    class, its instances called in a loop, role-named locals, state_dict keys nested as the
    Flax variables are, outputs equal to Flax's."""
    jax = pytest.importorskip("jax")
    from flax import linen as fnn

    from fixtures.flax_models import LinenBlock

    class Stack(fnn.Module):
        @fnn.compact
        def __call__(self, ids):
            x = fnn.Embed(50, 32)(ids)
            for _ in range(3):
                x = LinenBlock(32)(x)
            return fnn.Dense(50)(fnn.LayerNorm()(x))

    m = Stack()
    ids = np.random.default_rng(0).integers(0, 50, (2, 7)).astype(np.int32)
    variables = m.init(jax.random.PRNGKey(0), ids)
    model = xconv.from_flax(m, variables, (ids,))
    source, state = to_torch_source(model)
    assert source.count("class LinenBlock(nn.Module):") == 1
    assert "self.LinenBlock_2 = LinenBlock()" in source
    assert "for block in (self.LinenBlock_0, self.LinenBlock_1, self.LinenBlock_2):" in source
    assert "nn.Linear(32, 64)\n" in source and "bias=True" not in source
    assert not re.search(r"\b(add|mul|where|layernormalization|dropout)_\d+\b", source)
    assert "LinenBlock_1.Dense_0.weight" in state
    assert "LinenBlock_1.MultiHeadDotProductAttention_0.in_proj_weight" in state
    gen = _exec(source)()
    gen.load_state_dict(state)
    gen.eval()
    with torch.no_grad():
        got = gen(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(got, np.asarray(m.apply(variables, ids)), rtol=1e-5, atol=1e-5)
    assert to_torch_source(model)[0] == source
    (tmp_path / "model.py").write_text(source)
    result = _ruff(tmp_path / "model.py")
    assert result.returncode == 0, result.stdout + result.stderr


def test_flax_bert_shaped_source_reads_hand_written(tmp_path):
    """Flax BERT-shaped encoder -> torch source: one class per Flax class (BertSelfAttention,
    BertLayer), the identical layers called in a loop, q/k/v named by role, native Linear /
    LayerNorm, no exporter names, nested state_dict keys, outputs equal to Flax's, ruff-clean
    and deterministic."""
    jax = pytest.importorskip("jax")
    from fixtures.flax_models import linen_bert

    m, variables, (ids,) = linen_bert()
    model = xconv.from_flax(m, variables, (ids,))
    source, state = to_torch_source(model)
    assert source.count("class BertLayer(nn.Module):") == 1
    assert source.count("class BertSelfAttention(nn.Module):") == 1
    assert "for block in (self.layer_0, self.layer_1):" in source
    # the ids' length is the symbol seq: the head split reshapes q.shape[0], -1 (one line or two)
    for role in ("q", "k"):
        assert re.search(
            rf"{role} = self\.\w+\(x\)(\.reshape\(|\n\s+{role} = {role}\.reshape\()", source
        )
    assert "scores = torch.einsum(" in source
    assert "self.attention_norm = nn.LayerNorm(32, eps=1e-12)" in source
    assert not re.search(r"\b(add|mul|where|matmul|einsum|reshape|gather)_\d+\b", source)
    assert "layer_1.attention.query.weight" in state and "layer_1.output_norm.bias" in state
    gen = _exec(source)()
    gen.load_state_dict(state)
    gen.eval()
    want = m.apply(variables, ids)
    with torch.no_grad():
        got = gen(torch.from_numpy(ids))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert to_torch_source(model)[0] == source
    (tmp_path / "model.py").write_text(source)
    result = _ruff(tmp_path / "model.py")
    assert result.returncode == 0, result.stdout + result.stderr
    del jax


@pytest.mark.slow
def test_flaxmodels_resnet_blocks_share_classes_with_fields():
    """flaxmodels' ResNet-18 -> torch source: its own BatchNorm (raw parameters) at four
    widths is one class with a ``features`` field, the basic blocks (with and without the
    projection branch) one class with channel, ``stride`` and ``downsample`` fields, and the
    closing layout transpose stays in ``Model``; outputs equal to Flax's (~60 s)."""
    jax = pytest.importorskip("jax")
    fm = pytest.importorskip("flaxmodels")

    m = fm.ResNet18(output="logits", pretrained=None, num_classes=10)
    x = np.random.default_rng(0).random((2, 32, 32, 3), dtype=np.float32)
    variables = m.init(jax.random.PRNGKey(0), x, train=False)

    def call(module, x):
        return module(x, train=False)

    source, state = to_torch_source(xconv.from_flax(m, variables, (x,), method=call))
    assert re.findall(r"^class (\w+)\(nn\.Module\)", source, flags=re.M) == [
        "BatchNorm",
        "BasicBlock",
        "Model",
    ]
    assert "def __init__(self, features: int):" in source
    assert "self.BasicBlock_3 = BasicBlock(128, 128)" in source
    assert "self.BasicBlock_4 = BasicBlock(128, 256, stride=2, downsample=True)" in source
    assert "self.BasicBlock_7 = BasicBlock(512, 512)" in source
    assert "residual = self.BatchNorm_2(self.Conv_2(x)) if self.downsample else x" in source
    assert "BasicBlock_4.Conv_2.weight" in state and "BasicBlock_3.Conv_2.weight" not in state
    gen = _exec(source)()
    gen.load_state_dict(state)
    gen.eval()
    with torch.no_grad():
        got = gen(torch.from_numpy(x)).numpy()
    want = np.asarray(m.apply(variables, x, method=call))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_flax_resnet_shaped_blocks_are_one_class(tmp_path):
    """A Flax block class used with and without its projection branch -> one torch class with
    ``stride`` / ``downsample`` fields (the branch built and called under the flag), the
    state_dict keys of the flat model, outputs equal to Flax's, ruff-clean and deterministic."""
    jax = pytest.importorskip("jax")
    from fixtures.flax_models import linen_resnet

    m, variables, (x,) = linen_resnet()
    model = xconv.from_flax(m, variables, (x,))
    source, state = to_torch_source(model)
    assert re.findall(r"^class (\w+)\(nn\.Module\)", source, flags=re.M) == ["ResBlock", "Model"]
    assert (
        "def __init__(self, in_channels: int, channels: int, stride: int = 1, "
        "downsample: bool = False):" in source
    )
    assert "        if self.downsample:\n            self.Conv_2 = nn.Conv2d(" in source
    assert "if self.downsample else x" in source
    assert "self.ResBlock_0 = ResBlock(8, 8)" in source
    assert "self.ResBlock_1 = ResBlock(8, 16, stride=2, downsample=True)" in source
    assert "self.ResBlock_2 = ResBlock(16, 16)" in source
    assert "ResBlock_1.Conv_2.weight" in state and "ResBlock_1.BatchNorm_2.running_var" in state
    assert not any(k.startswith(("ResBlock_0.Conv_2", "ResBlock_2.Conv_2")) for k in state)
    gen = _exec(source)()
    gen.load_state_dict(state)
    gen.eval()
    with torch.no_grad():
        got = gen(torch.from_numpy(x)).numpy()
    want = np.asarray(m.apply(variables, x))
    assert np.abs(want).max() > 0.1  # the ReLUs are not all off
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert to_torch_source(model)[0] == source
    (tmp_path / "model.py").write_text(source)
    result = _ruff(tmp_path / "model.py")
    assert result.returncode == 0, result.stdout + result.stderr
    del jax
