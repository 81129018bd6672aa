"""The parity judgement never passes a wrong model (issue 13): element-wise bounds, NaN/inf
by position, dtype and shape, vacuous checks, input sets, gradient names, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xconv
from xconv.errors import ConversionError, ParityConfigError
from xconv.parity import Policy, compare
from xconv.parity.metrics import cosine


def _noisy(oracle: np.ndarray, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (oracle * (1 + rng.normal(scale=scale, size=oracle.shape))).astype(np.float32)


# ------------------------------------------------------------------ element-wise judgement


def test_small_elements_doubled_next_to_a_large_one_fail():
    rng = np.random.default_rng(0)
    oracle = rng.normal(size=1000)
    oracle[17] = 1e4
    ref = _noisy(oracle, 1e-7, 1)
    cand = _noisy(oracle, 1e-7, 2)
    assert compare("y", cand, ref, Policy(), oracle).passed
    bad = cand.copy()
    bad[100:110] *= 2
    m = compare("y", bad, ref, Policy(), oracle)
    assert not m.passed
    assert m.mismatches == 10 and m.first_mismatch == (100,)
    assert {tuple(w["index"]) for w in m.worst} <= {(i,) for i in range(100, 110)}
    assert all(np.isfinite(w["bound"]) for w in m.worst)


def test_one_wrong_element_in_ten_thousand_is_found_with_its_index():
    rng = np.random.default_rng(0)
    oracle = rng.normal(size=(100, 100))
    ref, cand = _noisy(oracle, 1e-7, 1), _noisy(oracle, 1e-7, 2)
    cand[42, 7] += 1e-3
    m = compare("y", cand, ref, Policy(), oracle)
    assert not m.passed and m.mismatches == 1 and m.first_mismatch == (42, 7)
    assert m.worst[0]["index"] == [42, 7]


def test_all_nan_candidate_fails_when_the_float32_reference_overflows():
    oracle = np.array([1e39, 1.0, 2.0, 3.0])
    ref = oracle.astype(np.float32)  # inf where the oracle is finite
    cand = np.full(4, np.nan, np.float32)
    for pol in (Policy(), Policy(kind="noise"), Policy(kind="dtype")):
        m = compare("y", cand, ref, pol, oracle)
        assert not m.passed, pol
        assert m.bound is None or np.isfinite(m.bound)


def test_nan_and_inf_must_sit_at_the_same_positions():
    oracle = np.array([np.nan, np.inf, -np.inf, 1.0, 2.0])
    ref = oracle.astype(np.float32)
    assert compare("y", ref.copy(), ref, Policy(), oracle).passed
    for bad in (
        np.float32([1.0, np.inf, -np.inf, 1.0, 2.0]),  # NaN missing
        np.float32([np.nan, -np.inf, -np.inf, 1.0, 2.0]),  # inf sign flipped
        np.float32([np.nan, np.inf, -np.inf, np.nan, 2.0]),  # extra NaN
        np.float32([np.nan, np.inf, -np.inf, 1.0, np.inf]),  # extra inf
    ):
        for pol in (Policy(), Policy(kind="dtype")):
            assert not compare("y", bad, ref, pol, oracle).passed, (bad, pol)


def test_noise_policy_one_inf_does_not_open_the_bound():
    rng = np.random.default_rng(0)
    cand64 = rng.normal(size=100)
    cand = cand64.astype(np.float32)
    cand[0] = np.inf  # overflow in the candidate only
    ref = (cand64 + 0.5).astype(np.float32)  # every other element wrong
    m = compare("y", cand, ref, Policy(kind="noise"), cand64)
    assert not m.passed and m.mismatches == 100


# ------------------------------------------------------------------ noise policy


def test_noise_policy_is_never_looser_than_the_dtype_policy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=1000)
    cand64 = np.tanh(x)
    # Spurious float16 round trip inside the candidate: its float64 twin lost the cast, so
    # the candidate's own "noise" is 1e-3 and would set a bound of ~1e-2.
    cand = np.tanh(x.astype(np.float16).astype(np.float32))
    ref = np.tanh(x).astype(np.float32)
    m = compare("y", cand, ref, Policy(kind="noise"), cand64)
    assert not m.passed
    d = compare("y", cand, ref, Policy(kind="dtype"))
    assert not d.passed


def test_noise_policy_is_named_in_the_verdict_line():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).eval()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()

    def pinned(x):  # closes over float32 weights: no float64 twin
        return x @ w.T + b

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    report = xconv.check_parity(pinned, lin, x)
    assert report.passed, report.summary()
    assert report.policy_kind == "noise"
    assert "noise" in report.summary().splitlines()[0]


# ------------------------------------------------------------------ dtype and shape


def test_dtype_must_match_unless_the_policy_names_the_promotion():
    rng = np.random.default_rng(0)
    oracle = rng.normal(size=(8, 8))
    ref = oracle.astype(np.float32)
    half = oracle.astype(np.float16)
    m = compare("y", half, ref, Policy(), oracle)
    assert not m.passed and "dtype" in m.error
    ok = compare("y", half, ref, Policy(allow_dtype={"float32": "float16"}), oracle)
    assert ok.passed, ok
    ints = compare("y", np.round(ref).astype(np.float32), np.round(ref).astype(np.int64), Policy())
    assert not ints.passed and "dtype" in ints.error


def test_bfloat16_promotion_has_its_own_bound():
    import ml_dtypes

    rng = np.random.default_rng(0)
    oracle = rng.normal(size=(16, 16))
    ref = oracle.astype(np.float32)
    cand = oracle.astype(ml_dtypes.bfloat16)
    pol = Policy(allow_dtype={"float32": "bfloat16"})
    assert compare("y", cand, ref, pol, oracle).passed
    assert not compare("y", (oracle * 1.25).astype(ml_dtypes.bfloat16), ref, pol, oracle).passed


# ------------------------------------------------------------------ vacuous checks


def test_cosine_of_two_zero_arrays_is_undefined():
    assert cosine(np.zeros(4), np.zeros(4)) != 1.0


def test_constant_reference_is_vacuous_unless_allowed():
    class Zero(torch.nn.Module):
        def forward(self, x):
            return x * 0.0

    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    report = xconv.check_parity(Zero(), Zero(), x)
    assert not report.passed
    assert report.reason.startswith("vacuous:")
    assert "vacuous" in report.summary().splitlines()[0]
    assert xconv.check_parity(Zero(), Zero(), x, allow_constant=True).passed


def test_no_outputs_is_vacuous():
    class Nothing(torch.nn.Module):
        def forward(self, x):
            return ()

    report = xconv.check_parity(Nothing(), Nothing(), np.ones((2, 2), np.float32))
    assert not report.passed and report.reason.startswith("vacuous:")


# ------------------------------------------------------------------ input sets


def test_several_input_sets_by_default():
    class Relu(torch.nn.Module):
        def forward(self, x, ids):
            return torch.relu(x) + ids.float().sum()

    x = np.random.default_rng(0).uniform(-1, 1, (2, 4)).astype(np.float32)
    ids = np.array([[3, 5], [4, 9]], np.int64)
    report = xconv.check_parity(Relu(), Relu(), (x, ids))
    names = [s["name"] for s in report.input_sets]
    assert names[0] == "example" and len(names) >= 4
    assert "zeros" in names and "large" in names
    assert all(s["passed"] for s in report.input_sets)

    class OnlyOnExample(torch.nn.Module):  # right on the example inputs, wrong elsewhere
        def forward(self, x, ids):
            y = torch.relu(x) + ids.float().sum()
            return torch.where((x == torch.from_numpy(x0)).all(), y, y * 1.01)

    x0 = x
    bad = xconv.check_parity(Relu(), OnlyOnExample(), (x, ids))
    assert not bad.passed
    assert [s["passed"] for s in bad.input_sets][0] is True


def test_random_draws_stay_in_the_observed_range():
    from xconv.parity.checker import input_sets

    x = np.random.default_rng(0).uniform(2, 3, (4, 4)).astype(np.float32)
    ids = np.array([[1, 7], [3, 5]], np.int64)
    sets = input_sets([x, ids], n_random=3, edges=True, seed=0)
    for name, arrays in sets:
        assert arrays[1].dtype == np.int64 and arrays[1].min() >= 1 and arrays[1].max() <= 7
        assert arrays[0].dtype == np.float32
        if name.startswith("random"):
            assert arrays[0].min() >= 2 and arrays[0].max() <= 3
    again = input_sets([x, ids], n_random=3, edges=True, seed=0)
    assert all(
        np.array_equal(a, b)
        for (_, p), (_, q) in zip(sets, again, strict=True)
        for a, b in zip(p, q, strict=True)
    )


# ------------------------------------------------------------------ gradients


def test_unmatched_gradient_names_are_an_error_unless_mapped():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()

    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(4, 3)
            self.dense.load_state_dict(a[0].state_dict())

        def forward(self, x):
            return self.dense(x)

    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    report = xconv.check_parity(a, Renamed(), x, grads=True)
    assert not report.passed
    assert any(m.error and "not matched" in m.error for m in report.grads)
    mapped = xconv.check_parity(
        a, Renamed(), x, grads=True, grad_names={"0.weight": "dense.weight", "0.bias": "dense.bias"}
    )
    assert mapped.passed, mapped.summary()
    assert {"d/0.weight", "d/0.bias"} <= {m.name for m in mapped.grads}


# ------------------------------------------------------------------ errors


def test_bad_devices_policies_and_inputs_are_conversion_errors():
    ident = torch.nn.Identity()
    x = np.ones(2, np.float32)
    with pytest.raises(ParityConfigError, match="none of the devices"):
        xconv.check_parity(ident, ident, x, devices="tpu")
    with pytest.raises(ParityConfigError, match="policy"):
        xconv.check_parity(ident, ident, x, policy="nonsense")
    with pytest.raises(ParityConfigError):
        Policy(k=-1)
    with pytest.raises(ParityConfigError, match="input spec"):
        xconv.check_parity(ident, ident, input_spec=["bad"])
    with pytest.raises(ParityConfigError, match="no inputs"):
        xconv.check_parity(ident, ident)
    assert issubclass(ParityConfigError, ConversionError)
    assert ParityConfigError.exit_code == 2


def test_cli_check_bad_devices_is_a_clean_error(tmp_path):
    from click.testing import CliRunner

    from tests.parity.models import SmallCNN, cnn_ir
    from xconv.cli import main

    path = tmp_path / "m.onnx"
    xconv.save(cnn_ir(SmallCNN(blocks=1)), path)
    result = CliRunner().invoke(main, ["check", str(path), str(path), "--devices", "cuda"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "none of the devices" in result.output
    ok = CliRunner().invoke(main, ["check", str(path), str(path), "--devices", "cpu"])
    assert ok.exit_code == 0, ok.output
    assert "inputs=random_1" in ok.output or "random_1" in ok.output
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    result = CliRunner().invoke(main, ["check", str(path), str(path), "--inputs", str(bad)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "cannot read inputs" in result.output
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, np.zeros((1, 2), np.float32))
    result = CliRunner().invoke(main, ["check", str(path), str(path), "--inputs", str(wrong)])
    assert result.exit_code == 2, result.output
    assert "cannot run on the inputs" in result.output


def test_generated_flax_names_match_torch_names_automatically():
    import flax.linen as nn

    torch.manual_seed(0)
    ref = torch.nn.Sequential()
    ref.add_module("blocks", torch.nn.Sequential(torch.nn.Linear(4, 3)))
    ref.eval()

    class Generated(nn.Module):  # how xconv.to_flax names module scopes
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="blocks_0")(x)

    lin = ref.blocks[0]
    variables = {
        "params": {
            "blocks_0": {
                "kernel": lin.weight.detach().numpy().T,
                "bias": lin.bias.detach().numpy(),
            }
        }
    }
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    report = xconv.check_parity(ref, (Generated(), variables), x, grads=True)
    assert report.passed, report.summary()
    assert {"d/blocks.0.weight", "d/blocks.0.bias"} <= {m.name for m in report.grads}


def test_noise_policy_candidate_with_float16_round_trips_fails():
    """The candidate's float64 twin (``cast_model_to_double``) loses its float16 casts, so
    under the noise policy its own error would widen its bound; the dtype cap stops that."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 16)).astype(np.float32)
    wt = torch.from_numpy(w)

    def reference(x):  # closes over float32 weights: no float64 twin
        return torch.tanh(x @ wt)

    def model(round_trip: bool):
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y"])]
        last = "y"
        if round_trip:
            nodes += [
                helper.make_node("Cast", ["y"], ["h"], to=TensorProto.FLOAT16),
                helper.make_node("Cast", ["h"], ["y2"], to=TensorProto.FLOAT),
            ]
            last = "y2"
        nodes.append(helper.make_node("Tanh", [last], ["out"]))
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, [8, 16])],
            [numpy_helper.from_array(w, "w")],
        )
        return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))

    x = rng.normal(size=(8, 16)).astype(np.float32) * 0.3
    good = xconv.check_parity(reference, model(False), x)
    assert good.passed, good.summary()
    assert good.policy_kind == "noise"
    bad = xconv.check_parity(reference, model(True), x)
    assert bad.policy_kind == "noise"
    assert not bad.passed, bad.summary()


