"""Rule tables, logical axes and the partitioned Flax output, on this process's one device.

The 8-device checks are in ``test_mesh.py`` (their own process); here: bad input is a clear
``ShardingError``, the CLI writes the rule table and an Orbax checkpoint that the generated
``load`` reads with and without a mesh, and unpartitioned output is unchanged.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from click.testing import CliRunner

import xconv
from xconv.cli import main
from xconv.sharding.axes import logical_axes
from xconv.sharding.rules import ShardingError, make_mesh, parse_mesh_shape, resolve_rules


def _import(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ("zero3", "unknown partitioning 'zero3'"),
        ([("embed", "fsdp")], "unknown mesh axis 'fsdp'"),
        ([("hidden", "model")], "unknown logical axis 'hidden'"),
        ([("embed",)], "expected (logical_axis, mesh_axis | None)"),
    ],
)
def test_bad_rules_are_sharding_errors(rules, message):
    with pytest.raises(ShardingError) as e:
        resolve_rules(rules)
    assert message in str(e.value)
    assert isinstance(e.value, xconv.ConversionError)


def test_meshes_are_checked_against_the_visible_devices():
    assert parse_mesh_shape("2x4") == (2, 4)
    with pytest.raises(ShardingError, match="expected DATAxMODEL"):
        parse_mesh_shape("2x4x1")
    import jax

    n = len(jax.devices())
    with pytest.raises(ShardingError, match=f"needs {4 * n} devices; JAX sees {n}"):
        make_mesh(f"2x{2 * n}")
    assert make_mesh(f"1x{n}").axis_names == ("data", "model")


def test_logical_axes_from_flax_leaf_names_without_ir():
    tree = {
        "params": {
            "embed": {"embedding": np.zeros((50, 32))},
            "up": {"kernel": np.zeros((32, 128)), "bias": np.zeros(128)},
            "down": {"kernel": np.zeros((128, 32)), "bias": np.zeros(32)},
            "conv": {"kernel": np.zeros((3, 3, 8, 16))},
            "ln": {"scale": np.zeros(32)},
        }
    }
    axes, notes = logical_axes(tree, strip_collection=True)
    assert axes["params", "embed", "embedding"] == ("vocab", "embed")
    assert axes["params", "conv", "kernel"] == (None, None, "conv_in", "conv_out")
    assert axes["params", "ln", "scale"] == ("norm",)
    # Without IR the model width is unknown: dense kernels default to (embed, mlp); their
    # bias follows the output axis.
    assert axes["params", "up", "bias"] == (axes["params", "up", "kernel"][-1],)
    assert notes == []


def test_cli_writes_rule_table_and_orbax_and_load_works(tmp_path):
    from xconv.demo import build_demo_model

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    out = tmp_path / "demo_flax"
    r = CliRunner().invoke(
        main, ["onnx-to-flax", str(path), "-o", str(out), "--partitioning", "fsdp"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / "parity.json").read_text())["passed"] is True
    assert (out / "variables.orbax").is_dir() and not (out / "variables.msgpack").exists()
    assert json.loads((out / "xconv.json").read_text())["partitioning"] == "fsdp"
    gen = _import(out / "model.py", "gen_demo_fsdp")
    assert gen.PARTITIONING == "fsdp" and ("embed", ("data", "model")) in gen.RULES
    assert gen.LOGICAL_AXES["params/conv/kernel"] == (None, None, "conv_in", "conv_out")
    assert gen.LOGICAL_AXES["params/conv/bias"] == ("conv_out",)
    assert gen.LOGICAL_AXES["batch_stats/bn/mean"] == ("norm",)
    model, host = gen.load(out)
    import jax

    _, placed = gen.load(out, mesh=make_mesh(f"1x{len(jax.devices())}"))
    assert placed["params"]["conv"]["kernel"].sharding.mesh.axis_names == ("data", "model")
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(model.apply(host, x)), np.asarray(model.apply(placed, x))
    )


def test_partitioned_output_is_ruff_clean_and_deterministic(tmp_path):
    import subprocess
    import sys

    from xconv.demo import build_demo_model

    files = []
    for api in ("linen", "nnx"):
        a = xconv.to_flax(build_demo_model(), tmp_path / f"{api}_a", api=api, partitioning="tp")
        b = xconv.to_flax(build_demo_model(), tmp_path / f"{api}_b", api=api, partitioning="tp")
        assert (a / "model.py").read_bytes() == (b / "model.py").read_bytes()
        files.append(str(a / "model.py"))
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *files],
                          capture_output=True, text=True)  # fmt: skip
    assert ruff.returncode == 0, ruff.stdout


def test_bad_partitioning_writes_nothing_and_plain_output_is_unchanged(tmp_path):
    from xconv.demo import build_demo_model

    with pytest.raises(ShardingError):
        xconv.to_flax(build_demo_model(), tmp_path / "bad", partitioning="zero3")
    assert not (tmp_path / "bad").exists()
    plain = xconv.to_flax(build_demo_model(), tmp_path / "plain")
    assert (plain / "variables.msgpack").is_file() and "LOGICAL_AXES" not in (
        plain / "model.py"
    ).read_text()


def test_partitioning_is_refused_for_other_targets(tmp_path):
    from xconv.demo import build_demo_model

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    r = CliRunner().invoke(
        main, ["onnx-to-jax", str(path), "-o", str(tmp_path / "j"), "--partitioning", "tp"]
    )
    assert r.exit_code != 0 and "only the flax target" in r.output
    assert "Traceback" not in r.output


CUSTOM = [["batch", "data"], ["conv_out", "model"], ["conv_in", None], ["norm", None]]


def test_cli_partitioning_takes_a_rules_file_or_a_python_table(tmp_path, monkeypatch):
    """``--partitioning`` reads a JSON rules file or ``file.py:RULES`` / ``pkg.mod:RULES``
    like the Python API's ``rules=``; the table lands in model.py as written."""
    from xconv.demo import build_demo_model

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    (tmp_path / "rules.json").write_text(json.dumps(CUSTOM))
    (tmp_path / "my_rules.py").write_text(f"RULES = {[tuple(r) for r in CUSTOM]!r}\n")
    want = tuple(tuple(r) for r in CUSTOM)
    monkeypatch.chdir(tmp_path)
    for i, spec in enumerate(["rules.json", "my_rules.py:RULES", "my_rules:RULES"]):
        out = tmp_path / f"out{i}"
        args = ["onnx-to-flax", str(path), "-o", str(out), "--partitioning", spec]
        r = CliRunner().invoke(main, args + (["--no-check"] if i else []))
        assert r.exit_code == 0, (spec, r.output)
        gen = _import(out / "model.py", f"gen_custom_{i}")
        assert gen.PARTITIONING == "custom" and tuple(gen.RULES) == tuple(want), spec
        assert json.loads((out / "xconv.json").read_text())["partitioning"] == "custom"
    assert json.loads((tmp_path / "out0" / "parity.json").read_text())["passed"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--partitioning", "bad.json"], "names the unknown logical axis 'hidden'"),
        (["--partitioning", "broken.json"], "is not valid JSON"),
        (["--partitioning", "missing.json"], "does not exist"),
        (["--partitioning", "my_rules.py:NOPE"], "has no attribute 'NOPE'"),
        (["--partitioning", "zero3"], "unknown partitioning 'zero3'"),
        (["--mesh", "2x4096"], "needs 8192 devices; JAX sees"),
        (["--mesh", "2x"], "expected DATAxMODEL"),
    ],
)
def test_cli_bad_rules_and_meshes_are_clear_errors(tmp_path, monkeypatch, args, message):
    from xconv.demo import build_demo_model

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    (tmp_path / "bad.json").write_text(json.dumps([["hidden", "model"]]))
    (tmp_path / "broken.json").write_text("[[")
    (tmp_path / "my_rules.py").write_text("RULES = ()\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["onnx-to-flax", str(path), "-o", str(out), *args])
    assert r.exit_code == 10, r.output  # ConversionError (ShardingError)'s exit code
    assert message in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_cli_mesh_is_refused_where_the_candidate_is_not_jax(tmp_path):
    from xconv.demo import build_demo_model

    path = xconv.save(build_demo_model(), tmp_path / "demo.onnx")
    r = CliRunner().invoke(
        main, ["onnx-to-torch", str(path), "-o", str(tmp_path / "t"), "--mesh", "1x1"]
    )
    assert r.exit_code == 10 and "applies to the flax and jax targets" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "t").exists()


