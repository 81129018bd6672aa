"""Shared table machinery for the linalg, reduce and attention handler tests: one ONNX node
per case, converted with xconv.to_jax and compared to an oracle on the same inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv

RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


@dataclass
class OpCase:
    """One node. ``data`` are run-time inputs (None = omitted optional input); ``consts``
    maps an input position to a value fed as an initializer (static: axes, k, ...)."""

    name: str
    op: str
    data: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    consts: dict[int, np.ndarray] = field(default_factory=dict)
    n_out: int = 1
    opset: int = 23
    domain: str = ""
    rtol: float = 1e-5
    atol: float = 1e-6
    #: "reference" (onnx.reference) or "onnxruntime" where the reference is wrong or absent.
    oracle: str = "reference"

    def __str__(self) -> str:
        return self.name


def build_model(case: OpCase) -> onnx.ModelProto:
    n_in = max([len(case.data), *(i + 1 for i in case.consts)])
    inputs, inits, names = [], [], []
    for i in range(n_in):
        if i in case.consts:
            name = f"c{i}"
            inits.append(numpy_helper.from_array(np.asarray(case.consts[i]), name))
            names.append(name)
            continue
        x = case.data[i] if i < len(case.data) else None
        if x is None:
            names.append("")
            continue
        name = f"x{i}"
        dtype = helper.np_dtype_to_tensor_dtype(x.dtype)
        inputs.append(helper.make_tensor_value_info(name, dtype, x.shape))
        names.append(name)
    while names and names[-1] == "":
        names.pop()
    outs = [f"y{i}" for i in range(case.n_out)]
    node = helper.make_node(case.op, names, outs, domain=case.domain, **case.attrs)
    graph = helper.make_graph(
        [node],
        case.name,
        inputs,
        [helper.make_value_info(o, onnx.TypeProto()) for o in outs],
        initializer=inits,
    )
    opsets = [helper.make_opsetid("", case.opset)]
    if case.domain:
        opsets.append(helper.make_opsetid(case.domain, 1))
    return helper.make_model(graph, opset_imports=opsets)


def feeds(case: OpCase) -> list[np.ndarray]:
    return [x for i, x in enumerate(case.data) if x is not None and i not in case.consts]


def expected_outputs(case: OpCase, model: onnx.ModelProto) -> list[np.ndarray]:
    inputs = {f"x{i}": x for i, x in enumerate(case.data) if x is not None and i not in case.consts}
    if case.oracle == "onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, inputs)
    return ReferenceEvaluator(model).run(None, inputs)


def convert(case: OpCase):
    model = build_model(case)
    fn, params = xconv.to_jax(xconv.load(model))
    return model, fn, params


def run_both(case: OpCase):
    model, fn, params = convert(case)
    expected = expected_outputs(case, model)
    actual = fn(params, *(jnp.asarray(x) for x in feeds(case)))
    return fn, params, actual, expected


def assert_close(actual, expected, rtol: float, atol: float) -> None:
    assert len(actual) >= len(expected), f"{len(actual)} outputs, expected {len(expected)}"
    for a, e in zip(actual, expected, strict=False):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
        if e.dtype.kind in "biu":
            np.testing.assert_array_equal(a, e)
        else:
            assert a.dtype == e.dtype, f"dtype {a.dtype} != {e.dtype}"
            np.testing.assert_allclose(
                a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True
            )