def _weight_grads(report) -> list[str]:
    """Names of the compared weight gradients (not ``d/input_*``, not ``d/<weights>``)."""
    skip = ("d/input_", "d/<")
    return [m.name for m in report.grads if m.name.startswith("d/") and not m.name.startswith(skip)]


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_torch_to_flax_grads_use_the_conversions_name_map(tmp_path, api):
    import importlib.util

    from tests.parity.models import SmallCNN

    net = SmallCNN(blocks=1)
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    out = xconv.to_flax(xconv.from_torch(net, (torch.from_numpy(x),)), tmp_path / "m", api=api)
    spec = importlib.util.spec_from_file_location(f"gen_grads_{api}", out / "model.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    report = xconv.check_parity(
        net, gen.load(out), x, grads=True, intermediates=False, n_random=0, edges=False
    )
    assert report.passed, report.summary()
    # Every torch parameter (BatchNorm buffers are not parameters) is compared, by the map.
    assert len(_weight_grads(report)) == len(list(net.parameters()))
    assert any("SOURCE_NAMES" in n and "matched by the conversion" in n for n in report.notes)


def test_renamed_candidate_parameter_is_an_error_naming_it(tmp_path):
    import importlib.util

    from flax import serialization

    from tests.parity.models import SmallCNN

    net = SmallCNN(blocks=1)
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    out = xconv.to_flax(xconv.from_torch(net, (torch.from_numpy(x),)), tmp_path / "m")
    # Rename the layer ``fc`` to ``head`` in the module and its variables, not in the recorded
    # names (SOURCE_SCOPES names fc/kernel fc.weight; SOURCE_NAMES lists only other renames).
    source = (out / "model.py").read_text()
    assert (
        source.count("self.fc") == 2 and '"fc": ("fc", "torch.nn.modules.linear.Linear")' in source
    )
    (tmp_path / "renamed.py").write_text(source.replace("self.fc", "self.head"))
    spec = importlib.util.spec_from_file_location("gen_grads_renamed", tmp_path / "renamed.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    variables = serialization.msgpack_restore((out / "variables.msgpack").read_bytes())
    variables["params"]["head"] = variables["params"].pop("fc")
    cand = (gen.Model(), variables)
    assert xconv.check_parity(net, cand, x, n_random=0, edges=False).passed  # outputs agree
    report = xconv.check_parity(net, cand, x, grads=True, n_random=0, edges=False)
    assert not report.passed
    (err,) = [m.error for m in report.grads if m.error]
    assert "fc.weight" in err and "head.kernel" in err and "conversion's name map" in err


def test_to_torch_grads_use_the_modules_weight_names():
    from tests.parity.models import SmallCNN, cnn_ir

    net = SmallCNN(blocks=1)
    module, _ = xconv.to_torch(cnn_ir(net))
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    report = xconv.check_parity(net, module, x, grads=True, intermediates=False, n_random=0)
    assert report.passed, report.summary()
    assert len(_weight_grads(report)) == len(list(net.parameters()))
    assert any("xconv.to_torch module's weight names" in n for n in report.notes)


def test_unconverted_candidate_grads_say_name_rules_were_used():
    a = torch.nn.Sequential(torch.nn.Linear(4, 3))
    b = torch.nn.Sequential(torch.nn.Linear(4, 3))
    b.load_state_dict(a.state_dict())
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    report = xconv.check_parity(a, b, x, grads=True, n_random=0)
    assert report.passed, report.summary()
    assert any("name rules (no conversion name map" in n for n in report.notes)


def test_flax_to_torch_grads_use_the_conversions_name_map():
    import flax.linen as nn
    import jax

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="head")(nn.gelu(nn.LayerNorm()(nn.Dense(8)(x))))

    m = M()
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    variables = m.init(jax.random.PRNGKey(0), x)
    module, _ = xconv.to_torch(xconv.from_flax(m, variables, (x,)))
    report = xconv.check_parity((m, variables), module, x, grads=True, n_random=0, edges=False)
    assert report.passed, report.summary()
    assert len(_weight_grads(report)) == len(jax.tree_util.tree_leaves(variables["params"]))
    assert any("6 of 6" in n and "to_torch module's weight names" in n for n in report.notes)


def test_compute_dtype_judges_a_float32_output_at_the_coarser_dtype():
    """A float32 output of a bfloat16 computation is judged at bfloat16's ULP: a bfloat16-sized
    error passes there and fails at float32's; a real error fails either way."""
    oracle = np.random.default_rng(0).standard_normal(256)
    ref = oracle.astype(np.float32)
    cand = (oracle * (1 + 2e-3)).astype(np.float32)  # bfloat16's eps is 7.8e-3
    bf16 = Policy(compute_dtype="bfloat16")
    assert not compare("y", cand, ref, Policy(), oracle).passed
    assert compare("y", cand, ref, bf16, oracle).passed
    assert not compare("y", (oracle * 1.25).astype(np.float32), ref, bf16, oracle).passed
    assert Policy(compute_dtype="float64").judged_at(np.float32) == np.float32
    with pytest.raises(ParityConfigError, match="compute_dtype"):
        Policy(compute_dtype="int32")
