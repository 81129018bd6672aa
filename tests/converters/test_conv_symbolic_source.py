"""A convolution over symbolic spatial sizes (a fully convolutional model exported with a
dynamic height and width) in the Flax source: explicit pads do not depend on the input's
size, so the source is written (it raised ``TypeError: int() ... NoneType`` in
``conv_padding_of``, as on a TorchScript CNN) and matches the ONNX reference evaluator at two
image sizes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _model():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 0, 1, 2], strides=[2, 1])
    graph = helper.make_graph(
        [conv],
        "fcn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, None, None])],
        [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def test_conv_with_symbolic_spatial_sizes(tmp_path):
    proto = _model()
    out = xconv.to_flax(ir.from_proto(proto), tmp_path / "flax")
    assert "(1, 1), (0, 2)" in (out / "model.py").read_text()
    module, variables = _load_generated(out / "model.py").load(out)
    ref = ReferenceEvaluator(proto)
    for shape in ((2, 3, 9, 7), (1, 3, 12, 5)):
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        (want,) = ref.run(None, {"x": x})
        got = np.asarray(module.apply(variables, x))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
