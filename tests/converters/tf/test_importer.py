"""TF frontend: every source kind converts with parity against TensorFlow; structure kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("tensorflow")
pytest.importorskip("tf2onnx")

import xconv  # noqa: E402
from fixtures import tf_models  # noqa: E402
from xconv.converters.tf.importer import from_tf  # noqa: E402
from xconv.ir.metadata import LAYER, LAYOUT, ROLE, SCOPE  # noqa: E402

ATOL = 2e-5


def _run_jax(model, xs):
    fn, params = xconv.to_jax(model)
    out = fn(params, *xs)
    return np.asarray(out[0] if isinstance(out, tuple | list) else out)


def _max_err(model, reference, xs) -> float:
    ref = reference(*xs)
    ref = ref[0] if isinstance(ref, tuple | list) else ref
    return float(np.abs(_run_jax(model, xs) - np.asarray(ref)).max())


def _weights(model) -> set[str]:
    """Keras weight paths (a Dropout's RNG state is not a weight: inference never reads it)."""
    return {v.path for v in model.variables if "seed_generator" not in v.path}


def _layers(model) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for node in model.graph.all_nodes():
        raw = node.metadata_props.get(LAYER)
        if raw:
            layer = json.loads(raw)
            out.setdefault(layer["kind"], []).append(layer | {"_scope": node.metadata_props[SCOPE]})
    return out


@pytest.fixture(scope="module")
def cnn():
    model, xs = tf_models.keras_cnn()
    return model, xs, from_tf(model)


@pytest.fixture(scope="module")
def transformer():
    model, xs = tf_models.keras_transformer()
    return model, xs, from_tf(model)


# --- numbers ------------------------------------------------------------------------------


def test_keras_cnn_parity(cnn):
    model, xs, ir_model = cnn
    assert _max_err(ir_model, lambda x: model(x, training=False), xs) < ATOL


def test_keras_transformer_parity(transformer):
    model, xs, ir_model = transformer
    assert _max_err(ir_model, lambda x: model(x, training=False), xs) < ATOL


@pytest.mark.parametrize("builder", ["keras_sequential", "keras_subclassed"])
def test_keras_models_parity(builder):
    model, xs = getattr(tf_models, builder)()
    ir_model = from_tf(model, xs)
    assert _max_err(ir_model, model, xs) < ATOL
    assert set(ir_model.graph.initializers) == {v.path for v in model.variables}


def test_tf_function_control_flow_parity():
    fn, xs = tf_models.tf_control_flow()
    ir_model = from_tf(fn)
    ops = {n.op_type for n in ir_model.graph}
    assert {"If", "Loop"} <= ops
    assert "w" in ir_model.graph.initializers  # captured variable keeps its name
    assert _max_err(ir_model, fn, xs) < ATOL
    negative = (-np.abs(xs[0]),)  # the other branch of the tf.cond
    assert _max_err(ir_model, fn, negative) < ATOL


def test_saved_model(tmp_path):
    path, model, xs = tf_models.saved_model(tmp_path)
    ir_model = from_tf(path)
    assert set(ir_model.graph.initializers) == {v.path for v in model.variables}
    assert _max_err(ir_model, model, xs) < ATOL


def test_keras_file_and_frozen_graph(tmp_path, cnn):
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2,
    )

    model, xs, _ = cnn
    keras_path = tmp_path / "cnn.keras"
    model.save(keras_path)
    from_file = from_tf(keras_path)
    assert "batch_normalization/moving_variance" in from_file.graph.initializers
    assert _max_err(from_file, lambda x: model(x, training=False), xs) < ATOL

    fn = tf.function(lambda x: model(x, training=False))
    concrete = fn.get_concrete_function(tf.TensorSpec([None, *xs[0].shape[1:]], tf.float32))
    frozen = convert_variables_to_constants_v2(concrete).graph.as_graph_def()
    pb = tmp_path / "graph.pb"
    pb.write_bytes(frozen.SerializeToString())
    assert _max_err(from_tf(pb), lambda x: model(x, training=False), xs) < ATOL


