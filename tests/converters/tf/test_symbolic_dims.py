"""TF frontend: the signature's ``None`` dims become named symbols shared across inputs.

tf2onnx names every ``None`` ``unk__N``, a fresh symbol per input; the importer renames them
by role (``batch`` for dim 0 of every input, ``seq`` for a token input's dim 1, ``height`` /
``width`` for an image's spatial dims) through every value shape. Each model is converted once
(TensorFlow is slow) and then run at several sizes through ``to_jax``, ``to_torch``, the
generated Flax module and the generated torch source, against Keras at those sizes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("tensorflow")
pytest.importorskip("tf2onnx")
torch = pytest.importorskip("torch")

import onnx_ir as ir  # noqa: E402

import xconv  # noqa: E402
from fixtures.tf_models import _randomize, _seed  # noqa: E402
from tests.converters.jax.generated import run_generated  # noqa: E402
from tests.torch_source import load_generated  # noqa: E402
from xconv.converters.tf.dims import role_names  # noqa: E402
from xconv.converters.tf.importer import from_tf  # noqa: E402

ATOL = 2e-5


def _two_inputs():
    import keras

    _seed()
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([a, b])
    h = keras.layers.Dense(8, activation="relu")(h)
    net = keras.Model([a, b], keras.layers.Dense(3)(h))
    _randomize(net)
    return net


def _tokens():
    import keras

    layers = keras.layers
    _seed()
    ids = keras.Input((None,), dtype="int32", name="ids")
    e = layers.Embedding(50, 16)(ids)
    h = layers.MultiHeadAttention(2, 8)(e, e) + e
    h = layers.Dense(8, activation="relu")(h)
    net = keras.Model(ids, layers.Dense(3)(layers.GlobalAveragePooling1D()(h)))
    _randomize(net)
    return net


def _image():
    import keras

    layers = keras.layers
    _seed()
    x = keras.Input((None, None, 3), name="image")
    h = layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    h = layers.MaxPooling2D()(h)
    h = layers.Conv2D(5, 3)(h)
    net = keras.Model(x, layers.GlobalAveragePooling2D()(h))
    _randomize(net)
    return net


def _converted(build, tmp_path_factory):
    net = build()
    model = from_tf(net)
    out = tmp_path_factory.mktemp("gen")
    fn, params = xconv.to_jax(model)
    runtime, _ = xconv.to_torch(model)
    flax_dir = xconv.to_flax(model, out / "flax")
    source_module, source = load_generated(model, out)
    return net, model, (fn, params, runtime, flax_dir, source_module, source)


@pytest.fixture(scope="module")
def two_inputs(tmp_path_factory):
    return _converted(_two_inputs, tmp_path_factory)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return _converted(_tokens, tmp_path_factory)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return _converted(_image, tmp_path_factory)


def _symbols(model: ir.Model) -> set[str]:
    out = set()
    for node in model.graph.all_nodes():
        for value in node.outputs:
            for d in value.shape or ():
                if isinstance(d, ir.SymbolicDim) and d.value is not None:
                    out.add(d.value)
    return out


def _shape(value: ir.Value) -> list:
    return [d if isinstance(d, int) else d.value for d in value.shape]


def _np(out) -> np.ndarray:
    out = out[0] if isinstance(out, tuple | list) else out
    return out.detach().numpy() if hasattr(out, "detach") else np.asarray(out)


def _check_all(converted, xs):
    net, _model, (fn, params, runtime, flax_dir, source_module, _src) = converted
    want = np.asarray(net(list(xs) if len(xs) > 1 else xs[0]))
    t_in = [torch.from_numpy(x) for x in xs]
    with torch.no_grad():
        got = {
            "to_jax": _np(fn(params, *xs)),
            "to_torch": _np(runtime(*t_in)),
            "flax source": _np(run_generated(flax_dir, "linen", *xs)[0]),
            "torch source": _np(source_module(*t_in)),
        }
    for route, out in got.items():
        assert out.shape == want.shape, (route, out.shape, want.shape)
        np.testing.assert_allclose(out, want, atol=ATOL, err_msg=f"{route} at {xs[0].shape}")


# --- names --------------------------------------------------------------------------------


def test_two_inputs_share_one_batch(two_inputs):
    _, model, (*_, source) = two_inputs
    assert [_shape(v) for v in model.graph.inputs] == [["batch", 6], ["batch", 4]]
    assert [_shape(v) for v in model.graph.outputs] == [["batch", 3]]
    assert _symbols(model) == {"batch"}  # every value: tf2onnx's unk__N are gone
    assert "unk__" not in source


def test_token_input_gets_batch_and_seq(tokens):
    _, model, _ = tokens
    assert _shape(model.graph.inputs[0]) == ["batch", "seq"]
    assert _shape(model.graph.outputs[0]) == ["batch", 3]
    assert {"batch", "seq"} <= _symbols(model)


def test_image_input_gets_height_and_width(image):
    _, model, _ = image
    assert _shape(model.graph.inputs[0]) == ["batch", "height", "width", 3]
    assert _shape(model.graph.outputs[0]) == ["batch", 5]


def test_pipeline_inputs_sized_by_role(tokens, image):
    """Without inputs, the pipeline checks a token model at length 8 and an image at 32x32
    (a size of 1 would hide mixing along the axis and starve a conv stack)."""
    from xconv.pipeline.importers import _tf_inputs_from_ir

    assert [x.shape for x in _tf_inputs_from_ir(tokens[1])] == [(1, 8)]
    assert [x.shape for x in _tf_inputs_from_ir(image[1])] == [(1, 32, 32, 3)]


def test_example_inputs_keep_other_dims_static():
    """Given example inputs, only the batch is symbolic: the examples fix the rest."""
    net = _tokens()
    x = np.zeros((2, 7), np.int32)
    model = from_tf(net, (x,))
    assert _shape(model.graph.inputs[0]) == ["batch", 7]


@pytest.mark.parametrize(
    ("shape", "dtype", "want"),
    [
        ((None, None), ir.DataType.INT64, {0: "batch", 1: "seq"}),
        ((None, None, 8), ir.DataType.FLOAT, {0: "batch", 1: "seq"}),
        ((None, None, None, 3), ir.DataType.FLOAT, {0: "batch", 1: "height", 2: "width"}),
        ((None, 3, None, None), ir.DataType.FLOAT, {0: "batch", 2: "height", 3: "width"}),
        ((None, None), ir.DataType.FLOAT, {0: "batch", 1: "x_1"}),
        ((None, 4, None, 2, None), ir.DataType.FLOAT, {0: "batch", 2: "x_2", 4: "x_4"}),
    ],
)
def test_role_names(shape, dtype, want):
    dims = [d if d is not None else ir.SymbolicDim(f"unk__{i}") for i, d in enumerate(shape)]
    value = ir.Value(name="x:0", type=ir.TensorType(dtype), shape=ir.Shape(dims))
    assert role_names(value) == want


# --- numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_two_inputs_run_at_any_batch(two_inputs, batch):
    rng = np.random.default_rng(batch)
    xs = (rng.standard_normal((batch, 6)), rng.standard_normal((batch, 4)))
    _check_all(two_inputs, tuple(x.astype(np.float32) for x in xs))


@pytest.mark.parametrize(("batch", "seq"), [(1, 5), (2, 3), (5, 11)])
def test_tokens_run_at_any_batch_and_length(tokens, batch, seq):
    ids = np.random.default_rng(batch * seq).integers(0, 50, (batch, seq)).astype(np.int32)
    _check_all(tokens, (ids,))


@pytest.mark.parametrize(("batch", "height", "width"), [(1, 8, 8), (2, 12, 10), (3, 9, 7)])
def test_image_runs_at_any_size(image, batch, height, width):
    x = np.random.default_rng(height).random((batch, height, width, 3)).astype(np.float32)
    _check_all(image, (x,))
