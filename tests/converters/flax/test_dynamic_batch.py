"""Flax / JAX frontend with a symbolic batch dimension (``dynamic_batch``, on by default).

Each fixture is converted once at its example batch (2 or 3) and then run at batch 1, 2 and 5
through the JAX interpreter, onnxruntime, the runtime torch backend and the generated torch
source, against the Flax module itself at that batch size.
"""

from __future__ import annotations

import functools
import uuid
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import onnx_ir as ir
import pytest
from jax import lax

import xconv
from fixtures import flax_models as fm
from tests.torch_source import load_generated
from xconv.converters.flax.importer.trace import from_flax, from_jax

LINEN = ["linen_mlp", "linen_cnn", "linen_transformer"]
NNX = ["nnx_mlp", "nnx_cnn", "nnx_transformer"]
BATCHES = [1, 2, 5]
ATOL = RTOL = 1e-5


@functools.cache
def _fixture(name: str):
    """``(module, variables, example_inputs, flax_fn, model)``: converted once, no fallback."""
    module, variables, xs = fm.build(name)
    if variables is not None:

        def flax_fn(*a):
            return module.apply(variables, *a)

    else:
        flax_fn = module
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to static shapes warns
        model = from_flax(module, variables, xs)
    return module, variables, xs, flax_fn, model


def _inputs(example: tuple, batch: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    out = []
    for x in example:
        shape = (batch, *np.shape(x)[1:])
        if np.asarray(x).dtype.kind == "i":
            out.append(rng.integers(0, 50, shape).astype(np.asarray(x).dtype))
        else:
            out.append(rng.standard_normal(shape).astype(np.float32))
    return tuple(out)


def _ort_session(model, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = xconv.save(model, tmp_path / f"{uuid.uuid4().hex[:8]}.onnx")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _torch_run(module, xs):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        out = module(*[torch.from_numpy(np.asarray(x)) for x in xs])
    out = out[0] if isinstance(out, tuple | list) else out
    return out.numpy()


@pytest.mark.parametrize("name", LINEN + NNX)
def test_graph_has_symbolic_batch(name):
    model = _fixture(name)[-1]
    # token ids (the transformers' int32 (batch, length)) also get a symbolic ``seq``: see
    # test_symbolic_seq.py; the rest of every shape is static
    tokens = model.graph.inputs[0].dtype.is_integer()
    for value in (model.graph.inputs[0], model.graph.outputs[0]):
        first = value.shape[0]
        assert isinstance(first, ir.SymbolicDim) and first.value == "batch", value.shape
        rest = list(value.shape[1:])
        if tokens:
            assert rest[0] == ir.SymbolicDim("seq"), value.shape
            rest = rest[1:]
        assert all(isinstance(d, int) for d in rest), value.shape
    if not tokens:
        # A reshape over the batch needs no shape arithmetic: the symbol becomes -1.
        assert not any(n.op_type == "Shape" for n in model.graph)


@pytest.mark.parametrize("name", LINEN + NNX)
def test_jax_and_onnxruntime_at_any_batch(name, tmp_path):
    _, _, example, flax_fn, model = _fixture(name)
    fn, params = xconv.to_jax(model)
    sess = _ort_session(model, tmp_path)
    feed_names = [i.name for i in sess.get_inputs()]
    for b in BATCHES:
        xs = _inputs(example, b, seed=b)
        ref = np.asarray(flax_fn(*xs))
        assert ref.shape[0] == b
        out = np.asarray(fn(params, *xs)[0])
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)
        (ort_out,) = sess.run(None, dict(zip(feed_names, xs, strict=True)))
        assert ort_out.shape == ref.shape
        np.testing.assert_allclose(ort_out, ref, atol=ATOL, rtol=RTOL)


def _source_module(model, tmp_path):
    return load_generated(model, tmp_path)[0].eval()


@pytest.mark.parametrize("route", ["runtime", "source"])
@pytest.mark.parametrize("name", LINEN + NNX)
def test_torch_at_any_batch(name, route, tmp_path):
    pytest.importorskip("torch")
    _, _, example, flax_fn, model = _fixture(name)
    if route == "source":
        module = _source_module(model, tmp_path)
    else:
        built = xconv.to_torch(model)
        module = (built[0] if isinstance(built, tuple) else built).eval()
    for b in BATCHES:
        xs = _inputs(example, b, seed=10 + b)
        ref = np.asarray(flax_fn(*xs))
        out = _torch_run(module, xs)
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=RTOL)


def _flatten_fn(params, x):
    h = x.reshape((x.shape[0], -1)) @ params["w"]
    return jnp.tanh(h).reshape((x.shape[0], 2, 3))


def _params():
    return {"w": np.random.default_rng(0).standard_normal((12, 6)).astype(np.float32)}


def _reshape_targets(model) -> list[list[int]]:
    out = []
    for node in model.graph:
        if node.op_type == "Reshape":
            tensor = ir.convenience.get_const_tensor(node.inputs[1])
            if tensor is not None:
                out.append([int(v) for v in tensor.numpy()])
    return out


