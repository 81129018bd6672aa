"""JAX handlers for control flow (If, Loop, Scan) and sequences/optionals.

Each case compares ``xconv.to_jax`` with the ONNX reference evaluator, eagerly (the steering
values are concrete: the handlers run in Python) and under ``jax.jit`` (traced: lax.cond,
lax.while_loop, lax.scan).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv
from xconv.errors import ConversionError

F = TensorProto.FLOAT
I64 = TensorProto.INT64
B = TensorProto.BOOL
RNG = np.random.default_rng(0)


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def const(name, value):
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.asarray(value))
    )


def model(nodes, inputs, outputs, opset=23):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def reference(m, feeds):
    return ReferenceEvaluator(m).run(None, feeds)


def convert(m):
    return xconv.to_jax(xconv.load(m))


def check(actual, expected, rtol=1e-5, atol=1e-6):
    if isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            check(a, e, rtol, atol)
        return
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)
    assert np.asarray(actual).shape == np.asarray(expected).shape


# ----------------------------------------------------------------------------------- If


def if_model(then_shape=(3,)):
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["x", "x"], ["t"])]
        if then_shape == (3,)
        else [helper.make_node("Concat", ["x", "x"], ["t"], axis=0)],
        "then",
        [],
        [vi("t", F, None)],
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [], [vi("e", F, None)]
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)
    return model([node], [vi("c", B, []), vi("x", F, [3])], [vi("y", F, None)])


@pytest.mark.parametrize("cond", [True, False])
def test_if_eager_and_jit(cond):
    m = if_model()
    x = RNG.standard_normal(3).astype(np.float32)
    c = np.array(cond)
    (expected,) = reference(m, {"c": c, "x": x})
    fn, params = convert(m)
    check(fn(params, jnp.asarray(c), jnp.asarray(x))[0], expected)
    jitted = jax.jit(fn)
    check(jitted(params, jnp.asarray(c), jnp.asarray(x))[0], expected)


def test_if_branches_of_different_shapes():
    m = if_model(then_shape=(6,))
    x = RNG.standard_normal(3).astype(np.float32)
    fn, params = convert(m)
    (expected,) = reference(m, {"c": np.array(True), "x": x})
    # Concrete condition: the branch runs in Python, shapes may differ.
    check(fn(params, jnp.asarray(True), jnp.asarray(x))[0], expected)
    with pytest.raises(ConversionError, match="same shapes"):
        jax.jit(fn)(params, jnp.asarray(True), jnp.asarray(x))


def test_if_grad_under_jit():
    m = if_model()
    fn, params = convert(m)
    x = jnp.asarray([1.0, 2.0, 3.0])
    grad = jax.jit(jax.grad(lambda x, c: fn(params, c, x)[0].sum()))
    np.testing.assert_allclose(grad(x, jnp.asarray(True)), 2 * np.asarray(x))
    np.testing.assert_allclose(grad(x, jnp.asarray(False)), -np.ones(3))


# --------------------------------------------------------------------------------- Loop


def for_loop_model(with_scan=True, m_input=False):
    """acc += x * i for i in range(M); scan output: acc at each step."""
    body_nodes = [
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["x", "fi"], ["xi"]),
        helper.make_node("Add", ["acc_in", "xi"], ["acc_out"]),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
    ]
    outs = [vi("cond_out", B, []), vi("acc_out", F, [3])]
    if with_scan:
        body_nodes.append(helper.make_node("Identity", ["acc_out"], ["acc_scan"]))
        outs.append(vi("acc_scan", F, [3]))
    body = helper.make_graph(
        body_nodes, "body", [vi("i", I64, []), vi("cond_in", B, []), vi("acc_in", F, [3])], outs
    )
    nodes = [const("cond", np.array(True)), const("acc0", np.zeros(3, np.float32))]
    inputs = [vi("x", F, [3])]
    if m_input:
        inputs.append(vi("M", I64, []))
    else:
        nodes.append(const("M", np.array(5, np.int64)))
    loop_outs = ["acc", "accs"] if with_scan else ["acc"]
    nodes.append(helper.make_node("Loop", ["M", "cond", "acc0"], loop_outs, body=body))
    outputs = [vi("acc", F, [3])] + ([vi("accs", F, [5, 3])] if with_scan else [])
    return model(nodes, inputs, outputs)


def test_loop_with_scan_outputs_eager_and_jit():
    m = for_loop_model()
    x = RNG.standard_normal(3).astype(np.float32)
    expected = reference(m, {"x": x})
    fn, params = convert(m)
    for out, e in zip(fn(params, jnp.asarray(x)), expected, strict=True):
        check(out, e)
    for out, e in zip(jax.jit(fn)(params, jnp.asarray(x)), expected, strict=True):
        check(out, e)
    # Differentiable through lax.scan: d/dx sum(acc) = sum(range(5)) = 10.
    g = jax.jit(jax.grad(lambda x: fn(params, x)[0].sum()))(jnp.asarray(x))
    np.testing.assert_allclose(g, np.full(3, 10.0))


def test_loop_traced_trip_count():
    m = for_loop_model(with_scan=False, m_input=True)
    x = RNG.standard_normal(3).astype(np.float32)
    fn, params = convert(m)
    jitted = jax.jit(fn)
    for trips in (0, 1, 4):
        (expected,) = reference(m, {"x": x, "M": np.array(trips, np.int64)})
        check(jitted(params, jnp.asarray(x), jnp.asarray(trips))[0], expected)
        check(fn(params, jnp.asarray(x), jnp.asarray(trips))[0], expected)


def test_loop_scan_outputs_with_traced_trip_count_is_a_clear_error():
    m = for_loop_model(with_scan=True, m_input=True)
    fn, params = convert(m)
    with pytest.raises(ConversionError, match="constant trip count"):
        jax.jit(fn)(params, jnp.ones(3), jnp.asarray(5))


def while_model(trip_limit=None):
    """while (sum(v) < limit): v = v * 2  -- a data-dependent condition, no trip count."""
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["v_in", "two"], ["v_out"]),
            helper.make_node("ReduceSum", ["v_out"], ["s"], keepdims=0),
            helper.make_node("Less", ["s", "limit"], ["cond_out"]),
        ],
        "body",
        [vi("i", I64, []), vi("cond_in", B, []), vi("v_in", F, [2])],
        [vi("cond_out", B, []), vi("v_out", F, [2])],
    )
    nodes = [
        const("two", np.array(2.0, np.float32)),
        const("true", np.array(True)),
        const("M", np.array(trip_limit or 0, np.int64)),
        helper.make_node("Loop", ["M" if trip_limit else "", "true", "v"], ["v_final"], body=body),
    ]
    return model(nodes, [vi("v", F, [2]), vi("limit", F, [])], [vi("v_final", F, [2])])


@pytest.mark.parametrize("trip_limit", [None, np.iinfo(np.int64).max], ids=["no_M", "int64_max"])
def test_loop_while_condition_under_jit(trip_limit):
    m = while_model(trip_limit)
    fn, params = convert(m)
    for v, limit in (([1.0, 0.5], 20.0), ([3.0, 4.0], 1.0)):
        v, limit = np.asarray(v, np.float32), np.asarray(limit, np.float32)
        (expected,) = reference(m, {"v": v, "limit": limit})
        check(fn(params, jnp.asarray(v), jnp.asarray(limit))[0], expected)
        check(jax.jit(fn)(params, jnp.asarray(v), jnp.asarray(limit))[0], expected)


def test_loop_building_a_sequence():
    body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["fi"], to=F),
            helper.make_node("Mul", ["x", "fi"], ["xi"]),
            helper.make_node("SequenceInsert", ["seq_in", "xi"], ["seq_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            vi("i", I64, []),
            vi("cond_in", B, []),
            helper.make_tensor_sequence_value_info("seq_in", F, None),
        ],
        [vi("cond_out", B, []), helper.make_tensor_sequence_value_info("seq_out", F, None)],
    )
    nodes = [
        const("M", np.array(3, np.int64)),
        const("cond", np.array(True)),
        helper.make_node("SequenceEmpty", [], ["empty"], dtype=F),
        helper.make_node("Loop", ["M", "cond", "empty"], ["seq"], body=body),
        helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0, new_axis=1),
    ]
    m = model(nodes, [vi("x", F, [2])], [vi("y", F, [3, 2])])
    x = RNG.standard_normal(2).astype(np.float32)
    (expected,) = reference(m, {"x": x})
    fn, params = convert(m)
    check(fn(params, jnp.asarray(x))[0], expected)
    # The trip count is constant, so the loop unrolls in Python even under jit.
    check(jax.jit(fn)(params, jnp.asarray(x))[0], expected)


def test_loop_with_growing_carried_value_unrolls_under_jit():
    body = helper.make_graph(
        [
            helper.make_node("Concat", ["acc_in", "x"], ["acc_out"], axis=0),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [vi("i", I64, []), vi("cond_in", B, []), vi("acc_in", F, None)],
        [vi("cond_out", B, []), vi("acc_out", F, None)],
    )
    nodes = [
        const("M", np.array(3, np.int64)),
        const("cond", np.array(True)),
        helper.make_node("Loop", ["M", "cond", "x"], ["y"], body=body),
    ]
    m = model(nodes, [vi("x", F, [2])], [vi("y", F, None)])
    x = RNG.standard_normal(2).astype(np.float32)
    (expected,) = reference(m, {"x": x})
    fn, params = convert(m)
    check(jax.jit(fn)(params, jnp.asarray(x))[0], expected)
    assert expected.shape == (8,)


# --------------------------------------------------------------------------------- Scan


def scan_model(**attrs):
    """Running sum and product over the scan axis; scan output = running sum."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Mul", ["p_in", "x_t"], ["p_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ],
        "body",
        [vi("s_in", F, [2]), vi("p_in", F, [2]), vi("x_t", F, [2])],
        [vi("s_out", F, [2]), vi("p_out", F, [2]), vi("y_t", F, [2])],
    )
    node = helper.make_node(
        "Scan", ["s0", "p0", "x"], ["s", "p", "y"], body=body, num_scan_inputs=1, **attrs
    )
    x_shape = [2, 4] if attrs.get("scan_input_axes") == [1] else [4, 2]
    return model(
        [node],
        [vi("s0", F, [2]), vi("p0", F, [2]), vi("x", F, x_shape)],
        [vi("s", F, [2]), vi("p", F, [2]), vi("y", F, [4, 2] if x_shape == [4, 2] else [2, 4])],
    )


