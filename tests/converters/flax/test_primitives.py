"""Flax / JAX frontend, per primitive: gather/scatter, while, special functions, bit ops.

Each case converts a JAX function, checks the IR's structure, then runs the model through
``xconv.to_jax`` (eager and jitted) and through onnxruntime on the saved file, comparing the
numbers against the JAX function itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import xconv
from xconv.converters.flax.importer.trace import from_jax

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 6)).astype(np.float32)
X3 = RNG.standard_normal((3, 4, 5)).astype(np.float32)
IDX = np.array([1, 3, 0], np.int32)
DUP = np.array([1, 1, 0], np.int32)
ROWS = np.array([0, 5, 2, 3], np.int32)
GAMMA_X = np.concatenate(
    [np.linspace(-4.7, 12, 60), [0.5, 1, 2, 3, 1e-3, 30.5, -0.5, -1.5, -2.0, 0.0]]
).astype(np.float32)
INTS = np.array([0, 1, 3, 255, -1, 2**30, -(2**31), 12345], np.int32)


def _j(a):
    return jnp.asarray(a)


# name -> (fn, inputs, ONNX ops that must appear, atol)
CASES = {
    # gather
    "take_axis0": (lambda a, b: a[b], (X, IDX), {"Gather"}, 0),
    "take_axis1": (lambda a, b: a[:, b], (X, IDX), {"Gather"}, 0),
    "take_along_axis": (
        lambda a: jnp.take_along_axis(a, jnp.argsort(a, 1), 1),
        (X,),
        {"GatherND"},
        0,
    ),
    "take_along_axis_3d": (
        lambda a, b: jnp.take_along_axis(a, b, 1),
        (X3, RNG.integers(0, 4, (3, 2, 5)).astype(np.int32)),
        {"GatherND"},
        0,
    ),
    "vmap_index": (lambda a, b: jax.vmap(lambda r, j: r[j])(a, b), (X, ROWS), {"GatherND"}, 0),
    "vmap_dynamic_slice": (
        lambda a, b: jax.vmap(lambda r, j: lax.dynamic_slice(r, (j,), (3,)))(a, b),
        (X, ROWS),
        {"GatherND"},
        0,
    ),
    "dynamic_slice_in_dim_vmap_2d": (
        lambda a, b: jax.vmap(lambda r, j: lax.dynamic_slice(r, (j, 1), (2, 3)))(a, b),
        (X3, np.array([0, 3, 1], np.int32)),
        {"GatherND"},
        0,
    ),
    "several_axes": (
        lambda a, b, c: a[:, b, c],
        (X3, np.array([0, 3], np.int32), np.array([4, 1], np.int32)),
        {"GatherND"},
        0,
    ),
    "outer_indexing": (
        lambda a, b, c: a[b[:, None], c[None, :]],
        (X, IDX, np.array([5, 0], np.int32)),
        {"GatherND"},
        0,
    ),
    "diagonal": (lambda a: jnp.diagonal(a), (X,), {"GatherND"}, 0),
    "fill_out_of_bounds": (
        lambda a, b: _j(a).at[b].get(mode="fill", fill_value=-1.0),
        (X, np.array([1, 7, -9], np.int32)),
        {"Where"},
        0,
    ),
    "fill_default_nan": (
        lambda a, b: _j(a).at[:, b].get(mode="fill"),
        (X, np.array([1, 6, 2], np.int32)),
        {"Where"},
        0,
    ),
    "clip_out_of_bounds": (
        lambda a, b: _j(a).at[b].get(mode="clip"),
        (X, np.array([1, 7, -9], np.int32)),
        {"Gather"},
        0,
    ),
    # scatter
    "set": (lambda a, b: _j(a).at[b].set(0.5), (X, IDX), {"ScatterND"}, 0),
    "set_slice": (lambda a: _j(a).at[1:3, 2].set(7.0), (X,), {"ScatterND"}, 0),
    "add_duplicates": (
        lambda a, b: _j(a).at[b].add(jnp.arange(18.0).reshape(3, 6)),
        (X, DUP),
        {"ScatterND"},
        1e-6,
    ),
    "mul": (lambda a, b: _j(a).at[b].mul(2.0), (X, DUP), {"ScatterND"}, 1e-6),
    "min_axis1": (lambda a, b: _j(a).at[:, b].min(0.0), (X, DUP), {"ScatterND"}, 0),
    "max_axis1": (lambda a, b: _j(a).at[:, b].max(0.0), (X, DUP), {"ScatterND"}, 0),
    "subtract": (
        lambda a, b: lax.scatter_sub(
            _j(a),
            b[:, None],
            jnp.ones((3, 6)),
            lax.ScatterDimensionNumbers((1,), (0,), (0,)),
        ),
        (X, DUP),
        {"ScatterND"},
        1e-6,
    ),
    "drop_out_of_bounds": (
        lambda a, b: _j(a).at[b].add(1.0),
        (X, np.array([1, 9, -7], np.int32)),
        {"ScatterND", "Pad"},
        1e-6,
    ),
    "drop_partial_window": (
        lambda a, b: _j(a).at[b, 2:5].set(-3.0),
        (X, np.array([0, 4, 2], np.int32)),
        {"ScatterND"},
        0,
    ),
    "clip_mode": (
        lambda a, b: _j(a).at[b].set(9.0, mode="clip"),
        (X, np.array([1, 9], np.int32)),
        {"ScatterND"},
        0,
    ),
    "vmap_set": (
        lambda a, b: jax.vmap(lambda r, j: r.at[j].set(9.0))(a, b),
        (X, ROWS),
        {"ScatterND"},
        0,
    ),
    "vmap_dynamic_update_slice": (
        lambda a, b: jax.vmap(lambda r, j: lax.dynamic_update_slice(r, jnp.ones(2), (j,)))(a, b),
        (X, ROWS),
        {"ScatterND"},
        0,
    ),
    "bincount": (
        lambda b: jnp.bincount(b, length=5),
        (np.array([0, 1, 1, 4, 2, 1], np.int32),),
        {"ScatterND"},
        0,
    ),
    # control flow
    "while": (
        lambda a: lax.while_loop(lambda v: v.sum() < 100, lambda v: v * 2 + 1, a),
        (np.abs(X),),
        {"Loop"},
        1e-4,
    ),
    "fori_loop_dynamic_trip": (
        lambda a, n: lax.fori_loop(0, n, lambda k, v: v * 1.1 + k, a),
        (X, np.int32(4)),
        {"Loop"},
        1e-4,
    ),
    "while_with_consts": (
        lambda a, w: lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, a)
        )[1],
        (X, RNG.standard_normal((6, 6)).astype(np.float32)),
        {"Loop"},
        1e-5,
    ),
    "while_cond_reads_outer_value": (
        lambda a, limit: lax.while_loop(lambda v: v.sum() < limit, lambda v: v + jnp.abs(a), a),
        (X, np.float32(40.0)),
        {"Loop"},
        1e-4,
    ),
    # math
    "erf_inv": (
        lambda a: lax.erf_inv(a),
        (np.linspace(-1, 1, 41).astype(np.float32),),
        set(),
        2e-5,
    ),
    "erfc_gelu_exact": (lambda a: jax.nn.gelu(a, approximate=False), (X,), {"Erf"}, 1e-6),
    "cbrt": (jnp.cbrt, (X,), {"Pow"}, 1e-6),
    "lgamma": (lax.lgamma, (GAMMA_X,), {"Sin"}, 2e-5),
    "digamma": (lax.digamma, (GAMMA_X,), {"Cos"}, 2e-5),
    "betaln": (lambda a: jax.scipy.special.betaln(jnp.abs(a) + 0.1, 2.5), (X,), set(), 1e-5),
    "atan2": (jnp.arctan2, (X, X[::-1].copy()), {"Atan"}, 1e-6),
    "clz": (lax.clz, (INTS,), {"BitShift"}, 0),
    "population_count": (lax.population_count, (INTS,), {"BitwiseAnd"}, 0),
    "population_count_u8": (
        lax.population_count,
        (np.arange(0, 256, 7, dtype=np.uint8),),
        set(),
        0,
    ),
    "clz_i16": (lax.clz, (np.array([0, 1, -1, 300, 32767], np.int16),), set(), 0),
    "shifts": (
        lambda a, s: (a << s, a >> s, lax.shift_right_logical(a, s)),
        (np.array([5, -8, 1, -1, 7], np.int32), np.array([1, 2, 31, 33, -1], np.int32)),
        {"BitShift"},
        0,
    ),
    "cumprod": (lambda a: jnp.cumprod(a, 1), (X,), {"ReduceProd"}, 1e-6),
    "cummax_reverse": (lambda a: lax.cummax(a, 1, reverse=True), (X,), {"ReduceMax"}, 0),
    "cummin": (lambda a: lax.cummin(a, 0), (X,), {"ReduceMin"}, 0),
    "cumlogsumexp": (lambda a: lax.cumlogsumexp(a * 30, 1), (X,), set(), 1e-4),
    "lexsort_two_keys": (
        lambda a, b: lax.sort((a, b, b * 2), num_keys=2),
        (np.array([1, 0, 1, 0, 2, 1], np.float32), np.array([3, 2, 1, 0, 5, 1], np.float32)),
        {"TopK"},
        0,
    ),
    "argsort": (lambda a: jnp.argsort(a, axis=0), (X,), {"TopK"}, 0),
    "searchsorted": (jnp.searchsorted, (np.sort(X[0]), X[1].copy()), set(), 0),
    "stack": (lambda a: jnp.stack([a, a * 2], 1), (X,), {"Concat"}, 0),
    "tile": (lambda a: jnp.tile(a, (2, 1, 3)), (X,), {"Tile"}, 0),
    "min_pool": (
        lambda a: lax.reduce_window(a, jnp.inf, lax.min, (2, 2), (1, 1), "SAME"),
        (X,),
        {"MaxPool"},
        0,
    ),
    "median": (jnp.median, (X,), set(), 1e-6),
    # realistic jnp functions built on the above
    "unique_sized": (lambda b: jnp.unique(b % 5, size=5), (INTS,), {"ScatterND"}, 0),
    "select_argmax_bool": (
        lambda a: jnp.select([a > 0, a < -1], [a, -a], 0.0),
        (X,),
        {"ArgMax"},
        0,
    ),
    "gcd_while_rem": (lambda b: jnp.gcd(b, 6), (INTS[INTS > -(2**31)],), {"Loop"}, 0),
    "int_div_rem_by_zero": (
        lambda a, b: (lax.div(a, b), lax.rem(a, b)),
        (np.array([5, -5, 7, -(2**31), 9], np.int32), np.array([0, 0, 2, -1, -1], np.int32)),
        set(),
        0,
    ),
    "compress_bool_sort": (
        lambda a: jnp.extract(a > 0, a, size=3),
        (X,),
        {"TopK"},
        0,
    ),
    "associative_scan_interior_pad": (
        lambda a: lax.associative_scan(jnp.add, a, axis=1),
        (X,),
        {"Pad"},
        1e-5,
    ),
    "segment_max": (
        lambda a, b: jax.ops.segment_max(a, b, 3),
        (X, np.array([2, 0, 2, 1], np.int32)),
        {"ScatterND"},
        0,
    ),
    "histogram": (lambda a: jnp.histogram(a, bins=4, range=(-2, 2))[0], (X,), set(), 0),
    "roll_traced_shift": (lambda a, n: jnp.roll(a, n, 1), (X, np.int32(2)), set(), 0),
    "insert": (lambda a: jnp.insert(a[0], 2, 5.0), (X,), set(), 0),
    "interp": (lambda a, b, c: jnp.interp(a, jnp.sort(b), c), (X[0], X[1], X[2]), set(), 1e-5),
}


# Cases the JAX backend can run eagerly but not under jax.jit (its limits, not the importer's).
NO_JIT = {
    "roll_traced_shift": "Slice with run-time starts needs concrete values under jit",
}


def _convert(fn, xs, dynamic: bool = False):
    return from_jax(lambda p, *a: fn(*a), {}, tuple(xs), dynamic_batch=dynamic)


def _as_tuple(out):
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def _ort(model, xs, tmp_path):
    path = xconv.save(model, tmp_path / "model.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(x) for i, x in zip(sess.get_inputs(), xs, strict=True)}
    return sess.run(None, feeds)


def _close(got, want, atol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, atol=atol, rtol=max(atol, 1e-7))


@pytest.mark.parametrize("name", sorted(CASES))
def test_primitive_parity(name, tmp_path):
    fn, xs, ops, atol = CASES[name]
    model = _convert(fn, xs)
    present = {n.op_type for n in model.graph}
    assert ops <= present, f"expected {ops} among {sorted(present)}"
    want = _as_tuple(fn(*xs))
    jfn, params = xconv.to_jax(model)
    for got, ref in zip(jfn(params, *xs), want, strict=True):
        _close(got, ref, atol)
    if name not in NO_JIT:
        for got, ref in zip(jax.jit(jfn)(params, *xs), want, strict=True):
            _close(got, ref, atol)
    for got, ref in zip(_ort(model, xs, tmp_path), want, strict=True):
        _close(got, ref, atol)


def test_fill_mode_gives_fill_value_out_of_bounds(tmp_path):
    fn = CASES["fill_default_nan"][0]
    xs = CASES["fill_default_nan"][1]
    out = _ort(_convert(fn, xs), xs, tmp_path)[0]
    assert np.isnan(out[:, 1]).all() and not np.isnan(out[:, [0, 2]]).any()


def test_while_body_is_a_subgraph_reading_outer_weights():
    fn, xs, _, _ = CASES["while_with_consts"]
    model = _convert(fn, xs)
    (loop,) = [n for n in model.graph if n.op_type == "Loop"]
    body = loop.attributes["body"].as_graph()
    assert [v.name for v in body.inputs][1:2] and len(body.outputs) == len(loop.outputs) + 1
    # The weight is read from the enclosing graph, not carried through the loop.
    outer = {v.name for v in model.graph.inputs}
    read = {v.name for n in body for v in n.inputs if v is not None}
    assert read & outer


DYNAMIC = {
    "take_along_axis": (lambda a: jnp.take_along_axis(a, jnp.argsort(a, 1), 1), 1),
    "vmap_index": (lambda a, b: jax.vmap(lambda r, j: r[j])(a, b), 2),
    "vmap_dynamic_slice": (
        lambda a, b: jax.vmap(lambda r, j: lax.dynamic_slice(r, (j,), (3,)))(a, b),
        2,
    ),
    "scatter_rows_drop": (lambda a, b: _j(a).at[b % 9].add(1.0), 2),
    "while": (lambda a: lax.while_loop(lambda v: v.sum() < 100, lambda v: v * 2 + 1, a), 1),
    "lexsort_batch": (lambda a, b: lax.sort((a, b), num_keys=2, dimension=0), 2),
}


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_symbolic_batch_runs_at_another_batch_size(name, tmp_path):
    fn, n_in = DYNAMIC[name]
    rng = np.random.default_rng(1)

    def inputs(batch):
        a = np.abs(rng.standard_normal((batch, 6))).astype(np.float32)
        if name == "lexsort_batch":
            return (np.round(a[:, 0] * 2), a[:, 1].copy())
        b = rng.integers(0, 6, (batch,)).astype(np.int32)
        return (a, b)[:n_in]

    model = _convert(fn, inputs(4), dynamic=True)
    assert any(not isinstance(d, int) for v in model.graph.inputs for d in v.shape), (
        "the conversion fell back to static shapes"
    )
    xs = inputs(7)
    want = _as_tuple(fn(*xs))
    for got, ref in zip(_ort(model, xs, tmp_path), want, strict=True):
        _close(got, ref, 1e-5)
