"""Window functions and MelWeightMatrix on numpy (their sizes are static)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

Fail = Callable[[str], Exception]

# Generalized cosine window coefficients a_k: w[n] = sum_k a_k cos(2 pi k n / N').
HANN = (0.5, -0.5)
HAMMING = (25.0 / 46.0, -(1 - 25.0 / 46.0))
BLACKMAN = (0.42, -0.5, 0.08)


def onnx_dtype(code: int, fail: Fail) -> np.dtype:
    """The numpy dtype of an ONNX ``output_datatype`` code."""
    try:
        return ir.DataType(code).numpy()
    except (ValueError, TypeError) as e:
        raise fail(f"unsupported output_datatype {code}") from e


def cosine_window(
    size: np.ndarray, periodic: int, output_datatype: int, coefficients, fail: Fail
) -> np.ndarray:
    """sum_k a_k cos(2 pi k n / N') for a generalized cosine window of ``size`` points."""
    n = int(np.asarray(size).reshape(-1)[0])
    if n < 0:
        raise fail(f"window size must be non-negative, got {n}")
    denom = n if periodic else n - 1
    ni = np.arange(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = sum(a * np.cos(2 * np.pi * k * ni / denom) for k, a in enumerate(coefficients))
    return np.asarray(out).astype(onnx_dtype(output_datatype, fail))


def mel_weight_matrix(
    num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz
) -> np.ndarray:
    """[dft_length // 2 + 1, num_mel_bins] float64 triangular filter bank."""
    bins = int(num_mel_bins)
    n_fft = int(dft_length)
    rate, low, high = sample_rate, lower_edge_hertz, upper_edge_hertz
    n_spec = n_fft // 2 + 1
    points = np.arange(0, bins + 2)
    low_mel = 2595 * np.log1p(low / 700) / np.log(10)
    high_mel = 2595 * np.log1p(high / 700) / np.log(10)
    step = (high_mel - low_mel) / points.shape[0]
    hz = 700 * np.expm1((points * step + low_mel) / 2595 * np.log(10))
    fbins = (((n_fft + 1) * hz) // rate).astype(int)
    out = np.zeros((n_spec, bins))
    for i in range(bins):
        left, center, right = fbins[i], fbins[i + 1], fbins[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            j = np.arange(left, center + 1)
            out[j, i] = (j - left) / (center - left)
        if right > center:
            j = np.arange(center, right)
            out[j, i] = (right - j) / (right - center)
    return out