@pytest.mark.parametrize(
    "attrs",
    [
        {},
        {"scan_input_directions": [1]},
        {"scan_input_axes": [1], "scan_output_axes": [1]},
        {"scan_output_directions": [1]},
    ],
    ids=["plain", "reverse_in", "axis1", "reverse_out"],
)
def test_scan_eager_and_jit(attrs):
    m = scan_model(**attrs)
    shape = (2, 4) if attrs.get("scan_input_axes") == [1] else (4, 2)
    x = RNG.uniform(0.5, 1.5, shape).astype(np.float32)
    s0, p0 = np.zeros(2, np.float32), np.ones(2, np.float32)
    feeds = {"s0": s0, "p0": p0, "x": x}
    fn, params = convert(m)
    # The reference evaluator only implements axis 0 / forward: build the oracle in numpy.
    xs = np.moveaxis(x, attrs.get("scan_input_axes", [0])[0], 0)
    if attrs.get("scan_input_directions") == [1]:
        xs = xs[::-1]
    running = np.cumsum(xs, axis=0) + s0
    ys = running[::-1] if attrs.get("scan_output_directions") == [1] else running
    ys = np.moveaxis(ys, 0, attrs.get("scan_output_axes", [0])[0])
    expected = [running[-1], np.prod(xs, axis=0) * p0, ys]
    if not attrs:
        for e, r in zip(expected, reference(m, feeds), strict=True):
            check(e, r)
    args = [jnp.asarray(v) for v in feeds.values()]
    for out, e in zip(fn(params, *args), expected, strict=True):
        check(out, e)
    for out, e in zip(jax.jit(fn)(params, *args), expected, strict=True):
        check(out, e)


