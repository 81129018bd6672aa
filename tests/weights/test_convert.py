"""Weights-only conversion: strict key report, shard-by-shard streaming, the CLI."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fixtures import torch_models
from xconv.cli import main
from xconv.errors import WeightsError
from xconv.weight_template import build_template, convert_weights
from xconv.weights import io
from xconv.weights.convert import SIDE_SUFFIX

MLP = "fixtures.torch_models:make_mlp"


@pytest.fixture(scope="module")
def mlp_template():
    return build_template(MLP)


def _state(factory=torch_models.make_mlp) -> dict[str, np.ndarray]:
    module, _ = factory()
    return {
        k: io.to_numpy(v) + (1 if v.is_floating_point() else 2)
        for k, v in module.state_dict().items()
    }


def _fails(tmp_path, template, state, match):
    path = io.write_checkpoint(state, tmp_path / "ckpt.safetensors")
    with pytest.raises(WeightsError, match=match) as err:
        convert_weights(path, template, out=tmp_path / "out.msgpack")
    assert not (tmp_path / "out.msgpack").exists()  # nothing written on failure
    assert err.value.exit_code == 6
    return err.value.report


def test_strict_missing_key(tmp_path, mlp_template):
    state = _state()
    del state["fc2.weight"]
    report = _fails(tmp_path, mlp_template, state, "missing key: fc2.weight")
    assert report.missing == ["fc2.weight"] and not report.unexpected and not report.mismatched


def test_strict_unexpected_key(tmp_path, mlp_template):
    state = _state()
    state["fc4.weight"] = np.zeros((2, 2), np.float32)
    report = _fails(tmp_path, mlp_template, state, "unexpected key: fc4.weight")
    assert report.unexpected == ["fc4.weight"] and not report.missing and not report.mismatched


def test_strict_shape_mismatch(tmp_path, mlp_template):
    state = _state()
    state["fc3.bias"] = np.zeros(9, np.float32)
    report = _fails(tmp_path, mlp_template, state, r"shape mismatch: fc3.bias: checkpoint \(9,\)")
    assert report.mismatched == [("fc3.bias", (9,), (8,))]
    assert not report.missing and not report.unexpected


def test_not_strict_keeps_template_values(tmp_path, mlp_template):
    state = _state()
    del state["fc1.bias"]
    state["extra"] = np.ones(1, np.float32)
    path = io.write_checkpoint(state, tmp_path / "ckpt.npz")
    report = convert_weights(path, mlp_template, out=tmp_path / "v.msgpack", strict=False)
    assert report.missing == ["fc1.bias"] and report.unexpected == ["extra"]
    got = io.read_checkpoint(tmp_path / "v.msgpack")
    module, _ = torch_models.make_mlp()
    np.testing.assert_array_equal(got["params/fc1/bias"], module.fc1.bias.detach().numpy())
    np.testing.assert_array_equal(got["params/fc1/kernel"], state["fc1.weight"].T)


@pytest.mark.parametrize("fmt", ["w.msgpack", "w_orbax", "w.safetensors"])
def test_round_trip_formats(tmp_path, fmt):
    """torch .pt -> Flax (msgpack / Orbax / safetensors) -> torch .safetensors, bit-exact;
    ResNet's num_batches_tracked travels in the side file."""
    template = _resnet_template()
    state = _state(torch_models.make_resnet)
    ckpt = io.write_checkpoint(state, tmp_path / "resnet.pt")
    report = convert_weights(ckpt, template, out=tmp_path / fmt)
    assert report.ok and report.converted == 52
    assert report.side_file is not None and report.side_file.name.endswith(SIDE_SUFFIX)
    back = convert_weights(
        report.out, template, direction="flax-to-torch", out=tmp_path / "b.safetensors"
    )
    assert back.ok and back.side_file == report.side_file
    got = io.read_checkpoint(tmp_path / "b.safetensors")
    assert set(got) == set(state)  # safetensors stores keys sorted
    for k, a in state.items():
        assert got[k].dtype == a.dtype and np.array_equal(got[k], a), k


