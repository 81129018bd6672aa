"""Torch backend shape and indexing handlers against ONNX's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest

from tests.converters.torch_backend.test_math import OpCase, check_case, f32, grad_check, ints

I64 = np.int64
X = f32(2, 3, 4)
IMG = f32(1, 2, 4, 5)


def i64(*v):
    return np.array(v, dtype=I64)


CASES = [
    OpCase("reshape_infer", "Reshape", [X], consts={1: i64(0, -1)}),
    OpCase("flatten", "Flatten", [X], attrs={"axis": 2}),
    OpCase("squeeze", "Squeeze", [f32(2, 1, 3)], consts={1: i64(1)}),
    OpCase("unsqueeze", "Unsqueeze", [X], consts={1: i64(0, -1)}),
    OpCase("transpose", "Transpose", [X], attrs={"perm": [2, 0, 1]}),
    OpCase("concat", "Concat", [X, f32(2, 3, 2)], attrs={"axis": -1}),
    OpCase("split", "Split", [X], attrs={"axis": 2, "num_outputs": 2}, n_out=2),
    OpCase("expand", "Expand", [f32(3, 1)], consts={1: i64(2, 3, 4)}),
    OpCase("tile", "Tile", [f32(2, 3)], consts={1: i64(2, 1)}),
    OpCase(
        "pad_reflect",
        "Pad",
        [IMG],
        attrs={"mode": "reflect"},
        consts={1: i64(0, 0, 1, 2, 0, 0, 2, 1)},
    ),  # fmt: skip
    OpCase(
        "pad_wrap", "Pad", [IMG], attrs={"mode": "wrap"}, consts={1: i64(0, 0, 1, 3, 0, 0, 2, 2)}
    ),  # fmt: skip
    OpCase(
        "pad_edge", "Pad", [IMG], attrs={"mode": "edge"}, consts={1: i64(0, 0, 1, 1, 0, 0, 1, 1)}
    ),  # fmt: skip
    OpCase(
        "pad_constant_axes",
        "Pad",
        [IMG],
        consts={1: i64(1, 2), 2: np.array(1.5, np.float32), 3: i64(-1)},
    ),  # fmt: skip
    OpCase("trilu", "Trilu", [f32(4, 5)], attrs={"upper": 0}, consts={1: i64(1)}),
    OpCase(
        "depth_to_space_crd",
        "DepthToSpace",
        [f32(1, 8, 2, 3)],
        attrs={"blocksize": 2, "mode": "CRD"},
    ),  # fmt: skip
    OpCase("space_to_depth", "SpaceToDepth", [f32(1, 2, 4, 6)], attrs={"blocksize": 2}),
    OpCase(
        "resize_cubic",
        "Resize",
        [IMG],
        attrs={"mode": "cubic"},
        consts={1: np.array([], np.float32), 2: np.array([1, 1, 1.5, 0.6], np.float32)},
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
    OpCase(
        "resize_linear_align",
        "Resize",
        [IMG],
        attrs={"mode": "linear", "coordinate_transformation_mode": "align_corners"},
        consts={1: np.array([], np.float32), 2: np.array([], np.float32), 3: i64(1, 2, 7, 3)},
        rtol=1e-4,
        atol=1e-5,
    ),  # fmt: skip
    OpCase(
        "resize_nearest_ceil",
        "Resize",
        [IMG],
        attrs={"nearest_mode": "ceil", "coordinate_transformation_mode": "asymmetric"},
        consts={1: np.array([], np.float32), 2: np.array([1, 1, 2.0, 1.5], np.float32)},
    ),
    OpCase(
        "slice_negative_step",
        "Slice",
        [X],
        consts={1: i64(-1, 3), 2: i64(-100, 0), 3: i64(2, 1), 4: i64(-1, -2)},
    ),  # fmt: skip
    OpCase("gather", "Gather", [X, np.array([[0, -1], [1, 0]], I64)], attrs={"axis": 1}),
    OpCase(
        "gather_elements",
        "GatherElements",
        [f32(3, 3), np.array([[0, -1], [2, 1], [1, 1]], I64)],
        attrs={"axis": 1},
    ),  # fmt: skip
    OpCase(
        "gather_nd_batch",
        "GatherND",
        [X, np.array([[[1], [0]], [[2], [1]]], I64)],
        attrs={"batch_dims": 1},
    ),  # fmt: skip
    OpCase(
        "scatter_elements_mul",
        "ScatterElements",
        [f32(3, 3), np.array([[1, 1], [0, 0]], I64), f32(2, 2)],
        attrs={"axis": 1, "reduction": "mul"},
    ),  # fmt: skip
    OpCase(
        "scatter_nd_add_duplicates",
        "ScatterND",
        [f32(4, 3), np.array([[1], [1], [3]], I64), f32(3, 3)],
        attrs={"reduction": "add"},
    ),  # fmt: skip
    OpCase(
        "scatter_nd_max",
        "ScatterND",
        [f32(4, 3), np.array([[1, 2], [1, 2]], I64), f32(2)],
        attrs={"reduction": "max"},
    ),  # fmt: skip
    OpCase(
        "one_hot",
        "OneHot",
        [np.array([0, -1, 2], I64)],
        consts={1: np.array(4, I64), 2: np.array([0, 5], np.float32)},
        attrs={"axis": 0},
    ),  # fmt: skip
    OpCase("compress", "Compress", [X], consts={1: np.array([1, 0, 1], bool)}, attrs={"axis": 1}),
    OpCase("nonzero", "NonZero", [ints(3, 4, lo=0, hi=2)]),
    OpCase(
        "unique_unsorted",
        "Unique",
        [np.array([3, 1, 3, 2, 1], np.float32)],
        attrs={"sorted": 0},
        n_out=4,
    ),  # fmt: skip
    OpCase(
        "reverse_sequence",
        "ReverseSequence",
        [f32(4, 3), np.array([4, 2, 1], I64)],
        attrs={"batch_axis": 1, "time_axis": 0},
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    check_case(case)


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.name in ("pad_reflect", "resize_cubic", "transpose", "concat")],
    ids=lambda c: c.name,
)
def test_gradients(case: OpCase) -> None:
    grad_check(case)


@pytest.mark.parametrize(
    "start, limit, delta",
    [(1, 5, 2), (0.5, 3.0, 0.25), (10, -3, -1.5), (-2.0, 7.0, 0.3)],
)
def test_range_bfloat16_run_time_inputs(start, limit, delta) -> None:
    """Range-27 of bfloat16 graph inputs (read back to numpy through ml_dtypes), accumulated
    in float as the reference does, against the reference's values."""
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    import xconv
    from xconv.converters.torch.runtime.dtypes import to_numpy, to_tensor

    names = ("start", "limit", "delta")
    bf16 = TensorProto.BFLOAT16
    graph = helper.make_graph(
        [helper.make_node("Range", list(names), ["y"])],
        "range",
        [helper.make_tensor_value_info(n, bf16, []) for n in names],
        [helper.make_value_info("y", onnx.TypeProto())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)])
    values = (start, limit, delta)
    feeds = {n: np.array(v, ml_dtypes.bfloat16) for n, v in zip(names, values, strict=True)}
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    module, _ = xconv.to_torch(xconv.load(model))
    got = to_numpy(module(*(to_tensor(x) for x in feeds.values())))
    assert got.dtype == expected.dtype == ml_dtypes.bfloat16
    assert len(expected) > 1
    np.testing.assert_array_equal(got.astype(np.float32), expected.astype(np.float32))