def test_nnx_output_carries_the_table_and_loads_with_and_without_a_mesh(tmp_path):
    """nnx: the same LOGICAL_AXES/RULES (paths without a collection level) and a ``load``
    that builds the module abstractly and restores its state onto the mesh."""
    import jax

    from xconv.demo import build_demo_model

    out = xconv.to_flax(build_demo_model(), tmp_path / "nnx", api="nnx", partitioning="fsdp")
    assert (out / "variables.orbax").is_dir() and not (out / "variables.msgpack").exists()
    gen = _import(out / "model.py", "gen_demo_nnx")
    assert gen.LOGICAL_AXES["conv/kernel"] == (None, None, "conv_in", "conv_out")
    assert gen.LOGICAL_AXES["bn/mean"] == ("norm",)
    host = gen.load(out)
    placed = gen.load(out, mesh=make_mesh(f"1x{len(jax.devices())}"))
    kernel = placed.conv.kernel[...]
    assert kernel.sharding.spec[-1] == ("data", "model")
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(host(x)), np.asarray(placed(x)))
    with pytest.raises(ShardingError, match="api='linen' or 'nnx'"):
        xconv.to_flax(build_demo_model(), tmp_path / "bad", api="haiku", format="orbax")
    assert not (tmp_path / "bad").exists()