def test_scan_grad_under_jit():
    m = scan_model()
    fn, params = convert(m)
    x = jnp.asarray(RNG.uniform(0.5, 1.5, (4, 2)).astype(np.float32))
    s0, p0 = jnp.zeros(2), jnp.ones(2)
    g = jax.jit(jax.grad(lambda x: fn(params, s0, p0, x)[1].sum()))(x)
    xn = np.asarray(x)
    np.testing.assert_allclose(g, np.prod(xn, axis=0) / xn, rtol=1e-5)


def test_scan_8_batched_with_sequence_lens():
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ],
        "body",
        [vi("s_in", F, [2]), vi("x_t", F, [2])],
        [vi("s_out", F, [2]), vi("y_t", F, [2])],
    )
    node = helper.make_node("Scan", ["lens", "s0", "x"], ["s", "y"], body=body, num_scan_inputs=1)
    m = model(
        [node],
        [vi("lens", I64, [2]), vi("s0", F, [2, 2]), vi("x", F, [2, 3, 2])],
        [vi("s", F, [2, 2]), vi("y", F, [2, 3, 2])],
        opset=8,
    )
    x = RNG.standard_normal((2, 3, 2)).astype(np.float32)
    s0 = RNG.standard_normal((2, 2)).astype(np.float32)
    lens = np.array([3, 2], np.int64)
    fn, params = convert(m)
    s, y = fn(params, lens, jnp.asarray(s0), jnp.asarray(x))
    expected_y = np.zeros_like(x)
    for b in range(2):
        expected_y[b, : lens[b]] = s0[b] + np.cumsum(x[b, : lens[b]], axis=0)
    check(y, expected_y)
    check(s, np.stack([expected_y[0, 2], expected_y[1, 1]]))