def test_bad_source_is_a_conversion_error(tmp_path):
    with pytest.raises(xconv.errors.ConversionError):
        from_tf(tmp_path / "nothing.txt")
    with pytest.raises(xconv.errors.ConversionError):
        from_tf(object())


# --- structure ----------------------------------------------------------------------------


def test_cnn_weights_keep_keras_paths_and_roles(cnn):
    model, _, ir_model = cnn
    inits = ir_model.graph.initializers
    paths = _weights(model)
    assert paths <= set(inits)
    for path in paths:
        assert ROLE in inits[path].metadata_props, path
    assert inits["conv2d/kernel"].metadata_props[LAYOUT] == "HWIO"
    assert inits["dense_1/kernel"].metadata_props[LAYOUT] == "IO"
    roles = {p.split("/")[-1]: inits[p].metadata_props[ROLE] for p in paths if "batch_norm" in p}
    assert roles == {
        "gamma": "scale",
        "beta": "bias",
        "moving_mean": "mean",
        "moving_variance": "var",
    }
    # values are the Keras variables, bit for bit
    for v in model.variables:
        if v.path not in paths:
            continue
        np.testing.assert_array_equal(inits[v.path].const_value.numpy(), v.numpy())


def test_cnn_batch_norm_kept_and_layers_marked(cnn):
    _, _, ir_model = cnn
    bns = [n for n in ir_model.graph if n.op_type == "BatchNormalization"]
    assert len(bns) == 2
    layers = _layers(ir_model)
    momenta = sorted(round(x["momentum"], 6) for x in layers["batch_norm"])
    assert momenta == [0.01, 0.1]  # Keras 0.99 / 0.9 in torch's convention
    assert len(layers["conv"]) == 5  # 2 Conv2D + Depthwise + Separable (depthwise, pointwise)
    scopes = {x["_scope"] for x in layers["conv"]}
    assert scopes == {
        "conv2d",
        "conv2d_1",
        "depthwise_conv2d",
        "separable_conv2d/depthwise",
        "separable_conv2d/pointwise",
    }
    depthwise = next(x for x in layers["conv"] if x["_scope"] == "depthwise_conv2d")
    assert depthwise["groups"] == 8
    assert [x["_scope"] for x in layers["dense"]] == ["dense_1"]
    assert {"max_pool", "avg_pool"} <= set(layers)


def test_cnn_no_transposes_between_convs(cnn):
    _, _, ir_model = cnn

    # Transposes on the data path (not preparing a kernel): the input's NHWC->NCHW and the
    # one before the channels-last global pooling; none between the convolutions.
    def prepares_kernel(value) -> bool:
        while not value.is_initializer():
            producer = value.producer()
            if producer is None or producer.op_type not in ("Reshape", "Transpose"):
                return False
            value = producer.inputs[0]
        return True

    data = [
        n for n in ir_model.graph if n.op_type == "Transpose" and not prepares_kernel(n.inputs[0])
    ]
    assert len(data) == 2, [n.name for n in data]
    assert data[0].inputs[0].is_graph_input()


def test_transformer_structure(transformer):
    model, _, ir_model = transformer
    ops = [n.op_type for n in ir_model.graph]
    assert ops.count("LayerNormalization") == 2
    gelus = [n for n in ir_model.graph if n.op_type == "Gelu"]
    assert len(gelus) == 1 and "Erf" not in ops  # TF's erfc form fused back into one node
    assert gelus[0].attributes["approximate"].value == "none"  # exact, not tanh
    layers = _layers(ir_model)
    assert layers["embedding"][0]["num_embeddings"] == 50
    assert layers["attention"][0]["num_heads"] == 2
    assert layers["attention"][0]["_scope"] == "multi_head_attention"
    assert len(layers["layer_norm"]) == 2
    inits = ir_model.graph.initializers
    assert inits["multi_head_attention/query/kernel"].metadata_props[ROLE] == "q_kernel"
    assert inits["embedding/embeddings"].metadata_props[ROLE] == "embedding"
    assert {v.path for v in model.variables} <= set(inits)


