"""check_parity catches deliberately broken conversions and names the broken scope."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import xconv
from tests.parity.models import DeepMLP, SmallCNN, cnn_ir, mlp_ir
from xconv.parity import InputSpec, Policy

X_SHAPE = (2, 3, 12, 12)


@pytest.fixture(scope="module")
def net():
    return SmallCNN(blocks=2)


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).uniform(-1, 1, X_SHAPE).astype(np.float32)


def _scale(params, path, factor):
    node = params
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = node[path[-1]] * factor
    return params


def _transpose_hw(params, path):
    node = params
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = np.swapaxes(np.asarray(node[path[-1]]), 2, 3)
    return params


BUGS = {
    "gelu_tanh_for_exact": (dict(gelu={"blocks.1.act": "tanh"}), None, "blocks.1.act"),
    "batchnorm_eps_1e-3": (dict(bn_eps={"blocks.0.bn": 1e-3}), None, "blocks.0.bn"),
    "padding_off_by_one": (dict(stem_pads=(2, 2, 0, 0)), None, "stem"),
    "kernel_transposed": (
        {},
        lambda p: _transpose_hw(p, ["blocks", "1", "conv", "weight"]),
        "blocks.1.conv",
    ),
    "weight_scaled_1.001": (
        {},
        lambda p: _scale(p, ["blocks", "0", "conv", "weight"], 1.001),
        "blocks.0.conv",
    ),
}


def test_correct_conversion_passes(net, x):
    fn, params = xconv.to_jax(cnn_ir(net))
    report = xconv.check_parity(net, (fn, params), x)
    assert report.passed, report.summary()
    assert report.first_divergence is None
    assert report.outputs[0].bound is not None  # judged against the float64 oracle
    assert report.outputs[0].cosine > 0.999999


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_broken_conversion_is_caught_and_localised(net, x, bug):
    ir_kwargs, perturb, scope = BUGS[bug]
    fn, params = xconv.to_jax(cnn_ir(net, **ir_kwargs))
    if perturb is not None:
        params = perturb(params)
    report = xconv.check_parity(net, (fn, params), x)
    assert not report.passed
    assert report.first_divergence == scope, report.summary()
    statuses = {s.name: s.status for s in report.scopes}
    assert statuses[scope] == "diverged"
    order = [s.name for s in report.scopes]
    # Everything that completes before the broken scope is within tolerance.
    before = [s for s in report.scopes[: order.index(scope)] if not scope.startswith(s.name + ".")]
    assert all(s.status == "ok" for s in before), [(s.name, s.status) for s in before]
    assert statuses["fc"] == "propagated"
    assert report.outputs[0].mismatches > 0


def test_broken_onnx_candidate_localised_through_onnxruntime(net, x):
    model = cnn_ir(net, bn_eps={"blocks.1.bn": 1e-3})
    report = xconv.check_parity(net, model, x)
    assert not report.passed
    assert report.first_divergence == "blocks.1.bn", report.summary()
    assert report.matrix[0].framework == "onnxruntime"


def test_onnx_reference_oracle_and_check_files(net, x, tmp_path):
    good, bad = tmp_path / "ref.onnx", tmp_path / "out"
    xconv.save(cnn_ir(net), good)
    xconv.save(cnn_ir(net, gelu={"blocks.0.act": "tanh"}), bad / "model.onnx")
    from xconv.parity import check_files

    same = check_files(good, good, x)
    assert same.passed, same.summary()
    assert not any("fell back" in n for n in same.notes), same.notes
    report = check_files(good, bad, x)
    assert not report.passed
    assert report.first_divergence == "blocks.0.act", report.summary()


def test_deep_fp32_network_passes_oracle_but_catches_a_1e4_scaling():
    torch.manual_seed(3)
    net = DeepMLP(width=64, depth=24)
    assert sum(1 for _ in net.modules() if isinstance(_, torch.nn.Linear)) >= 49
    model = mlp_ir(net, batch=8)
    fn, params = xconv.to_jax(model)
    spec = [InputSpec((8, 32), "float32", -2.0, 2.0)]
    report = xconv.check_parity(net, (fn, params), input_spec=spec)
    assert report.passed, report.summary()
    out = report.outputs[0]
    # Deep fp32 drift is real (the reference itself is off the oracle)...
    assert out.ref_err > 0
    # ...yet far from the bound; and a tiny real bug is not.
    params = _scale(params, ["layers", "20", "fc2", "weight"], 1 + 1e-4)
    broken = xconv.check_parity(net, (fn, params), input_spec=spec)
    assert not broken.passed
    assert broken.first_divergence == "layers.20.fc2", broken.summary()


def test_dtype_policy_and_explicit_tolerances(net, x):
    fn, params = xconv.to_jax(cnn_ir(net, gelu={"blocks.1.act": "tanh"}))
    strict = xconv.check_parity(net, (fn, params), x, policy="dtype")
    assert not strict.passed
    assert strict.outputs[0].rtol == pytest.approx(1.3e-6) and strict.outputs[
        0
    ].atol == pytest.approx(1e-5)
    loose = xconv.check_parity(net, (fn, params), x, policy=Policy(rtol=1e-2, atol=1e-3))
    assert loose.passed, loose.summary()
    assert xconv.check_parity(net, (fn, params), x, rtol=1e-2, atol=1e-3).passed


def test_gradients_match_and_catch_a_scaled_weight(net, x):
    fn, params = xconv.to_jax(cnn_ir(net))
    report = xconv.check_parity(net, (fn, params), x, grads=True)
    assert report.passed, report.summary()
    names = {m.name for m in report.grads}
    assert {"d/input_0", "d/stem.weight", "d/fc.bias", "d/blocks.1.bn.weight"} <= names
    assert len(names) - 1 == len(list(net.parameters()))  # every weight, by to_jax's names
    assert any("xconv.to_jax function's weight names" in n for n in report.notes)
    params = _scale(params, ["blocks", "1", "conv", "weight"], 1.001)
    broken = xconv.check_parity(net, (fn, params), x, grads=True, intermediates=False)
    assert not broken.passed
    bad = {m.name for m in broken.grads if not m.passed}
    assert "d/blocks.1.conv.weight" in bad


def test_devices_matrix_and_reports(net, x, tmp_path):
    fn, params = xconv.to_jax(cnn_ir(net, bn_eps={"blocks.0.bn": 1e-3}))
    report = xconv.check_parity(net, (fn, params), x, devices="cpu")
    assert {(r.framework, r.device) for r in report.matrix} == {("jax", "cpu:0")}
    assert [r.inputs for r in report.matrix] == [s["name"] for s in report.input_sets]
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data["first_divergence"] == "blocks.0.bn"
    assert data["passed"] is False and data["scopes"]
    page = report.to_html(tmp_path / "r.html")
    assert "<svg" in page and "blocks.0.bn" in page
    assert (tmp_path / "r.html").read_text() == page
    text = report.summary()
    assert "first divergence: scope 'blocks.0.bn'" in text and "FAILED" in text
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report)
    assert "blocks.0.bn" in console.export_text()


def test_flax_linen_localised_against_torch():
    import flax.linen as nn
    import jax

    class FMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(16, name="fc1")(x), approximate=False)
            return nn.Dense(4, name="fc2")(nn.Dense(16, name="mid")(x))

    class TMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.mid, self.fc2 = (
                torch.nn.Linear(8, 16),
                torch.nn.Linear(16, 16),
                torch.nn.Linear(16, 4),
            )

        def forward(self, x):
            return self.fc2(self.mid(torch.nn.functional.gelu(self.fc1(x))))

    tnet = TMLP().eval()
    variables = {
        "params": {
            n: {
                "kernel": getattr(tnet, n).weight.detach().numpy().T,
                "bias": getattr(tnet, n).bias.detach().numpy(),
            }
            for n in ("fc1", "mid", "fc2")
        }
    }
    module = FMLP()
    xs = np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32)
    assert xconv.check_parity(tnet, (module, variables), xs).passed
    bad = jax.tree_util.tree_map(lambda a: a, variables)
    bad["params"]["mid"]["kernel"] = bad["params"]["mid"]["kernel"] * 1.001
    report = xconv.check_parity(tnet, (module, bad), xs)
    assert not report.passed
    assert report.first_divergence == "mid", report.summary()


def test_oracle_fallback_is_reported():
    w = torch.randn(4, 4)

    def f(a):  # closes over a float32 weight: no float64 twin
        return a @ w

    report = xconv.check_parity(f, f, input_spec=[(3, 4)])
    assert report.passed
    assert any("fell back to the dtype policy" in n for n in report.notes)
    assert "dtype" in report.policy


def test_generated_inputs_are_deterministic_and_respect_vocab():
    from xconv.parity import make_inputs

    specs = [
        InputSpec((4, 5), "int64", vocab=7),
        {"shape": (2, 3), "dtype": "float32", "low": 0, "high": 1},
    ]
    a = make_inputs(None, specs, [])
    b = make_inputs(None, specs, [])
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert a[0].dtype == np.int64 and a[0].min() >= 0 and a[0].max() < 7
    assert a[1].dtype == np.float32 and a[1].min() >= 0 and a[1].max() < 1


def test_jax_conversion_as_reference_with_its_own_float64_oracle(net, x):
    import copy

    fn, params = xconv.to_jax(cnn_ir(net))
    report = xconv.check_parity((fn, params), net, x)
    assert report.passed, report.summary()
    assert report.outputs[0].bound is not None and not report.notes  # x64 oracle ran
    bad = copy.deepcopy(net)
    bad.blocks[1].bn.eps = 1e-3
    broken = xconv.check_parity((fn, params), bad, x)
    assert broken.first_divergence == "blocks.1.bn", broken.summary()


def test_reference_pinned_to_float32_still_gets_a_float64_oracle(tmp_path):
    """A Flax reference whose layers pin ``dtype=float32`` gets its float64 twin by running
    those layers in float64 (not the candidate's own float64 run, which would let the
    candidate set its tolerance): a correct conversion passes, a x1.001 weight fails."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    nn = pytest.importorskip("flax.linen")
    torch = pytest.importorskip("torch")
    from tests.torch_source import load_generated

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(8):
                x = nn.gelu(nn.Dense(32, dtype=jnp.float32)(x)) + x
            return nn.Dense(10, dtype=jnp.float32)(x) * 50.0

    module = Deep()
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    variables = module.init(jax.random.PRNGKey(0), x)
    generated, _ = load_generated(xconv.from_flax(module, variables, (x,)), tmp_path)
    generated.eval()
    report = xconv.check_parity((module, variables), generated, (x,))
    assert report.passed, report.summary()
    assert report.policy.startswith("oracle"), report.summary()
    with torch.no_grad():
        next(generated.parameters()).mul_(1.001)
    bugged = xconv.check_parity((module, variables), generated, (x,))
    assert not bugged.passed
