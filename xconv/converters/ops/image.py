"""ImageDecoder: encoded image bytes (JPEG, PNG, BMP, TIFF, WebP, PNM, JPEG 2000) decoded by
Pillow, as the ONNX reference decodes them. The bytes must be known when the op runs (not a
value traced under ``jax.jit``); both runtimes decode them here and take the pixels back as
their arrays.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np

Fail = Callable[[str], Exception]

#: pixel_format -> the Pillow mode decoded to.
PIXEL_FORMATS = {"RGB": "RGB", "BGR": "RGB", "Grayscale": "L"}


def decode_image(encoded: np.ndarray, pixel_format: str, fail: Fail) -> np.ndarray:
    """The (H, W, C) uint8 pixels of one encoded image: C = 3 for RGB / BGR, 1 for Grayscale."""
    if pixel_format not in PIXEL_FORMATS:
        raise fail(f"pixel_format must be one of {sorted(PIXEL_FORMATS)}, got {pixel_format!r}")
    if encoded.dtype != np.uint8 or encoded.ndim != 1:
        raise fail(
            f"encoded_stream must be a 1-D uint8 tensor, got {encoded.dtype} {encoded.shape}"
        )
    try:
        import PIL.Image
    except ImportError as e:
        raise fail("ImageDecoder needs Pillow: pip install 'xconv[image]'") from e
    try:
        image = PIL.Image.open(io.BytesIO(encoded.tobytes()))
        pixels = np.array(image.convert(PIXEL_FORMATS[pixel_format]), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as e:  # what Pillow raises for bytes it cannot read
        raise fail(f"cannot decode the image ({len(encoded)} bytes): {e}") from e
    if pixel_format == "Grayscale":
        return pixels[:, :, None]
    return np.ascontiguousarray(pixels[:, :, ::-1]) if pixel_format == "BGR" else pixels


def register_image_ops(
    builtin: Callable[..., Any], to_backend: Callable[[np.ndarray], Any]
) -> None:
    """Register ImageDecoder with a backend registry's ``builtin``; ``to_backend`` turns the
    decoded pixels into the backend's array."""

    @builtin("ImageDecoder", since=20, attrs={"pixel_format": "RGB"})
    def image_decoder(ctx, encoded_stream, *, pixel_format):
        """ImageDecoder(encoded_stream: uint8 bytes) -> (H, W, C) uint8 pixels."""
        encoded = np.asarray(ctx.static(encoded_stream, "encoded_stream"))
        return to_backend(decode_image(encoded, pixel_format, ctx.error))
