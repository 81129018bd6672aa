"""RoiAlign, MaxRoiPool and DeformConv (written once in ``xconv.converters.ops.detection``) on
both runtimes: each node built with ``onnx.helper`` runs on torch and on JAX (eager and under
``jax.jit``) against ONNX's reference evaluator (onnxruntime for MaxRoiPool, which the
reference evaluator lacks); gradients through torch match finite differences and JAX's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import xconv

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

RNG = np.random.default_rng(7)


def rand(*shape: int, lo: float = -2.0, hi: float = 2.0, dtype=np.float32) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(dtype)


@dataclass
class Case:
    """One node over run-time inputs (None: omitted)."""

    name: str
    op: str
    data: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 22
    oracle: str = "reference"
    rtol: float = 1e-4
    atol: float = 1e-5


def build(case: Case) -> onnx.ModelProto:
    inputs, names = [], []
    for i, x in enumerate(case.data):
        if x is None:
            names.append("")
            continue
        dtype = helper.np_dtype_to_tensor_dtype(x.dtype)
        inputs.append(helper.make_tensor_value_info(f"x{i}", dtype, x.shape))
        names.append(f"x{i}")
    node = helper.make_node(case.op, names, ["y"], **case.attrs)
    out = [helper.make_value_info("y", onnx.TypeProto())]
    graph = helper.make_graph([node], case.name, inputs, out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])


def feeds(case: Case) -> dict[str, np.ndarray]:
    return {f"x{i}": x for i, x in enumerate(case.data) if x is not None}


def expected(case: Case) -> np.ndarray:
    model = build(case)
    if case.oracle == "onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds(case))[0]
    return ReferenceEvaluator(model).run(None, feeds(case))[0]


# Feature maps with several images; rois over all of them, some leaving the map, one tiny.
X = rand(3, 4, 10, 12)
ROIS = np.array(
    [
        [0.5, 1.2, 8.4, 9.1],
        [2.0, 0.0, 11.5, 7.5],
        [-3.0, -2.0, 4.0, 3.0],
        [6.2, 5.1, 6.4, 5.3],
        [1.0, 3.0, 14.0, 12.5],
    ],
    np.float32,
)
BATCH = np.array([2, 0, 1, 0, 2], np.int64)
MAX_ROIS = np.array(
    [
        [2, 1, 0.5, 8, 9],  # scaled by 0.5, x1 and y2 are halves: C's round goes up
        [0, 3, 2, 11, 7.5],
        [1, -3, -2.5, 5, 4],  # unscaled, y1 rounds down to -3
        [0, 6, 5, 6, 5],  # one pixel
        [2, 1, 3, 18, 14],  # beyond the map
    ],
    np.float32,
)


def roi_align(name: str, adaptive: bool, opset: int = 22, **attrs: Any) -> Case:
    """The adaptive grid (sampling_ratio 0) or 2 x 2 samples per bin. Before opset 16 the
    mode was output_half_pixel, which the reference evaluator does not apply: onnxruntime
    checks those."""
    oracle = "reference" if opset >= 16 else "onnxruntime"
    attrs = attrs if adaptive else {"sampling_ratio": 2, **attrs}
    return Case(name, "RoiAlign", [X, ROIS, BATCH], attrs, opset, oracle)


CASES = [
    roi_align("roialign_half_adaptive", True, output_height=3, output_width=2),
    roi_align(
        "roialign_output_half_ratio2",
        False,
        output_height=2,
        output_width=4,
        spatial_scale=0.75,
        coordinate_transformation_mode="output_half_pixel",
    ),
    roi_align("roialign_max_adaptive", True, output_height=2, output_width=3, mode="max"),
    roi_align(
        "roialign_max_ratio3_output_half",
        False,
        output_height=3,
        output_width=3,
        sampling_ratio=3,
        spatial_scale=0.5,
        mode="max",
        coordinate_transformation_mode="output_half_pixel",
    ),
    roi_align("roialign_opset10_default", True, opset=10, output_height=2, output_width=2),
    Case(
        "roialign_float64",
        "RoiAlign",
        [X.astype(np.float64), ROIS.astype(np.float64), BATCH],
        {"output_height": 2, "output_width": 2, "sampling_ratio": 1, "spatial_scale": 0.5},
    ),
    Case(
        "maxroipool_scaled",
        "MaxRoiPool",
        [X, MAX_ROIS],
        {"pooled_shape": [3, 2], "spatial_scale": 0.5},
        opset=21,
        oracle="onnxruntime",
    ),
    Case(
        "maxroipool_unscaled",
        "MaxRoiPool",
        [X, MAX_ROIS],
        {"pooled_shape": [2, 4]},
        opset=21,
        oracle="onnxruntime",
    ),
    Case(
        "deform_group_offset_group_mask_bias_strided",
        "DeformConv",
        [
            rand(2, 4, 9, 8),
            rand(6, 2, 3, 2),
            rand(2, 24, 4, 8, lo=-3, hi=3),
            rand(6),
            rand(2, 12, 4, 8, lo=0, hi=1),
        ],
        {
            "group": 2,
            "offset_group": 2,
            "strides": [2, 1],
            "dilations": [1, 2],
            "pads": [1, 0, 0, 2],
        },
    ),  # fmt: skip
    Case(
        "deform_offset_groups_only_dilated",
        "DeformConv",
        [rand(1, 4, 7, 7), rand(3, 4, 3, 3), rand(1, 72, 4, 4, lo=-4, hi=4)],
        {
            "offset_group": 4,
            "dilations": [2, 2],
            "pads": [2, 2, 2, 2],
            "strides": [2, 2],
            "kernel_shape": [3, 3],
        },
    ),  # fmt: skip
    Case(
        "deform_plain_far_offsets",
        "DeformConv",
        [rand(2, 3, 5, 6), rand(4, 3, 2, 2), rand(2, 8, 4, 5, lo=-7, hi=7), rand(4)],
    ),
]


def run_torch(case: Case) -> np.ndarray:
    module, _ = xconv.to_torch(xconv.load(build(case)))
    with torch.no_grad():
        return module(*(torch.from_numpy(x) for x in feeds(case).values())).numpy()


def run_jax(case: Case, jit: bool) -> np.ndarray:
    wide = any(x.dtype == np.float64 for x in feeds(case).values())
    with jax.enable_x64(wide):  # float64 cases stay float64
        fn, params = xconv.to_jax(xconv.load(build(case)))
        fn = jax.jit(fn) if jit else fn
        out = fn(params, *(jax.numpy.asarray(x) for x in feeds(case).values()))
        return np.asarray(out[0])


def adaptive(case: Case) -> bool:
    """RoiAlign's adaptive grid: its size comes from the rois' values, so no ``jax.jit``."""
    return case.op == "RoiAlign" and not case.attrs.get("sampling_ratio")


@pytest.mark.parametrize(
    ("case", "runtime"),
    [
        (case, runtime)
        for case in CASES
        for runtime in ("torch", "jax", "jax_jit")
        if runtime != "jax_jit" or not adaptive(case)
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_matches_oracle(case: Case, runtime: str) -> None:
    want = expected(case)
    got = run_torch(case) if runtime == "torch" else run_jax(case, jit=runtime == "jax_jit")
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert np.any(want != 0)  # the case reads the map
    np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol)


def test_roialign_adaptive_needs_static_rois_under_jit() -> None:
    """The adaptive grid's size comes from the rois' values: run-time rois cannot be jitted
    (a StaticValueError naming the node), but run eagerly on both runtimes."""
    case = Case("adaptive_runtime", "RoiAlign", [X, ROIS, BATCH], {"output_height": 2})
    want = expected(case)
    np.testing.assert_allclose(run_torch(case), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run_jax(case, jit=False), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(xconv.errors.ConversionError, match="rois"):
        run_jax(case, jit=True)


def test_roialign_adaptive_with_initializer_rois_runs_under_jit() -> None:
    """Boxes given as an initializer are configuration, not a weight: a constant when
    traced, so the adaptive grid is sized under ``jax.jit``; neither runtime makes them a
    parameter."""
    case = Case("adaptive_const", "RoiAlign", [X, ROIS, BATCH], {"output_height": 2})
    want = expected(case)
    model = build(case)
    model.graph.initializer.append(onnx.numpy_helper.from_array(ROIS, "x1"))
    del model.graph.input[1]
    fn, params = xconv.to_jax(xconv.load(model))
    assert "x1" not in params
    got = jax.jit(fn)(params, jax.numpy.asarray(X), jax.numpy.asarray(BATCH))[0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    module, state = xconv.to_torch(xconv.load(model))
    assert "x1" not in dict(module.named_parameters())
    got = module(torch.from_numpy(X), torch.from_numpy(BATCH)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


SMALL = rand(2, 2, 5, 6)


#: Small cases (gradcheck perturbs every element) and the inputs differentiated.
def test_deform_conv_1d_is_2d_of_two_equal_rows() -> None:
    """The shared DeformConv is N-d: a 1-d one on both runtimes equals each row of the
    reference's 2-d one over two equal rows, with zero vertical offsets (the reference cannot
    take maps of height 1)."""
    x, w = rand(2, 4, 9), rand(6, 2, 3)
    offset = rand(2, 2 * 3, 4, lo=-3, hi=3)  # (N, offset_group * k, out)
    mask, b = rand(2, 2 * 3, 4, lo=0, hi=1), rand(6)
    attrs = {"group": 2, "offset_group": 2, "strides": [2], "dilations": [2], "pads": [1, 2]}

    def rows(a):
        return np.repeat(a[:, :, None], 2, axis=2)

    offset2 = np.stack([np.zeros_like(offset), offset], axis=2).reshape(2, 12, 4)
    attrs2 = {"group": 2, "offset_group": 2, "strides": [1, 2], "dilations": [1, 2],
              "pads": [0, 1, 0, 2]}  # fmt: skip
    flat = Case("deform_2d", "DeformConv", [rows(x), w[:, :, None], rows(offset2), b,
                rows(mask)], attrs2)  # fmt: skip
    want = expected(flat)
    np.testing.assert_array_equal(want[:, :, 0], want[:, :, 1])
    case = Case("deform_1d", "DeformConv", [x, w, offset, b, mask], attrs)
    np.testing.assert_allclose(run_torch(case), want[:, :, 0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run_jax(case, jit=True), want[:, :, 0], rtol=1e-4, atol=1e-5)


GRAD_CASES = [
    (
        Case("roialign_adaptive", "RoiAlign", [SMALL, ROIS[:3] * 0.5, BATCH[:3] % 2]),
        [0],
    ),
    (
        Case(
            "roialign_max_ratio2", "RoiAlign", [SMALL, ROIS[:3] * 0.5, BATCH[:3] % 2],
            {"output_width": 2, "sampling_ratio": 2, "mode": "max"},
        ),
        [0],
    ),
    (
        Case(
            "maxroipool", "MaxRoiPool", [SMALL, MAX_ROIS[1:4] * np.float32([1, 0.5, 0.5, 0.5, 0.5])],
            {"pooled_shape": [2, 2]}, opset=21,
        ),
        [0],
    ),
    (
        Case(
            "deform_groups_mask_bias", "DeformConv",
            [rand(1, 4, 4, 4), rand(2, 2, 2, 2), rand(1, 16, 2, 3, lo=-1.5, hi=1.5), rand(2),
             rand(1, 8, 2, 3, lo=0, hi=1)],
            {"group": 2, "offset_group": 2, "strides": [2, 1], "dilations": [1, 2]},
        ),
        [0, 1, 2, 3, 4],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "wrt"), GRAD_CASES, ids=lambda c: getattr(c, "name", ""))
def test_torch_gradients(case: Case, wrt: list[int]) -> None:
    """Autograd through the torch runtime: gradcheck in float64 against finite differences,
    and the gradient of sum(Y * probe) equal to JAX's, for every differentiable input."""
    data = [None if x is None or x.dtype.kind != "f" else x.astype(np.float64) for x in case.data]
    data = [d if d is not None else x for d, x in zip(data, case.data, strict=True)]
    case64 = Case(case.name, case.op, data, case.attrs, case.opset)
    model = build(case64)
    module, _ = xconv.to_torch(xconv.load(model))
    live = [x for x in data if x is not None]
    args = [torch.from_numpy(x.copy()) for x in live]
    for i in wrt:
        args[i].requires_grad_(True)

    def f(*diff):
        full = list(args)
        for i, t in zip(wrt, diff, strict=True):
            full[i] = t
        return module(*full)

    assert torch.autograd.gradcheck(f, tuple(args[i] for i in wrt), eps=1e-6, atol=1e-5)

    out = f(*(args[i] for i in wrt))
    probe = torch.from_numpy(RNG.standard_normal(tuple(out.shape)))
    grads = torch.autograd.grad((out * probe).sum(), [args[i] for i in wrt])
    assert any(float(g.abs().sum()) > 0 for g in grads)

    with jax.enable_x64(True):
        fn, params = xconv.to_jax(xconv.load(model))
        jnp = jax.numpy

        def loss(*diff):
            full = [jnp.asarray(x) for x in live]
            for i, t in zip(wrt, diff, strict=True):
                full[i] = t
            return jnp.sum(fn(params, *full)[0] * jnp.asarray(probe.numpy()))

        jgrads = jax.grad(loss, argnums=tuple(range(len(wrt))))(
            *(jnp.asarray(live[i]) for i in wrt)
        )
        for g, jg in zip(grads, jgrads, strict=True):
            np.testing.assert_allclose(g.numpy(), np.asarray(jg), rtol=1e-7, atol=1e-9)
