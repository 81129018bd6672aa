"""How generated statements are laid out: constants in closed form, long statements wrapped
as ruff formats them, a reshape of a reshape folded, ``v = e; return v`` as ``return e``, a
constant causal mask recognised (pure functions; no conversion)."""

from __future__ import annotations

import ast
import textwrap

import numpy as np
import pytest

pytest.importorskip("jax")

import onnx_ir as ir  # noqa: E402

from xconv.converters.codegen import (  # noqa: E402
    drop_noop_attention_masks,
    fold_reduce_reshapes,
    reshape_dims,
)
from xconv.converters.flax.source.templates import closed_form  # noqa: E402
from xconv.converters.flax.source.templates_attention import _causal_mask  # noqa: E402
from xconv.converters.module_tree import (  # noqa: E402
    fold_reshapes,
    inline_chains,
    unpack_splits,
    wrap_line,
)


@pytest.mark.parametrize(
    ("array", "want"),
    [
        (np.arange(10, dtype=np.int64)[None], "np.arange(10, dtype=np.int64)[None]"),
        (np.arange(3, 9, dtype=np.int32), "np.arange(3, 9, dtype=np.int32)"),
        (
            np.tril(np.ones((8, 8), dtype=bool))[None, None],
            "np.tril(np.ones((8, 8), dtype=bool))[None, None]",
        ),
        (np.tril(np.ones((4, 6), dtype=bool), 2), "np.tril(np.ones((4, 6), dtype=bool), 2)"),
        (np.ones((1, 8), dtype=bool), "np.ones((1, 8), dtype=bool)"),
        (np.full((2, 3), 0.5, np.float32), "np.full((2, 3), 0.5, dtype=np.float32)"),
    ],
)
def test_closed_form_computes_the_same_array(array, want):
    got = closed_form(array)
    assert got == want
    value = eval(got, {"np": np})  # noqa: S307 (our own literal)
    assert value.dtype == array.dtype and np.array_equal(value, array)


@pytest.mark.parametrize(
    "array",
    [
        np.array([1, 3, 4]),
        np.triu(np.ones((4, 4), dtype=bool)),
        np.float32([1.0, 2.5]),
        np.int64(3),
    ],
)
def test_closed_form_none_for_other_arrays(array):
    assert closed_form(array) is None


def test_causal_mask():
    tril = np.tril(np.ones((5, 5), dtype=bool))
    assert _causal_mask(tril[None, None])
    assert _causal_mask(np.where(tril, 0.0, -np.inf).astype(np.float32))
    assert not _causal_mask(np.tril(np.ones((4, 5), dtype=bool)))  # not square
    assert not _causal_mask(np.where(tril, 0.0, -1e9).astype(np.float32))  # not -inf
    assert not _causal_mask(np.tril(np.ones((5, 5), dtype=bool), -1))


def test_wrap_line_keeps_the_statement():
    line = (
        "        h = _attention(h, h_3, v, np.tril(np.ones((8, 8), dtype=bool))[None, None], "
        "is_causal=False, scale=0.3535533905932738, q_num_heads=0, kv_num_heads=2)"
    )
    lines = wrap_line(line)
    assert len(lines) > 3 and all(len(ln) <= 100 for ln in lines)
    assert lines[-1] == "        )" and lines[1].endswith(",")
    one = ast.dump(ast.parse(line.strip()))
    assert ast.dump(ast.parse("\n".join(ln[8:] for ln in lines))) == one
    value = (
        '        self.table_with_a_long_name = self.variable("constants", "table_1", jnp.zeros, '
        "(1, 1, 8, 8), jnp.float32).value"
    )
    assert wrap_line(value)[-1] == "        ).value"  # the attribute after the call stays
    short = "        h = self.fc(x)"
    assert wrap_line(short) == [short]
    assert wrap_line("        x = 1  # " + "c" * 100) == ["        x = 1  # " + "c" * 100]


def test_reshape_of_reshape_and_return():
    body = [
        "x = jnp.mean(x, axis=(1, 2), keepdims=True)",
        "x_nchw = jnp.reshape(x, (2, 16, 1, 1))",
        "x = jnp.reshape(x_nchw, (2, 16))",
        "x = self.fc(x)",
        "return x",
    ]
    out = inline_chains(fold_reshapes(body), 92)
    assert out == ["return self.fc(jnp.reshape(jnp.mean(x, axis=(1, 2), keepdims=True), (2, 16)))"]
    # a reshape read twice stays
    kept = ["t = jnp.reshape(x, (4,))", "y = jnp.reshape(t, (2, 2))", "return y + t"]
    assert fold_reshapes(kept) == kept


