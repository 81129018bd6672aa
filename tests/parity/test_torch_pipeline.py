"""The real pipeline: torch module -> xconv.from_torch -> xconv.to_jax, then broken on
purpose (in the IR or the params) and checked against the torch module."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

import xconv
from tests.parity.models import SmallCNN
from xconv.ir.metadata import get_scope

pytest.importorskip("torch")

X_SHAPE = (2, 3, 12, 12)


@pytest.fixture(scope="module")
def setup():
    net = SmallCNN(blocks=2)
    x = np.random.default_rng(0).uniform(-1, 1, X_SHAPE).astype(np.float32)
    model = xconv.from_torch(net, (torch.from_numpy(x),))
    return net, x, ir.to_proto(model)


def _node(model, op, scope):
    return next(n for n in model.graph if n.op_type == op and get_scope(n) == scope)


def _gelu_tanh(m):
    _node(m, "Gelu", "blocks.1.act").attributes["approximate"] = ir.AttrString(
        "approximate", "tanh"
    )


def _bn_eps(m):
    _node(m, "BatchNormalization", "blocks.0.bn").attributes["epsilon"] = ir.AttrFloat32(
        "epsilon", 1e-3
    )


def _pads(m):
    _node(m, "Conv", "stem").attributes["pads"] = ir.AttrInt64s("pads", [2, 2, 0, 0])


def _get(params, dotted):
    node = params
    for k in dotted.split(".")[:-1]:
        node = node[k]
    return node, dotted.split(".")[-1]


def _transpose(params):
    node, k = _get(params, "blocks.1.conv.weight")
    node[k] = np.swapaxes(np.asarray(node[k]), 2, 3)


def _scale(params):
    node, k = _get(params, "blocks.0.conv.weight")
    node[k] = node[k] * 1.001


CASES = {
    "gelu_tanh": (_gelu_tanh, None, "blocks.1.act"),
    "bn_eps": (_bn_eps, None, "blocks.0.bn"),
    "pads": (_pads, None, "stem"),
    "kernel_transposed": (None, _transpose, "blocks.1.conv"),
    "weight_scaled": (None, _scale, "blocks.0.conv"),
}


def test_converted_model_passes_with_grads(setup):
    net, x, proto = setup
    fn, params = xconv.to_jax(ir.from_proto(proto))
    report = xconv.check_parity(net, (fn, params), x, grads=True)
    assert report.passed, report.summary()
    assert any(m.name == "d/blocks.0.conv.weight" for m in report.grads)


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_conversion_localised(setup, case):
    net, x, proto = setup
    break_ir, break_params, scope = CASES[case]
    model = ir.from_proto(proto)
    if break_ir:
        break_ir(model)
    fn, params = xconv.to_jax(model)
    if break_params:
        break_params(params)
    report = xconv.check_parity(net, (fn, params), x)
    assert not report.passed
    assert report.first_divergence == scope, report.summary()


def test_emitted_flax_module_localised_against_torch(setup, tmp_path):
    """to_flax output (NHWC, blocks as nested submodules) is matched to torch scopes."""
    pytest.importorskip("flax")
    import jax

    net, x, proto = setup
    out = xconv.to_flax(ir.from_proto(proto), tmp_path / "flax")
    from xconv.parity import check_files
    from xconv.parity.checker import _load_flax_dir

    with pytest.raises(xconv.UsageError, match="--trust-code"):
        check_files(out, out, x)
    module, variables = _load_flax_dir(out)
    assert xconv.check_parity(net, (module, variables), x).passed
    bad = jax.tree_util.tree_map(lambda a: a, variables)
    block = bad["params"]["blocks_1"]  # the module tree: each block a nested submodule
    block["conv"]["kernel"] = block["conv"]["kernel"] * 1.001
    report = xconv.check_parity(net, (module, bad), x)
    assert not report.passed
    assert report.first_divergence == "blocks.1.conv", report.summary()
