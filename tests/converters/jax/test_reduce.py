"""JAX handlers for the Reduce* family and ArgMax / ArgMin: parity with the ONNX reference
evaluator over axes-as-attribute (old opsets) and axes-as-input (new ones), keepdims,
noop_with_empty_axes and empty sets, plus jit and grad checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
import pytest

import xconv
from tests.converters.jax.linalg_cases import (
    OpCase,
    assert_close,
    build_model,
    expected_outputs,
    feeds,
    rand,
    run_both,
)

I64 = np.int64
X = rand(3, 4, 5)
POS = np.abs(X) + 0.5
EMPTY = np.zeros((2, 0, 4), np.float32)
INTS = np.array([[3, -1, 7], [2, 9, -4]], np.int32)
REDUCERS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
]
#: The first opset that takes axes as an input.
AXES_INPUT = {op: 13 if op == "ReduceSum" else 18 for op in REDUCERS}


def _cases():
    cases = []
    for op in REDUCERS:
        data = POS if op == "ReduceLogSum" else X
        new = AXES_INPUT[op]
        cases += [
            OpCase(f"{op}_attr_axes", op, [data], {"axes": [0, 2], "keepdims": 0}, opset=new - 1),
            OpCase(f"{op}_input_axes", op, [data], consts={1: np.array([-1, 1], I64)}, opset=new),
            OpCase(f"{op}_all_axes_no_keepdims", op, [data], {"keepdims": 0}, opset=new),
            OpCase(
                f"{op}_noop_empty_axes",
                op,
                [data],
                {"noop_with_empty_axes": 1},
                consts={1: np.array([], I64)},
                opset=new,
            ),
            OpCase(
                f"{op}_empty_set",
                op,
                [EMPTY],
                consts={1: np.array([1], I64)},
                opset=max(new, 20) if op in ("ReduceMax", "ReduceMin") else new,
            ),
        ]
    cases += [
        OpCase(
            "ReduceMax_int32",
            "ReduceMax",
            [INTS],
            {"keepdims": 0},
            consts={1: np.array([1], I64)},
            opset=18,
        ),
        OpCase("ReduceMin_bool", "ReduceMin", [INTS > 0], consts={1: np.array([0], I64)}, opset=20),
        OpCase(
            "ReduceMax_bool_empty",
            "ReduceMax",
            [np.zeros((0, 3), bool)],
            consts={1: np.array([0], I64)},
            opset=20,
        ),
        OpCase("ReduceMean_int32", "ReduceMean", [INTS], consts={1: np.array([1], I64)}, opset=18),
        OpCase("ReduceSum_int32_all", "ReduceSum", [INTS], opset=13),
    ]
    ties = np.array([[1, 5, 5, 0], [2, 2, -1, -1]], np.float32)
    for op in ("ArgMax", "ArgMin"):
        cases += [
            OpCase(f"{op}_default", op, [X]),
            OpCase(f"{op}_axis_neg_no_keepdims", op, [X], {"axis": -1, "keepdims": 0}),
            OpCase(f"{op}_ties_first", op, [ties], {"axis": 1}),
            OpCase(f"{op}_ties_last", op, [ties], {"axis": 1, "select_last_index": 1}),
            OpCase(f"{op}_int32", op, [INTS], {"axis": 0, "keepdims": 0}),
        ]
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case: OpCase):
    _, _, actual, expected = run_both(case)
    assert_close(actual, expected, 1e-5, 1e-5)


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceL2", "ReduceLogSumExp"])
def test_old_opset_axes_attribute_in_handler(op):
    """The handler's own attribute path (xconv.load would upgrade the node)."""
    case = OpCase(op, op, [X], {"axes": [1], "keepdims": 1}, opset=11)
    model = build_model(case)
    fn, params = xconv.to_jax(ir.from_proto(model))
    assert fn.model.opset_imports[""] == 11
    assert_close(fn(params, X), expected_outputs(case, model), 1e-5, 1e-5)


def test_log_sum_exp_is_stable():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf], [-1000.0, 0.0]], np.float32)
    case = OpCase("lse", "ReduceLogSumExp", [x], consts={1: np.array([1], I64)}, opset=18)
    fn, params = xconv.to_jax(xconv.load(build_model(case)))
    y = np.asarray(fn(params, x)[0]).ravel()
    np.testing.assert_allclose(y, [1000.0 + np.log(2.0), -np.inf, 0.0], rtol=1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "ReduceSum_input_axes",
        "ReduceMax_empty_set",
        "ReduceLogSumExp_input_axes",
        "ArgMax_ties_last",
        "ReduceL2_noop_empty_axes",
    ],
)
def test_under_jit(name):
    case = next(c for c in CASES if c.name == name)
    fn, params, eager, expected = run_both(case)
    jitted = jax.jit(fn)(params, *(jnp.asarray(x) for x in feeds(case)))
    assert_close(jitted, expected, 1e-5, 1e-5)
    assert_close(jitted, eager, 1e-6, 1e-6)


def test_grad_reduce_mean_and_logsumexp():
    for op, want in [
        ("ReduceMean", lambda v: jnp.mean(v, axis=(0, 2))),
        ("ReduceLogSumExp", lambda v: jax.nn.logsumexp(v, axis=(0, 2))),
    ]:
        case = OpCase(op, op, [X], {"keepdims": 0}, consts={1: np.array([0, 2], I64)}, opset=18)
        fn, params = xconv.to_jax(xconv.load(build_model(case)))
        g = jax.grad(lambda v, fn=fn, params=params: jnp.sum(fn(params, v)[0] ** 2))(X)
        ref = jax.grad(lambda v, want=want: jnp.sum(want(v) ** 2))(jnp.asarray(X))
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6)