# --- keras.applications -------------------------------------------------------------------


def _data_transposes(ir_model) -> list:
    """Transposes on the data path (not preparing a kernel from a weight)."""

    def prepares_kernel(value) -> bool:
        while not value.is_initializer():
            producer = value.producer()
            if producer is None or producer.op_type not in ("Reshape", "Transpose"):
                return False
            value = producer.inputs[0]
        return True

    return [
        n for n in ir_model.graph if n.op_type == "Transpose" and not prepares_kernel(n.inputs[0])
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["MobileNetV2", "ResNet50"])
def test_keras_applications_parity(name):
    import keras

    keras.utils.set_random_seed(0)
    kwargs = {"alpha": 0.35} if name == "MobileNetV2" else {}
    model = getattr(keras.applications, name)(
        input_shape=(64, 64, 3), weights=None, classes=10, classifier_activation=None, **kwargs
    )
    tf_models._randomize(model)
    x = np.random.default_rng(0).standard_normal((1, 64, 64, 3)).astype(np.float32)
    ir_model = from_tf(model)
    n_bn = sum(type(la).__name__ == "BatchNormalization" for la in model.layers)
    assert sum(n.op_type == "BatchNormalization" for n in ir_model.graph) == n_bn
    # the input's NHWC->NCHW and the one before the global pooling; none between convs
    assert len(_data_transposes(ir_model)) == 2
    ref = np.asarray(model(x, training=False))
    err = np.abs(_run_jax(ir_model, (x,)) - ref).max()
    assert err <= 1e-4 * max(1.0, float(np.abs(ref).max())), err


# --- import isolation ---------------------------------------------------------------------


def _python(code: str) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_import_xconv_does_not_load_tensorflow():
    out = _python(
        """
        import sys, xconv
        import onnx
        model = onnx.parser.parse_model('''<ir_version: 10, opset_import: ["" : 18]>
            g (float[2] x) => (float[2] y) { y = Relu(x) }''')
        fn, params = xconv.to_jax(xconv.load(model))
        print("tensorflow" in sys.modules, "keras" in sys.modules)
        """
    )
    assert out.split() == ["False", "False"]


def test_tf_conversion_does_not_load_torch():
    out = _python(
        """
        import sys
        from fixtures import tf_models
        import xconv
        import tempfile
        from xconv.pipeline import ConvertOptions, convert
        model, xs = tf_models.keras_sequential()
        ir_model = xconv.from_tf(model)
        result = convert(model, source_kind="tf", target="jax", out_dir=tempfile.mkdtemp(),
                         example_inputs=xs, options=ConvertOptions(devices="cpu"))
        print("torch" in sys.modules, len(ir_model.graph.initializers), result.passed)
        """
    )
    assert out.split() == ["False", "4", "True"]


# --- pipeline -----------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["jax", "onnx"])
def test_pipeline_tf_source(tmp_path, target):
    from xconv.pipeline import ConvertOptions, convert

    model, xs = tf_models.keras_cnn()
    result = convert(
        model,
        source_kind="tf",
        target=target,
        out_dir=tmp_path / target,
        example_inputs=xs,
        options=ConvertOptions(devices="cpu"),
    )
    assert result.passed, result.parity
    assert (tmp_path / target / "model.onnx").is_file()