def test_weights_streamed_for_nnx_load_like_to_flax_output(tmp_path):
    """``convert_weights(..., api="nnx", mesh=)``: the torch state_dict streamed into Orbax
    (nnx paths, no collection level) loads through the nnx ``load(mesh=)`` exactly as the
    checkpoint ``to_flax`` wrote, and both match torch."""
    import shutil

    import jax
    import torch
    from torch import nn

    from xconv.weight_template import convert_weights

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.fc = (
                nn.Conv2d(3, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.Linear(8, 4),
            )

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))

    torch.manual_seed(0)
    module, x = Small().eval(), torch.randn(2, 3, 16, 16)
    src = xconv.to_flax(xconv.from_torch(module, (x,)), tmp_path / "nnx", api="nnx",
                        partitioning="tp")  # fmt: skip
    torch.save(module.state_dict(), tmp_path / "state.pt")
    folder = tmp_path / "streamed"
    folder.mkdir()
    for name in ("model.py", "xconv.json"):
        shutil.copy(src / name, folder / name)
    mesh = f"1x{len(jax.devices())}"
    convert_weights(tmp_path / "state.pt", lambda: (module, (x,)), out=folder / "variables.orbax",
                    format="orbax", api="nnx", mesh=mesh, partitioning="tp")  # fmt: skip
    gen = _import(folder / "model.py", "gen_nnx_streamed")
    got, want = gen.load(folder, mesh=mesh), gen.load(src, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(got(x.numpy())), np.asarray(want(x.numpy())))
    np.testing.assert_allclose(np.asarray(got(x.numpy())), module(x).detach().numpy(), atol=1e-5)
    assert got.conv.kernel[...].sharding.spec == want.conv.kernel[...].sharding.spec


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("flax", ["--partitioning", "bad.json"], "names the unknown logical axis 'hidden'"),
        ("flax", ["--partitioning", "fsdp", "--mesh", "3x4096"], "needs 12288 devices"),
        ("onnx", ["--partitioning", "fsdp"], "only the flax target has them"),
    ],
)
def test_meta_route_bad_partitioning_fails_before_reading_anything(
    tmp_path, monkeypatch, target, extra, message
):
    """``--weights ... --partitioning``: bad rules, a mesh the devices do not match, or a
    target without sharding fail before the checkpoint is read (none exists here)."""
    (tmp_path / "bad.json").write_text(json.dumps([["hidden", "model"]]))
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    args = [f"torch-to-{target}", "--module", "transformers:LlamaForCausalLM", "--config",
            "config.json", "--weights", "nothing-*.safetensors", "-o", "out", *extra]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 10, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_weights_partitioning_without_a_mesh_is_a_usage_error(tmp_path):
    ckpt = tmp_path / "state.safetensors"
    ckpt.write_bytes(b"")
    r = CliRunner().invoke(main, ["weights", "torch-to-flax", str(ckpt), "--template", "m:f",
                                  "--partitioning", "fsdp"])  # fmt: skip
    assert r.exit_code == 2 and "--partitioning places the weights on a --mesh" in r.output


def test_to_jax_kernels_stored_permuted_keep_their_logical_axes():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
            self.fc = torch.nn.Linear(8, 8)  # square: its shape cannot tell the layout

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))

    model = xconv.from_torch(Net().eval(), torch.randn(2, 8, 6, 6))
    fn0, p0 = xconv.to_jax(model, kernel_layout="onnx")
    fn1, p1 = xconv.to_jax(model)  # HWIO: conv (3, 3, I, O), fc (I, O)
    assert {"conv.weight", "fc.weight"} <= set(fn1.kernel_perms)
    a0, _ = logical_axes(p0, model=model)
    a1, _ = logical_axes(p1, model=model, perms=fn1.kernel_perms)
    for name, perm in fn1.kernel_perms.items():
        path = tuple(name.split("."))
        assert a1[path] == tuple(a0[path][i] for i in perm), name
    assert a1[("fc", "weight")] != a0[("fc", "weight")]  # the square kernel's axes swapped
