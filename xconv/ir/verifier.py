"""Verify an IR model: ONNX checker, then types and shapes through ONNX shape inference."""

from __future__ import annotations

import onnx
import onnx_ir as ir

from xconv.errors import InvalidModelError


def verify(model: ir.Model, *, strict_shapes: bool = True) -> onnx.ModelProto:
    """Check the model and return the shape-inferred proto.

    Raises:
        InvalidModelError: the checker or strict shape inference rejects the model; the
            message is the checker's, naming the node.
    """
    proto = ir.serde.serialize_model(model)
    try:
        onnx.checker.check_model(proto, full_check=False)
    except onnx.checker.ValidationError as e:
        raise InvalidModelError(f"the IR fails the ONNX checker: {e}") from e
    try:
        return onnx.shape_inference.infer_shapes(
            proto, check_type=True, strict_mode=strict_shapes, data_prop=True
        )
    except onnx.shape_inference.InferenceError as e:
        raise InvalidModelError(f"the IR fails type and shape inference: {e}") from e
