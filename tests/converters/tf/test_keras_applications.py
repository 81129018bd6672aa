"""Keras graphs tf2onnx could not take as they were: captured constants and nested functions.

* Captured constants: a ``Normalization`` layer given its mean and variance (EfficientNet's
  input normalisation) captures them as eager tensors; they must become initializers, never
  graph inputs.
* Nested functions: Keras 3 runs a grouped convolution on CPU through
  ``tf.function(jit_compile=True)`` (ConvNeXt's depthwise convs), a ``PartitionedCall`` freezing
  does not inline; the importer inlines it before tf2onnx.

The default suite checks one small model with both; EfficientNetB0 and ConvNeXtTiny
(``weights=None``, logits, 64 px) run under ``slow``. Each converts to JAX, torch and Flax with
parity. At 32 px their last stage is 1x1; the Flax source failed there on two tf2onnx forms the
importer now rewrites (both checked below on small maps): ``auto_pad="SAME_UPPER"`` left in
the inlined grouped convs, and an NHWC->NCHW Transpose of a pooled ``(N, 1, 1, C)`` written as
a Reshape (MobileNetV3's squeeze-and-excite). The zoo runs every keras.applications model at
its smallest size (``tests/models/test_keras_zoo.py``).
"""

from __future__ import annotations

import importlib.util
import uuid

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
pytest.importorskip("flax")

import xconv  # noqa: E402

#: Relative to the reference's largest magnitude.
RTOL = 1e-4


def _import(path):
    spec = importlib.util.spec_from_file_location(f"keras_app_{uuid.uuid4().hex}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _first(out):
    out = out[0] if isinstance(out, tuple | list) else out
    return out.detach().numpy() if hasattr(out, "detach") else np.asarray(out)


def _close(got, want, what: str) -> float:
    scale = float(np.abs(want).max())
    assert scale > 1e-2, f"{what}: the reference is ~0 ({scale}); it proves nothing"
    err = float(np.abs(got - want).max())
    assert err <= RTOL * scale, f"{what}: max error {err} on outputs up to {scale}"
    return err


def _check(net, x, tmp_path, flax: bool = True) -> None:
    want = np.asarray(net(x, training=False))
    model = xconv.from_tf(net, (x,))
    assert [v.name for v in model.graph.inputs] == ["input_0"]
    assert not [n for n in model.graph.all_nodes() if n.op_type.endswith("PartitionedCall")]
    fn, params = xconv.to_jax(model)
    _close(_first(fn(params, x)), want, "to_jax")
    module, _ = xconv.to_torch(model)
    with torch.no_grad():
        _close(_first(module(torch.from_numpy(x))), want, "to_torch")
    if flax:
        out = xconv.to_flax(model, tmp_path / "linen")
        flax_model, variables = _import(out / "model.py").load(out)
        _close(_first(flax_model.apply(variables, x)), want, "to_flax")


def _calibrate_batch_norm(net, x) -> None:
    """Move each BatchNormalization's statistics a tenth of the way to the batch's, so a
    randomly initialised deep net's outputs keep real magnitude (EfficientNet's logits are
    ~1e-6 with the initial statistics)."""
    for layer in net.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.9
    net(x, training=True)


def test_captured_constants_and_grouped_conv(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3), batch_size=2)
    x = keras.layers.Rescaling(1.0 / 255.0)(inputs)
    x = keras.layers.Normalization(mean=[0.485, 0.456, 0.406], variance=[0.05, 0.05, 0.05])(x)
    x = keras.layers.Conv2D(8, 3, padding="same")(x)
    x = keras.layers.Conv2D(8, 3, padding="same", groups=8, name="grouped")(x)  # jit_compile
    x = keras.layers.Conv2D(8, 3, padding="same", groups=2)(x)
    outputs = keras.layers.GlobalAveragePooling2D()(x)
    net = keras.Model(inputs, outputs)
    x = (np.random.RandomState(0).rand(2, 8, 8, 3) * 255).astype(np.float32)
    _check(net, x, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["EfficientNetB0", "ConvNeXtTiny"])
def test_keras_application(name, tmp_path):
    keras.utils.set_random_seed(0)
    net = getattr(keras.applications, name)(
        weights=None, input_shape=(64, 64, 3), classifier_activation=None
    )
    x = (np.random.RandomState(0).rand(2, 64, 64, 3) * 255).astype(np.float32)
    _calibrate_batch_norm(net, x)
    _check(net, x, tmp_path)


def test_squeeze_excite_reshape_is_a_transpose(tmp_path):
    """tf2onnx writes the NHWC->NCHW Transpose of a pooled ``(N, 1, 1, C)`` tensor as a
    Reshape; kept as one, the Flax source reshaped it in the wrong layout (MobileNetV3's
    squeeze-and-excite: ``ScopeParamShapeError`` on the 1x1 conv). The importer writes it as
    the Transpose it is."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    s = keras.layers.GlobalAveragePooling2D(keepdims=True)(x)
    s = keras.layers.Conv2D(4, 1)(s)
    s = keras.layers.Conv2D(8, 1)(keras.layers.ReLU()(s))
    x = keras.layers.Multiply()([x, s])
    net = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(x))
    x = np.random.RandomState(0).rand(1, 8, 8, 3).astype(np.float32)
    _check(net, x, tmp_path)
    model = xconv.from_tf(net, (x,))
    pooled = [n.outputs[0] for n in model.graph if n.op_type == "ReduceMean"]
    assert not [n for n in model.graph if n.op_type == "Reshape" and n.inputs[0] in pooled]


@pytest.mark.parametrize("side", [1, 3])
def test_grouped_conv_same_padding_on_a_small_map(side, tmp_path):
    """A grouped ``padding="same"`` conv whose kernel is larger than its input (ConvNeXt's 7x7
    depthwise convs on the 1x1 last stage at 32 px): tf2onnx leaves ``auto_pad="SAME_UPPER"``
    in the inlined function, which the Flax source did not take; the importer writes pads."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((side, side, 8))
    x = keras.layers.Conv2D(8, 7, padding="same", groups=8)(inputs)
    x = keras.layers.Conv2D(8, 2, strides=2, padding="same", groups=4)(x)
    net = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(x))
    x = np.random.RandomState(0).rand(1, side, side, 8).astype(np.float32)
    _check(net, x, tmp_path)
    model = xconv.from_tf(net, (x,))
    assert not [n for n in model.graph if "auto_pad" in n.attributes]
