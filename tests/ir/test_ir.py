from __future__ import annotations

import numpy as np
import pytest

import xconv
from xconv.converters.registry import REQUIRED, Registry
from xconv.demo import build_demo_model
from xconv.errors import UnsupportedAttributeError, UnsupportedOpError
from xconv.ir import LAYER, ROLE, SCOPE, get_layer
from xconv.ir.builder import GraphBuilder
from xconv.ir.layers import layer_json
from xconv.ir.naming import flatten, nest, split_path
from xconv.ir.printer import format_model
from xconv.ir.verifier import verify


def test_builder_model_verifies_and_carries_metadata():
    model = build_demo_model()
    verify(model)
    conv = next(n for n in model.graph if n.op_type == "Conv")
    assert conv.metadata_props[SCOPE] == "conv"
    assert get_layer(conv)["kind"] == "conv"
    assert model.graph.initializers["conv.weight"].metadata_props[ROLE] == "kernel"


def test_printer_is_deterministic_and_shows_metadata():
    a = format_model(build_demo_model())
    b = format_model(build_demo_model())
    assert a == b
    assert "scope=conv" in a and '"kind": "conv"' in a
    assert "Conv(%x, %conv.weight, %conv.bias)" in a


def test_printer_survives_save_and_load(tmp_path):
    model = build_demo_model()
    xconv.save(model, tmp_path / "m.onnx")
    assert format_model(xconv.load(tmp_path / "m.onnx")) == format_model(model)


def test_verifier_rejects_shape_errors():
    b = GraphBuilder()
    x = b.input("x", np.float32, (2, 3))
    w = b.constant(np.ones((4, 5), np.float32))
    y = b.op("MatMul", [x, w])
    model = b.build([y], infer_shapes=False)
    with pytest.raises(xconv.InvalidModelError):
        verify(model)


def test_naming_nests_and_flattens():
    flat = {"layer1.0.conv1.weight": 1, "layer1.0.bn1.bias": 2, "fc/kernel": 3, "a.b": 4, "a": 5}
    tree = nest(flat)
    assert tree["layer1"]["0"]["conv1"]["weight"] == 1
    assert tree["fc"]["kernel"] == 3
    assert flatten(tree, flat) == flat  # "a" collides with "a.b" and stays whole
    assert split_path("x") == ("x",)


def test_layer_schema_rejects_unknown_and_missing_keys():
    assert '"kind": "dropout"' in layer_json("dropout", rate=0.1)
    with pytest.raises(ValueError, match="missing"):
        layer_json("dense", in_features=3)
    with pytest.raises(ValueError, match="unknown layer kind"):
        layer_json("conv9d")
    assert LAYER == "xconv.layer"


def test_registry_scans_whole_graph_and_validates_attributes():
    reg = Registry("test")

    @reg.builtin("Relu")
    def relu(ctx, x):
        return x

    @reg.builtin("Flatten", attrs={"axis": REQUIRED})
    def flatten_(ctx, x, *, axis):
        return x

    model = build_demo_model()
    with pytest.raises(UnsupportedOpError) as info:
        reg.check_supported(model)
    missing = {m.op_type: m for m in info.value.missing}
    assert set(missing) == {"Conv", "BatchNormalization", "GlobalAveragePool", "Gemm"}
    assert missing["Conv"].first_scope == "conv" and missing["Conv"].count == 1
    assert "Register a handler" in str(info.value)
    flat_node = next(n for n in model.graph if n.op_type == "Flatten")
    handler, _ = reg.lookup("", "Flatten", 23)
    assert handler.parse_attributes(flat_node) == {"axis": 1}
    handler, _ = reg.lookup("", "Relu", 23)
    with pytest.raises(UnsupportedAttributeError, match="not supported"):
        handler.parse_attributes(flat_node)


def test_user_registration_wins():
    reg = Registry("test")
    reg.builtin("Relu")(lambda ctx, x: "builtin")
    reg.register("Relu")(lambda ctx, x: "user")
    handler, _ = reg.lookup("", "Relu", 23)
    assert handler.fn(None, 0) == "user"


def test_registry_opset_ranges():
    reg = Registry("test")
    reg.builtin("Squeeze", until=12, attrs={"axes": None})(lambda ctx, x, *, axes: "old")
    reg.builtin("Squeeze", since=13)(lambda ctx, x, axes=None: "new")
    assert reg.lookup("", "Squeeze", 11)[0].fn(None, 0, axes=None) == "old"
    assert reg.lookup("", "Squeeze", 21)[0].fn(None, 0) == "new"
    assert reg.lookup("", "Nope", 21) == (None, "no handler registered for Nope")
