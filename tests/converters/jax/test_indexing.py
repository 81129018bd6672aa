"""JAX handlers for indexing ops: parity with the ONNX reference evaluator, jit and grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from onnx import numpy_helper

import xconv
from tests.converters.jax.test_shape import (
    OpCase,
    assert_close,
    build_model,
    f32,
    i64,
    jacobian_from_reference,
    reference,
    run_case,
)

I64_MAX = np.iinfo(np.int64).max
I64_MIN = np.iinfo(np.int64).min
X = f32(3, 4, 5)
I32 = np.int32


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


CASES = [
    OpCase("slice_basic", "Slice", [X], [i64(0, 1), i64(2, -1), i64(0, 2)]),
    OpCase("slice_int64_max_end", "Slice", [X], [i64(1), i64(I64_MAX), i64(1)]),
    OpCase(
        "slice_negative_step_int64_min",
        "Slice",
        [X],
        [i64(-1, 3), i64(I64_MIN, 0), i64(2, 1), i64(-2, -1)],
    ),
    OpCase("slice_default_axes_step", "Slice", [X], [i64(1, 0, 1), i64(3, 4, 100)]),
    OpCase(
        "slice_attrs_opset1",
        "Slice",
        [X],
        attrs={"starts": [1, -3], "ends": [1000, -1], "axes": [0, 2]},
        opset=1,
    ),
    OpCase("gather_negative_runtime_indices", "Gather", [X, i32(-1, 0, -3)], attrs={"axis": 1}),
    OpCase(
        "gather_const_indices_2d", "Gather", [X], [i64(-1, 2, 0, 1).reshape(2, 2)], {"axis": -1}
    ),
    OpCase("gather_scalar_index", "Gather", [X], [np.int64(-2)]),
    # Indices smaller than the data in other axes: the reference evaluator refuses them.
    OpCase(
        "gather_elements_smaller_index",
        "GatherElements",
        [X, np.array([[[1, -1]], [[0, 2]]], I32)],
        attrs={"axis": 1},
        oracle="onnxruntime",
    ),
    OpCase("gather_nd", "GatherND", [X, i32(0, -1, 1, 2).reshape(2, 2)]),
    OpCase(
        "gather_nd_batch_dims",
        "GatherND",
        [X, i32(1, 3, 0, 2, 1, -1).reshape(3, 2, 1)],
        attrs={"batch_dims": 1},
    ),
    OpCase(
        "scatter_elements_add",
        "ScatterElements",
        [X, np.array([[[1, 1, 0]]], I32), f32(1, 1, 3)],
        attrs={"axis": 1, "reduction": "add"},
    ),
    OpCase(
        "scatter_elements_neg_axis_min",
        "ScatterElements",
        [X, np.array([[[4, -1], [0, 0]]], I32), f32(1, 2, 2)],
        attrs={"axis": -1, "reduction": "min"},
    ),
    OpCase(
        "scatter_elements_none",
        "ScatterElements",
        [X, np.array([[[2], [-3]]], I32), f32(1, 2, 1)],
        attrs={"axis": 0},
    ),
    OpCase(
        "scatter_deprecated_opset9",
        "Scatter",
        [X, np.array([[[1, 0]]], I32), f32(1, 1, 2)],
        attrs={"axis": 2},
        opset=9,
        oracle="onnxruntime",
    ),
    OpCase("scatter_nd_none", "ScatterND", [X, i32(1, -1).reshape(2, 1), f32(2, 4, 5)]),
    OpCase(
        "scatter_nd_mul",
        "ScatterND",
        [X, i32(0, 1, 0, 1, 2, 3).reshape(3, 2), f32(3, 5)],
        attrs={"reduction": "mul"},
    ),
    OpCase(
        "scatter_nd_max",
        "ScatterND",
        [X, i32(0, 1, 2, 2, 3, 4).reshape(2, 3), f32(2)],
        attrs={"reduction": "max"},
    ),
    OpCase(
        "one_hot_axis0_negative",
        "OneHot",
        [i32(1, -1, 5, 0)],
        [np.float32(4), np.array([-2, 3], np.float32)],
        {"axis": 0},
    ),
    # The spec casts non-integer indices to int64 (the reference evaluator does not).
    OpCase(
        "one_hot_float_indices",
        "OneHot",
        [np.array([[1.0, 2.7], [0, 3]], np.float32)],
        [np.float32(4), np.array([0, 1], np.float32)],
        oracle="onnxruntime",
    ),
    OpCase("compress_axis", "Compress", [X], [np.array([True, False, True])], {"axis": 0}),
    OpCase(
        "compress_flat_short_condition",
        "Compress",
        [X],
        [np.array([False, True, True, False, True])],
    ),
    OpCase("non_zero", "NonZero", [np.array([[0, 1, 0], [2, 0, 3]], np.float32)]),
    OpCase("unique_sorted", "Unique", [np.array([2, 1, 1, 3, 4, 3], np.float32)], n_out=4),
    OpCase(
        "unique_unsorted",
        "Unique",
        [np.array([2, 1, 1, 3, 4, 3], np.float32)],
        attrs={"sorted": 0},
        n_out=4,
    ),
    OpCase(
        "unique_axis",
        "Unique",
        [np.array([[1, 0], [1, 0], [2, 3], [1, 0]], np.float32)],
        attrs={"axis": 0},
        n_out=4,
    ),
    OpCase("reverse_sequence_time0", "ReverseSequence", [f32(4, 3, 2), i32(4, 1, 2)]),
    OpCase(
        "reverse_sequence_batch0",
        "ReverseSequence",
        [f32(3, 4), i32(1, 4, 3)],
        attrs={"batch_axis": 0, "time_axis": 1},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: OpCase) -> None:
    run_case(case)


JIT_CASES = [
    c
    for c in CASES
    if c.op
    in {
        "Slice",
        "Gather",
        "GatherElements",
        "GatherND",
        "ScatterElements",
        "ScatterND",
        "OneHot",
        "ReverseSequence",
    }
]


@pytest.mark.parametrize("case", JIT_CASES, ids=lambda c: c.name)
def test_under_jit(case: OpCase) -> None:
    # x64 stays off: INT64_MAX/MIN slice ends are clamped with numpy before JAX sees them.
    assert not jax.config.jax_enable_x64
    model = build_model(case)
    expected = reference(model, case.data, case.oracle)[0]
    fn, params = xconv.to_jax(xconv.load(model))
    y = jax.jit(lambda *xs: fn(params, *xs)[0])(*(jnp.asarray(x) for x in case.data))
    assert_close(y, expected, case.rtol, case.atol)


def test_gather_grad_accumulates_repeated_indices() -> None:
    case = OpCase("gather", "Gather", [X], [i64(-1, 0, -1)], {"axis": 1})
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    g = jax.jit(jax.grad(lambda x: jnp.sum(fn(params, x)[0])))(jnp.asarray(X))
    expected = np.zeros_like(X)
    expected[:, 0] = 1
    expected[:, 3] = 2
    np.testing.assert_array_equal(np.asarray(g), expected)


def test_gather_of_one_constant_index_is_a_slice_and_its_grad_a_pad() -> None:
    """How exporters split packed q, k, v: its gradient pads, no scatter-add (which XLA:CPU
    runs as an unvectorised map)."""
    case = OpCase("gather", "Gather", [X], [np.int64(-2)], {"axis": 1})
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    x = jnp.asarray(X)
    np.testing.assert_array_equal(np.asarray(fn(params, x)[0]), X[:, -2])
    grad = jax.grad(lambda v: jnp.sum(fn(params, v)[0] * 3))
    jaxpr = str(jax.make_jaxpr(grad)(x))
    assert "scatter" not in jaxpr and "gather" not in jaxpr, jaxpr
    expected = np.zeros_like(X)
    expected[:, -2] = 3
    np.testing.assert_array_equal(np.asarray(jax.jit(grad)(x)), expected)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gather_from_a_few_rows_selects_and_its_grad_sums_per_row(dtype) -> None:
    """A token-type table (at most 8 rows): exact values, and a gradient without the
    scatter-add a take's would be (a bfloat16 scatter-add of many positions into 2 rows was
    most of a BERT-base training step on a GPU)."""
    table = np.random.default_rng(0).standard_normal((2, 2, 6)).astype(dtype)
    ids = np.array([[0, 1, -1], [1, 0, 0]], np.int32)
    case = OpCase("gather", "Gather", [table, ids], attrs={"axis": 1})
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    got = jax.jit(lambda t, i: fn(params, t, i)[0])(jnp.asarray(table), jnp.asarray(ids))
    assert got.dtype == table.dtype
    np.testing.assert_array_equal(np.asarray(got), np.take(table, ids % 2, axis=1))
    w = np.random.default_rng(1).standard_normal(got.shape).astype(np.float32)
    loss = lambda t: jnp.sum(fn(params, t, jnp.asarray(ids))[0].astype(jnp.float32) * w)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(jnp.asarray(table)))
    assert "scatter" not in jaxpr, jaxpr
    expected = np.zeros(table.shape, np.float32)
    np.add.at(expected, (slice(None), ids.reshape(-1) % 2), w.reshape(2, -1, 6))
    got_grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(table)), np.float32)
    np.testing.assert_allclose(got_grad, expected, rtol=2e-2 if dtype != np.float32 else 1e-6)


def test_gather_along_a_symbolic_axis_takes() -> None:
    """jax.export with a symbolic batch: the row count of the gathered axis is unknown, so
    it is taken (a comparison of it with the select bound would be inconclusive)."""
    from jax import export

    case = OpCase(
        "gather", "Gather", [f32(5, 4), np.array([0, 4, -1], np.int32)], attrs={"axis": 0}
    )
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    (b,) = export.symbolic_shape("b")
    exported = export.export(jax.jit(lambda x, i: fn(params, x, i)[0]))(
        jax.ShapeDtypeStruct((b, 4), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)
    )
    x = f32(6, 4)
    got = exported.call(x, np.array([0, 4, -1], np.int32))
    np.testing.assert_array_equal(np.asarray(got), x[[0, 4, 5]])


def test_gather_from_a_large_table_takes() -> None:
    table, ids = f32(9, 3), np.array([8, -9, 4], np.int32)
    case = OpCase("gather", "Gather", [table, ids], attrs={"axis": 0})
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    loss = lambda t: jnp.sum(fn(params, t, jnp.asarray(ids))[0])  # noqa: E731
    assert "scatter" in str(jax.make_jaxpr(jax.grad(loss))(jnp.asarray(table)))
    np.testing.assert_array_equal(
        np.asarray(fn(params, jnp.asarray(table), jnp.asarray(ids))[0]), table[[8, 0, 4]]
    )


def test_slice_negative_step_grad() -> None:
    case = OpCase("slice", "Slice", [X], [i64(-1), i64(I64_MIN), i64(2), i64(-2)])
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    w = f32(3, 4, 3)
    g = jax.grad(lambda x: jnp.sum(fn(params, x)[0] * w))(jnp.asarray(X))
    expected = np.zeros_like(X)
    expected[:, :, ::-2] = w
    np.testing.assert_allclose(np.asarray(g), expected)
    assert reference(build_model(case), [X])[0].shape == (3, 4, 3)


def test_scatter_nd_grad_flows_to_updates() -> None:
    case = OpCase(
        "scatter",
        "ScatterND",
        [X, i32(2, 0).reshape(2, 1), f32(2, 4, 5)],
        attrs={"reduction": "add"},
    )
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    idx = jnp.asarray(case.data[1])
    gx, gu = jax.grad(lambda x, u: jnp.sum(fn(params, x, idx, u)[0] ** 2), argnums=(0, 1))(
        jnp.asarray(X), jnp.asarray(case.data[2])
    )
    y = reference(build_model(case), case.data)[0]
    np.testing.assert_allclose(np.asarray(gx), 2 * y, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gu), 2 * y[[2, 0]], rtol=1e-5)


def test_constant_one_hot_depth_value_keeps_dtype() -> None:
    case = OpCase("onehot", "OneHot", [i32(0, 2)], [np.int64(3), np.array([0, 7], np.int32)])
    model = build_model(case)
    assert model.graph.node[0].attribute[0].t == numpy_helper.from_array(np.int64(3), "c0")
    fn, params = xconv.to_jax(xconv.load(model))
    y = np.asarray(fn(params, jnp.asarray(case.data[0]))[0])
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, [[7, 0, 0], [0, 0, 7]])


@pytest.mark.parametrize(
    "name",
    [
        "gather_negative_runtime_indices",
        "scatter_nd_mul",
        "reverse_sequence_time0",
        "slice_negative_step_int64_min",
        "gather_nd_batch_dims",
    ],
)
def test_vmap_matches_per_example(name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    model = build_model(case)
    fn, params = xconv.to_jax(xconv.load(model))
    batch = np.stack([case.data[0], 2 * case.data[0] + 1])
    rest = [jnp.asarray(x) for x in case.data[1:]]
    y = jax.vmap(lambda x: fn(params, x, *rest)[0])(jnp.asarray(batch))
    for i in range(2):
        expected = reference(model, [batch[i], *case.data[1:]], case.oracle)[0]
        assert_close(y[i], expected, 1e-5, 1e-5)


@pytest.mark.parametrize(
    ("op", "data", "consts", "attrs", "match"),
    [
        (
            "ScatterND",
            [X, i32(0).reshape(1, 1), f32(1, 4, 5)],
            [],
            {"reduction": "avg"},
            "reduction 'avg' not supported",
        ),
        (
            "Pad",
            [X],
            [i64(0, 0, 1, 0, 0, 1)],
            {"mode": "symmetric"},
            "mode 'symmetric' not supported",
        ),
        (
            "Resize",
            [X],
            [None, np.array([1, 1, 2], np.float32)],
            {"mode": "area"},
            "mode 'area' not supported",
        ),
    ],
)
def test_unsupported_attribute_values_are_named(op, data, consts, attrs, match) -> None:
    model = build_model(OpCase("bad", op, data, consts, attrs))
    fn, params = xconv.to_jax(xconv.load(model))
    with pytest.raises(xconv.UnsupportedAttributeError, match=match):
        fn(params, *(jnp.asarray(x) for x in data))


GRAD_CASES = [
    c
    for c in CASES
    if c.name
    in {
        "slice_basic",
        "slice_negative_step_int64_min",
        "gather_negative_runtime_indices",
        "gather_elements_smaller_index",
        "gather_nd_batch_dims",
        "scatter_elements_add",
        "scatter_nd_none",
        "compress_axis",
        "reverse_sequence_batch0",
    }
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
def test_grad_matches_reference_jacobian(case: OpCase) -> None:
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    jac = jacobian_from_reference(case)
    cot = np.random.default_rng(1).standard_normal(jac.shape[0]).astype(np.float32)
    rest = [jnp.asarray(v) for v in case.data[1:]]

    def loss(x):
        return jnp.sum(fn(params, x, *rest)[0].ravel() * cot)

    g = jax.jit(jax.grad(loss))(jnp.asarray(case.data[0]))
    np.testing.assert_allclose(np.asarray(g).ravel(), jac.T @ cot, rtol=1e-4, atol=1e-5)
