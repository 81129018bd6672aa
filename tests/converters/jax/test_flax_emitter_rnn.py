"""Flax emitter: recurrent layers (vs torch, onnxruntime, the ONNX reference), template registration, errors."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import xconv
from tests.converters.jax.generated import import_generated, run_generated
from tests.converters.jax.test_flax_emitter import (
    APIS,
    check_grads,
    ort_run,
    ruff_ok,
)
from xconv.converters.flax.source import templates as flax_ops
from xconv.converters.flax.source.emitter import FlaxOptions, generate
from xconv.errors import UnsupportedOpError

SEQ, BATCH, D_IN, HIDDEN = 5, 3, 4, 6
NATIVE = FlaxOptions(native_conv_transpose=True)
BLOCKS = FlaxOptions(share_blocks=True)


@pytest.fixture(scope="module")
def seq_model():
    torch = pytest.importorskip("torch")
    from fixtures import torch_models
    from xconv import from_torch

    module, inputs = torch_models.make_seq_model()
    with torch.no_grad():
        expected = module(*inputs).numpy()
    return from_torch(module, inputs), inputs[0].numpy(), expected


@pytest.mark.parametrize("api", APIS)
def test_seq_model_matches_torch(tmp_path, api, seq_model):
    model, x, expected = seq_model
    out = xconv.to_flax(model, tmp_path / "out", api=api)
    src = (out / "model.py").read_text()
    # Structure: one generated class per recurrent layer, weights named by torch's parameters.
    assert "class LSTM(" in src and "class GRU(" in src
    assert "def _lstm(" in src and "def _gru(" in src and "lax.scan(" in src
    assert "weight_ih_l1" in src and "bias_hh_l0_reverse" in src
    assert "constants" not in src  # zero initial states are written as None, not stored
    got, handle = run_generated(out, api, x)
    err = float(np.max(np.abs(np.asarray(got) - expected)))
    assert err <= 1e-5, err
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    # 8 LSTM + 8 GRU + 2 head parameters, each reached by the gradient.
    assert check_grads(api, handle, x) == 18


def test_seq_model_deterministic(seq_model):
    model = seq_model[0]
    assert generate(model, api="nnx")[0] == generate(model, api="nnx")[0]


def _rnn_model(op, direction, layout=0, with_lens=False, with_peephole=False, **attrs):
    rng = np.random.default_rng(0)
    n_dir = 2 if direction == "bidirectional" else 1
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    x_shape = [BATCH, SEQ, D_IN] if layout else [SEQ, BATCH, D_IN]
    state_shape = [BATCH, n_dir, HIDDEN] if layout else [n_dir, BATCH, HIDDEN]

    def init(name, *shape):
        arr = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        return numpy_helper.from_array(arr, name)

    inits = [
        init("W", n_dir, gates * HIDDEN, D_IN),
        init("R", n_dir, gates * HIDDEN, HIDDEN),
        init("B", n_dir, 2 * gates * HIDDEN),
    ]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, x_shape)]
    inputs.append(h.make_tensor_value_info("h0", T.FLOAT, state_shape))
    names = ["x", "W", "R", "B", "", "h0"]
    if with_lens:
        inputs.append(h.make_tensor_value_info("lens", T.INT32, [BATCH]))
        names[4] = "lens"
    if op == "LSTM":
        inputs.append(h.make_tensor_value_info("c0", T.FLOAT, state_shape))
        names.append("c0")
        if with_peephole:
            inits.append(init("P", n_dir, 3 * HIDDEN))
            names.append("P")
    outs = ["y", "y_h"] + (["y_c"] if op == "LSTM" else [])
    node = h.make_node(
        op, names, outs, hidden_size=HIDDEN, direction=direction, layout=layout, **attrs
    )
    graph = h.make_graph(
        [node], "g", inputs, [h.make_tensor_value_info(o, T.FLOAT, None) for o in outs], inits
    )
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 23)])
    feeds = [
        rng.standard_normal(x_shape).astype(np.float32),
        rng.standard_normal(state_shape).astype(np.float32),
    ]
    if with_lens:
        feeds.append(np.array([SEQ, 2, 4], np.int32))
    if op == "LSTM":
        feeds.append(rng.standard_normal(state_shape).astype(np.float32))
    return ir.serde.deserialize_model(proto), feeds


CASES = [
    ("LSTM", "forward", {}),
    ("LSTM", "bidirectional", {"layout": 1}),
    ("LSTM", "reverse", {"with_lens": True, "with_peephole": True}),
    ("LSTM", "bidirectional", {"with_lens": True}),
    ("GRU", "bidirectional", {"linear_before_reset": 1}),
    ("GRU", "forward", {"linear_before_reset": 0, "layout": 1}),
    ("GRU", "reverse", {"with_lens": True}),
    ("RNN", "bidirectional", {}),
    ("RNN", "forward", {"layout": 1}),  # the ONNX reference ignores sequence_lens
    ("RNN", "reverse", {"with_lens": True}),
]


@pytest.mark.parametrize(("op", "direction", "kw"), CASES)
def test_recurrent_ops_match_onnxruntime(tmp_path, op, direction, kw):
    model, feeds = _rnn_model(op, direction, **kw)
    if kw.get("layout"):  # onnxruntime's CPU kernels refuse layout=1
        from onnx.reference import ReferenceEvaluator

        names = [v.name for v in model.graph.inputs]
        ref = ReferenceEvaluator(ir.to_proto(model))
        expected = ref.run(None, dict(zip(names, feeds, strict=True)))
    else:
        expected = ort_run(model, *feeds)
    out = xconv.to_flax(model, tmp_path / "out", api="linen")
    got, _ = run_generated(out, "linen", *feeds)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=1e-5, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg


def test_non_default_activations_are_refused(tmp_path):
    model, _ = _rnn_model("RNN", "forward", activations=["Relu"])
    with pytest.raises(xconv.ConversionError, match="activations"):
        xconv.to_flax(model, tmp_path / "out")


def _custom_model():
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", T.FLOAT, None)
    nodes = [
        h.make_node("Scale", ["x"], ["a"], domain="my.ops", alpha=3.0),
        h.make_node("Relu", ["a"], ["y"]),
    ]
    proto = h.make_model(
        h.make_graph(nodes, "g", [x], [y]),
        opset_imports=[h.make_opsetid("", 23), h.make_opsetid("my.ops", 1)],
    )
    return ir.serde.deserialize_model(proto)


def test_missing_template_error_names_the_emitter_and_the_fix(tmp_path):
    with pytest.raises(UnsupportedOpError) as info:
        xconv.to_flax(_custom_model(), tmp_path / "out")
    msg = str(info.value)
    assert "flax emitter" in msg and "jax backend" not in msg
    assert "my.ops::Scale x1" in msg
    assert "templates.register_template(op_type, fn" in msg
    assert info.value.backend == "flax emitter"


def test_register_template_custom_op_and_user_wins(tmp_path):
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], np.float32)
    try:
        flax_ops.register_template(
            "Scale",
            lambda c: f"{c.args[0]} * {flax_ops.scalar_literal(c.attrs['alpha'])}",
            domain="my.ops",
            attrs={"alpha": 1.0},
        )

        # A user template for a built-in op wins over the built-in one.
        @flax_ops.register_template("Relu", layout="unary", helpers={"my_relu": _MY_RELU})
        def _relu(c):
            c.helpers.add("my_relu")
            return f"_my_relu({c.args[0]})"

        out = xconv.to_flax(_custom_model(), tmp_path / "out")
        src = (out / "model.py").read_text()
        assert "* 3.0" in src and "_my_relu(" in src and "jax.nn.relu" not in src
        got, _ = run_generated(out, "linen", x)
        np.testing.assert_allclose(np.asarray(got), np.maximum(x * 3.0, 0.0) + 1.0)
        ok, msg = ruff_ok(out / "model.py")
        assert ok, msg
    finally:
        flax_ops.unregister_template("Scale", domain="my.ops")
        flax_ops.unregister_template("Relu")
    src, _ = generate(_custom_model_builtin_only())
    assert "jax.nn.relu(" in src  # unregistering restores the built-in template


_MY_RELU = """
def _my_relu(x):
    return jnp.maximum(x, 0) + 1
