"""xconv.from_torch: structure (metadata, weights, high-level ops) and numbers vs torch."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

import onnx_ir as ir  # noqa: E402

import xconv  # noqa: E402
from fixtures.torch_models import FIXTURES  # noqa: E402
from xconv.errors import ConversionError  # noqa: E402
from xconv.ir.layers import LAYER_KINDS  # noqa: E402
from xconv.ir.metadata import LAYER, LAYOUT, MODULE, ROLE, SCOPE, SOURCE_LINE  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


@functools.cache
def converted(name: str, dynamic_batch: bool = False):
    module, args = FIXTURES[name]()
    return module, args, xconv.from_torch(module, args, dynamic_batch=dynamic_batch)


def torch_outputs(module, args) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*args)
    out = out if isinstance(out, tuple) else (out,)
    return [o.numpy() for o in out if o is not None]


def run_jax(model, args) -> list[np.ndarray]:
    fn, params = xconv.to_jax(model)
    return [np.asarray(o) for o in fn(params, *[a.numpy() for a in args])]


def run_onnxruntime(model, args) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString())
    names = [v.name for v in model.graph.inputs]
    return sess.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})


def nodes_by_scope(model, scope: str) -> list[ir.Node]:
    return [n for n in model.graph if n.metadata_props.get(SCOPE) == scope]


def anchor(model, scope: str) -> tuple[ir.Node, dict]:
    marked = [n for n in nodes_by_scope(model, scope) if LAYER in n.metadata_props]
    assert len(marked) == 1, f"{scope}: {len(marked)} anchors"
    return marked[0], json.loads(marked[0].metadata_props[LAYER])


# -- numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_ir_matches_torch_on_onnxruntime(name):
    """The IR itself is right, independently of the JAX backend."""
    module, args, model = converted(name)
    for got, want in zip(run_onnxruntime(model, args), torch_outputs(module, args), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_to_jax_matches_torch(name):
    module, args, model = converted(name)
    want = torch_outputs(module, args)
    got = run_jax(model, args)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_artifact_saves_and_checks(tmp_path):
    _, _, model = converted("resnet")
    path = xconv.save(model, tmp_path / "resnet.onnx")  # runs onnx.checker
    reloaded = xconv.load(path)
    assert reloaded.opset_imports[""] == 23
    conv = next(n for n in reloaded.graph if n.op_type == "Conv")
    assert conv.metadata_props[SCOPE] == "conv1"


# -- structure --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_weights_are_the_state_dict(name):
    module, _, model = converted(name)
    weights = {k for k, v in model.graph.initializers.items() if ROLE in v.metadata_props}
    assert weights == set(module.state_dict())
    for key, tensor in module.state_dict().items():
        value = model.graph.initializers[key].const_value.numpy()
        np.testing.assert_array_equal(value, tensor.numpy())


def test_opset_and_no_torch_metadata_left():
    _, _, model = converted("transformer")
    assert model.opset_imports[""] == xconv.ir.OPSET
    for node in model.graph:
        assert not [k for k in node.metadata_props if k.startswith("pkg.torch")]
    for value in model.graph.initializers.values():
        assert not [k for k in value.metadata_props if k.startswith("pkg.torch")]


def test_roles_and_layouts():
    _, _, resnet = converted("resnet")
    _, _, zoo = converted("conv_zoo")
    _, _, tfm = converted("transformer")
    _, _, seq = converted("seq_model")
    expect = [
        (resnet, "conv1.weight", "kernel", "OIHW"),
        (resnet, "fc.weight", "kernel", "OI"),
        (resnet, "fc.bias", "bias", "O"),
        (resnet, "layer1.0.bn1.weight", "scale", "C"),
        (resnet, "layer1.0.bn1.bias", "bias", "C"),
        (resnet, "layer1.0.bn1.running_mean", "mean", "C"),
        (resnet, "layer1.0.bn1.running_var", "var", "C"),
        (resnet, "layer2.0.downsample.1.num_batches_tracked", "num_batches", None),
        (zoo, "conv1d.weight", "kernel", "OIW"),
        (zoo, "conv3d.weight", "kernel", "OIDHW"),
        (zoo, "up.weight", "kernel", "IOHW"),
        (zoo, "gn.weight", "scale", "C"),
        (tfm, "tok.weight", "embedding", "VD"),
        (tfm, "layers.0.ln1.weight", "scale", "C"),
        (tfm, "layers.0.attn.in_proj_weight", "in_proj_kernel", "OI"),
        (tfm, "layers.0.attn.out_proj.weight", "out_proj_kernel", "OI"),
        (tfm, "layers.0.attn.out_proj.bias", "out_proj_bias", "O"),
        (seq, "lstm.weight_ih_l1", "weight_ih_l1", "OI"),
        (seq, "gru.bias_hh_l0_reverse", "bias_hh_l0_reverse", "O"),
    ]
    for model, name, role, layout in expect:
        props = model.graph.initializers[name].metadata_props
        assert props.get(ROLE) == role, name
        assert props.get(LAYOUT) == layout, name


def test_non_persistent_buffer_is_a_constant():
    _, _, model = converted("transformer")
    value = model.graph.initializers["position_ids"]
    assert ROLE not in value.metadata_props
    _, params = xconv.to_jax(model)
    assert "position_ids" not in params


def test_batch_norm_stays_unfused():
    module, _, model = converted("resnet")
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in module.modules())
    bns = [n for n in model.graph if n.op_type == "BatchNormalization"]
    assert len(bns) == n_bn == 10
    for node in bns:
        assert all(v.is_initializer() for v in node.inputs[1:]), node.name
    convs = [n for n in model.graph if n.op_type == "Conv"]
    # Bias-free convs lose the exporter's zero-bias bookkeeping; weights feed Conv directly.
    assert all(len(n.inputs) == 2 and n.inputs[1].is_initializer() for n in convs)
    assert not [n for n in model.graph if n.op_type in ("Expand", "CastLike")]
    # Symbolic by default: the flatten reads the batch size off the input, nothing else.
    shapes = [n for n in model.graph if n.op_type == "Shape"]
    assert [n.inputs[0].name for n in shapes] == ["x"]


def test_layer_metadata_on_anchors():
    _, _, model = converted("resnet")
    node, layer = anchor(model, "layer2.0.conv1")
    assert node.op_type == "Conv"
    assert layer == {
        "kind": "conv", "ndim": 2, "in_channels": 8, "out_channels": 16, "kernel_size": [3, 3],
        "strides": [2, 2], "padding": [[1, 1], [1, 1]], "dilations": [1, 1], "groups": 1,
        "use_bias": False,
    }  # fmt: skip
    node, layer = anchor(model, "layer2.0.downsample.1")
    assert node.op_type == "BatchNormalization"
    assert layer == {"kind": "batch_norm", "num_features": 16, "epsilon": 1e-5,
                     "momentum": 0.1, "affine": True, "track_running_stats": True}  # fmt: skip
    assert anchor(model, "maxpool")[1]["kind"] == "max_pool"
    assert anchor(model, "pool2")[1]["kind"] == "avg_pool"
    assert anchor(model, "fc")[0].op_type == "Gemm"
    # Every anchor's metadata satisfies the schema.
    for n in model.graph:
        if LAYER in n.metadata_props:
            meta = json.loads(n.metadata_props[LAYER])
            required, optional = LAYER_KINDS[meta.pop("kind")]
            assert set(required) <= set(meta) <= set(required) | set(optional)


def test_layer_metadata_transformer_and_conv_zoo():
    _, _, tfm = converted("transformer")
    node, layer = anchor(tfm, "layers.0.attn")
    assert node.op_type == "MatMul"
    assert layer["kind"] == "attention" and layer["num_heads"] == 4 and layer["batch_first"]
    node, layer = anchor(tfm, "tok")
    assert node.op_type == "Gather" and layer["padding_idx"] == 0 and layer["features"] == 32
    node, layer = anchor(tfm, "layers.1.ln3")
    assert node.op_type == "LayerNormalization" and layer["epsilon"] == 1e-6
    node, layer = anchor(tfm, "layers.0.ff1")
    assert node.op_type == "MatMul" and layer == {
        "kind": "dense", "in_features": 32, "out_features": 128, "use_bias": True}  # fmt: skip
    assert anchor(tfm, "layers.0.dropout")[1] == {"kind": "dropout", "rate": 0.1}

    _, _, zoo = converted("conv_zoo")
    assert anchor(zoo, "depthwise")[1]["groups"] == 8
    grouped = anchor(zoo, "grouped")[1]
    assert grouped["groups"] == 2 and grouped["dilations"] == [2, 2]
    node, up = anchor(zoo, "up")
    assert node.op_type == "ConvTranspose" and up["output_padding"] == [1, 1]
    assert anchor(zoo, "circular")[1]["padding_mode"] == "circular"
    assert anchor(zoo, "gn")[0].op_type == "GroupNormalization"

    _, _, seq = converted("seq_model")
    node, lstm = anchor(seq, "lstm")
    assert node.op_type == "LSTM" and lstm["num_layers"] == 2 and lstm["batch_first"]
    assert anchor(seq, "gru")[1]["bidirectional"] is True

    _, _, norms = converted("norm_zoo")
    assert anchor(norms, "rms")[0].op_type == "RMSNormalization"
    assert anchor(norms, "ln_nobias")[1]["use_bias"] is False


def test_scope_module_and_source_line():
    _, _, model = converted("resnet")
    node = next(n for n in model.graph if n.op_type == "Conv")
    assert node.metadata_props[SCOPE] == "conv1"
    assert node.metadata_props[MODULE] == "torch.nn.modules.conv.Conv2d"
    path, _, line = node.metadata_props[SOURCE_LINE].rpartition(":")
    assert os.path.basename(path) == "torch_models.py" and int(line) > 0
    add = next(n for n in model.graph if n.op_type == "Add")
    assert add.metadata_props[SCOPE] == "layer1.0"
    assert add.metadata_props[MODULE] == "fixtures.torch_models.BasicBlock"
    classes = json.loads(model.metadata_props["xconv.modules"])
    assert classes["layer1"] == "torch.nn.modules.container.Sequential"
    assert classes["layer1.0"] == "fixtures.torch_models.BasicBlock"


@pytest.mark.parametrize("name", ["transformer", "mha_weights", "seq_model"])
def test_constants_are_not_shared_across_scopes(name):
    """A layer body never defines a constant another layer reads (bodies are replaceable)."""
    _, _, model = converted(name)
    for node in model.graph:
        if node.op_type != "Constant":
            continue
        scope = node.metadata_props.get(SCOPE)
        for use in node.outputs[0].uses():
            assert use.node.metadata_props.get(SCOPE) == scope, node.name


def test_attention_and_gelu_stay_whole():
    _, _, model = converted("transformer")
    attention = [n for n in model.graph if n.op_type == "Attention"]
    causal = [n for n in attention if n.attributes["is_causal"].value == 1]
    assert {n.metadata_props[SCOPE] for n in causal} == {
        "layers.0.self_attn",
        "layers.1.self_attn",
    }
    assert not [n for n in model.graph if n.op_type == "Softmax"]
    gelus = {n.metadata_props[SCOPE]: n for n in model.graph if n.op_type == "Gelu"}
    assert gelus["layers.0.act"].attributes["approximate"].value == "none"
    assert gelus["layers.1.act"].attributes["approximate"].value == "tanh"
    assert len([n for n in model.graph if n.op_type == "LayerNormalization"]) == 7


@pytest.mark.parametrize("name", ["resnet", "conv_zoo", "norm_zoo"])
def test_exported_program_gets_the_same_layers(name):
    """An ExportedProgram has no module instances: layers are read from the graph instead."""
    module, args, from_module = converted(name)
    from_program = xconv.from_torch(torch.export.export(module, args))

    def layers_of(model):
        return {
            n.metadata_props[SCOPE]: json.loads(n.metadata_props[LAYER])
            for n in model.graph
            if LAYER in n.metadata_props
        }

    def weights_of(model):
        return {k: dict(v.metadata_props) for k, v in model.graph.initializers.items()}

    assert layers_of(from_program) == layers_of(from_module)
    assert weights_of(from_program) == weights_of(from_module)


def test_training_flag_is_restored():
    module, args = FIXTURES["mlp"]()
    module.train()
    model = xconv.from_torch(module, args)
    assert module.training
    # Exported with inference semantics: dropout is an identity.
    assert not [n for n in model.graph if n.op_type == "Dropout"]


def test_numpy_example_inputs():
    module, (x,) = FIXTURES["mlp"]()
    model = xconv.from_torch(module, [x.numpy()])
    assert [str(d) for d in model.graph.inputs[0].shape] == ["batch", "16"]
    np.testing.assert_allclose(
        run_onnxruntime(model, (x,))[0], torch_outputs(module, (x,))[0], rtol=RTOL, atol=ATOL
    )


def test_errors():
    module, _ = FIXTURES["mlp"]()
    with pytest.raises(ConversionError, match="example_inputs are required"):
        xconv.from_torch(module, None)
    with pytest.raises(ConversionError, match="takes an nn.Module"):
        xconv.from_torch(object(), ())


# -- dynamic batch ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["resnet", "transformer", "mlp"])
def test_dynamic_batch(name):
    module, args, model = converted(name, True)
    for value in model.graph.inputs:
        assert value.shape[0] == ir.SymbolicDim("batch")
    bigger = tuple(torch.cat([a] * 3 + [a[:1]]) for a in args)  # batch 3n + 1
    want = torch_outputs(module, bigger)
    got = run_jax(model, bigger)
    for g, w in zip(got, want, strict=True):
        assert g.shape[0] == bigger[0].shape[0]
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


class _FixedBatch(torch.nn.Module):
    def forward(self, x):
        return x.reshape(2, -1)


def test_dynamic_batch_refused_when_the_model_fixes_it():
    with pytest.raises(ConversionError, match="batch"):
        xconv.from_torch(_FixedBatch(), (torch.randn(2, 3),), dynamic_batch=True)


# -- Hugging Face transformers, built offline from tiny configs --------------------------------


def _hf_model(name: str):
    os.environ["HF_HUB_OFFLINE"] = "1"
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    if name == "bert":
        cfg = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=64)  # fmt: skip
        return tf.BertModel(cfg).eval(), (ids,)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                            use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return tf.GPT2Model(cfg).eval(), (ids,)
    if name == "vit":
        cfg = tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64)  # fmt: skip
        return tf.ViTModel(cfg).eval(), (pixels,)
    if name == "resnet":
        cfg = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                              depths=[1, 1], layer_type="basic")  # fmt: skip
        return tf.ResNetModel(cfg).eval(), (pixels,)
    raise ValueError(name)


def _hf_outputs(module, args) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*args)
    return [t.numpy() for t in out.to_tuple() if isinstance(t, torch.Tensor)]


# Each takes ~7-15 s on one CPU core: under the 20 s mark for @pytest.mark.slow.
@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "resnet"])
def test_transformers_models(name):
    module, args = _hf_model(name)
    model = xconv.from_torch(module, args)
    weights = {k for k, v in model.graph.initializers.items() if ROLE in v.metadata_props}
    assert weights == set(module.state_dict())
    ops = {n.op_type for n in model.graph}
    if name == "resnet":
        assert "BatchNormalization" in ops
    else:
        assert {"Attention", "LayerNormalization"} <= ops
    if name == "gpt2":  # transformers' Conv1D is a dense layer with an (in, out) kernel
        props = model.graph.initializers["h.0.attn.c_attn.weight"].metadata_props
        assert (props[ROLE], props[LAYOUT]) == ("kernel", "IO")
        assert anchor(model, "h.0.attn.c_attn")[1] == {
            "kind": "dense", "in_features": 32, "out_features": 96, "use_bias": True}  # fmt: skip
    want = _hf_outputs(module, args)
    got = run_jax(model, args)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_transformers_dynamic_batch():
    module, args = _hf_model("gpt2")
    model = xconv.from_torch(module, args, dynamic_batch=True)
    assert model.graph.inputs[0].shape[0] == ir.SymbolicDim("batch")
    bigger = tuple(torch.cat([a, a, a[:1]]) for a in args)
    want = _hf_outputs(module, bigger)
    got = run_jax(model, bigger)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_keyword_inputs():
    """A dict of example inputs traces forward(**kwargs); graph inputs follow its order."""
    tf = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=4, intermediate_size=64)  # fmt: skip
    module = tf.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    model = xconv.from_torch(module, inputs, dynamic_batch=True)
    assert [v.name for v in model.graph.inputs] == ["input_ids", "attention_mask"]
    with torch.no_grad():
        want = module(**inputs).last_hidden_state.numpy()
    got = run_jax(model, (ids, mask))[0]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_an_older_exporter_opset_is_upgraded(monkeypatch):
    from onnx import TensorProto, helper

    from xconv.converters.torch.importer import trace as importer

    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    class _Program:
        model = ir.serde.deserialize_model(proto)

    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: _Program())
    model = importer._to_ir(None)
    assert model.opset_imports[""] == xconv.ir.OPSET
    (reduce,) = [n for n in model.graph if n.op_type == "ReduceMean"]
    assert "axes" not in reduce.attributes and len(reduce.inputs) == 2  # opset-18 form


def test_a_view_as_example_input_keeps_the_dims_symbolic():
    """``ids[:, :5]`` as the example: torch.export guarded on the view's base size, which
    failed the symbolic export and fell back to the example's shapes."""

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(50, 8)

        def forward(self, ids):
            return self.table(ids).sum(-1)

    ids = torch.randint(0, 50, (3, 11))
    model = xconv.from_torch(Embed(), (ids[:, :5],))
    dims = model.graph.inputs[0].shape.dims
    assert [getattr(d, "value", d) for d in dims] == ["batch", "seq"], dims