_RESNET = []


def _resnet_template():
    if not _RESNET:
        _RESNET.append(build_template("fixtures.torch_models:make_resnet"))
    return _RESNET[0]


class _Wide(torch.nn.Module):
    def __init__(self, layers: int = 12, width: int = 1024) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def make_wide():
    torch.manual_seed(0)
    return _Wide().eval(), (torch.randn(2, 1024),)


class _RssSampler(threading.Thread):
    """Samples resident memory (``/proc/self/statm``) every 2 ms: its peak over a block."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.rss()
        self.peak = self.base
        self.stop = False

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def run(self) -> None:
        while not self.stop:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)


def test_sharded_streaming_memory(tmp_path, record_property):
    """A 48 MiB checkpoint in 12 shards converts with memory near one shard, both ways."""
    template = build_template(make_wide)
    module, _ = make_wide()
    state = {k: io.to_numpy(v) * 2 for k, v in module.state_dict().items()}
    total = sum(a.nbytes for a in state.values())
    index = io.write_checkpoint(state, tmp_path / "in.safetensors", max_shard_bytes=4_300_000)
    del state, module
    shard = max(sum(a.nbytes for a in s.values()) for s in io.iter_shards(index))
    tracemalloc.start()
    sampler = _RssSampler()
    sampler.start()
    report = convert_weights(index, template, out=tmp_path / "flax.safetensors.index.json")
    sampler.stop = True
    sampler.join()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_growth = sampler.peak - sampler.base
    record_property("checkpoint_bytes", total)
    record_property("largest_shard_bytes", shard)
    record_property("tracemalloc_peak_bytes", peak)
    record_property("rss_peak_growth_bytes", rss_growth)
    print(
        f"\ncheckpoint {total / 2**20:.1f} MiB in {report.shards} shards, largest {shard / 2**20:.2f} MiB; "
        f"tracemalloc peak {peak / 2**20:.2f} MiB, RSS peak growth {rss_growth / 2**20:.2f} MiB"
    )
    assert report.ok and report.shards == 12 and report.converted == 24
    assert report.largest_shard_bytes == shard
    assert peak < 4 * shard < total / 2
    assert len(io.safetensors_shards(report.out)) == 12  # one output shard per input shard
    got = io.read_checkpoint(report.out)
    module, _ = make_wide()
    w = module.layers[3].weight.detach().numpy() * 2
    np.testing.assert_array_equal(got["params/layers_3/kernel"], w.T)

    back = convert_weights(
        report.out, template, direction="flax-to-torch", out=tmp_path / "t.safetensors.index.json"
    )
    assert back.ok and back.converted == 24
    assert np.array_equal(io.read_checkpoint(back.out)["layers.3.weight"], w)


# ---------------------------------------------------------------- CLI


def test_cli_round_trip(tmp_path):
    state = _state()
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, tmp_path / "mlp.pt")
    runner = CliRunner()
    res = runner.invoke(
        main,
        ["weights", "torch-to-flax", str(tmp_path / "mlp.pt"), "--template", MLP,
         "-o", str(tmp_path / "mlp.msgpack")],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "5 tensor(s)" in res.output
    flax = io.read_checkpoint(tmp_path / "mlp.msgpack")
    assert sorted(flax) == [
        "params/fc1/bias", "params/fc1/kernel", "params/fc2/kernel", "params/fc3/bias",
        "params/fc3/kernel",
    ]  # fmt: skip
    np.testing.assert_array_equal(flax["params/fc2/kernel"], state["fc2.weight"].T)
    res = runner.invoke(
        main,
        ["weights", "flax-to-torch", str(tmp_path / "mlp.msgpack"), "--template", MLP,
         "-o", str(tmp_path / "back.pt")],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back) == list(state)
    assert all(np.array_equal(back[k].numpy(), state[k]) for k in state)


def test_cli_strict_exit_code(tmp_path):
    state = _state()
    state["fc1.weight"] = np.zeros((3, 3), np.float32)
    io.write_checkpoint(state, tmp_path / "bad.safetensors")
    res = CliRunner().invoke(
        main,
        ["weights", "torch-to-flax", str(tmp_path / "bad.safetensors"), "--template", MLP,
         "--format", "safetensors", "-o", str(tmp_path / "o.safetensors")],
    )  # fmt: skip
    assert res.exit_code == 6, res.output
    assert "shape mismatch: fc1.weight" in res.output
    assert not (tmp_path / "o.safetensors").exists()


# ---------------------------------------------------------------- tied weights


class _TiedLM(torch.nn.Module):
    """An embedding reused as the LM head: one torch tensor under two state_dict keys."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(20, 8)
        self.ln = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 20, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        return self.head(self.ln(self.tok(ids)))


