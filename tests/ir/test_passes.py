"""Canonicalisation passes: each on a small hand-built graph, numbers kept before/after."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

from xconv.ir.layers import mark_layer, mark_weight
from xconv.ir.passes import (
    ConstantFoldingPass,
    DeadNodeRemovalPass,
    NoOpEliminationPass,
    ShapeFoldingPass,
    TransposeCancellationPass,
    canonicalize,
)


def make(nodes, inputs, outputs, inits=()) -> ir.Model:
    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    return ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 23)]))


def run(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    proto = ir.to_proto(model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def clone(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def vi(name, shape, dtype=T.FLOAT):
    return h.make_tensor_value_info(name, dtype, shape)


def i64(name, values):
    return h.make_tensor(name, T.INT64, [len(values)], values)


def flatten_chain(batch):
    """The exporter's flatten: Shape -> Gather -> Concat -> Reshape."""
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        h.make_node("Concat", ["n", "minus1"], ["shape"], axis=0),
        h.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    return make(
        nodes, [vi("x", [batch, 3, 4])], [vi("y", None)], [i64("zero", [0]), i64("minus1", [-1])]
    )


def test_shape_chain_folds_to_literal_reshape():
    model = flatten_chain(2)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    before = run(clone(model), {"x": x})
    canonicalize(model)
    assert ops(model) == ["Constant", "Reshape"]
    shape = model.graph.node(0).outputs[0].const_value.numpy()
    np.testing.assert_array_equal(shape, [2, -1])
    np.testing.assert_array_equal(run(model, {"x": x})[0], before[0])


def test_symbolic_batch_stays_symbolic():
    model = flatten_chain("N")
    canonicalize(model)
    # Reshape(x, Concat(Shape(x)[0], -1)) becomes Reshape(x, [0, -1]): 0 copies the batch.
    assert ops(model) == ["Constant", "Reshape"]
    np.testing.assert_array_equal(model.graph.node(0).outputs[0].const_value.numpy(), [0, -1])
    x = np.ones((5, 3, 4), np.float32)
    assert run(model, {"x": x})[0].shape == (5, 12)


def test_scalar_gather_unsqueeze_chain_becomes_literal():
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        h.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        h.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
        h.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    zero = h.make_tensor("zero", T.INT64, [], [0])
    model = make(
        nodes,
        [vi("x", ["N", 3, 4])],
        [vi("y", None)],
        [zero, i64("axes0", [0]), i64("minus1", [-1])],
    )
    canonicalize(model)
    assert ops(model) == ["Constant", "Reshape"]
    assert run(model, {"x": np.ones((2, 3, 4), np.float32)})[0].shape == (2, 12)


def test_batch_read_from_the_input_folds_every_later_reshape():
    """How torch.onnx writes a multi-head split under a dynamic batch: the batch read once
    from the graph input (Shape, Squeeze, Reshape to [-1]), ``allowzero=1``, and a computed
    batch x heads: the head split keeps the batch (0, the same symbol) and the merged one
    infers it (-1); the numbers are unchanged at other batches."""
    nodes = [
        h.make_node("Shape", ["x"], ["s"], start=0, end=1),
        h.make_node("Squeeze", ["s"], ["n"]),
        h.make_node("Reshape", ["n", "minus1"], ["n1"]),
        h.make_node("Relu", ["x"], ["r"]),
        h.make_node("Concat", ["n1", "seq", "heads", "dim"], ["split"], axis=0),
        h.make_node("Reshape", ["r", "split"], ["q"], allowzero=1),
        h.make_node("Mul", ["n", "four"], ["nh"]),
        h.make_node("Reshape", ["nh", "minus1"], ["nh1"]),
        h.make_node("Concat", ["nh1", "seq", "dim"], ["merged"], axis=0),
        h.make_node("Reshape", ["q", "merged"], ["y"], allowzero=1),
    ]
    four = h.make_tensor("four", T.INT64, [], [4])
    inits = [i64("minus1", [-1]), i64("seq", [3]), i64("heads", [4]), i64("dim", [2]), four]
    model = make(nodes, [vi("x", ["N", 3, 8])], [vi("y", None)], inits)
    x = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8) - 20
    before = run(clone(model), {"x": x})[0]
    canonicalize(model)
    assert ops(model).count("Reshape") == 2 and "Shape" not in ops(model), ops(model)
    shapes = [
        n.inputs[1].const_value.numpy().tolist() for n in model.graph if n.op_type == "Reshape"
    ]
    assert shapes == [[0, 3, 4, 2], [-1, 3, 2]], shapes
    np.testing.assert_array_equal(run(clone(model), {"x": x})[0], before)
    x5 = np.ones((5, 3, 8), np.float32)
    assert run(model, {"x": x5})[0].shape == (20, 3, 2)


