"""Device-aware precision: the policy judges each row at the precision its dots ran at.

No accelerator here: :mod:`tests.parity.simulate` runs a ``gpu:0`` / ``tpu:0`` row on the
CPU with every dot's inputs rounded as TF32 / one bfloat16 pass round them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import xconv
from tests.parity import models as M
from tests.parity.simulate import simulated_accelerator
from xconv.errors import ParityConfigError
from xconv.parity import precision as prec
from xconv.parity.policies import DOT_UNIT_ROUNDOFF, Policy


@pytest.mark.parametrize(
    ("platform", "kind", "cc", "setting", "expected"),
    [
        ("cpu", "cpu", None, None, "float32"),
        ("cpu", "cpu", None, "bfloat16", "float32"),
        ("gpu", "NVIDIA H100 80GB HBM3", "9.0", None, "tf32"),
        ("gpu", "NVIDIA H200", "9.0", "high", "tf32"),
        ("gpu", "NVIDIA H200", "9.0", "tensorfloat32", "tf32"),
        ("gpu", "NVIDIA H200", "9.0", "highest", "float32"),
        ("gpu", "NVIDIA H200", "9.0", "float32", "float32"),
        ("gpu", "NVIDIA A100-SXM4-40GB", "8.0", "default", "tf32"),
        ("gpu", "Tesla V100-SXM2-16GB", "7.0", None, "float32"),
        ("gpu", "Tesla T4", None, None, "float32"),
        ("gpu", "NVIDIA H100", "9.0", "BF16_BF16_F32", "bf16"),
        ("gpu", "NVIDIA H100", "9.0", "F32_F32_F32", "float32"),
        ("tpu", "TPU v5 lite", None, None, "bf16"),
        ("tpu", "TPU v4", None, "bfloat16", "bf16"),
        ("tpu", "TPU v4", None, "high", "bf16_3x"),
        ("tpu", "TPU v4", None, "bfloat16_3x", "bf16_3x"),
        ("tpu", "TPU v4", None, "highest", "float32"),
        ("tpu", "TPU v4", None, "BF16_BF16_F32_X6", "float32"),
    ],
)
def test_jax_precision_by_device_and_setting(platform, kind, cc, setting, expected):
    assert prec.jax_precision(platform, kind, cc, setting) == expected


def test_jax_setting_follows_the_context():
    import jax

    assert prec.jax_setting() is None
    with jax.default_matmul_precision("highest"):
        assert prec.jax_setting() == "highest"


def test_float32_bound_unchanged_and_reduced_floor():
    base = Policy()
    assert base.dot_rel == 0.0 and base.at_precision("float32", 50).dot_rel == 0.0
    tf32 = base.at_precision("tf32", 16)
    assert tf32.dot_rel == pytest.approx(8 * 2**-11 * 4)
    assert base.at_precision("bf16", 16).dot_rel == pytest.approx(8 * 2**-8 * 4)
    assert set(DOT_UNIT_ROUNDOFF) == {"float32", "tf32", "bf16", "bf16_3x"}
    assert "tf32" in tf32.describe_precision() and "L = 16" in tf32.describe_precision()
    with pytest.raises(ParityConfigError, match="precision"):
        Policy(precision="fp8")
    with pytest.raises(ParityConfigError, match="highest"):
        xconv.check_parity(lambda x: x, lambda x: x, np.ones(3), precision="fast")


def test_compare_widens_by_the_floor_only_off_float32():
    from xconv.parity.metrics import compare

    rng = np.random.default_rng(0)
    oracle = rng.standard_normal(1000)
    ref = oracle.astype(np.float32)
    cand = (oracle * (1 + 2**-11 * rng.standard_normal(1000))).astype(np.float32)
    assert not compare("y", cand, ref, Policy(), oracle).passed
    assert compare("y", cand, ref, Policy().at_precision("tf32", 4), oracle).passed
    # A systematic 2 % error stays out of a TF32 bound of depth 4 (8 * 2^-11 * 2 = 0.8 %).
    wrong = (oracle * 1.02).astype(np.float32)
    assert not compare("y", wrong, ref, Policy().at_precision("tf32", 4), oracle).passed
    assert not compare("y", wrong, ref, Policy(kind="dtype").at_precision("tf32", 4)).passed


def test_jaxpr_depth_counts_chained_dots():
    import jax.numpy as jnp

    def f(w, x):
        h = jnp.tanh(x @ w)  # 1
        h = (h @ w) + (x @ w)  # 2 (the parallel branch is shorter)
        return jnp.sum(h @ w)  # 3

    w = np.ones((4, 4), np.float32)
    assert prec.jaxpr_dot_depth(f, w, np.ones((2, 4), np.float32)) == 3
    assert prec.jaxpr_dot_depth(lambda x: x + 1, np.ones(3)) == 1


def test_torch_depth_and_precision_on_cpu():
    import torch

    net = M.SmallCNN(blocks=2)
    depth, conv = prec.torch_dot_depth(net, (torch.zeros(1, 3, 8, 8),))
    assert depth == 4 and conv  # stem, two block convs, fc
    assert prec.torch_precision("cpu", True) == "float32"


def _cnn():
    net = M.SmallCNN()
    x = np.random.default_rng(0).standard_normal((2, 3, 12, 12)).astype(np.float32)
    return net, x, xconv.to_jax(M.cnn_ir(net))


@pytest.mark.parametrize(("kind", "expected"), [("gpu", "tf32"), ("tpu", "bf16")])
def test_right_model_passes_at_the_simulated_default_and_names_it(kind, expected):
    net, x, cand = _cnn()
    with simulated_accelerator(kind) as dev:
        report = xconv.check_parity(net, cand, x, n_random=0, edges=False)
        strict = xconv.check_parity(
            net, cand, x, n_random=0, edges=False, precision="highest", intermediates=False
        )
    rows = {r.device: r for r in report.matrix}
    assert report.passed, report.summary()
    assert rows["cpu:0"].precision == "float32" and rows[dev].precision == expected
    assert rows[dev].dot_depth == 4
    assert f"precision={expected}" in report.summary()
    assert f"<td>{expected}</td>" in report.to_html()
    assert json.loads(report.to_json())["matrix"][1]["precision"] == expected
    assert any(expected in n and "dots" in n for n in report.notes)
    # The simulated rounding is real: judged at float32 the same outputs fail (what the
    # checker did before it knew the precision), and 'highest' runs them at float32.
    bad = [m for m in rows[dev].outputs if m.excess is not None]
    assert bad and max(m.excess for m in bad) > 0
    assert all(r.precision == "float32" for r in strict.matrix) and strict.passed


def test_simulated_rounding_fails_a_precision_blind_judge(monkeypatch):
    """Without the precision floor (the old checker), a right model fails on the simulated
    TF32 row: the case the H200 run of benchmarks/throughput.md hit."""
    from xconv.parity import policies

    net, x, cand = _cnn()
    monkeypatch.setattr(policies, "DOT_FACTOR", 0.0)
    with simulated_accelerator("tpu") as dev:
        report = xconv.check_parity(net, cand, x, n_random=0, edges=False, intermediates=False)
    rows = {r.device: r for r in report.matrix}
    assert rows["cpu:0"].passed and not rows[dev].passed


def test_cli_check_precision_option(tmp_path):
    from click.testing import CliRunner

    from xconv.cli import main

    path = tmp_path / "m.onnx"
    xconv.save(M.cnn_ir(M.SmallCNN(blocks=1)), path)
    ok = CliRunner().invoke(main, ["check", str(path), str(path), "--precision", "highest"])
    assert ok.exit_code == 0, ok.output
    assert "precision='highest'" in ok.output and "float32" in ok.output
    bad = CliRunner().invoke(main, ["check", str(path), str(path), "--precision", "fast"])
    assert bad.exit_code == 2 and "highest" in bad.output


def test_layerwise_blocks_judged_at_the_default_devices_precision(monkeypatch):
    """The layerwise check runs candidate blocks on JAX's default device: on a GPU their
    bound is TF32's, L the IR's matmul / conv depth; on the CPU the policy is unchanged."""
    model = M.cnn_ir(M.SmallCNN(blocks=2))
    base = Policy()
    assert prec.blocks_policy(base, model) is base
    monkeypatch.setattr(prec, "jax_device_precision", lambda device: "tf32")
    pol = prec.blocks_policy(base, model)
    assert (pol.precision, pol.dot_depth) == ("tf32", 4)
    assert prec.blocks_policy(base, None) is base
