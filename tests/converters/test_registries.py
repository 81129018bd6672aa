"""The source templates and the Flax frontend's primitives use converters/registry.py's
rules: a user registration (custom domain, or over a built-in) wins, unregistering restores
the built-in one, a missing op is listed once with the function to register it."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from xconv.errors import UnsupportedOpError


def _model(op: str, domain: str = "", **attrs) -> ir.Model:
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", T.FLOAT, [2, 3])
    node = h.make_node(op, ["x"], ["y"], domain=domain, **attrs)
    opsets = [h.make_opsetid("", 23)] + ([h.make_opsetid(domain, 1)] if domain else [])
    proto = h.make_model(h.make_graph([node], "g", [x], [y]), opset_imports=opsets)
    return ir.serde.deserialize_model(proto)


def test_torch_source_user_templates_custom_domain_and_override():
    pytest.importorskip("torch")
    from xconv.converters.torch.source import templates
    from xconv.converters.torch.source.emitter import generate

    with pytest.raises(UnsupportedOpError) as info:
        generate(_model("Scale", "my.ops", alpha=3.0))
    msg = str(info.value)
    assert "my.ops::Scale x1" in msg
    assert "xconv.converters.torch.source.templates.register(op_type" in msg
    try:
        templates.register("Scale", domain="my.ops", attrs={"alpha": 1.0})(
            lambda c: f"{c.args[0]} * {c.attrs['alpha']}"
        )
        templates.register("Relu")(lambda c: f"torch.clamp({c.args[0]}, min=0.0)")
        src, _ = generate(_model("Scale", "my.ops", alpha=3.0))
        assert "* 3.0" in src
        src, _ = generate(_model("Relu"))
        assert "torch.clamp(x, min=0.0)" in src and "torch.relu" not in src
    finally:
        templates.registry.unregister("Scale", domain="my.ops")
        templates.registry.unregister("Relu")
    src, _ = generate(_model("Relu"))
    assert "torch.clamp(" not in src and "torch.relu(x)" in src
    with pytest.raises(UnsupportedOpError):
        generate(_model("Scale", "my.ops", alpha=3.0))


def test_torch_source_templates_reject_undeclared_attributes():
    pytest.importorskip("torch")
    from xconv.converters.torch.source import templates
    from xconv.converters.torch.source.emitter import generate
    from xconv.errors import UnsupportedAttributeError

    try:
        templates.register("Scale", domain="my.ops", attrs={"alpha": 1.0})(
            lambda c: f"{c.args[0]} * {c.attrs['alpha']}"
        )
        with pytest.raises(UnsupportedAttributeError, match="beta"):
            generate(_model("Scale", "my.ops", alpha=3.0, beta=1.0))
    finally:
        templates.registry.unregister("Scale", domain="my.ops")


def test_flax_primitive_user_handler_wins_and_unregister_restores():
    jax = pytest.importorskip("jax")
    from xconv.converters.flax.importer import primitives
    from xconv.converters.flax.importer.trace import from_jax

    def fn(params, x):
        return jax.numpy.sin(x)

    x = np.ones((2, 3), np.float32)
    ops = lambda m: [n.op_type for n in m.graph]  # noqa: E731
    assert "Sin" in ops(from_jax(fn, {}, (x,), dynamic_batch=False))
    try:

        @primitives.register("sin")
        def _sin_as_cos(ctx, eqn, inputs):
            return [ctx.op("Cos", inputs)]

        got = ops(from_jax(fn, {}, (x,), dynamic_batch=False))
        assert "Cos" in got and "Sin" not in got
    finally:
        primitives.registry.unregister("sin", domain=primitives.DOMAIN)
    assert "Sin" in ops(from_jax(fn, {}, (x,), dynamic_batch=False))


def test_flax_primitive_registry_rejects_a_bad_name():
    pytest.importorskip("jax")
    from xconv.converters.flax.importer import primitives

    with pytest.raises(ValueError, match="invalid op type"):
        primitives.register("bad name")(lambda ctx, eqn, inputs: inputs)