def test_pipeline_keras_file_without_inputs(tmp_path):
    from xconv.pipeline import ConvertOptions, convert

    model, _ = tf_models.keras_sequential()
    path = tmp_path / "mlp.keras"
    model.save(path)
    result = convert(
        str(path),
        source_kind="tf",
        target="onnx",
        out_dir=tmp_path / "out",
        options=ConvertOptions(devices="cpu"),
    )
    assert result.passed, result.parity


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_flax_emitter_on_keras_cnn(tmp_path, api, cnn):
    from xconv.pipeline import ConvertOptions, convert

    model, xs, _ = cnn
    result = convert(
        model,
        source_kind="tf",
        target="flax",
        out_dir=tmp_path / api,
        example_inputs=xs,
        options=ConvertOptions(devices="cpu", api=api),
    )
    assert result.passed, result.parity
    source = (tmp_path / api / "model.py").read_text()
    assert "BatchNorm(" in source and "Conv(" in source


def test_fused_activation_is_outside_the_layer_body(tmp_path):
    from xconv.pipeline import ConvertOptions, convert

    model, xs = tf_models.keras_sequential()  # Dense(16, activation="relu")
    ir_model = from_tf(model)
    relu = next(n for n in ir_model.graph if n.op_type == "Relu")
    assert relu.metadata_props[SCOPE] == f"{model.name}/dense/activation"
    result = convert(
        model,
        source_kind="tf",
        target="flax",
        out_dir=tmp_path / "flax",
        example_inputs=xs,
        options=ConvertOptions(devices="cpu"),
    )
    assert result.passed, result.parity


@pytest.mark.parametrize(
    "builder", ["keras_cnn", "keras_transformer", "keras_sequential", "tf_control_flow"]
)
def test_to_torch_parity(builder):
    torch = pytest.importorskip("torch")
    model, xs = getattr(tf_models, builder)()
    module, _state = xconv.to_torch(from_tf(model))
    out = module(*[torch.from_numpy(x) for x in xs])
    out = out[0] if isinstance(out, tuple | list) else out
    assert np.abs(out.detach().numpy() - np.asarray(model(*xs))).max() < ATOL


def test_keras_recurrent_layers_translate_with_frozen_weights(tmp_path):
    """tf2onnx writes a Keras LSTM (and a Bidirectional one) as ONNX's LSTM only from constant
    weights: fed as function inputs it failed ("'xconv_w0' must be Const"). Traced with the
    weights frozen in, the model converts, its other weights named back by Keras path, the
    LSTMs' W / R / B by their layers; the generated Flax runs it too."""
    import keras

    from tests.converters.jax.generated import run_generated

    layers = keras.layers
    inp = keras.Input((7, 8))
    h = layers.LSTM(5, return_sequences=True)(inp)
    h = layers.Bidirectional(layers.LSTM(3, return_sequences=True))(h)
    net = keras.Model(inp, layers.Dense(2)(h))
    x = np.random.default_rng(0).random((2, 7, 8)).astype(np.float32)
    model = from_tf(net, (x,))
    assert [n.op_type for n in model.graph if n.op_type == "LSTM"] == ["LSTM", "LSTM"]
    assert {"dense/kernel", "dense/bias"} <= set(model.graph.initializers)
    # tf2onnx's W0__72 / R0__73 / B0__74, matched by value to the cells whose kernels they
    # rearrange: named under the layer (a Bidirectional layer's for both directions)
    names = {"lstm/lstm_cell/W", "lstm/lstm_cell/R", "lstm/lstm_cell/B", "bidirectional/W"}
    assert names <= set(model.graph.initializers)
    assert model.graph.initializers["bidirectional/W"].metadata_props["xconv.role"] == "W"
    want = np.asarray(net(x))
    assert _max_err(model, net, (x,)) < ATOL
    got, _ = run_generated(xconv.to_flax(model, tmp_path / "flax"), "linen", x)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)


