"""Flax emitter: structure, numbers (vs onnxruntime), validity, gradients; linen and nnx."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import xconv
from tests.converters.jax.flax_models import resnet_block
from tests.converters.jax.generated import import_generated, run_generated
from xconv.errors import UnsupportedOpError
from xconv.ir.layers import mark_layer, mark_weight
from xconv.ir.metadata import SCOPE

APIS = ["linen", "nnx"]


def ort_run(model: ir.Model, *inputs: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(
        ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, inputs, strict=True)))


def _sum_squares(outputs):
    return sum(jnp.sum(jnp.square(o)) for o in jax.tree_util.tree_leaves(outputs))


def check_grads(api, handle, *inputs):
    """jax.grad reaches every parameter (each gets a non-zero gradient)."""
    _, model, variables = handle
    if api == "linen":

        def loss(params):
            v = {**variables, "params": params}
            return _sum_squares(model.apply(v, *inputs))

        grads = jax.grad(loss)(variables["params"])
    else:
        from flax import nnx

        grads = nnx.grad(lambda m: _sum_squares(m(*inputs)))(model)
        grads = nnx.to_pure_dict(nnx.state(grads, nnx.Param))
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert leaves
    for path, g in leaves:
        assert np.all(np.isfinite(g)), path
        assert np.any(np.asarray(g) != 0), f"no gradient reaches {jax.tree_util.keystr(path)}"
    return len(leaves)


def ruff_ok(path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--isolated",
            "--select",
            "E,F,W,I,B,UP",
            "--ignore",
            "E501",
            str(path),
        ],
        capture_output=True,
        text=True,
    )
    return res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("api", APIS)
def test_resnet_block(tmp_path, api):
    model = resnet_block()
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    (expected,) = ort_run(model, x)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    # structure: native layers, one transpose in and one out
    for layer in ("Conv(", "BatchNorm(", "Dense(" if api == "linen" else "Linear("):
        assert layer in src
    # one transpose into NHWC; the pooled (N, 1, 1, C) needs no transpose back: its free
    # reshape to NCHW and the flatten are one reshape, its batch read from the array
    assert src.count("jnp.transpose(") == 1
    assert "_nchw" not in src
    assert "h = _mean(h, axis=(1, 2), keepdims=True)" in src
    assert "return self.fc(jnp.reshape(h, (h.shape[0], -1)))" in src
    # role-named locals; a chain of layers reads as one nested call, as a person writes it;
    # direct children need no scope comment
    assert re.search(r"h = .*self\.bn1\(self\.conv1\(x_nhwc\)", src) and "# bn1" not in src
    assert "Shape" not in src and "np.take" not in src  # the flatten chain was folded
    # numbers, under jit
    got, handle = run_generated(out, api, x)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)
    # validity: ruff, determinism
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    again = xconv.to_flax(model, tmp_path / "again", api=api)
    assert (again / "model.py").read_bytes() == (out / "model.py").read_bytes()
    assert (again / "variables.msgpack").read_bytes() == (out / "variables.msgpack").read_bytes()
    assert check_grads(api, handle, x) == 14 - 4  # 10 trainable params (BN stats are not)


@pytest.mark.parametrize("api", APIS)
def test_resnet_block_dynamic_batch(tmp_path, api):
    model = resnet_block("N")
    x = np.random.default_rng(2).standard_normal((3, 3, 8, 8)).astype(np.float32)
    (expected,) = ort_run(model, x)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    got, _ = run_generated(out, api, x)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


def test_variables_use_flax_conventions(tmp_path):
    model = resnet_block()
    out = xconv.to_flax(model, tmp_path / "out", api="linen")
    _, variables = import_generated(out).load(out)
    w = model.graph.initializers["conv1.weight"].const_value.numpy()
    np.testing.assert_array_equal(variables["params"]["conv1"]["kernel"], w.transpose(2, 3, 1, 0))
    fc = model.graph.initializers["fc.weight"].const_value.numpy()
    np.testing.assert_array_equal(variables["params"]["fc"]["kernel"], fc.T)
    assert set(variables["batch_stats"]["bn1"]) == {"mean", "var"}


def test_batchnorm_train_updates_stats(tmp_path):
    out = xconv.to_flax(resnet_block(), tmp_path / "out", api="linen")
    model, variables = import_generated(out).load(out)
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    _, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
    before = variables["batch_stats"]["bn1"]["mean"]
    assert not np.allclose(updates["batch_stats"]["bn1"]["mean"], before)


def test_unsupported_ops_listed_before_writing(tmp_path):
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", T.FLOAT, None)
    nodes = [
        h.make_node("ImageDecoder", ["x"], ["a"]),
        h.make_node("ImageDecoder", ["a"], ["b"]),
        h.make_node("GlobalLpPool", ["b"], ["y"]),
    ]
    model = ir.serde.deserialize_model(
        h.make_model(h.make_graph(nodes, "g", [x], [y]), opset_imports=[h.make_opsetid("", 23)])
    )
    with pytest.raises(UnsupportedOpError) as info:
        xconv.to_flax(model, tmp_path / "out")
    assert "ImageDecoder x2" in str(info.value) and "GlobalLpPool x1" in str(info.value)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("api", APIS)
def test_tiny_transformer(tmp_path, api):
    from tests.converters.jax.flax_models import tiny_transformer

    model = tiny_transformer()
    ids = np.random.default_rng(4).integers(0, 11, size=(3, 5)).astype(np.int64)
    (expected,) = ort_run(model, ids)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    for layer in ("Embed(", "LayerNorm(", "RMSNorm(", "Dropout("):
        assert layer in src
    assert ("nn.Dense(" if api == "linen" else "nnx.Linear(") in src
    assert "approximate=True" in src and "approximate=False" in src and "lax.erf(" in src
    got, handle = run_generated(out, api, ids)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    # 14 layer weights + the raw positional table
    assert check_grads(api, handle, ids) == 15


def test_dropout_follows_train(tmp_path):
    from tests.converters.jax.flax_models import tiny_transformer

    out = xconv.to_flax(tiny_transformer(), tmp_path / "out", api="linen")
    model, variables = import_generated(out).load(out)
    ids = np.arange(10, dtype=np.int64).reshape(2, 5) % 11
    a = model.apply(variables, ids)
    b = model.apply(variables, ids, train=True, rngs={"dropout": jax.random.key(0)})
    c = model.apply(variables, ids, train=True, rngs={"dropout": jax.random.key(0)})
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(b, c)


def _torch_net():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
            self.bn1 = torch.nn.BatchNorm2d(8)
            self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
            self.pool = torch.nn.MaxPool2d(3, 2, 1)
            self.fc = torch.nn.Linear(8, 4)
            self.ln = torch.nn.LayerNorm(4)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.pool(self.conv2(y) + y[:, :, ::2, ::2])
            y = torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
            y = torch.nn.functional.gelu(self.fc(y), approximate="tanh")
            return self.ln(y).softmax(-1)

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.bn1.running_mean.uniform_(-0.5, 0.5)
        net.bn1.running_var.uniform_(0.5, 1.5)
    return torch, net


@pytest.mark.parametrize("api", APIS)
def test_torch_exported_unannotated(tmp_path, api):
    """A dynamo export without layer metadata: raw ops, weights as top-level params."""
    torch, net = _torch_net()
    x = torch.randn(2, 3, 16, 16)
    onnx_program = torch.onnx.export(net, (x,), dynamo=True, optimize=False, verbose=False)
    model = xconv.load(onnx_program.model_proto)
    with torch.no_grad():
        expected = net(x).numpy()
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    assert "CastLike" not in src and "broadcast_to" not in src  # exporter bookkeeping folded
    got, _ = run_generated(out, api, x.numpy())
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg


@pytest.mark.parametrize("api", APIS)
def test_dynamic_batch_transformer_runs_under_jit(tmp_path, api):
    """Shape values computed from a dynamic batch stay numpy across generated classes (they
    are passed into and returned from attention submodules), so the model jits; a jnp shape
    would be a tracer in ``_reshape`` and raise ConcretizationTypeError under jit."""
    import torch

    from fixtures.torch_models import TinyTransformer, _build

    net = _build(TinyTransformer)
    ids = torch.randint(1, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model = xconv.from_torch(net, (ids,), dynamic_batch=True)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    with torch.no_grad():
        expected = net(ids).numpy()
    got, _ = run_generated(out, api, ids.numpy(), jit=True)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which", ["resnet_block", "tiny_transformer"])
def test_matches_to_jax(tmp_path, api, which):
    """The generated module and the IR interpreter (xconv.to_jax), both under jit, agree."""
    from tests.converters.jax import flax_models

    model = getattr(flax_models, which)()
    rng = np.random.default_rng(5)
    if which == "resnet_block":
        x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    else:
        x = rng.integers(0, 11, size=(2, 5)).astype(np.int64)
    fn, params = xconv.to_jax(model)
    (expected,) = jax.jit(fn)(params, x)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    got, _ = run_generated(out, api, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("api", APIS)
def test_attention_layer_becomes_generated_submodule(tmp_path, api):
    from tests.converters.jax.flax_models import tiny_transformer

    model = tiny_transformer(attention_module=True)
    ids = np.random.default_rng(6).integers(0, 11, size=(2, 5)).astype(np.int64)
    (expected,) = ort_run(model, ids)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    base = "nn.Module" if api == "linen" else "nnx.Module"
    assert f"class MultiheadAttention({base}):" in src
    assert re.search(r"(h\w*) = .*self\.attn\(\1\)", src)  # role-named locals (a chain folds)
    got, handle = run_generated(out, api, ids)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    mod = import_generated(out)
    if api == "linen":
        _, variables = mod.load(out)
        assert set(variables["params"]["attn"]) == {"out_proj_kernel", "out_proj_bias"}
    assert check_grads(api, handle, ids) == 15


def _two_blocks() -> ir.Model:
    """Two structurally identical recognised layers with no native Flax layer."""
    rng = np.random.default_rng(7)
    nodes, inits = [], []
    prev = "x"
    for i in (1, 2):
        w = rng.standard_normal((4, 4)).astype(np.float32)
        inits.append(h.make_tensor(f"blk{i}.w", T.FLOAT, [4, 4], w.reshape(-1).tolist()))
        nodes += [
            h.make_node("MatMul", [prev, f"blk{i}.w"], [f"s{i}"], name=f"mm{i}"),
            h.make_node("Softmax", [f"s{i}"], [f"p{i}"], axis=-1, name=f"sm{i}"),
            h.make_node("Mul", [f"p{i}", prev], [f"y{i}"], name=f"mul{i}"),
        ]
        prev = f"y{i}"
    graph = h.make_graph(
        nodes,
        "two_blocks",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 4])],
        [h.make_tensor_value_info(prev, T.FLOAT, [2, 4])],
        inits,
    )
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]))
    for n in model.graph:
        n.metadata_props[SCOPE] = f"blocks.{n.name[-1]}"
    for i in (1, 2):
        anchor = next(n for n in model.graph if n.name == f"mm{i}")
        mark_layer(anchor, "attention", embed_dim=4, num_heads=1, use_bias=False, batch_first=True)
        mark_weight(model.graph.initializers[f"blk{i}.w"], "q_kernel", "IO")
    return model


@pytest.mark.parametrize("api", APIS)
def test_identical_layers_share_one_generated_class(tmp_path, api):
    model = _two_blocks()
    x = np.random.default_rng(8).standard_normal((2, 4)).astype(np.float32)
    (expected,) = ort_run(model, x)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    assert src.count("class Attention(") == 1
    assert "self.blocks_1 = Attention(" in src and "self.blocks_2 = Attention(" in src
    got, _ = run_generated(out, api, x)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg


def test_torch_exported_transformer_layer(tmp_path):
    """nn.TransformerEncoderLayer via the dynamo exporter (no layer metadata), linen."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 16)
            self.enc = torch.nn.TransformerEncoderLayer(
                16, 4, 32, dropout=0.1, batch_first=True, activation="gelu"
            )
            self.head = torch.nn.Linear(16, 5)

        def forward(self, ids):
            return self.head(self.enc(self.emb(ids)).mean(1))

    torch.manual_seed(0)
    net = Net().eval()
    ids = torch.randint(0, 20, (2, 7))
    onnx_program = torch.onnx.export(net, (ids,), dynamo=True, optimize=False, verbose=False)
    model = xconv.load(onnx_program.model_proto)
    with torch.no_grad():
        expected = net(ids).numpy()
    out = xconv.to_flax(model, tmp_path / "out", api="linen")
    src = (out / "model.py").read_text()
    assert "jax.nn.softmax(" in src and "_layer_norm(" in src
    got, handle = run_generated(out, "linen", ids.numpy())
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    assert check_grads("linen", handle, ids.numpy()) == 15  # every torch parameter