def test_gather_of_static_dim_folds_with_symbolic_batch():
    nodes = [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "one"], ["c"], axis=0),
        h.make_node("Concat", ["minus1", "c"], ["shape"], axis=0),
        h.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    model = make(
        nodes, [vi("x", ["N", 3, 4])], [vi("y", None)], [i64("one", [1]), i64("minus1", [-1])]
    )
    ShapeFoldingPass()(model)
    ConstantFoldingPass()(model)
    DeadNodeRemovalPass()(model)
    assert ops(model) == ["Constant", "Reshape"]
    assert run(model, {"x": np.ones((2, 3, 4), np.float32)})[0].shape == (8, 3)


def test_constant_folding_keeps_weights():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [
        h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),  # reads a weight: kept
        h.make_node("Add", ["c1", "c2"], ["c3"]),  # constants only: folded
        h.make_node("MatMul", ["x", "wt"], ["m"]),
        h.make_node("Add", ["m", "c3"], ["y"]),
    ]
    inits = [
        h.make_tensor("w", T.FLOAT, [2, 3], w.reshape(-1).tolist()),
        h.make_tensor("c1", T.FLOAT, [2], [1, 2]),
        h.make_tensor("c2", T.FLOAT, [2], [3, 4]),
    ]
    model = make(nodes, [vi("x", [4, 3])], [vi("y", [4, 2])], inits)
    mark_weight(model.graph.initializers["w"], "kernel", "OI")
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    before = run(clone(model), {"x": x})
    result = ConstantFoldingPass()(model)
    assert result.modified
    assert ops(model) == ["Transpose", "Constant", "MatMul", "Add"]
    assert "w" in model.graph.initializers
    DeadNodeRemovalPass()(model)
    assert "c1" not in model.graph.initializers
    np.testing.assert_allclose(run(model, {"x": x})[0], before[0], rtol=1e-6)


@pytest.mark.parametrize(
    ("node", "removed"),
    [
        (h.make_node("Identity", ["x"], ["y"]), True),
        (h.make_node("Dropout", ["x"], ["y"], seed=0), True),
        (h.make_node("Cast", ["x"], ["y"], to=T.FLOAT), True),
        (h.make_node("Cast", ["x"], ["y"], to=T.DOUBLE), False),
        (h.make_node("Reshape", ["x", "same"], ["y"]), True),
        (h.make_node("Reshape", ["x", "other"], ["y"]), False),
        (h.make_node("Expand", ["x", "ones"], ["y"]), True),
        (h.make_node("Transpose", ["x"], ["y"], perm=[0, 1, 2]), True),
    ],
)
def test_noop_elimination(node, removed):
    nodes = [
        h.make_node("Relu", ["x0"], ["x"]),
        node,
        h.make_node("Cast", ["y"], ["yf"], to=T.FLOAT),
        h.make_node("Neg", ["yf"], ["z"]),
    ]
    inits = [i64("same", [2, 0, -1]), i64("other", [2, 12]), i64("ones", [1, 4])]
    model = make(nodes, [vi("x0", [2, 3, 4])], [vi("z", None)], inits)
    from onnx_ir.passes.common import ShapeInferencePass

    ShapeInferencePass()(model)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    before = run(clone(model), {"x0": x})
    NoOpEliminationPass()(model)
    assert (node.op_type not in ops(model)) == removed
    got = run(model, {"x0": x})
    np.testing.assert_allclose(got[0].astype(np.float32), before[0].astype(np.float32))


def test_noop_elimination_keeps_marked_dropout_and_graph_io():
    nodes = [h.make_node("Dropout", ["x"], ["d"]), h.make_node("Identity", ["d"], ["y"])]
    model = make(nodes, [vi("x", [2])], [vi("y", [2])])
    mark_layer(model.graph.node(0), "dropout", rate=0.5)
    NoOpEliminationPass()(model)
    assert ops(model) == ["Dropout"]
    assert model.graph.outputs[0].name == "y"