"""


def _custom_model_builtin_only():
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", T.FLOAT, None)
    proto = h.make_model(
        h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
        opset_imports=[h.make_opsetid("", 23)],
    )
    return ir.serde.deserialize_model(proto)


def test_register_template_rejects_unknown_layout():
    with pytest.raises(xconv.ConversionError, match="layout="):
        flax_ops.register_template("Foo", lambda c: "x", layout="sideways")


# ---------------------------------------------------------------- native nn.ConvTranspose


def _from_torch(make):
    torch = pytest.importorskip("torch")
    from xconv import from_torch

    module, inputs = make()
    with torch.no_grad():
        expected = module(*inputs)
    expected = expected if isinstance(expected, tuple | list) else (expected,)
    return from_torch(module, inputs), [i.numpy() for i in inputs], [e.numpy() for e in expected]


def _up_zoo():
    import torch
    from torch import nn

    class UpZoo(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=(1, 0))
            self.dilated = nn.ConvTranspose2d(
                6, 5, 3, stride=2, padding=2, dilation=2, output_padding=1, bias=False
            )
            self.up3d = nn.ConvTranspose3d(2, 3, 2, stride=2)

        def forward(self, x, v):
            return self.dilated(torch.relu(self.up(x))), self.up3d(v)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return UpZoo().eval(), (torch.randn(2, 4, 5, 4, generator=gen), torch.randn(1, 2, 3, 4, 4))


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which", ["conv_zoo", "up_zoo"])
def test_conv_transpose_is_native_and_matches_torch(tmp_path, api, which):
    if which == "conv_zoo":
        from fixtures import torch_models

        make, n_native = torch_models.make_conv_zoo, 2
    else:
        make, n_native = _up_zoo, 3
    model, xs, expected = _from_torch(make)
    plain = (xconv.to_flax(model, tmp_path / "plain", api=api) / "model.py").read_text()
    assert "ConvTranspose(" not in plain.replace("class ConvTranspose", "")  # opt-in
    out = xconv.to_flax(model, tmp_path / "out", api=api, options=NATIVE)
    src = (out / "model.py").read_text()
    layer = "nn.ConvTranspose(" if api == "linen" else "nnx.ConvTranspose("
    assert src.count(layer) == n_native
    assert src.count("transpose_kernel=True") == n_native
    assert "lhs_dilation" not in src  # no raw lax transposed convolution left
    got, handle = run_generated(out, api, *xs)
    got = got if isinstance(got, tuple | list) else (got,)
    for g, e in zip(got, expected, strict=True):
        err = float(np.max(np.abs(np.asarray(g) - e)))
        assert err <= 1e-5, err
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    if which == "up_zoo":
        assert check_grads(api, handle, *xs) == 5  # up: kernel+bias, dilated, up3d: kernel+bias


# ---------------------------------------------------------------- shared block classes


@pytest.mark.parametrize("api", APIS)
def test_resnet_blocks_become_shared_classes(tmp_path, api):
    from fixtures import torch_models

    model, xs, expected = _from_torch(torch_models.make_resnet)
    out = xconv.to_flax(model, tmp_path / "out", api=api, options=BLOCKS)
    src = (out / "model.py").read_text()
    # One BasicBlock class with fields (layer1.*: 8, layer2.1: 16); layer2.0 only adds a
    # downsample branch and strides: the same class, the branch under ``if self.downsample``.
    assert src.count("class BasicBlock") == 1 and "class BasicBlockDownsample(" not in src
    assert "        if self.downsample:\n" in src and "        residual = x\n" in src
    if api == "linen":  # the Sequential is a list built and called in a loop
        assert "    features: int\n" in src
        assert "self.layer1 = [BasicBlock(8) for _ in range(2)]" in src
        assert "    strides: int = 1\n    downsample: bool = False\n" in src
        assert "self.layer2 = [BasicBlock(16, strides=2, downsample=True), BasicBlock(16)]" in src
        assert "for block in (*self.layer1, *self.layer2):" in src
        assert "nn.Conv(self.features, (3, 3), padding=1, use_bias=False)" in src
        assert "strides=self.strides, padding=1" in src
        # a 1x1 convolution pads nothing under Flax's default padding: none written; it is
        # the plain nn.Conv on every backend (no formulation of one backend's in the source)
        assert "nn.Conv(self.features, (1, 1), strides=self.strides, use_bias=False)" in src
        assert "_matmul_conv" not in src and "conv_general_dilated=" not in src
    else:
        # the defaulted fields say their type by their default: the signature fits a line
        head = "def __init__(self, in_features, features, strides=1, downsample=False, *, rngs"
        assert head in src
        # nnx: the Sequential is an nnx.List built and called in a loop
        assert "self.layer1 = nnx.List([BasicBlock(8, 8, rngs=rngs) for _ in range(2)])" in src
        # too long for one line: one line per distinct block, not a list nested in a call
        first = "BasicBlock(8, 16, strides=2, downsample=True, rngs=rngs)"
        assert f"self.layer2 = nnx.List([{first}])\n" in src
        assert "self.layer2.append(BasicBlock(16, 16, rngs=rngs))\n" in src
        assert "for block in (*self.layer1, *self.layer2):" in src
    # Defaults left out (as keywords: the _matmul_conv helper reads feature_group_count),
    # role-named locals, no exporter names.
    for spelled in ("kernel_dilation=", "feature_group_count=", "use_scale=", "epsilon="):
        assert spelled not in src
    assert "jax.nn.relu(x + residual)" in src  # folded chains
    for exporter in ("getitem", "conv2d", "batch_normalization", "relu_"):
        assert exporter not in src
    assert src.count("jnp.transpose(") == 1  # blocks take and return NHWC
    got, handle = run_generated(out, api, *xs)
    err = float(np.max(np.abs(np.asarray(got) - expected[0])))
    assert err <= 1e-5, err
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    assert check_grads(api, handle, *xs) == 32
    _, variables = generate(model, api=api, options=BLOCKS)
    params = variables["params"] if api == "linen" else variables
    # linen: one attribute per list element; nnx: the nnx.List nests by index.
    first, second = (
        ("layer1_0", "layer2_0") if api == "linen" else (("layer1", "0"), ("layer2", "0"))
    )
    block = params[first] if api == "linen" else params[first[0]][first[1]]
    assert sorted(block) == ["bn1", "bn2", "conv1", "conv2"]
    assert "downsample_0" in (params[second] if api == "linen" else params[second[0]][second[1]])
    assert generate(model, api=api, options=BLOCKS)[0] == src
    assert generate(model, api=api)[0] == src  # the module tree is the default
    flat = generate(model, api=api, options=FlaxOptions(share_blocks=False))[0]
    assert "class BasicBlock" not in flat


def test_resnet_block_train_mode_updates_nested_stats(tmp_path):
    from fixtures import torch_models

    model, xs, _ = _from_torch(torch_models.make_resnet)
    out = xconv.to_flax(model, tmp_path / "out", api="linen", options=BLOCKS)
    flax_model, variables = import_generated(out).load(out)
    _, updates = flax_model.apply(variables, *xs, train=True, mutable=["batch_stats"])
    before = variables["batch_stats"]["layer1_1"]["bn2"]["mean"]
    assert not np.allclose(updates["batch_stats"]["layer1_1"]["bn2"]["mean"], before)


def test_transformer_layers_become_block_classes(tmp_path):
    """Constants the exporter hoists out of a block do not stop it becoming a class."""
    from fixtures import torch_models

    model, xs, expected = _from_torch(torch_models.make_transformer)
    out = xconv.to_flax(model, tmp_path / "out", api="nnx", options=BLOCKS)
    src = (out / "model.py").read_text()
    # The two EncoderLayers differ only in their GELU (erf vs tanh): one class with a bool
    # field, one MultiheadAttention.
    assert src.count("class EncoderLayer") == 1
    assert src.count("class MultiheadAttention(") == 1
    assert "def __init__(self, approximate: bool, *, rngs: nnx.Rngs):" in src
    assert "jax.nn.gelu(self.ff1(self.ln3(x)), approximate=self.approximate)" in src
    # torch's self-attention on its packed weights: one helper call, the variables its own
    assert "        return _torch_mha(self, x, heads=4)\n" in src
    assert "self.in_proj_kernel = nnx.Param(jnp.zeros((96, 32), jnp.float32))" in src
    want = "nnx.List([EncoderLayer(False, rngs=rngs), EncoderLayer(True, rngs=rngs)])"
    assert f"self.layers = {want}" in src
    got, handle = run_generated(out, "nnx", *xs)
    err = float(np.max(np.abs(np.asarray(got) - expected[0])))
    assert err <= 1e-5, err
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg
    assert check_grads("nnx", handle, *xs) == 42


@pytest.mark.parametrize("kind", ["masked", "sequence_first", "cross"])
def test_multihead_attention_outside_the_helper_keeps_its_ops(tmp_path, kind):
    """Only unmasked batch-first self-attention is the ``_torch_mha`` call; a causal mask,
    (T, B, E) inputs or separate keys keep the op-by-op body, and still match torch."""
    torch = pytest.importorskip("torch")

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=kind != "sequence_first")

        def forward(self, x, y):
            kv = y if kind == "cross" else x
            mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1) if kind == "masked" else None
            return self.attn(x, kv, kv, attn_mask=mask, need_weights=False)[0]

    def make():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return Attn().eval(), (
            torch.randn(6, 6, 16, generator=g),
            torch.randn(6, 6, 16, generator=g),
        )

    model, xs, expected = _from_torch(make)
    out = xconv.to_flax(model, tmp_path / "out", api="linen")
    src = (out / "model.py").read_text()
    assert "_torch_mha" not in src
    got, _ = run_generated(out, "linen", *xs)
    np.testing.assert_allclose(np.asarray(got), expected[0], rtol=1e-4, atol=1e-5)