@pytest.mark.parametrize("api", APIS)
def test_an_embedding_of_a_few_rows_is_a_plain_embed_call(tmp_path, api):
    """A token-type table (2 rows) is called as the nn.Embed it is, as a person writes it (a
    row-select formulation for one backend's gradient belongs to to_jax): torch's numbers and
    gradients, no helper."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(20, 8)
            self.segment = torch.nn.Embedding(2, 8)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, ids, types):
            return self.head(self.tok(ids) + self.segment(types))

    torch.manual_seed(0)
    net = Net().eval()
    ids, types = torch.randint(0, 20, (2, 7)), torch.randint(0, 2, (2, 7))
    with torch.no_grad():
        expected = net(ids, types).numpy()
    model = xconv.from_torch(net, (ids, types))
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    assert src.count("Embed(2, 8") == 1 and "_embed_rows" not in src, src
    assert not re.search(r"^def _", src, re.M), src  # no helper function
    got, handle = run_generated(out, api, ids.numpy(), types.numpy())
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    assert check_grads(api, handle, ids.numpy(), types.numpy()) == 4


@pytest.mark.parametrize("api", APIS)
def test_conv1d_groupnorm_batchnorm1d(tmp_path, api):
    from tests.converters.jax.flax_models import conv1d_norms

    model = conv1d_norms()
    x = np.random.default_rng(9).standard_normal((2, 4, 9)).astype(np.float32)
    (expected,) = ort_run(model, x)
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    assert "GroupNorm(" in src and src.count("BatchNorm(") == 2
    # channels-last from the first conv to the mean over length: one transpose, none back
    assert src.count("jnp.transpose(") == 1
    got, handle = run_generated(out, api, x)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    assert check_grads(api, handle, x) == 8


def test_failed_run_keeps_previous_output_and_input_model(tmp_path):
    model = resnet_block()
    before = ir.to_proto(model).SerializeToString()
    out = xconv.to_flax(model, tmp_path / "out")
    assert ir.to_proto(model).SerializeToString() == before  # canonicalised on a copy
    old = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = ir.from_proto(ir.to_proto(model))
    next(n for n in bad.graph if n.op_type == "Relu").op_type = "NoSuchOp"
    with pytest.raises(UnsupportedOpError, match="NoSuchOp x1"):
        xconv.to_flax(bad, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with pytest.raises(xconv.ConversionError, match="api="):
        xconv.to_flax(model, tmp_path / "other", api="haiku")


@pytest.mark.parametrize(("name", "n_params"), [("resnet", 32), ("transformer", 42)])
def test_torch_importer_fixtures(tmp_path, name, n_params):
    """End to end through xconv.from_torch's layer metadata: native layers, numbers, grads."""
    torch = pytest.importorskip("torch")
    from fixtures import torch_models
    from xconv import from_torch

    module, inputs = torch_models.FIXTURES[name]()
    model = from_torch(module, inputs)
    with torch.no_grad():
        expected = module(*inputs)
    expected = expected[0] if isinstance(expected, tuple | list) else expected
    out = xconv.to_flax(model, tmp_path / "out", api="linen")
    src = (out / "model.py").read_text()
    if name == "resnet":
        assert "nn.Conv(" in src and "nn.BatchNorm(" in src and "nn.Dense(" in src
        assert src.count("jnp.transpose(") == 1  # NHWC from the stem to the head
        # the global average pool and the flatten before the classifier: one mean
        assert "return self.fc(_mean(" in src and ", axis=(1, 2)))\n" in src
        body = src[src.index("\nclass ") :]  # the modules, after the helpers
        assert "keepdims" not in body and "jnp.reshape(" not in src
    else:
        assert src.count("class MultiheadAttention(") == 1  # one class for every layer
    xs = [i.numpy() for i in inputs]
    got, handle = run_generated(out, "linen", *xs)
    got = got[0] if isinstance(got, tuple | list) else got
    np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-4, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    assert check_grads("linen", handle, *xs) == n_params


