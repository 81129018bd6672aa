"""And / Or / Xor with a constant Python bool in the torch source: ``torch.logical_and``
takes tensors only (GPT-2's and Llama's vmapped causal mask give ``And(True, ...)``), so the
source writes the operator (``(a < b) & True``), which matches the ONNX reference."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch")

from tests.torch_source import load_generated  # noqa: E402


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
@pytest.mark.parametrize("value", [True, False])
def test_logical_op_with_a_constant_bool(op, value, tmp_path):
    const = helper.make_tensor("t", TensorProto.BOOL, [], [value])
    nodes = [
        helper.make_node("Constant", [], ["t"], value=const),
        helper.make_node("Less", ["a", "b"], ["c"]),
        helper.make_node(op, ["t", "c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "logical",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 4]) for n in "ab"],
        [helper.make_tensor_value_info("y", TensorProto.BOOL, ["n", 4])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    module, source = load_generated(ir.from_proto(proto), tmp_path)
    assert f"torch.logical_{op.lower()}(True" not in source
    rng = np.random.default_rng(0)
    for n in (1, 3):
        a, b = (rng.standard_normal((n, 4)).astype(np.float32) for _ in range(2))
        (want,) = ReferenceEvaluator(proto).run(None, {"a": a, "b": b})
        got = module(torch.from_numpy(a), torch.from_numpy(b)).numpy()
        np.testing.assert_array_equal(got, want)