def test_keras_gru_and_simple_rnn_become_onnx_recurrent_ops(tmp_path):
    """tf2onnx writes Keras 3's GRU and SimpleRNN as a Loop, which neither source emitter
    writes: the importer replaces each by ONNX's GRU / RNN (reset_after as
    linear_before_reset, a go_backwards layer over its reversed input, a bias shared by value
    with another layer found by value), with W / R / B as trainable weights under the cell's
    scope. Both generated sources match Keras."""
    import keras
    import torch

    from tests.converters.jax.generated import run_generated

    layers = keras.layers
    inp = keras.Input((7, 8))
    h = layers.GRU(5, return_sequences=True)(inp)
    h = layers.Bidirectional(layers.GRU(3, return_sequences=True, reset_after=False))(h)
    h = layers.SimpleRNN(4)(h)
    net = keras.Model(inp, layers.Dense(2)(h))
    rng = np.random.default_rng(0)
    for v in net.variables:  # trained-looking weights: nonzero biases
        v.assign(rng.normal(0, 0.3, v.shape).astype(np.float32))
    x = rng.random((2, 7, 8)).astype(np.float32)
    want = np.asarray(net(x))
    model = from_tf(net, (x,))
    ops = [n.op_type for n in model.graph if n.op_type in ("GRU", "RNN", "Loop")]
    assert sorted(ops) == ["GRU", "GRU", "GRU", "RNN"]
    assert {"gru/gru_cell/W", "gru/gru_cell/R", "gru/gru_cell/B"} <= set(model.graph.initializers)
    assert _max_err(model, net, (x,)) < ATOL
    out = xconv.to_flax(model, tmp_path / "flax", example_inputs=x)
    assert '"gru_gru_cell_W"' in (out / "model.py").read_text()  # a param
    got, _ = run_generated(out, "linen", x)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)
    source, state = xconv.to_torch_source(model, example_inputs=(x,))
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    module = ns["Model"]().eval()
    module.load_state_dict(state)
    with torch.no_grad():
        got = module(torch.from_numpy(x))
    np.testing.assert_allclose(got.numpy(), want, atol=ATOL)
    # as initialised, both directions' biases are zeros: named by neither, found by value
    fresh = keras.Model(inp, layers.Bidirectional(layers.GRU(3))(inp))
    model = from_tf(fresh, (x,))
    assert [n.op_type for n in model.graph if n.op_type in ("GRU", "Loop")] == ["GRU", "GRU"]
    assert _max_err(model, fresh, (x,)) < ATOL


def test_depth_multiplier_kernels_reach_every_target(tmp_path):
    """A depthwise kernel (H, W, C, M) with M > 1 is stored (H, W, 1, C*M), tf2onnx's reshape
    of it, under its Keras path: a plain (I=1, O) kernel. Its layout was "HWIM", which the
    Flax emitter could not permute and the torch source loaded with the wrong shape."""
    import keras
    import torch

    from tests.converters.jax.generated import run_generated

    layers = keras.layers
    inp = keras.Input((9, 9, 4))
    h = layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same")(inp)
    h = layers.SeparableConv2D(5, 3, depth_multiplier=3)(h)
    net = keras.Model(inp, h)
    x = np.random.default_rng(0).random((2, 9, 9, 4)).astype(np.float32)
    want = np.asarray(net(x))
    model = from_tf(net, (x,))
    assert model.graph.initializers["depthwise_conv2d/kernel"].shape == (3, 3, 1, 8)
    assert model.graph.initializers["separable_conv2d/depthwise_kernel"].shape == (3, 3, 1, 24)
    assert _max_err(model, net, (x,)) < ATOL
    got, _ = run_generated(xconv.to_flax(model, tmp_path / "flax", example_inputs=x), "linen", x)
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL)
    source, state = xconv.to_torch_source(model, example_inputs=(x,))
    ns: dict = {}
    exec(compile(source, "<generated>", "exec"), ns)
    module = ns["Model"]().eval()
    module.load_state_dict(state)
    with torch.no_grad():
        out = module(torch.from_numpy(x))
    np.testing.assert_allclose(out.numpy(), want, atol=ATOL)
