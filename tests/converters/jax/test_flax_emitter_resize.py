"""GatherND and Resize templates of the Flax emitter, against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import xconv
from tests.converters.jax.generated import run_generated
from tests.converters.jax.test_flax_emitter import ort_run, ruff_ok

CASES = [
    ("nearest", "asymmetric", "floor", [1.0, 1.0, 2.0, 2.0], None),  # torch nearest
    ("nearest", "half_pixel", "round_prefer_floor", None, [2, 3, 5, 3]),
    ("linear", "half_pixel", "round_prefer_floor", [1.0, 1.0, 2.0, 1.5], None),
    ("linear", "pytorch_half_pixel", "round_prefer_floor", None, [2, 3, 3, 7]),
    ("linear", "align_corners", "round_prefer_floor", [1.0, 1.0, 2.0, 2.0], None),
    ("linear", "asymmetric", "round_prefer_floor", None, [2, 3, 8, 2]),
    ("nearest", "tf_half_pixel_for_nn", "floor", None, [2, 3, 7, 9]),  # Keras Resizing
]


def _resize_model(mode, coord, nearest, scales, sizes, x_shape=(2, 3, 4, 5)) -> ir.Model:
    inits, names = [], ["x", ""]
    if scales is not None:
        inits.append(h.make_tensor("scales", T.FLOAT, [4], scales))
        names.append("scales")
    else:
        inits.append(h.make_tensor("sizes", T.INT64, [4], sizes))
        names += ["", "sizes"]
    node = h.make_node(
        "Resize",
        names,
        ["y"],
        mode=mode,
        coordinate_transformation_mode=coord,
        nearest_mode=nearest,
    )
    graph = h.make_graph(
        [node],
        "resize",
        [h.make_tensor_value_info("x", T.FLOAT, list(x_shape))],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        inits,
    )
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 19)]))


@pytest.mark.parametrize(("mode", "coord", "nearest", "scales", "sizes"), CASES)
def test_resize_matches_onnxruntime(tmp_path, mode, coord, nearest, scales, sizes):
    model = _resize_model(mode, coord, nearest, scales, sizes)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    (want,) = ort_run(model, x)
    out = xconv.to_flax(model, tmp_path / "out", api="linen")
    src = (out / "model.py").read_text()
    assert "def _resize(" in src
    got, _ = run_generated(out, "linen", x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg


@pytest.mark.parametrize("batch_dims", [0, 1])
def test_gather_nd_matches_onnxruntime(tmp_path, batch_dims):
    data_shape = [2, 3, 4]
    idx = np.array([[[1, -1], [0, 2]], [[2, 3], [-3, 0]]], dtype=np.int64)
    if batch_dims == 0:
        idx = np.array([[[1, -1], [0, 2]], [[1, 1], [0, 0]]], dtype=np.int64)
    node = h.make_node("GatherND", ["x", "idx"], ["y"], batch_dims=batch_dims)
    graph = h.make_graph(
        [node],
        "gnd",
        [h.make_tensor_value_info("x", T.FLOAT, data_shape)],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [h.make_tensor("idx", T.INT64, list(idx.shape), idx.reshape(-1).tolist())],
    )
    model = ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    x = np.random.default_rng(1).standard_normal(data_shape).astype(np.float32)
    (want,) = ort_run(model, x)
    out = xconv.to_flax(model, tmp_path / "out", api="nnx")
    got, _ = run_generated(out, "nnx", x)
    np.testing.assert_array_equal(np.asarray(got), want)
    ok, msg = ruff_ok(out / "model.py")
    assert ok, msg


def test_resize_by_scales_of_a_symbolic_batch(tmp_path):
    """Keras UpSampling2D(interpolation="bilinear") through tf2onnx: scales of an input
    whose batch is symbolic; the batch axis, scale 1, is kept whole. Sizes over such an axis
    are resolved against the input's shape when the model runs, as onnxruntime does."""
    model = _resize_model("linear", "half_pixel", "floor", [1.0, 1.0, 2.0, 2.0], None,
                          x_shape=("N", 3, 4, 5))  # fmt: skip
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    (want,) = ort_run(model, x)
    got, _ = run_generated(xconv.to_flax(model, tmp_path / "out", api="linen"), "linen", x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    sized = _resize_model("linear", "half_pixel", "floor", None, [2, 3, 8, 10],
                          x_shape=("N", 3, 4, 5))  # fmt: skip
    (want,) = ort_run(sized, x)
    got, _ = run_generated(xconv.to_flax(sized, tmp_path / "sized", api="linen"), "linen", x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale_factor": 2, "mode": "bicubic", "align_corners": False},
        {"size": (5, 7), "mode": "bicubic", "align_corners": True},
        {"size": (5, 3), "mode": "bilinear", "antialias": True},
        {"size": (4, 3), "mode": "bicubic", "antialias": True},
    ],
)
def test_torch_interpolate_through_the_generated_flax_matches_torch(tmp_path, kwargs):
    """F.interpolate's bicubic (ONNX cubic, a = -0.75) and antialiased downsampling, exported
    by torch, through the jitted generated Flax against torch."""
    torch = pytest.importorskip("torch")

    class Interpolate(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.interpolate(x, **kwargs)

    module, x = Interpolate().eval(), torch.randn(2, 3, 8, 9)
    model = xconv.from_torch(module, (x,))
    assert [n.op_type for n in model.graph].count("Resize") == 1
    got, _ = run_generated(xconv.to_flax(model, tmp_path / "out"), "linen", x.numpy())
    np.testing.assert_allclose(np.asarray(got), module(x).numpy(), rtol=1e-5, atol=1e-5)
