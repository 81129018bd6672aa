"""ONNX files in and out of the IR."""

from __future__ import annotations

from xconv.converters.onnx.io import load, save

__all__ = ["load", "save"]