def test_reshape_of_reshape_reads_the_batch_through():
    """The second reshape's reads of the first's result shape (``t.shape[0]``,
    ``*t.shape[:2]``) are written from the first's target, so the two still fold."""
    body = [
        "x = jnp.mean(x, axis=(1, 2), keepdims=True)",
        "x_nchw = jnp.reshape(x, (x.shape[0], 16, 1, 1))",
        "x = jnp.reshape(x_nchw, (x_nchw.shape[0], 16))",
        "return self.fc(x)",
    ]
    assert fold_reshapes(body)[1:] == ["x = jnp.reshape(x, (x.shape[0], 16))", "return self.fc(x)"]
    whole = ["t = jnp.reshape(h, (*h.shape[:2], 1))", "y = jnp.reshape(t, t.shape[:2])"]
    assert fold_reshapes(whole) == ["y = jnp.reshape(h, h.shape[:2])"]
    split = ["t = jnp.reshape(h, (*h.shape[:2], 4, 8))", "y = jnp.reshape(t, (*t.shape[:3], 8))"]
    assert fold_reshapes(split) == ["y = jnp.reshape(h, (*h.shape[:2], 4, 8))"]
    # an inferred (-1) dimension cannot be read through: both reshapes stay
    kept = ["t = jnp.reshape(h, (-1, 16))", "y = jnp.reshape(t, (t.shape[0], 4, 4))"]
    assert fold_reshapes(kept) == kept


@pytest.mark.parametrize(
    ("arg", "shape", "target", "want"),
    [
        ("h", (2, 10, 32), [2, 10, 4, 8], ["*h.shape[:2]", "4", "8"]),
        ("h", (2, 10, 4, 8), [2, 10, 32], ["*h.shape[:2]", "32"]),
        ("x", (2, 16, 1, 1), [2, 16], ["*x.shape[:2]"]),
        ("x", (2, 16, 1, 1), [2, -1], ["x.shape[0]", "-1"]),
        ("x", (2, 16), [0, 4, 4], ["x.shape[0]", "4", "4"]),
        ("x", (None, 16), [-1, 4, 4], ["-1", "4", "4"]),  # a symbolic batch: nothing shared
        ("x", (2, 10, 32), [20, 32], ["20", "32"]),
        ("x", (6, 4, 5), [3, 8, 0], ["3", "8", "x.shape[2]"]),  # a copied dim after others
        ("self.w[...]", (2, 16), [2, 0], ["2", "16"]),  # not a name: numbers
        ("x", None, [2, 0], ["2", "x.shape[1]"]),
    ],
)
def test_reshape_dims_read_the_shared_leading_dims(arg, shape, target, want):
    assert reshape_dims(arg, shape, target, allowzero=False) == want


def test_wrap_line_splits_the_call_before_a_binary_tail():
    """``x = f(<long args>) + b.reshape(...)``: the call the statement starts with is split
    (as ruff does), not the trailing ``reshape`` whose head would stay over the width."""
    line = (
        "        x = lax.conv_general_dilated(x, self.kernel[...], window_strides=(1, 1), "
        "padding=[(0, 0), (0, 0)], rhs_dilation=(1, 1), dimension_numbers=('NCHW', 'OIHW', "
        "'NCHW'), feature_group_count=1) + self.bias[...].reshape((-1, 1, 1))"
    )
    lines = wrap_line(line)
    assert all(len(ln) <= 100 for ln in lines)
    assert lines[0] == "        x = lax.conv_general_dilated("
    assert lines[-1] == "        ) + self.bias[...].reshape((-1, 1, 1))"
    one = ast.dump(ast.parse(line.strip()))
    assert ast.dump(ast.parse("\n".join(ln[8:] for ln in lines))) == one


def test_split_parts_read_once_are_unpacked():
    lines = [
        "x = list(jnp.split(self.qkv(x), [32, 64], axis=-1))",
        "h = x[0]",
        "h_1 = x[1]",
        "x = x[2]",
        "return h + h_1 + x",
    ]
    assert unpack_splits(lines) == [
        "h, h_1, x = jnp.split(self.qkv(x), [32, 64], axis=-1)",
        "return h + h_1 + x",
    ]
    # two parts read of three: unpacking would fail at run time; the list is still read later
    assert unpack_splits(lines[:3] + ["return h + h_1"]) == lines[:3] + ["return h + h_1"]
    kept = ["y = list(jnp.split(x, [4], axis=0))", "a = y[0]", "b = y[1]", "return y"]
    assert unpack_splits(kept) == kept