# ---------------------------------------------------------------------------- Sequences


SEQ = helper.make_tensor_sequence_value_info


def seq_cases():
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    yield (
        "split_concat",
        [
            const("split", np.array([1, 3], np.int64)),
            helper.make_node("SplitToSequence", ["x", "split"], ["s"], axis=0),
            helper.make_node("SequenceLength", ["s"], ["n"]),
            helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0),
        ],
        {"x": x},
        [vi("y", F, None), vi("n", I64, None)],
    )
    yield (
        "split_nokeepdims_stack",
        [
            helper.make_node("SplitToSequence", ["x"], ["s"], axis=1, keepdims=0),
            helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=-1, new_axis=1),
        ],
        {"x": x},
        [vi("y", F, None)],
    )
    yield (
        "insert_erase_at",
        [
            const("zero", np.array(0, np.int64)),
            const("minus1", np.array(-1, np.int64)),
            helper.make_node("SequenceConstruct", ["x", "x2"], ["s"]),
            helper.make_node("SequenceInsert", ["s", "x2", "zero"], ["s2"]),
            helper.make_node("SequenceErase", ["s2", "minus1"], ["s3"]),
            helper.make_node("SequenceAt", ["s3", "zero"], ["y"]),
            helper.make_node("SequenceLength", ["s3"], ["n"]),
        ],
        {"x": x, "x2": 2 * x},
        [vi("y", F, None), vi("n", I64, None)],
    )
    body = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])],
        "body",
        [vi("a", F, None), vi("b", F, None)],
        [vi("c", F, None)],
    )
    yield (
        "sequence_map",
        [
            helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
            helper.make_node("SequenceMap", ["s", "bias"], ["mapped"], body=body),
            helper.make_node("ConcatFromSequence", ["mapped"], ["y"], axis=0),
        ],
        {"x": x, "bias": np.ones(3, np.float32)},
        [vi("y", F, None)],
    )


@pytest.mark.parametrize("case", list(seq_cases()), ids=lambda c: c[0])
def test_sequence_ops(case):
    _, nodes, feeds, outputs = case
    inputs = [vi(k, F, list(v.shape)) for k, v in feeds.items()]
    m = model(nodes, inputs, outputs)
    expected = reference(m, feeds)
    fn, params = convert(m)
    args = [jnp.asarray(v) for v in feeds.values()]
    for run in (fn, jax.jit(fn)):
        actual = run(params, *args)
        for a, e in zip(actual, expected, strict=True):
            check(a, e)


def test_optional_round_trip_under_jit():
    nodes = [
        helper.make_node("Optional", ["x"], ["o"]),
        helper.make_node("OptionalHasElement", ["o"], ["has"]),
        helper.make_node("OptionalGetElement", ["o"], ["y"]),
    ]
    m = model(nodes, [vi("x", F, [2])], [vi("y", F, [2]), vi("has", B, [])])
    fn, params = convert(m)
    x = np.asarray([1.5, -2.0], np.float32)
    for run in (fn, jax.jit(fn)):
        y, has = run(params, jnp.asarray(x))
        check(y, x)
        assert bool(has)


def test_sequence_at_runtime_position_under_jit():
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=0, keepdims=0),
        helper.make_node("SequenceAt", ["s", "pos"], ["y"]),
    ]
    m = model(nodes, [vi("x", F, [4, 3]), vi("pos", I64, [])], [vi("y", F, [3])])
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    fn, params = convert(m)
    for pos in (2, -1):
        (expected,) = reference(m, {"x": x, "pos": np.array(pos, np.int64)})
        check(jax.jit(fn)(params, jnp.asarray(x), jnp.asarray(pos))[0], expected)


def test_sequence_output_and_empty_optional():
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["s"], axis=0),
        helper.make_node(
            "Optional", [], ["empty"], type=helper.make_tensor_type_proto(F, shape=None)
        ),
        helper.make_node("OptionalHasElement", ["empty"], ["has"]),
    ]
    m = model(nodes, [vi("x", F, [3, 2])], [SEQ("s", F, None), vi("has", B, [])])
    x = RNG.standard_normal((3, 2)).astype(np.float32)
    s, has = xconv.to_jax(xconv.load(m))[0]({}, jnp.asarray(x))
    assert isinstance(s, list) and len(s) == 3
    check(s, [x[i : i + 1] for i in range(3)])
    assert not bool(has)


def test_onnx_checker_accepts_test_models():
    # The hand-built graphs are valid ONNX (so the comparisons above mean something).
    onnx.checker.check_model(for_loop_model(), full_check=True)
    onnx.checker.check_model(scan_model(), full_check=True)