def make_tied():
    torch.manual_seed(0)
    return _TiedLM().eval(), (
        torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1)),
    )


def test_tied_weights(tmp_path):
    """Both Flax variables of a tied weight get the checkpoint's values; both torch keys return."""
    import importlib.util

    from xconv.converters.flax.source.emitter import to_flax
    from xconv.converters.torch.importer.trace import from_torch

    template = build_template(make_tied)
    module, (ids,) = make_tied()
    state = {k: io.to_numpy(v) + 0.5 for k, v in module.state_dict().items()}
    io.write_checkpoint(state, tmp_path / "t.pt")
    report = convert_weights(tmp_path / "t.pt", template, out=tmp_path / "t.msgpack")
    assert report.ok, str(report)
    assert not template.wmap.template  # every Flax variable comes from the checkpoint

    out = to_flax(from_torch(module, (ids,)), tmp_path / "gen")
    spec = importlib.util.spec_from_file_location("xconv_gen_weights_tied", out / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    flax_model, _ = mod.load(out)
    variables = io.unflatten(io.read_checkpoint(tmp_path / "t.msgpack"))
    module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with torch.no_grad():
        ref = module(ids).numpy()
    np.testing.assert_allclose(
        np.asarray(flax_model.apply(variables, ids.numpy())), ref, rtol=1e-4, atol=1e-4
    )

    # a checkpoint that keeps only one of the tied keys (as HF checkpoints do) converts too
    one = {k: v for k, v in state.items() if k != "head.weight"}
    io.write_checkpoint(one, tmp_path / "one.safetensors")
    report = convert_weights(tmp_path / "one.safetensors", template, out=tmp_path / "one.msgpack")
    assert report.ok, str(report)
    flat = io.read_checkpoint(tmp_path / "one.msgpack")
    assert all(
        np.array_equal(flat[k], a) for k, a in io.read_checkpoint(tmp_path / "t.msgpack").items()
    )

    back = convert_weights(
        tmp_path / "t.msgpack", template, direction="flax-to-torch", out=tmp_path / "b.pt"
    )
    assert back.ok
    got = io.read_checkpoint(tmp_path / "b.pt")
    assert list(got) == list(state)
    assert all(np.array_equal(got[k], state[k]) for k in state)


def test_bfloat16_checkpoint_kept_bit_exact(tmp_path, mlp_template):
    """Dtypes are kept as stored: a bf16 checkpoint gives bf16 variables, and back."""
    import ml_dtypes

    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in _state().items()}
    io.write_checkpoint(state, tmp_path / "bf16.safetensors")
    report = convert_weights(
        tmp_path / "bf16.safetensors", mlp_template, out=tmp_path / "v.msgpack"
    )
    assert report.ok
    flax = io.read_checkpoint(tmp_path / "v.msgpack")
    assert flax["params/fc1/kernel"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(flax["params/fc1/kernel"], state["fc1.weight"].T)
    convert_weights(
        tmp_path / "v.msgpack", mlp_template, direction="flax-to-torch", out=tmp_path / "b.pt"
    )
    back = io.read_checkpoint(tmp_path / "b.pt")
    for k, a in state.items():
        assert back[k].dtype == a.dtype and back[k].tobytes() == a.tobytes(), k
