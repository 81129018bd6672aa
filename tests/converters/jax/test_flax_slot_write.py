"""A ScatterElements whose indices are one vector broadcast along its axis (a cache written at
its slots) is generated as ``x.at[:, :, slots].set(updates)``: whole slices, not the
``_scatter_elements`` helper's one scalar per element. Any other index keeps the helper. Both
match ONNX's reference at two sizes of the symbolic dims."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import xconv  # noqa: E402
from xconv.pipeline import _load_generated  # noqa: E402


def _cache_write(tmp_path, broadcast: bool):
    """cache (b, 2, L, 4) with new (b, 2, n, 4) written along axis 2 at ``slots`` (n,);
    ``broadcast=False`` writes at an index that differs per row (``slots`` plus the batch
    index), which no slice form expresses."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [4], [1, 1, -1, 1])
    nodes = [
        helper.make_node("Reshape", ["slots", "shape"], ["column"]),
        helper.make_node("Shape", ["new"], ["new_shape"]),
        helper.make_node("Expand", ["column", "new_shape"], ["index"]),
    ]
    if not broadcast:
        nodes += [
            helper.make_node("Shape", ["new"], ["dims"]),
            helper.make_node("Gather", ["dims", "zero"], ["batch"], axis=0),
            helper.make_node("Range", ["zero", "batch", "one"], ["rows"]),
            helper.make_node("Reshape", ["rows", "row_shape"], ["row_column"]),
            helper.make_node("Add", ["index", "row_column"], ["shifted"]),
        ]
    nodes.append(helper.make_node("ScatterElements",
                                  ["cache", "index" if broadcast else "shifted", "new"], ["out"],
                                  axis=2))  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "cache_write",
        [
            helper.make_tensor_value_info("cache", TensorProto.FLOAT, ["b", 2, "L", 4]),
            helper.make_tensor_value_info("new", TensorProto.FLOAT, ["b", 2, "n", 4]),
            helper.make_tensor_value_info("slots", TensorProto.INT64, ["n"]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", 2, "L", 4])],
        initializer=[
            shape,
            helper.make_tensor("zero", TensorProto.INT64, [], [0]),
            helper.make_tensor("one", TensorProto.INT64, [], [1]),
            helper.make_tensor("row_shape", TensorProto.INT64, [4], [-1, 1, 1, 1]),
        ],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "write.onnx"
    onnx.save(proto, path)
    out = xconv.to_flax(xconv.load(path), tmp_path / "out")
    return proto, out


@pytest.mark.parametrize("broadcast", [True, False])
def test_slot_write_is_a_slice_update(tmp_path, broadcast):
    proto, out = _cache_write(tmp_path, broadcast)
    source = (out / "model.py").read_text()
    if broadcast:
        assert ".at[:, :, " in source and "_scatter_elements" not in source, source
    else:
        assert "_scatter_elements(" in source, source
    module, variables = _load_generated(out / "model.py").load(out)
    reference = ReferenceEvaluator(proto)
    rng = np.random.default_rng(0)
    for b, length, slots in [(2, 9, [3, 4, 5]), (3, 6, [0])]:
        cache = rng.standard_normal((b, 2, length, 4)).astype(np.float32)
        new = rng.standard_normal((b, 2, len(slots), 4)).astype(np.float32)
        feed = {"cache": cache, "new": new, "slots": np.asarray(slots, np.int64)}
        want = reference.run(None, feed)[0]
        got = module.apply(variables, cache, new, feed["slots"])
        np.testing.assert_array_equal(np.asarray(got), want)
