"""ImageDecoder on both runtimes: images Pillow encodes, decoded by xconv's JAX and torch
runtimes, compared with the pixels encoded (lossless formats) and with the ONNX reference."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import xconv
from xconv.errors import ConversionError

PIL_Image = pytest.importorskip("PIL.Image")

LOSSLESS = ["PNG", "BMP", "TIFF", "PPM", "WEBP"]


def _pixels(h: int = 13, w: int = 21) -> np.ndarray:
    rng = np.random.default_rng(h * w)
    return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def _encode(pixels: np.ndarray, fmt: str) -> np.ndarray:
    buffer = io.BytesIO()
    options = {"lossless": True} if fmt == "WEBP" else {}
    PIL_Image.fromarray(pixels).save(buffer, format=fmt, **options)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8).copy()


def _model(pixel_format: str) -> onnx.ModelProto:
    node = helper.make_node("ImageDecoder", ["data"], ["image"], pixel_format=pixel_format)
    graph = helper.make_graph(
        [node],
        "decode",
        [helper.make_tensor_value_info("data", TensorProto.UINT8, ["n"])],
        [helper.make_tensor_value_info("image", TensorProto.UINT8, ["h", "w", "c"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def _run(runtime: str, model: onnx.ModelProto, data: np.ndarray) -> np.ndarray:
    if runtime == "torch":
        torch = pytest.importorskip("torch")
        module, _ = xconv.to_torch(xconv.load(model))
        out = module(torch.from_numpy(data))
        assert isinstance(out, torch.Tensor)
        return out.numpy()
    jnp = pytest.importorskip("jax.numpy")
    fn, params = xconv.to_jax(xconv.load(model))
    return np.asarray(fn(params, jnp.asarray(data))[0])


@pytest.mark.parametrize("runtime", ["torch", "jax"])
@pytest.mark.parametrize("fmt", LOSSLESS)
@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
def test_lossless_images_decode_to_their_pixels(runtime, fmt, pixel_format):
    pixels = _pixels()
    data = _encode(pixels, fmt)
    got = _run(runtime, _model(pixel_format), data)
    want = ReferenceEvaluator(_model(pixel_format)).run(None, {"data": data})[0]
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)
    if pixel_format == "RGB":
        np.testing.assert_array_equal(got, pixels)
    elif pixel_format == "BGR":
        np.testing.assert_array_equal(got, pixels[:, :, ::-1])
    else:
        assert got.shape == (*pixels.shape[:2], 1)


@pytest.mark.parametrize("runtime", ["torch", "jax"])
def test_jpeg_decodes_as_the_reference(runtime):
    data = _encode(_pixels(32, 48), "JPEG")
    got = _run(runtime, _model("RGB"), data)
    np.testing.assert_array_equal(
        got, ReferenceEvaluator(_model("RGB")).run(None, {"data": data})[0]
    )
    assert got.shape == (32, 48, 3)


@pytest.mark.parametrize("runtime", ["torch", "jax"])
def test_bytes_that_are_no_image_are_a_clear_error(runtime):
    data = np.frombuffer(b"not an image at all", dtype=np.uint8).copy()
    with pytest.raises(ConversionError, match="cannot decode the image"):
        _run(runtime, _model("RGB"), data)


def test_unknown_pixel_format_is_refused():
    data = _encode(_pixels(), "PNG")
    with pytest.raises(ConversionError, match="pixel_format must be one of"):
        _run("torch", _model("CMYK"), data)


def test_bytes_traced_under_jit_are_a_clear_error():
    jax = pytest.importorskip("jax")
    fn, params = xconv.to_jax(xconv.load(_model("RGB")))
    with pytest.raises(ConversionError, match="encoded_stream must be known at trace time"):
        jax.jit(fn)(params, jax.numpy.asarray(_encode(_pixels(), "PNG")))
