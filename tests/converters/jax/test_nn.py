"""JAX handlers for the nn family (conv, pooling, normalisation, dropout, sampling, recurrent):
parity with the ONNX reference evaluator, plus jit and grad checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import xconv

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


@dataclass
class OpCase:
    """One node whose inputs are all run-time graph inputs (``None`` = omitted input)."""

    name: str
    op: str
    data: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    n_out: int = 1
    opset: int = 23
    rtol: float = 1e-4
    atol: float = 1e-5
    # The reference evaluator lacks GlobalLpPool, MaxRoiPool and RNN's Relu, and gets grouped
    # ConvTranspose with batch > 1, LRN and L1 LpNormalization wrong: onnxruntime checks those.
    oracle: str = "reference"


def build_model(case: OpCase) -> onnx.ModelProto:
    inputs, names = [], []
    for i, x in enumerate(case.data):
        if x is None:
            names.append("")
            continue
        name = f"x{i}"
        dtype = helper.np_dtype_to_tensor_dtype(x.dtype)
        inputs.append(helper.make_tensor_value_info(name, dtype, x.shape))
        names.append(name)
    outs = [f"y{i}" for i in range(case.n_out)]
    node = helper.make_node(case.op, names, outs, **case.attrs)
    graph = helper.make_graph(
        [node], case.name, inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])


def feeds(case: OpCase) -> list[np.ndarray]:
    return [x for x in case.data if x is not None]


def run_both(case: OpCase):
    model = build_model(case)
    inputs = {f"x{i}": x for i, x in enumerate(case.data) if x is not None}
    if case.oracle == "onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        expected = sess.run(None, inputs)
    else:
        expected = ReferenceEvaluator(model).run(None, inputs)
    fn, params = xconv.to_jax(xconv.load(model))
    actual = fn(params, *(jnp.asarray(x) for x in feeds(case)))
    return fn, params, actual, expected


X4 = rand(2, 4, 7, 6)
X3 = rand(2, 3, 9)
X5 = rand(1, 2, 5, 6, 4)
SEQ = rand(5, 3, 4)  # (seq, batch, input)

CASES = [
    # --- convolution
    OpCase(
        "conv2d_pads_strides",
        "Conv",
        [X4, rand(6, 4, 3, 3), rand(6)],
        {"pads": [1, 0, 2, 1], "strides": [2, 1]},
    ),
    OpCase(
        "conv2d_same_lower_dilated_group",
        "Conv",
        [X4, rand(4, 2, 3, 2)],
        {"auto_pad": "SAME_LOWER", "dilations": [2, 1], "group": 2, "strides": [2, 2]},
    ),
    OpCase("conv1d_same_upper", "Conv", [X3, rand(5, 3, 4)], {"auto_pad": "SAME_UPPER"}),
    OpCase("conv3d_valid", "Conv", [X5, rand(3, 2, 2, 3, 2)], {"auto_pad": "VALID"}),
    OpCase(
        "convtranspose_pads_outpad",
        "ConvTranspose",
        [X4, rand(4, 3, 3, 3), rand(3)],
        {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
    ),
    OpCase(
        "convtranspose_group_dilated",
        "ConvTranspose",
        [X4, rand(4, 2, 2, 3)],
        {"group": 2, "dilations": [2, 1], "strides": [1, 2]},
        oracle="onnxruntime",
    ),
    OpCase(
        "convtranspose_output_shape",
        "ConvTranspose",
        [X3, rand(3, 2, 3)],
        {"strides": [2], "output_shape": [20]},
    ),
    OpCase(
        "convtranspose_same_upper",
        "ConvTranspose",
        [X3, rand(3, 2, 4)],
        {"strides": [2], "auto_pad": "SAME_UPPER"},
    ),
    OpCase(
        "deform_conv_mask_bias",
        "DeformConv",
        [rand(1, 4, 5, 5), rand(2, 2, 2, 2), rand(1, 16, 4, 4), rand(2), rand(1, 8, 4, 4)],
        {"group": 2, "offset_group": 2},
    ),
    OpCase(
        "col2im_strided_padded",
        "Col2Im",
        [rand(1, 2 * 4, 9), np.array([5, 6]), np.array([2, 2])],
        {"strides": [2, 2], "pads": [1, 1, 0, 0]},
    ),
    # --- pooling
    OpCase(
        "maxpool_ceil_dilated",
        "MaxPool",
        [X4],
        {"kernel_shape": [2, 3], "strides": [2, 2], "dilations": [2, 1], "ceil_mode": 1},
    ),
    OpCase(
        "maxpool_indices_colmajor",
        "MaxPool",
        [X4],
        {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "storage_order": 1},
        n_out=2,
    ),
    OpCase(
        "maxpool_same_upper_1d",
        "MaxPool",
        [X3],
        {"kernel_shape": [4], "auto_pad": "SAME_UPPER", "strides": [2]},
    ),
    OpCase(
        "avgpool_pads_exclude",
        "AveragePool",
        [X4],
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]},
    ),
    OpCase(
        "avgpool_include_ceil",
        "AveragePool",
        [X4],
        {
            "kernel_shape": [3, 2],
            "pads": [1, 0, 1, 0],
            "strides": [2, 2],
            "ceil_mode": 1,
            "count_include_pad": 1,
        },
    ),
    OpCase(
        "avgpool_3d_same_lower",
        "AveragePool",
        [X5],
        {"kernel_shape": [2, 3, 2], "auto_pad": "SAME_LOWER"},
    ),
    OpCase("lppool_p3", "LpPool", [X4], {"kernel_shape": [2, 2], "p": 3, "strides": [2, 1]}),
    OpCase("global_average", "GlobalAveragePool", [X5]),
    OpCase("global_max", "GlobalMaxPool", [X4]),
    OpCase("global_lp", "GlobalLpPool", [X4], {"p": 3}, opset=21, oracle="onnxruntime"),
    OpCase(
        "maxroipool",
        "MaxRoiPool",
        [X4, np.array([[0, 0, 0, 4, 5], [1, 1, 2, 3, 6], [0, 2, 1, 2, 1]], np.float32)],
        {"pooled_shape": [2, 3], "spatial_scale": 1.0},
        opset=21,
        oracle="onnxruntime",
    ),
    OpCase(
        "roialign_avg_ratio2",
        "RoiAlign",
        [
            X4,
            np.array([[0.5, 0.2, 4.4, 5.1], [1.0, 1.0, 3.0, 6.5]], np.float32),
            np.array([1, 0], np.int64),
        ],
        {"output_height": 2, "output_width": 3, "sampling_ratio": 2, "spatial_scale": 0.9},
    ),
    OpCase(
        "roialign_max_adaptive",
        "RoiAlign",
        [
            X4,
            np.array([[0.5, 0.2, 4.4, 5.1], [1.0, 1.0, 3.0, 6.5]], np.float32),
            np.array([1, 0], np.int64),
        ],
        {"output_height": 2, "output_width": 2, "mode": "max"},
    ),
    # --- normalisation
    OpCase(
        "batchnorm_inference",
        "BatchNormalization",
        [X4, rand(4), rand(4), rand(4), np.abs(rand(4)) + 0.5],
        {"epsilon": 1e-3},
    ),
    OpCase(
        "batchnorm_training",
        "BatchNormalization",
        [X4, rand(4), rand(4), rand(4), np.abs(rand(4)) + 0.5],
        {"training_mode": 1, "momentum": 0.8},
        n_out=3,
    ),
    OpCase("instancenorm", "InstanceNormalization", [X5, rand(2), rand(2)], {"epsilon": 1e-3}),
    OpCase(
        "layernorm_stats", "LayerNormalization", [X4, rand(7, 6), rand(7, 6)], {"axis": 2}, n_out=3
    ),
    OpCase(
        "groupnorm_21", "GroupNormalization", [X4, rand(4), rand(4)], {"num_groups": 2}, opset=21
    ),
    OpCase("rmsnorm", "RMSNormalization", [X4, rand(6)], {"epsilon": 1e-3}),
    OpCase(
        "lrn",
        "LRN",
        [X4],
        {"size": 3, "alpha": 0.01, "beta": 0.6, "bias": 2.0},
        oracle="onnxruntime",
    ),
    OpCase("lpnorm_l1", "LpNormalization", [X4], {"axis": 1, "p": 1}, oracle="onnxruntime"),
    OpCase("mvn", "MeanVarianceNormalization", [X4]),
    OpCase("dropout_inference", "Dropout", [X4], n_out=2),
    # --- sampling
    OpCase(
        "gridsample_bilinear_border",
        "GridSample",
        [X4, rand(2, 3, 5, 2) * 1.2],
        {"padding_mode": "border"},
    ),
    OpCase(
        "gridsample_bicubic_reflection_aligned",
        "GridSample",
        [X4, rand(2, 3, 5, 2) * 1.5],
        {"mode": "cubic", "padding_mode": "reflection", "align_corners": 1},
    ),
    OpCase("gridsample_nearest_zeros", "GridSample", [X4, rand(2, 4, 4, 2)], {"mode": "nearest"}),
    OpCase("gridsample_3d_linear", "GridSample", [X5, rand(1, 2, 3, 4, 3) * 1.1]),
    OpCase("affinegrid_2d", "AffineGrid", [rand(2, 2, 3), np.array([2, 3, 4, 5])]),
    OpCase(
        "affinegrid_3d_aligned",
        "AffineGrid",
        [rand(1, 3, 4), np.array([1, 1, 2, 3, 4])],
        {"align_corners": 1},
    ),
    # --- recurrent
    OpCase(
        "rnn_bidirectional_relu",
        "RNN",
        [SEQ, rand(2, 5, 4), rand(2, 5, 5), rand(2, 10)],
        {"hidden_size": 5, "direction": "bidirectional", "activations": ["Relu", "Tanh"]},
        n_out=2,
        oracle="onnxruntime",
    ),
    OpCase(
        "gru_reverse_lbr",
        "GRU",
        [SEQ, rand(1, 9, 4), rand(1, 9, 3), rand(1, 18), None, rand(1, 3, 3)],
        {"hidden_size": 3, "direction": "reverse", "linear_before_reset": 1},
        n_out=2,
    ),
    OpCase(
        "gru_batchwise",
        "GRU",
        [np.swapaxes(SEQ, 0, 1).copy(), rand(1, 9, 4), rand(1, 9, 3)],
        {"hidden_size": 3, "layout": 1},
        n_out=2,
    ),
    OpCase(
        "lstm_peepholes_init",
        "LSTM",
        [
            SEQ,
            rand(1, 12, 4),
            rand(1, 12, 3),
            rand(1, 24),
            None,
            rand(1, 3, 3),
            rand(1, 3, 3),
            rand(1, 9),
        ],
        {"hidden_size": 3},
        n_out=3,
    ),
    OpCase(
        "lstm_bidirectional",
        "LSTM",
        [SEQ, rand(2, 12, 4), rand(2, 12, 3)],
        {"hidden_size": 3, "direction": "bidirectional"},
        n_out=3,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    _, _, actual, expected = run_both(case)
    assert len(actual) >= len(expected)
    for a, e in zip(actual, expected, strict=False):
        a = np.asarray(a)
        assert a.shape == np.shape(e)
        if np.asarray(e).dtype.kind in "biu":
            np.testing.assert_array_equal(a, e)
        else:
            np.testing.assert_allclose(a, e, rtol=case.rtol, atol=case.atol)


def test_lstm_sequence_lens_reverse() -> None:
    """Each sequence runs over its own length; later outputs are zero, states frozen."""
    w, r, b = rand(2, 8, 4), rand(2, 8, 2), rand(2, 16)
    lens = np.array([5, 2, 3], np.int32)
    case = OpCase(
        "lstm_lens",
        "LSTM",
        [SEQ, w, r, b, lens],
        {"hidden_size": 2, "direction": "bidirectional"},
        n_out=3,
    )
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    y, y_h, y_c = fn(params, *(jnp.asarray(x) for x in feeds(case)))
    # Oracle: run each batch entry alone, truncated to its length, without sequence_lens.
    for i, n in enumerate(lens):
        sub = OpCase(
            "lstm_one",
            "LSTM",
            [SEQ[:n, i : i + 1], w, r, b],
            {"hidden_size": 2, "direction": "bidirectional"},
            n_out=3,
        )
        ey, eh, ec = ReferenceEvaluator(build_model(sub)).run(
            None, {f"x{k}": x for k, x in enumerate(sub.data)}
        )
        np.testing.assert_allclose(np.asarray(y)[:n, :, i : i + 1], ey, rtol=1e-4, atol=1e-5)
        assert np.all(np.asarray(y)[n:, :, i] == 0)
        np.testing.assert_allclose(np.asarray(y_h)[:, i : i + 1], eh, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(y_c)[:, i : i + 1], ec, rtol=1e-4, atol=1e-5)


def test_groupnorm_opset18_per_group_scale() -> None:
    x, scale, bias = X4, rand(2), rand(2)
    case = OpCase("gn18", "GroupNormalization", [x, scale, bias], {"num_groups": 2}, opset=18)
    _, _, actual, _ = run_both(case)
    g = x.reshape(2, 2, -1)
    norm = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-5)).reshape(
        x.shape
    )
    expected = (
        norm * np.repeat(scale, 2)[None, :, None, None] + np.repeat(bias, 2)[None, :, None, None]
    )
    np.testing.assert_allclose(np.asarray(actual[0]), expected, rtol=1e-4, atol=1e-5)


def test_dropout_training_mask_and_scale() -> None:
    x = np.abs(rand(64, 64)) + 1.0
    case = OpCase(
        "dropout_train",
        "Dropout",
        [x, np.array(0.25, np.float32), np.array(True)],
        {"seed": 3},
        n_out=2,
    )
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    y, mask = (np.asarray(v) for v in fn(params, *(jnp.asarray(v) for v in feeds(case))))
    assert mask.dtype == np.bool_
    assert 0.7 < mask.mean() < 0.8
    np.testing.assert_allclose(y[mask], x[mask] / 0.75, rtol=1e-6)
    assert np.all(y[~mask] == 0)


def _jit_grad_case(case: OpCase) -> None:
    fn, params, _, expected = run_both(case)
    args = [jnp.asarray(x) for x in feeds(case)]
    jitted = jax.jit(fn)(params, *args)
    np.testing.assert_allclose(np.asarray(jitted[0]), expected[0], rtol=1e-4, atol=1e-5)

    weights = jnp.asarray(rand(*np.shape(expected[0])))

    def loss(x0):
        y = fn(params, x0, *args[1:])[0]
        return jnp.sum(weights * y) + 0.1 * jnp.sum(y * y)

    grad = jax.jit(jax.grad(loss))(args[0])
    # Central finite difference along a random direction checks the gradient's numbers.
    v = jnp.asarray(rand(*args[0].shape))
    eps = 1e-3
    fd = (loss(args[0] + eps * v) - loss(args[0] - eps * v)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(grad, v)), float(fd), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize(
    "name",
    [
        "conv2d_pads_strides",
        "convtranspose_pads_outpad",
        "batchnorm_training",
        "maxpool_ceil_dilated",
        "avgpool_pads_exclude",
        "lstm_peepholes_init",
        "gru_reverse_lbr",
        "layernorm_stats",
        "gridsample_bilinear_border",
    ],
)
def test_jit_and_grad(name: str) -> None:
    _jit_grad_case(next(c for c in CASES if c.name == name))


def test_dilated_max_pool_slices_each_axis_once() -> None:
    """A dilated max pool is a max over strided slices taken one spatial axis at a time:
    kh + kw slices, not kh * kw (the conformance suite's 60 x 80 kernel on 1000 x 1000 timed
    out at 4,800), with the reference's numbers and gradient."""
    case = OpCase(
        "maxpool_dilated_wide",
        "MaxPool",
        [rand(2, 3, 30, 40)],
        {"kernel_shape": [5, 7], "dilations": [2, 3], "strides": [2, 1], "pads": [1, 2, 0, 3]},
    )
    fn, params, actual, expected = run_both(case)
    np.testing.assert_allclose(np.asarray(actual[0]), expected[0], rtol=0, atol=0)
    x = case.data[0]
    jaxpr = jax.make_jaxpr(lambda v: fn(params, v)[0])(jnp.asarray(x))
    assert sum(e.primitive.name == "slice" for e in jaxpr.eqns) == 5 + 7
    # The gradient goes to each window's maximum (random floats: no ties). Finite differences
    # are no check here: 35-element windows overlap, and a step moves many maxima.
    w = rand(*expected[0].shape)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(w * fn(params, v)[0])))(jnp.asarray(x))
    padded = np.pad(x, ((0, 0), (0, 0), (1, 0), (2, 3)), constant_values=-np.inf)
    want = np.zeros_like(padded)
    for n, c, i, j in np.ndindex(*w.shape):
        rows, cols = 2 * i + 2 * np.arange(5), j + 3 * np.arange(7)
        r, q = np.unravel_index(np.argmax(padded[n, c][np.ix_(rows, cols)]), (5, 7))
        want[n, c, rows[r], cols[q]] += w[n, c, i, j]
    np.testing.assert_allclose(np.asarray(grad), want[:, :, 1:, 2:-3], rtol=1e-5, atol=1e-5)


def test_unsupported_auto_pad_is_an_error() -> None:
    case = OpCase("bad", "Conv", [X4, rand(2, 4, 3, 3)], {"auto_pad": "BOGUS"})
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    with pytest.raises(xconv.errors.ConversionError, match="auto_pad"):
        fn(params, *(jnp.asarray(x) for x in feeds(case)))


@pytest.mark.parametrize("name", ["conv2d_pads_strides", "maxpool_ceil_dilated", "gru_batchwise"])
def test_vmap_over_extra_axis(name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    fn, params, _, expected = run_both(case)
    args = [jnp.asarray(x) for x in feeds(case)]
    stacked = jnp.stack([args[0], args[0] * 0.5])
    out = jax.vmap(lambda x0: fn(params, x0, *args[1:])[0])(stacked)
    np.testing.assert_allclose(np.asarray(out[0]), expected[0], rtol=1e-4, atol=1e-5)
    half = fn(params, args[0] * 0.5, *args[1:])[0]
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(half), rtol=1e-5, atol=1e-6)