def test_identity_to_graph_output_renames():
    nodes = [h.make_node("Relu", ["x"], ["r"]), h.make_node("Identity", ["r"], ["y"])]
    model = make(nodes, [vi("x", [3])], [vi("y", [3])])
    NoOpEliminationPass()(model)
    assert ops(model) == ["Relu"] and model.graph.outputs[0].name == "y"
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    np.testing.assert_array_equal(run(model, {"x": x})[0], [0, 0, 2])


@pytest.mark.parametrize(
    ("p", "q", "left"),
    [([0, 2, 3, 1], [0, 3, 1, 2], []), ([0, 2, 3, 1], [1, 0, 2, 3], [[2, 0, 3, 1]])],
)
def test_transpose_cancellation(p, q, left):
    nodes = [
        h.make_node("Transpose", ["x"], ["t"], perm=p),
        h.make_node("Transpose", ["t"], ["u"], perm=q),
        h.make_node("Relu", ["u"], ["y"]),
    ]
    model = make(nodes, [vi("x", [2, 3, 4, 5])], [vi("y", None)])
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    before = run(clone(model), {"x": x})
    TransposeCancellationPass()(model)
    DeadNodeRemovalPass()(model)
    perms = [list(n.attributes["perm"].value) for n in model.graph if n.op_type == "Transpose"]
    assert perms == left
    np.testing.assert_array_equal(run(model, {"x": x})[0], before[0])


def test_canonicalize_is_deterministic_and_matches_reference():
    def build():
        nodes = [
            h.make_node("Identity", ["x"], ["a"]),
            h.make_node("Shape", ["a"], ["s"]),
            h.make_node(
                "ConstantOfShape", ["s"], ["ones"], value=h.make_tensor("v", T.FLOAT, [1], [1.0])
            ),
            h.make_node("Add", ["a", "ones"], ["b"]),
            h.make_node("Transpose", ["b"], ["t1"], perm=[1, 0]),
            h.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0]),
            h.make_node("Cast", ["t2"], ["y"], to=T.FLOAT),
        ]
        return make(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])

    m1, m2 = canonicalize(build()), canonicalize(build())
    assert ir.to_proto(m1).SerializeToString() == ir.to_proto(m2).SerializeToString()
    assert ops(m1) == ["Constant", "Add"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ref = ReferenceEvaluator(ir.to_proto(build())).run(None, {"x": x})[0]
    np.testing.assert_array_equal(run(m1, {"x": x})[0], ref)


@pytest.mark.parametrize(
    "mask, kv, dropped",
    [
        (np.ones((1, 1, 3, 1), bool), 5, True),  # all True, expanded over the 5 keys
        (np.zeros((1, 1, 3, 1), np.float32), 5, True),  # a zero bias
        (np.array([True, True, False]).reshape(1, 1, 3, 1), 5, False),  # masks a query row
        (np.ones((1, 1, 3, 1), bool), 4, False),  # over 4 of 5 keys: the 5th is masked
    ],
)
def test_attention_mask_that_masks_nothing_is_dropped(mask, kv, dropped):
    """How exporters write the mask of an input without padding: a constant expanded to
    (B, 1, Sq, Skv); dropped only where it masks no key of any query."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((2, 2, 5, 4)).astype(np.float32)
    v = rng.standard_normal((2, 2, 5, 4)).astype(np.float32)
    dtype = T.BOOL if mask.dtype == np.bool_ else T.FLOAT
    const = h.make_tensor("m0", dtype, mask.shape, mask.reshape(-1).tolist())
    nodes = [
        h.make_node("Constant", [], ["m"], value=const),
        h.make_node("Expand", ["m", "shape"], ["mask"]),
        h.make_node("Attention", ["q", "k", "v", "mask"], ["y"]),
    ]
    model = make(
        nodes,
        [vi("q", [2, 2, 3, 4]), vi("k", [2, 2, 5, 4]), vi("v", [2, 2, 5, 4])],
        [vi("y", None)],
        [i64("shape", [2, 1, 3, kv])],
    )
    model.graph.node(1).outputs[0].shape = ir.Shape([2, 1, 3, kv])
    feeds = {"q": q, "k": k, "v": v}
    before = ReferenceEvaluator(ir.to_proto(clone(model))).run(None, feeds)
    canonicalize(model)
    attention = next(n for n in model.graph if n.op_type == "Attention")
    assert (len(attention.inputs) < 4 or attention.inputs[3] is None) == dropped
    got = ReferenceEvaluator(ir.to_proto(model)).run(None, feeds)
    np.testing.assert_allclose(got[0], before[0], rtol=1e-6, atol=1e-6)