@pytest.mark.parametrize("api", APIS)
def test_tied_lm_head_stored_once(tmp_path, api):
    """An LM head tied to the embedding: one variable serves both (no transposed second copy
    in variables.msgpack), and the numbers match torch."""
    import torch

    from xconv.converters.torch.importer.trace import from_torch
    from xconv.weights.flax_msgpack import read_msgpack

    class TiedLM(torch.nn.Module):  # the embedding gathered from the head's weight
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 20, bias=False)

        def forward(self, ids):
            return self.head(self.ln(torch.nn.functional.embedding(ids, self.head.weight)))

    torch.manual_seed(0)
    net = TiedLM().eval()
    ids = torch.randint(0, 20, (2, 5))
    with torch.no_grad():
        expected = net(ids).numpy()
    out = xconv.to_flax(from_torch(net, (ids,)), tmp_path / "out", api=api)
    leaves = jax.tree_util.tree_leaves(read_msgpack(out / "variables.msgpack"))
    assert sum(leaf.shape in ((20, 8), (8, 20)) for leaf in leaves) == 1
    for jit in (True, False):
        got, _ = run_generated(out, api, ids.numpy(), jit=jit)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg


@pytest.mark.parametrize("api", APIS)
def test_values_computed_at_run_time_are_read_eagerly_and_named_under_jit(tmp_path, api):
    """Reduction axes, Slice bounds and Pad's pads that are graph inputs: the written module
    reads them when it runs eagerly (matching onnxruntime, a max over an empty axis giving
    ONNX's -inf), and under jit names the value jit would need constant."""
    f32 = T.FLOAT
    inputs = [
        h.make_tensor_value_info("x", f32, [2, 0, 4]),
        h.make_tensor_value_info("y", f32, [3, 5]),
        h.make_tensor_value_info("axes", T.INT64, [1]),
        h.make_tensor_value_info("starts", T.INT64, [1]),
        h.make_tensor_value_info("pads", T.INT64, [4]),
    ]
    outputs = [h.make_tensor_value_info(n, f32, None) for n in ("m", "s", "p")]
    nodes = [
        h.make_node("ReduceMax", ["x", "axes"], ["m"], keepdims=0),
        h.make_node("Slice", ["y", "starts", "ends"], ["s"]),
        h.make_node("Pad", ["y", "pads"], ["p"], mode="reflect"),
    ]
    ends = h.make_tensor("ends", T.INT64, [1], [-9223372036854775807])  # a reversed slice
    graph = h.make_graph(nodes, "g", inputs, outputs, initializer=[ends])
    model = ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 21)]))
    rng = np.random.default_rng(0)
    feed = [
        np.zeros((2, 0, 4), np.float32),
        rng.standard_normal((3, 5)).astype(np.float32),
        np.array([1], np.int64),
        np.array([-1], np.int64),
        np.array([1, 2, 0, 1], np.int64),
    ]
    out = tmp_path / api
    xconv.to_flax(model, out, api=api)
    got, _ = run_generated(out, api, *feed, jit=False)
    want = ort_run(model, *feed)
    assert np.all(np.isneginf(np.asarray(got[0]))) and np.asarray(got[0]).shape == (2, 4)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)
    with pytest.raises(ValueError, match="ReduceMax axes is computed at run time.*jax.jit"):
        run_generated(out, api, *feed, jit=True)


@pytest.mark.parametrize(
    ("mode", "padding", "corners"),
    [("bilinear", "zeros", False), ("nearest", "border", True), ("bicubic", "reflection", False)],
)
def test_grid_sample_from_torch_matches_torch(tmp_path, mode, padding, corners):
    """A torch module's F.grid_sample, exported to ONNX's GridSample, through the generated
    Flax (jitted) against torch, with grid points outside [-1, 1]."""
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional

    class Sampler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x, grid):
            y = self.conv(x)
            return functional.grid_sample(
                y, grid, mode=mode, padding_mode=padding, align_corners=corners
            )

    torch.manual_seed(0)
    module = Sampler().eval()
    x, grid = torch.randn(2, 3, 8, 8), torch.rand(2, 5, 6, 2) * 2.4 - 1.2
    model = xconv.from_torch(module, (x, grid))
    assert "GridSample" in {n.op_type for n in model.graph}
    xconv.to_flax(model, tmp_path / "out")
    got, _ = run_generated(tmp_path / "out", "linen", x.numpy(), grid.numpy())
    want = module(x, grid).detach().numpy()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
