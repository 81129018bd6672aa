"""The ai.onnx.preview.training ops on both runtimes: Adagrad, Adam and Momentum (written once
in ``xconv.converters.ops.training``) against ONNX's reference evaluator, over several
tensors per group, T == 0 and T > 0; Gradient (``jax.vjp`` / ``torch.autograd`` over the
shared graph walk) against the closed-form derivative; the errors each runtime raises."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import xconv
from xconv.errors import ConversionError

TRAINING = "ai.onnx.preview.training"
RNG = np.random.default_rng(7)


def f32(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, shape).astype(np.float32)


def model(nodes, inputs: dict[str, np.ndarray], outputs, initializers=()):
    """A model over float/int64 graph inputs named by ``inputs``, with untyped outputs."""
    vi = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
        for n, x in inputs.items()
    ]
    outs = [helper.make_value_info(o, onnx.TypeProto()) for o in outputs]
    graph = helper.make_graph(nodes, "training", vi, outs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid(TRAINING, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def run_jax(m, feeds):
    """The converted function eagerly and under jit: one list of outputs per run."""
    jax = pytest.importorskip("jax")
    fn, params = xconv.to_jax(xconv.load(m))
    args = [jax.numpy.asarray(x) for x in feeds]
    return [[np.asarray(o) for o in run(params, *args)] for run in (fn, jax.jit(fn))]


def run_torch(m, feeds):
    """The converted module with grad, under no_grad and under inference_mode."""
    torch = pytest.importorskip("torch")
    module, _ = xconv.to_torch(xconv.load(m))
    runs = []
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            out = module(*(torch.from_numpy(x) for x in feeds))
        out = out if isinstance(out, tuple) else (out,)
        runs.append([o.detach().numpy() for o in out])
    return runs


RUNTIMES = {"jax": run_jax, "torch": run_torch}


def optimizer_case(op, groups: int, shapes, t: int, attrs: dict):
    """``op`` over R, T and ``groups`` groups of one tensor per shape; its reference
    outputs."""
    n = len(shapes)
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(t, np.int64)}
    for k in range(groups):
        for i, shape in enumerate(shapes):
            # H (Adagrad's and Adam's last group) accumulates squares: non-negative.
            low = 0.05 if k == groups - 1 and op != "Momentum" else -1.0
            feeds[f"in{k}_{i}"] = f32(*shape, low=low)
    outputs = [f"out{k}_{i}" for k in range(groups - 1) for i in range(n)]
    node = helper.make_node(op, list(feeds), outputs, domain=TRAINING, **attrs)
    m = model([node], feeds, outputs)
    return m, feeds, ReferenceEvaluator(m).run(None, feeds)


OPTIMIZERS = {
    "adagrad": ("Adagrad", 3, {"decay_factor": 0.1, "epsilon": 1e-6, "norm_coefficient": 0.01}),
    "adagrad_defaults": ("Adagrad", 3, {}),
    "adam": (
        "Adam",
        4,
        {
            "alpha": 0.8,
            "beta": 0.95,
            "epsilon": 1e-6,
            "norm_coefficient": 0.02,
            "norm_coefficient_post": 0.01,
        },
    ),
    "momentum": (
        "Momentum",
        3,
        {"alpha": 0.9, "beta": 0.5, "mode": "standard", "norm_coefficient": 0.01},
    ),
    "nesterov": (
        "Momentum",
        3,
        {"alpha": 0.7, "beta": 0.3, "mode": "nesterov", "norm_coefficient": 0.02},
    ),
}


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
@pytest.mark.parametrize("t", [0, 4])
@pytest.mark.parametrize("shapes", [[(5,)], [(3,), (2, 4), ()]], ids=["one", "three"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_reference(name, shapes, t, runtime):
    op, groups, attrs = OPTIMIZERS[name]
    m, feeds, expected = optimizer_case(op, groups, shapes, t, attrs)
    assert len(expected) == (groups - 1) * len(shapes)
    for actual in RUNTIMES[runtime](m, list(feeds.values())):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            # The spec keeps each input's type (the reference returns float64 for some).
            assert a.dtype == np.float32 and a.shape == np.shape(e)
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "momentum"])
def test_first_and_later_steps_differ(name):
    """T == 0 drops Adam's bias correction and Momentum's beta: a guard that the T
    parametrization above checks two different branches."""
    op, groups, attrs = OPTIMIZERS[name]
    m, feeds, first = optimizer_case(op, groups, [(4,)], 0, attrs)
    later = ReferenceEvaluator(m).run(None, {**feeds, "T": np.array(3, np.int64)})
    assert not np.allclose(first[0], later[0])


def gradient_model():
    """y = (a + b) * a / c + k, differentiated for xs = [a, b, u] (u unused) with zs = [c]."""
    k = numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "k")
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Mul", ["s", "a"], ["p"]),
        helper.make_node("Div", ["p", "c"], ["q"]),
        helper.make_node("Add", ["q", "k"], ["y"]),
        helper.make_node(
            "Gradient",
            ["a", "b", "u", "c"],
            ["da", "db", "du"],
            domain=TRAINING,
            xs=["a", "b", "u"],
            zs=["c"],
            y="y",
        ),
    ]
    feeds = {"a": f32(3), "b": f32(3), "u": f32(3), "c": f32(3, low=0.5, high=2.0)}
    return model(nodes, feeds, ["y", "da", "db", "du"], [k]), feeds


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_gradient_matches_closed_form(runtime):
    m, feeds = gradient_model()
    a, b, c = feeds["a"], feeds["b"], feeds["c"]
    # y itself against the reference evaluator, run without the Gradient node.
    forward = onnx.ModelProto()
    forward.CopyFrom(m)
    del forward.graph.node[-1]
    del forward.graph.output[1:]
    (y_ref,) = ReferenceEvaluator(forward).run(None, feeds)
    expected = [y_ref, (2 * a + b) / c, a / c, np.zeros(3, np.float32)]
    for actual in RUNTIMES[runtime](m, list(feeds.values())):
        assert len(actual) == 4
        for got, want in zip(actual, expected, strict=True):
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_gradient_of_an_input_itself_is_ones(runtime):
    """y = x: the chain is empty, dy/dx the all-ones seed."""
    node = helper.make_node("Gradient", ["x"], ["dx"], domain=TRAINING, xs=["x"], y="x")
    feeds = {"x": f32(2, 3)}
    for (dx,) in RUNTIMES[runtime](model([node], feeds, ["dx"]), list(feeds.values())):
        np.testing.assert_array_equal(dx, np.ones((2, 3), np.float32))


def _raises(runtime, m, feeds, match):
    with pytest.raises(ConversionError, match=match):
        RUNTIMES[runtime](m, feeds)


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_errors_name_what_to_fix(runtime):
    # y reads b, which is neither differentiated (xs) nor held fixed (zs).
    nodes = [
        helper.make_node("Mul", ["a", "b"], ["y"]),
        helper.make_node("Gradient", ["a"], ["da"], domain=TRAINING, xs=["a"], y="y"),
    ]
    feeds = {"a": f32(3), "b": f32(3)}
    _raises(runtime, model(nodes, feeds, ["da"]), list(feeds.values()), "'b'.*list it in xs or zs")
    # Adagrad's groups after R, T must be equally long: 4 tensors are not 3 groups.
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(1, np.int64)}
    feeds.update({f"v{i}": f32(2) for i in range(4)})
    node = helper.make_node("Adagrad", list(feeds), ["x", "h"], domain=TRAINING)
    _raises(runtime, model([node], feeds, ["x", "h"]), list(feeds.values()), "equally long")
    # Momentum's mode is standard or nesterov.
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(1, np.int64)}
    feeds.update({f"v{i}": f32(2) for i in range(3)})
    attrs = {"alpha": 0.9, "beta": 0.1, "mode": "heavy_ball", "norm_coefficient": 0.0}
    node = helper.make_node("Momentum", list(feeds), ["x", "v"], domain=TRAINING, **attrs)
    _raises(runtime, model([node], feeds, ["x", "v"]), list(feeds.values()), "heavy_ball")


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_runtimes_register_the_shared_optimizers(runtime):
    pytest.importorskip(runtime)
    if runtime == "jax":
        from xconv.converters.jax.registry import registry
    else:
        import xconv.converters.torch.runtime  # noqa: F401 - registers the handlers
        from xconv.converters.torch.runtime.registry import registry
    for op in ("Adagrad", "Adam", "Momentum"):
        handler, reason = registry.lookup(TRAINING, op, 1)
        assert handler is not None, reason
        assert handler.fn.__module__ == "xconv.converters.ops.training", op
    handler, reason = registry.lookup(TRAINING, "Gradient", 1)
    assert handler is not None, reason
