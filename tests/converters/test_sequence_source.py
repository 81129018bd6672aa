"""Sequence and optional ops in both source emitters: a hand-built graph of them (positions
and split sizes computed at run time) written as Flax and torch source, each checked against
its runtime, against the ONNX reference; under jax.jit the run-time split is a named error."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import xconv  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _model() -> onnx.ModelProto:
    n = helper.make_node
    nodes = [
        n("SplitToSequence", ["x", "sizes"], ["pieces"], axis=1),
        n("SequenceInsert", ["pieces", "y", "at"], ["inserted"]),
        n("SequenceErase", ["inserted", "minus_one"], ["erased"]),
        n("SequenceAt", ["erased", "at"], ["picked"]),
        n("ConcatFromSequence", ["erased"], ["joined"], axis=1),
        n("SequenceConstruct", ["picked", "y"], ["pair"]),
        n("ConcatFromSequence", ["pair"], ["stacked"], axis=-1, new_axis=1),
        n("SequenceLength", ["erased"], ["length"]),
        n("Optional", ["y"], ["maybe"]),
        n("OptionalHasElement", ["maybe"], ["has"]),
        n("OptionalGetElement", ["maybe"], ["got"]),
    ]
    ints = [helper.make_tensor_value_info(v, TensorProto.INT64, s) for v, s in
            (("sizes", [3]), ("at", []))]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "sequences",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2]), *ints],
        [helper.make_tensor_value_info(v, t, None) for v, t in
         (("joined", TensorProto.FLOAT), ("stacked", TensorProto.FLOAT),
          ("length", TensorProto.INT64), ("has", TensorProto.BOOL), ("got", TensorProto.FLOAT))],
        [helper.make_tensor("minus_one", TensorProto.INT64, [], [-1])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_sequence_ops_match_the_reference(tmp_path):
    from onnx.reference import ReferenceEvaluator

    proto = _model()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6)).astype(np.float32)
    y = rng.standard_normal((2, 2)).astype(np.float32)
    inputs = (x, y, np.array([2, 2, 2], np.int64), np.array(1, np.int64))
    names = ("x", "y", "sizes", "at")
    want = ReferenceEvaluator(proto).run(None, dict(zip(names, inputs, strict=True)))
    if isinstance(want[-1], list):  # the reference's OptionalGetElement keeps a list
        want[-1] = want[-1][0]
    model = xconv.load(proto)
    out = xconv.to_flax(model, tmp_path / "flax", example_inputs=inputs)
    module, variables = _load_generated(out / "model.py").load(out)
    flax_out = module.apply(variables, *inputs)
    source, state = xconv.to_torch_source(model, example_inputs=inputs)
    ns: dict = {"__name__": "generated_torch_source"}
    exec(compile(source, "<generated>", "exec"), ns)  # noqa: S102
    generated = ns["Model"]().eval()
    generated.load_state_dict(state)
    with torch.no_grad():
        torch_out = generated(*(torch.as_tensor(v) for v in inputs))
    for got in (flax_out, torch_out):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6)
    with pytest.raises(ValueError, match="SplitToSequence split is computed at run time"):
        jax.jit(module.apply)(variables, *inputs)
