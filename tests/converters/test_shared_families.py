"""The op families written once in ``xconv.converters.ops`` are what both runtimes run: each
runtime's built-in handler for these ops is the shared definition, not a copy of it."""

from __future__ import annotations

import pytest

#: shared module -> (domain, op type) it defines for both runtimes.
SHARED = {
    "xconv.converters.ops.attention": [
        ("", "Attention"),
        ("", "RotaryEmbedding"),
        ("", "SwiGLU"),
        ("", "TensorScatter"),
        ("", "LinearAttention"),
        ("", "CausalConvWithState"),
        ("ai.onnx.preview", "FlexAttention"),
    ],
    "xconv.converters.ops.detection": [("", "RoiAlign"), ("", "MaxRoiPool"), ("", "DeformConv")],
    "xconv.converters.ops.image": [("", "ImageDecoder")],
    "xconv.converters.ops.training": [
        ("ai.onnx.preview.training", "Adagrad"),
        ("ai.onnx.preview.training", "Adam"),
        ("ai.onnx.preview.training", "Momentum"),
    ],
    "xconv.converters.ops.nn": [
        ("", op)
        for op in (
            "Conv",
            "ConvTranspose",
            "Col2Im",
            "MaxPool",
            "AveragePool",
            "LpPool",
            "GlobalAveragePool",
            "GlobalMaxPool",
            "GlobalLpPool",
            "MaxUnpool",
            "GridSample",
            "AffineGrid",
        )
    ],
    "xconv.converters.ops.ml": [
        ("ai.onnx.ml", "LabelEncoder"),
        ("ai.onnx.ml", "ArrayFeatureExtractor"),
        ("ai.onnx.ml", "Binarizer"),
        ("ai.onnx.ml", "TreeEnsemble"),
        ("", "TfIdfVectorizer"),
    ],
}


def _registry(framework: str):
    pytest.importorskip(framework)
    if framework == "jax":
        from xconv.converters.jax.registry import registry
    else:
        import xconv.converters.torch.runtime  # noqa: F401 - registers the handlers
        from xconv.converters.torch.runtime.registry import registry
    return registry


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("module", sorted(SHARED))
def test_runtime_handler_is_the_shared_definition(framework, module):
    registry = _registry(framework)
    for domain, op in SHARED[module]:
        handler, reason = registry.lookup(domain, op, 30)
        assert handler is not None, reason
        assert handler.fn.__module__ == module, (op, handler.fn.__module__)
