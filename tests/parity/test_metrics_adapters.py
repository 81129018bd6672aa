"""Metrics, policies and the adapters for Flax nnx, TF and plain functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xconv
from xconv.parity import Policy, compare, resolve_policy
from xconv.parity.metrics import ulp_p99


def test_ulp_distance_counts_representable_steps():
    a = np.ones(1000, np.float32)
    b = a.copy()
    b[:] = np.nextafter(a, np.float32(2))  # one ULP above
    b[:3] = np.nextafter(np.nextafter(np.nextafter(a[:3], 2), 2), 2)  # three ULPs
    assert ulp_p99(b, a) == 1.0  # 3 of 1000 elements at 3 ULP sit above the 99th percentile
    assert ulp_p99(b[:100], a[:100]) == pytest.approx(3.0, abs=0.1)
    assert ulp_p99(a, a) == 0
    neg = np.float32([-0.0, 0.0])
    assert ulp_p99(neg, neg[::-1].copy()) == 0  # -0 and +0 are the same value
    c = np.float32([np.nextafter(np.float32(0), np.float32(-1))])  # tiniest negative
    assert ulp_p99(c, np.float32([np.nextafter(np.float32(0), np.float32(1))])) == 2


def test_logit_agreement_and_mismatch_location():
    ref = np.array([[0.1, 0.9, 0.0, 0.3], [0.5, 0.2, 0.1, 0.05]], np.float32)
    cand = ref.copy()
    cand[1, 1] = 0.7  # argmax of row 1 flips
    m = compare("logits", cand, ref, Policy(kind="dtype"))
    assert not m.passed
    assert m.argmax_agree == 0.5
    assert m.mismatches == 1 and m.first_mismatch == (1, 1)
    assert m.max_abs == pytest.approx(0.5)
    assert m.cosine < 1


def test_oracle_rule_separates_noise_from_bugs():
    rng = np.random.default_rng(0)
    oracle = rng.normal(size=1000)
    ref = (oracle + rng.normal(scale=1e-6, size=1000)).astype(np.float32)
    noisy = (oracle + rng.normal(scale=2e-6, size=1000)).astype(np.float32)  # 2x ref noise
    buggy = (oracle * 1.0005).astype(np.float32)
    pol = Policy()
    assert compare("y", noisy, ref, pol, oracle).passed
    m = compare("y", buggy, ref, pol, oracle)
    assert not m.passed and m.ratio > 4
    # Each element's bound is (k * c + floor_ulps * eps) * (|oracle_i| + rms(oracle)), with
    # c the reference's largest error per unit of that magnitude.
    s = np.sqrt(np.mean(oracle**2))
    c = np.max(np.abs(ref.astype(np.float64) - oracle) / (np.abs(oracle) + s))
    i = tuple(m.worst[0]["index"])
    expect = (4 * c + 8 * np.finfo(np.float32).eps) * (abs(oracle[i]) + s)
    assert m.bound == pytest.approx(expect)
    assert m.bound >= 4 * abs(float(ref[i]) - oracle[i])


def test_dtype_defaults_and_integer_outputs():
    assert Policy(kind="dtype").tolerances(np.float16) == (1e-3, 1e-5)
    assert Policy(kind="dtype").tolerances("bfloat16") == (1.6e-2, 1e-5)
    assert resolve_policy("oracle", rtol=1e-3).kind == "explicit"
    ints = compare("ids", np.array([1, 2, 3]), np.array([1, 2, 4]), Policy())
    assert not ints.passed and ints.first_mismatch == (2,)
    shape = compare("y", np.zeros((2, 3)), np.zeros((3, 2)), Policy())
    assert not shape.passed and "shape" in shape.error


def _linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).eval()
    return lin, lin.weight.detach().numpy(), lin.bias.detach().numpy()


def test_nnx_module_and_grads_by_name():
    from flax import nnx

    lin, w, b = _linear()

    class M(nnx.Module):
        def __init__(self, scale=1.0):
            self.fc = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
            self.fc.kernel.value = w.T * scale
            self.fc.bias.value = b

        def __call__(self, x):
            return self.fc(x)

    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    r = xconv.check_parity(lin, M(), x, grads=True)
    assert not r.passed  # torch "weight" and nnx "fc.kernel" are not matched by name
    names = {"weight": "fc.kernel", "bias": "fc.bias"}
    r = xconv.check_parity(lin, M(), x, grads=True, grad_names=names)
    assert r.passed, r.summary()
    assert {"d/weight", "d/bias"} <= {m.name for m in r.grads}
    assert not xconv.check_parity(lin, M(1.001), x).passed


def test_plain_jax_function_and_tf_function():
    import jax.numpy as jnp

    lin, w, b = _linear()
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    assert xconv.check_parity(
        lin, (lambda p, x: jnp.dot(x, p["w"].T) + p["b"], {"w": w, "b": b}), x
    ).passed
    tf = pytest.importorskip("tensorflow")

    @tf.function
    def bad(x):
        return tf.matmul(x, tf.constant(w.T)) + b + 1e-3

    report = xconv.check_parity(lin, bad, x)
    assert not report.passed and report.matrix[0].framework == "tf"


def test_device_selection():
    from xconv.parity.checker import _select_devices

    avail = ["cpu:0", "cuda:0", "cuda:1"]
    assert _select_devices(avail, "all") == avail
    assert _select_devices(avail, "cpu") == ["cpu:0"]
    assert _select_devices(avail, "cuda") == ["cuda:0", "cuda:1"]
    assert _select_devices(avail, ["cpu", "cuda:1"]) == ["cpu:0", "cuda:1"]
    assert _select_devices(["cpu"], "cpu") == ["cpu"]
    with pytest.raises(ValueError, match="none of the devices"):
        xconv.check_parity(
            torch.nn.Identity(), torch.nn.Identity(), np.ones(2, np.float32), devices="tpu"
        )


def test_a_torch_module_on_another_device_runs_its_cpu_row_from_a_cpu_copy(monkeypatch):
    """A module whose weights live on a GPU: the checker's ``cpu`` row must not feed CPU
    tensors to the module as given (a device mismatch that made the whole check an error)."""
    from xconv.parity.adapters import TorchAdapter

    module = torch.nn.Linear(3, 2)
    adapter = TorchAdapter(module)
    assert adapter._home() == "cpu" and adapter._on("cpu") is module
    assert TorchAdapter(lambda x: x)._home() == "cpu"
    monkeypatch.setattr(TorchAdapter, "_home", lambda self: "cuda:0")  # as a CUDA module
    copy_ = adapter._on("cpu")
    assert copy_ is not module and next(copy_.parameters()).device.type == "cpu"
    x = np.ones((1, 3), np.float32)
    np.testing.assert_allclose(adapter.run([x], "cpu")[0], module(torch.ones(1, 3)).detach())


def test_a_jax_candidate_failing_off_the_cpu_only_is_checked_again_at_highest_precision():
    """JAX computes float32 dots in TF32 on NVIDIA GPUs by default (seen on an H200: a
    converted ResNet-50 failed there, passed at 'highest'); the report must say which it is.
    Here a candidate claims a ``gpu:0`` whose default precision adds a 1e-2 error."""
    import jax

    from xconv.parity.jax_adapters import JaxAdapter

    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    module = torch.nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.as_tensor(w.T))

    class OffCpu(JaxAdapter):
        def __init__(self, broken_at_highest=False):
            super().__init__(lambda p, x: x @ p, w)
            self.broken_at_highest = broken_at_highest

        def devices(self):
            return ["cpu:0", "gpu:0"]

        def prepare(self, device):
            super().prepare("cpu:0")

        def run(self, inputs, device):
            (out,) = super().run(inputs, "cpu:0")
            precise = jax.config.jax_default_matmul_precision == "highest"
            if device == "gpu:0" and (self.broken_at_highest or not precise):
                out = out * (1 + 1e-2)  # what reduced-precision products do to the output
            return [out]

    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    report = xconv.check_parity(module, OffCpu(), x, n_random=0, edges=False)
    assert not report.passed  # the verdict stays as judged at the default precision
    assert [r.device for r in report.matrix if not r.passed] == ["gpu:0"]
    assert any(
        "gpu:0: passes at jax.default_matmul_precision('highest')" in n for n in report.notes
    )
    report = xconv.check_parity(module, OffCpu(True), x, n_random=0, edges=False)
    assert any(
        "gpu:0: fails at jax.default_matmul_precision('highest') too" in n for n in report.notes
    )
    with jax.default_matmul_precision("highest"):  # the user's own choice: no second run
        report = xconv.check_parity(module, OffCpu(True), x, n_random=0, edges=False)
    assert not report.passed and not any("default_matmul_precision" in n for n in report.notes)


def test_compare_judges_a_0d_output_as_one_element():
    """A symbolic size (int) and an optimizer's step count (float) are 0-d: judged, not a crash."""
    from xconv.parity.metrics import compare
    from xconv.parity.policies import Policy

    assert compare("size", np.array(3), np.array(3), Policy()).passed
    assert not compare("size", np.array(3), np.array(4), Policy()).passed
    one = np.array(1.0)
    assert compare("step", one, one, Policy(), one).passed
    bad = compare("step", np.array(1.5), one, Policy(), one)
    assert not bad.passed and bad.shape == ()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float16", "float64"])
def test_ulp_distance_at_one_and_eight_bytes(dtype):
    """float8 (one byte: it raised KeyError) and float64 (its sign bit overflowed int64)."""
    import ml_dtypes

    dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    a = np.array([-2.0], dt)
    ints = {1: np.int8, 2: np.int16, 8: np.int64}[dt.itemsize]
    b = (a.view(ints) + 1).view(dt)  # the next code: one representable step in magnitude
    assert abs(float(b[0])) > 2.0
    with np.errstate(all="raise"):
        assert ulp_p99(a, a.copy()) == 0.0
        assert ulp_p99(a, b) == 1.0
    assert not compare("y", a, np.array([-3.0], dt), Policy(kind="dtype")).passed


def test_complex_outputs_are_judged_part_by_part():
    """A wrong imaginary part fails (a cast to float dropped it); the index names the part."""
    a = np.array([1 + 1j, 2 - 1j], np.complex64)
    wrong = np.array([1 + 2j, 2 - 1j], np.complex64)
    m = compare("y", wrong, a, Policy(kind="dtype"))
    assert not m.passed and m.first_mismatch == (0, 1)
    assert compare("y", a.copy(), a, Policy(kind="dtype")).passed
    assert ulp_p99(a, a.copy()) == 0.0