def test_long_nnx_list_is_built_a_run_at_a_time():
    from xconv.converters.flax.source.classes import split_nnx_lists

    a = "Block(8, 16, strides=2, downsample=True, rngs=rngs)"
    b = "Block(16, 16, rngs=rngs)"
    line = f"        self.layer2 = nnx.List([{a}, {b}, {b}, {b}])"
    assert len(line) > 100
    got = split_nnx_lists(line)
    assert got.split("\n") == [
        f"        self.layer2 = nnx.List([{a}])",
        f"        self.layer2.extend({b} for _ in range(3))",
    ]
    # the same elements in the same order
    ns = {"nnx": type("nnx", (), {"List": list}), "Block": lambda *a, **k: (a, k), "rngs": 0}
    ns["self"] = type("Self", (), {})()
    exec(textwrap.dedent(got), ns)
    assert ns["self"].layer2 == eval(f"[{a}, {b}, {b}, {b}]", ns)
    # a short list, or a comprehension however long, stays as it is
    short = f"        self.layer1 = nnx.List([{b}, {b}])"
    assert split_nnx_lists(short) == short
    many = f"        self.layer1 = nnx.List([{a.replace('8', '8' * 30)} for _ in range(2)])"
    assert len(many) > 100 and split_nnx_lists(many) == many


def _mean_then_reshape(target: list[int], axes: list[int]) -> ir.Model:
    x = ir.Value(name="x", shape=ir.Shape([2, 16, 3, 3]), type=ir.TensorType(ir.DataType.FLOAT))
    ax = ir.Value(name="axes", const_value=ir.tensor(np.array(axes, dtype=np.int64)))
    shp = ir.Value(name="shp", const_value=ir.tensor(np.array(target, dtype=np.int64)))
    mean = ir.Node("", "ReduceMean", [x, ax], [ir.AttrInt64("keepdims", 1)], name="mean")
    reshape = ir.Node("", "Reshape", [mean.outputs[0], shp], name="reshape")
    reshape.outputs[0].shape = ir.Shape(target)
    head = ir.Node("", "Relu", [reshape.outputs[0]], name="relu")
    head.outputs[0].name = "y"
    graph = ir.Graph(
        [x],
        head.outputs,
        nodes=[mean, reshape, head],
        initializers=[ax, shp],
        opset_imports={"": 18},
    )
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize(
    ("target", "axes", "folds"),
    [
        ([2, 16], [2, 3], True),
        ([2, 16], [-1, -2], True),
        ([2, 16, 1], [2, 3], False),  # keeps a unit axis
        ([32, 1], [2, 3], False),  # not just the unit axes dropped
        ([2, 3], [1, 2], True),  # (2, 1, 1, 3) -> (2, 3)
        ([3, 2], [1, 2], False),  # the same count, other dims
    ],
)
def test_reduce_then_reshape_dropping_its_unit_axes_is_one_reduce(target, axes, folds):
    model = fold_reduce_reshapes(_mean_then_reshape(target, axes))
    ops = [n.op_type for n in model.graph]
    mean = next(n for n in model.graph if n.op_type == "ReduceMean")
    if folds:
        assert ops == ["ReduceMean", "Relu"]
        assert mean.attributes["keepdims"].value == 0
        assert list(mean.outputs[0].shape) == target
    else:
        assert ops == ["ReduceMean", "Reshape", "Relu"]
        assert mean.attributes["keepdims"].value == 1


@pytest.mark.parametrize(
    ("mask", "dropped"),
    [
        (np.ones((2, 1, 4, 4), dtype=bool), True),
        (np.zeros((1, 1, 4, 4), dtype=np.float32), True),
        (np.tril(np.ones((4, 4), dtype=bool)), False),
        (np.where(np.tril(np.ones((4, 4))), 0.0, -np.inf).astype(np.float32), False),
        (np.full((4, 4), 0.5, dtype=np.float32), False),
    ],
)
def test_attention_mask_that_masks_nothing_is_dropped(mask, dropped):
    def value(name):
        t = ir.TensorType(ir.DataType.FLOAT)
        return ir.Value(name=name, shape=ir.Shape([2, 2, 4, 8]), type=t)

    q, k, v = value("q"), value("k"), value("v")
    const = ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(mask))], name="c")
    const.outputs[0].name = "mask"
    att = ir.Node("", "Attention", [q, k, v, const.outputs[0]], name="att")
    att.outputs[0].name = "y"
    graph = ir.Graph([q, k, v], att.outputs, nodes=[const, att], opset_imports={"": 23})
    model = drop_noop_attention_masks(ir.Model(graph, ir_version=10))
    ops = [n.op_type for n in model.graph]
    if dropped:
        assert ops == ["Attention"] and att.inputs[3] is None
    else:
        assert ops == ["Constant", "Attention"] and att.inputs[3] is const.outputs[0]
