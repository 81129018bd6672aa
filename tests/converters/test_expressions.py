"""The templates both source emitters take from ``converters/expressions.py``: one
definition, each emitter's namespace, and each emitter's own forms kept where they differ."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from xconv.converters import expressions as ex
from xconv.converters.flax.source import templates as flax_t
from xconv.converters.torch.source import templates as torch_t


def _call(mod, op, args, attrs=None, dtype=ir.DataType.FLOAT, **extra):
    ins = [ir.Value(name=f"i{i}", type=ir.TensorType(dtype), shape=ir.Shape([2, 3])) for i in args]
    node = ir.Node("", op, inputs=ins, num_outputs=1)
    node.outputs[0].dtype = dtype
    return mod.OpCall(
        node=node,
        args=list(args),
        consts=[None] * len(args),
        shapes=[(2, 3)] * len(args),
        attrs=dict(attrs or {}),
        **extra,
    )


def _emit(mod, op, args, attrs=None, **extra):
    tpl = mod.registry[op]
    return tpl.fn(_call(mod, op, args, {**tpl.attrs, **(attrs or {})}, **extra))


@pytest.mark.parametrize("op", sorted(ex.UNARY))
def test_shared_unary_in_each_namespace(op):
    fmt = ex.UNARY[op]
    assert _emit(torch_t, op, ["x"]) == fmt.format("x", xp="torch")
    assert _emit(flax_t, op, ["x"], xp="jnp") == fmt.format("x", xp="jnp")
    assert _emit(flax_t, op, ["x"], xp="np") == fmt.format("x", xp="np")


@pytest.mark.parametrize("op", sorted(ex.BINARY))
def test_shared_binary_in_each_namespace(op):
    fmt = ex.BINARY[op]
    assert _emit(torch_t, op, ["a", "b"]) == fmt.format("a", "b", xp="torch")
    assert _emit(flax_t, op, ["a", "b"], xp="jnp") == fmt.format("a", "b", xp="jnp")


def test_forms_that_differ_stay_per_emitter():
    assert _emit(torch_t, "Pow", ["a", "b"]) == "torch.pow(a, b)"
    assert _emit(flax_t, "Pow", ["a", "b"], xp="jnp") == "jnp.power(a, b)"
    assert _emit(torch_t, "Asin", ["x"]) == "torch.asin(x)"
    assert _emit(flax_t, "Asin", ["x"], xp="jnp") == "jnp.arcsin(x)"
    assert torch_t.dtype_expr(ir.DataType.BOOL) == "torch.bool"
    assert flax_t.dtype_expr(ir.DataType.BOOL, "np") == "np.bool_"
    assert flax_t.dtype_expr(ir.DataType.BFLOAT16, "np") == "jnp.bfloat16"


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({}, "a @ b + c"),
        ({"transA": 1, "alpha": 0.5}, "0.5 * (a.T @ b) + c"),
        ({"transB": 1, "beta": 2.0}, "a @ b.T + 2.0 * c"),
    ],
)
def test_gemm_generic_form_is_shared(attrs, expected):
    assert _emit(flax_t, "Gemm", ["a", "b", "c"], attrs, xp="jnp") == expected
    assert _emit(torch_t, "Gemm", ["a", "b", "c"], attrs) == expected


def test_gemm_torch_linear_form_first():
    assert _emit(torch_t, "Gemm", ["x", "w", "b"], {"transB": 1}) == "F.linear(x, w, b)"


def test_folds_mod_where_matmul():
    assert _emit(torch_t, "Min", ["a", "b", "c"]) == "torch.minimum(torch.minimum(a, b), c)"
    assert _emit(flax_t, "Min", ["a", "b", "c"], xp="np") == "np.minimum(np.minimum(a, b), c)"
    assert _emit(torch_t, "Mod", ["a", "b"], {"fmod": 1}) == "torch.fmod(a, b)"
    assert _emit(flax_t, "Mod", ["a", "b"], xp="jnp") == "jnp.remainder(a, b)"
    assert _emit(flax_t, "Where", ["m", "a", "b"], xp="np") == "np.where(m, a, b)"
    assert _emit(torch_t, "Mean", ["a", "b"]) == "(a + b) / 2"
    assert _emit(flax_t, "Sum", ["a", "b", "c"], xp="jnp") == "a + b + c"
    assert _emit(torch_t, "MatMul", ["a", "b"]) == "a @ b"


def test_literals_and_dtype_errors():
    a = np.arange(3, dtype=np.int32)
    assert torch_t.tensor_literal(a) == "torch.tensor([0, 1, 2], dtype=torch.int32)"
    assert flax_t.array_literal(a) == "np.asarray([0, 1, 2], dtype=np.int32)"
    assert flax_t.array_literal(np.float32(1.5), bare_scalar=True) == "1.5"
    with pytest.raises(Exception, match="PyTorch source emitter does not write dtype"):
        torch_t.dtype_expr(ir.DataType.STRING)
    with pytest.raises(Exception, match="Flax emitter does not write dtype"):
        flax_t.dtype_expr(None)


def test_shared_attribute_tables():
    for op, table in (
        ("Gemm", ex.GEMM_ATTRS),
        ("Conv", ex.CONV_ATTRS),
        ("ConvTranspose", ex.CONV_TRANSPOSE_ATTRS),
        ("MaxPool", ex.MAX_POOL_ATTRS),
        ("AveragePool", ex.AVERAGE_POOL_ATTRS),
    ):
        assert flax_t.registry[op].attrs == table == torch_t.registry[op].attrs