def test_from_jax_reshape_over_batch(tmp_path):
    params = _params()
    model = from_jax(_flatten_fn, params, (np.ones((2, 4, 3), np.float32),))
    assert model.graph.inputs[0].shape[0] == ir.SymbolicDim("batch")
    assert model.graph.outputs[0].shape[0] == ir.SymbolicDim("batch")
    targets = _reshape_targets(model)
    assert [-1, 12] in targets and [-1, 2, 3] in targets
    fn, p = xconv.to_jax(model)
    sess = _ort_session(model, tmp_path)
    for b in BATCHES:
        x = np.random.default_rng(b).standard_normal((b, 4, 3)).astype(np.float32)
        ref = np.asarray(_flatten_fn(params, x))
        np.testing.assert_allclose(np.asarray(fn(p, x)[0]), ref, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(sess.run(None, {"input": x})[0], ref, atol=ATOL, rtol=RTOL)


def test_dynamic_batch_false_keeps_example_shapes():
    params = _params()
    model = from_jax(_flatten_fn, params, (np.ones((2, 4, 3), np.float32),), dynamic_batch=False)
    assert model.graph.inputs[0].shape.dims == (2, 4, 3)
    targets = _reshape_targets(model)
    assert [2, 12] in targets


def _shape_ops_fn(params, x):
    """Handlers whose shapes follow the batch: slice, pad, dynamic_slice, iota, split, sort,
    broadcast_in_dim, concatenate, integer_pow 0 and the batch used as a number."""
    n = x.shape[0]
    a = jnp.mean(x, axis=0) + n * jnp.ones(3) + jnp.arange(n).sum()
    a = a + 2 * lax.slice(x, (n - 1, 0), (n, 3))[0] + lax.slice(x, (1, 0), (n, 3)).sum(0)
    flat = jnp.concatenate([x, x]).reshape(-1)
    a = a + lax.slice(flat, (0,), (3,)) + lax.pad(x, 0.0, ((1, -1, 0), (0, 0, 0))).sum(0)
    a = a + lax.dynamic_slice(x, (0, 1), (n, 2)).sum()
    a = a + jnp.broadcast_to(lax.expand_dims(x, (1,)), (n, 2, 3)).sum((0, 1))
    h1, h2 = jnp.split(jnp.concatenate([x, x]), 2)
    low = lax.index_in_dim(jnp.sort(x, axis=0), 0, keepdims=False)
    return a + (h1 - h2).sum(0) + low + jnp.zeros_like(x, dtype=jnp.int32).sum() + (x**0).sum(0)


def test_shape_handlers_follow_the_batch(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model = from_jax(_shape_ops_fn, {}, (np.ones((4, 3), np.float32),))
    ops = {n.op_type for n in model.graph}
    assert {"Shape", "Range", "TopK", "Split", "Pad"} <= ops
    fn, p = xconv.to_jax(model)
    sess = _ort_session(model, tmp_path)
    for b in (2, 3, 7):
        x = np.random.default_rng(b).standard_normal((b, 3)).astype(np.float32)
        ref = np.asarray(_shape_ops_fn({}, x))
        np.testing.assert_allclose(np.asarray(fn(p, x)[0]), ref, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(sess.run(None, {"input": x})[0], ref, atol=ATOL, rtol=RTOL)


def _python_branch_fn(params, x):
    # Shape-dependent Python control flow: cannot be traced at a symbolic batch.
    if x.shape[0] > 3:
        return x * 2.0
    return x + params["b"]


def test_untraceable_model_falls_back_with_a_warning():
    params = {"b": np.float32(1.5)}
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with pytest.warns(UserWarning, match="symbolic batch dimension failed"):
        model = from_jax(_python_branch_fn, params, (x,))
    assert model.graph.inputs[0].shape.dims == (2, 3)
    fn, p = xconv.to_jax(model)
    np.testing.assert_allclose(np.asarray(fn(p, x)[0]), _python_branch_fn(params, x))


def test_inputs_sharing_the_batch_and_a_static_one():
    def fn(params, x, y, scale):
        return (x * y.sum(-1, keepdims=True)) * scale

    x = np.ones((3, 4), np.float32)
    y = np.ones((3, 2), np.float32)
    scale = np.float32(2.0)
    model = from_jax(fn, {}, (x, y, scale))
    shapes = [v.shape for v in model.graph.inputs]
    assert shapes[0][0] == ir.SymbolicDim("batch") and shapes[1][0] == ir.SymbolicDim("batch")
    assert shapes[2].dims == ()
    f, p = xconv.to_jax(model)
    rng = np.random.default_rng(0)
    for b in BATCHES:
        xb = rng.standard_normal((b, 4)).astype(np.float32)
        yb = rng.standard_normal((b, 2)).astype(np.float32)
        ref = np.asarray(fn({}, xb, yb, scale))
        np.testing.assert_allclose(np.asarray(f(p, xb, yb, scale)[0]), ref, atol=ATOL, rtol=RTOL)


def test_jaxpr_symbolic_tracing_is_what_the_importer_relies_on():
    """``jax.make_jaxpr`` takes ``ShapeDtypeStruct`` with ``jax.export`` symbolic dims."""
    (b,) = jax.export.symbolic_shape("batch")
    closed = jax.make_jaxpr(lambda x: x.reshape((x.shape[0], -1)))(
        jax.ShapeDtypeStruct((b, 2, 3), np.float32)
    )
    assert str(closed.jaxpr.outvars[0].aval.shape[0]) == "batch"


def test_inputs_that_do_not_fit_the_module_are_a_conversion_error():
    from xconv.errors import ConversionError

    module, variables, (x,) = fm.linen_cnn()
    wrong = np.zeros((2, 3, 16, 16), np.float32)  # channels-first input for a channels-last CNN
    with pytest.raises(ConversionError, match=r"example inputs float32\[2, 3, 16, 16\]"):
        from_flax(module, variables, (wrong,))
