"""Runs every 8-device mesh check, and the torch FSDP2/DDP check (``fsdp_worker.run``), in
one process and writes the findings as JSON.

JAX fixes its device count when it starts, so the 8 forced CPU devices need their own process:
``tests/sharding/test_mesh.py`` starts this module with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and asserts on what it writes, so the
rest of the suite keeps one device. Run by hand:
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.sharding.mesh_worker out.json``
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

MESHES = ("1x8", "2x4", "8x1")
STRATEGIES = ("fsdp", "tp", "fsdp+tp")
#: The default suite's subset: per model, every strategy once and every mesh once (a Latin
#: square); ``full`` runs all nine pairs per model.
DEFAULT = {
    "transformer": (("fsdp", "8x1"), ("tp", "1x8"), ("fsdp+tp", "2x4")),
    "resnet": (("fsdp", "1x8"), ("tp", "2x4"), ("fsdp+tp", "8x1")),
}
BATCH = 8  # divides every mesh's data axis


def fixtures():
    from fixtures.torch_models import ResNetTiny, TinyTransformer, _build

    g = torch.Generator().manual_seed(3)
    # No token 0: torch's Embedding(padding_idx=0) never updates that row, a training-time
    # rule the converted inference module does not carry (the training step below would
    # differ on that row only).
    ids = torch.randint(1, 50, (BATCH, 10), generator=g)
    images = torch.randn(BATCH, 3, 32, 32, generator=g)
    return {"transformer": (_build(TinyTransformer), ids), "resnet": (_build(ResNetTiny), images)}


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _largest(variables):
    """(path, array) of the largest kernel/embedding."""
    from xconv.sharding.axes import leaves

    flat = {
        p: a
        for p, a in leaves(variables).items()
        if p[0] == "params" and p[-1] in ("kernel", "embedding") and a.ndim >= 2
    }
    path = max(sorted(flat), key=lambda p: flat[p].size)
    return "/".join(path), flat[path]


def _shards(a) -> int:
    """How many distinct pieces the array is split into."""
    return len(
        {
            tuple((s.start, s.stop) for s in idx)
            for idx in a.sharding.devices_indices_map(a.shape).values()
        }
    )


def mesh_checks(name, module, x, model, root: Path, out: dict, full: bool) -> None:
    import xconv

    pairs = [(s, m) for s in STRATEGIES for m in MESHES] if full else DEFAULT[name]
    for strategy in STRATEGIES:
        folder = xconv.to_flax(model, root / f"{name}_{strategy}", partitioning=strategy)
        gen = _import(folder / "model.py", f"gen_{name}_{strategy.replace('+', '_')}")
        for mesh in [m for s, m in pairs if s == strategy]:
            t = time.perf_counter()
            flax_model, variables = gen.load(folder, mesh=mesh)
            path, big = _largest(variables)
            report = xconv.check_parity(
                module, (flax_model, variables), (x,), mesh=mesh, n_random=0, edges=False,
                intermediates=False,
            )  # fmt: skip
            out["runs"].append(
                {
                    "model": name,
                    "strategy": strategy,
                    "mesh": mesh,
                    "passed": bool(report.passed),
                    "verdict": report.verdict,
                    "mesh_report": report.mesh["shape"],
                    "n_params_reported": len(report.mesh["params"]),
                    "largest": path,
                    "spec": [None if e is None else str(e) for e in big.sharding.spec],
                    "shards": _shards(big),
                    "rules": [
                        list(r) if not isinstance(r[1], tuple) else [r[0], list(r[1])]
                        for r in gen.RULES
                    ],
                    "seconds": round(time.perf_counter() - t, 2),
                }
            )


def training_step(name, module, x, model, root: Path, out: dict) -> None:
    """One jitted SGD step (torch's SGD with momentum and weight decay, as optax via
    xconv.training) on the 2x4 mesh with fsdp+tp, against torch taking the same step on the
    source module. (SGD: the update is linear in the gradient, so reduction-order noise stays
    at float32 rounding; Adam's first step divides by |g| and magnifies it near eps.)"""
    import jax
    import jax.numpy as jnp
    import optax

    from xconv.converters.flax.source_names import SourceNames
    from xconv.sharding.axes import leaves
    from xconv.sharding.place import batch_sharding
    from xconv.sharding.rules import make_mesh
    from xconv.training import from_torch_optimizer

    # A copy: the IR's weights may share memory with the module's, and the step is in place.
    module = copy.deepcopy(module)
    gen = _import(root / f"{name}_fsdp+tp" / "model.py", f"gen_train_{name}")
    flax_model, host = gen.load(root / f"{name}_fsdp+tp")
    _, sharded = gen.load(root / f"{name}_fsdp+tp", mesh="2x4")
    opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    # The optimizer state comes from torch once, on the host; jit places it beside the
    # sharded params.
    tx, state = from_torch_optimizer(opt, host, model=module)

    @jax.jit
    def step(variables, state, x_in):
        def loss_fn(params):
            y = flax_model.apply({**variables, "params": params}, x_in)
            return jnp.mean(jnp.square(y))

        loss, grads = jax.value_and_grad(loss_fn)(variables["params"])
        updates, state = tx.update(grads, state, variables["params"])
        return optax.apply_updates(variables["params"], updates), state, loss

    xs = jnp.asarray(x.numpy())
    params, _, loss = step(sharded, state, jax.device_put(xs, batch_sharding(make_mesh("2x4"), xs)))

    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    torch_loss = module(x).pow(2).mean()
    torch_loss.backward()
    opt.step()
    after = dict(module.named_parameters())
    names = SourceNames(gen.SOURCE_NAMES, getattr(gen, "SOURCE_SCOPES", {}))
    diff, moved, compared = 0.0, 0.0, 0
    for path, leaf in leaves(params).items():
        key = "/".join(path)
        torch_name = names.get(key, key.replace("/", "."))
        want = after[torch_name].detach().numpy()
        got = np.asarray(leaf)
        if path[-1] == "kernel":  # a Flax Dense kernel is the torch Linear weight transposed
            want = want.T
        diff = max(diff, float(np.max(np.abs(got - want))))
        moved = max(moved, float((after[torch_name].detach() - before[torch_name]).abs().max()))
        compared += 1
    split = sum(1 for v in leaves(params).values() if any(e is not None for e in v.sharding.spec))
    out["training"][name] = {
        "loss": [float(torch_loss), float(loss)],
        "max_param_diff": diff,
        "max_update": moved,
        "params_split_after_step": split,
        "n_params": compared,
        "n_torch_params": len(after),
    }


def nnx_check(name, module, x, model, root: Path, out: dict, strategy="tp", mesh="1x8") -> None:
    """nnx output: ``to_flax(api="nnx", partitioning=)`` loaded onto the mesh by the
    generated ``load(mesh=)``, parity checked sharded against the torch source."""
    from flax import nnx

    import xconv

    folder = xconv.to_flax(model, root / f"{name}_nnx", api="nnx", partitioning=strategy)
    gen = _import(folder / "model.py", f"gen_nnx_{name}")
    t = time.perf_counter()
    nnx_model = gen.load(folder, mesh=mesh)
    path, big = _largest({"params": nnx.state(nnx_model, nnx.Param).to_pure_dict()})
    report = xconv.check_parity(module, nnx_model, (x,), mesh=mesh, n_random=0, edges=False,
                                intermediates=False)  # fmt: skip
    out["nnx"][name] = {
        "strategy": strategy,
        "mesh": mesh,
        "passed": bool(report.passed),
        "verdict": report.verdict,
        "mesh_report": report.mesh["shape"],
        "largest": path,
        "spec": [None if e is None else str(e) for e in big.sharding.spec],
        "shards": _shards(big),
        "n_params": len(gen.LOGICAL_AXES),
        "seconds": round(time.perf_counter() - t, 2),
    }


def constraint_check(name, x, root: Path, out: dict, mesh="2x4") -> None:
    """The generated ``constrained(mesh)``: block outputs get ``with_logical_constraint`` to
    the batch over data; jitted on the mesh, the numbers do not move."""
    import jax

    from xconv.sharding.place import batch_sharding
    from xconv.sharding.rules import make_mesh

    gen = _import(root / f"{name}_fsdp+tp" / "model.py", f"gen_constrained_{name}")
    flax_model, variables = gen.load(root / f"{name}_fsdp+tp", mesh=mesh)
    xs = jax.device_put(x.numpy(), batch_sharding(make_mesh(mesh), x.numpy()))

    def constrained(v, x_in):
        with gen.constrained(mesh):
            return flax_model.apply(v, x_in)

    got = jax.jit(constrained)(variables, xs)
    want = jax.jit(flax_model.apply)(variables, xs)
    jaxpr = str(jax.make_jaxpr(constrained)(variables, xs))
    out["constrained"] = {
        "n_constraints": jaxpr.count("sharding_constraint"),
        "n_block_classes": sum(1 for v in vars(gen).values() if isinstance(v, type)
                               and issubclass(v, gen.nn.Module) and v.__module__ == gen.__name__),
        "max_abs": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))),
        "out_spec": [None if e is None else str(e) for e in got.sharding.spec],
    }  # fmt: skip


def to_jax_checks(model, x, out: dict) -> None:
    import jax

    import xconv
    from xconv.errors import ConversionError

    fn0, p0 = xconv.to_jax(model)
    ref = np.asarray(jax.jit(fn0)(p0, x.numpy())[0])
    fn, params = xconv.to_jax(model, mesh="2x4", rules="tp")
    got = jax.jit(fn)(params, x.numpy())[0]  # jitted over the params' shardings
    out["to_jax"] = {
        "max_abs": float(np.max(np.abs(np.asarray(got) - ref))),
        "ff1_spec": [
            None if e is None else str(e)
            for e in params["layers"]["0"]["ff1"]["weight"].sharding.spec
        ],
        "notes": fn.plan.notes,
    }
    errors = {}
    for label, kwargs in {
        "mesh_mismatch": {"mesh": "4x4"},
        "bad_mesh": {"mesh": "2x"},
        "unknown_mesh_axis": {"mesh": "2x4", "rules": [("embed", "fsdp")]},
        "unknown_logical_axis": {"mesh": "2x4", "rules": [("hidden", "model")]},
        "unknown_strategy": {"mesh": "2x4", "rules": "zero3"},
    }.items():
        try:
            xconv.to_jax(model, **kwargs)
            errors[label] = None
        except ConversionError as e:
            errors[label] = f"{type(e).__name__}: {e}"
        except Exception as e:  # a raw JAX error is a failure of ours
            errors[label] = f"RAW {type(e).__name__}: {e}"
    out["errors"] = errors


def cli_check(model, x, root: Path, out: dict) -> None:
    """``xconv check REF.onnx FOLDER --mesh 2x4 --trust-code`` on the fsdp+tp folder."""
    from click.testing import CliRunner

    import xconv
    from xconv.cli import main as cli

    onnx_path = xconv.save(model, root / "ref.onnx")
    np.savez(root / "inputs.npz", x.numpy())
    folder = root / "transformer_fsdp+tp"
    args = ["check", str(onnx_path), str(folder), "--trust-code", "--mesh", "2x4",
            "--inputs", str(root / "inputs.npz"), "--random-inputs", "0"]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    out["cli_check"] = {"exit_code": r.exit_code, "output": r.output}


#: A user's rule table (TP without vocab splitting), given to the CLI as a JSON file.
CUSTOM_RULES = [["batch", "data"], ["embed", None], ["mlp", "model"], ["heads", "model"],
                ["vocab", None], ["norm", None]]  # fmt: skip


def cli_convert(root: Path, out: dict, full: bool = False) -> None:
    """``xconv onnx-to-flax REF --partitioning rules.json --mesh 2x4`` (and onnx-to-jax with
    ``--mesh``): the conversion's own parity check runs the candidate on the mesh."""
    from click.testing import CliRunner

    from xconv.cli import main as cli

    (root / "rules.json").write_text(json.dumps(CUSTOM_RULES))
    out["cli_convert"] = {}
    cases = [("flax", ["--partitioning", str(root / "rules.json")])] + [("jax", [])] * full
    for target, extra in cases:
        dest = root / f"cli_{target}"
        args = [f"onnx-to-{target}", str(root / "ref.onnx"), "-o", str(dest), "--mesh", "2x4",
                "--inputs", str(root / "inputs.npz"), *extra]  # fmt: skip
        t = time.perf_counter()
        r = CliRunner().invoke(cli, args)
        parity = json.loads((dest / "parity.json").read_text()) if dest.exists() else {}
        out["cli_convert"][target] = {
            "exit_code": r.exit_code,
            "output": r.output[-3000:],
            "passed": parity.get("passed"),
            "mesh": parity.get("mesh"),
            "notes": parity.get("notes"),
            "seconds": round(time.perf_counter() - t, 2),
        }


def meta_route(root: Path, out: dict, check: bool = True) -> None:
    """``xconv torch-to-flax --module transformers:LlamaForCausalLM --config --weights
    'model-*.safetensors' --partitioning fsdp --mesh 2x4``: a 10-shard Llama checkpoint
    streamed into Orbax parts placed on the mesh, layerwise parity with the candidate blocks
    sharded on the 2x4 mesh (and the written parts read back bit for bit), then
    ``load(OUT, mesh=)`` onto 2x4 and onto 1x8, against torch."""
    import jax
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from benchmarks.make_checkpoint import make_checkpoint
    from xconv.cli import main as cli
    from xconv.sharding.axes import leaves

    ckpt, dest = root / "llama", root / "llama_flax"
    make_checkpoint(ckpt, 3.2e5, dtype="float32", shard_size=150_000)  # hidden 64, 6 layers
    args = ["torch-to-flax", "--module", "transformers:LlamaForCausalLM", "--config",
            str(ckpt / "config.json"), "--weights", str(ckpt / "model-*.safetensors"),
            "--partitioning", "fsdp", "--mesh", "2x4", "-o", str(dest)]  # fmt: skip
    if not check:
        args.append("--no-check")
    t = time.perf_counter()
    r = CliRunner().invoke(cli, args, env={"COLUMNS": "200"})
    res = {"exit_code": r.exit_code, "output": r.output[-3000:],
           "seconds": round(time.perf_counter() - t, 2)}  # fmt: skip
    out["meta_route"] = res
    if r.exit_code != 0:
        return
    res["input_shards"] = len(list(ckpt.glob("model-*.safetensors")))
    res["parts"] = sorted(p.name for p in (dest / "variables.orbax").iterdir())
    if check:
        parity = json.loads((dest / "parity.json").read_text())
        res["parity"] = parity["passed"]
        res["parity_mesh"] = parity.get("mesh")
        res["parity_notes"] = parity.get("notes")
    gen = _import(dest / "model.py", "gen_llama_meta")
    res["partitioning"] = gen.PARTITIONING
    import transformers

    cfg = transformers.LlamaConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    cfg.use_cache = False
    ref = transformers.LlamaForCausalLM(cfg).eval()
    state = {}
    for shard in sorted(ckpt.glob("model-*.safetensors")):
        state.update(load_file(shard))
    ref.load_state_dict(state, strict=True)
    ids = torch.arange(3, 11).reshape(1, 8)  # the traced example shape (1, 8)
    with torch.no_grad():
        want = ref(ids).logits.numpy()
    model, host = gen.load(dest)
    base = np.asarray(model.apply(host, ids.numpy())[0])
    res["host_vs_torch"] = float(np.max(np.abs(base - want)))
    for mesh in ("2x4", "1x8"):
        _, placed = gen.load(dest, mesh=mesh)
        flat = leaves(placed)
        embed = next(v for p, v in flat.items() if p[-1] == "embedding")
        got = np.asarray(jax.jit(model.apply)(placed, ids.numpy())[0])
        res[mesh] = {
            "vs_host": float(np.max(np.abs(got - base))),
            "split": sum(1 for v in flat.values() if any(e is not None for e in v.sharding.spec)),
            "n": len(flat),
            "embed_shards": _shards(embed),
            "mesh": dict(zip(embed.sharding.mesh.axis_names,
                             (int(d) for d in embed.sharding.mesh.devices.shape), strict=True)),
        }  # fmt: skip


def weights_stream(module, x, root: Path, out: dict) -> None:
    """``convert_weights(..., mesh="2x4")``: the torch state_dict streamed into an Orbax
    checkpoint placed by fsdp+tp, read by the generated ``load(mesh=)`` next to the one
    ``to_flax`` wrote."""
    import shutil

    import jax

    from xconv.sharding.axes import leaves
    from xconv.weight_template import convert_weights

    ckpt = root / "state.pt"
    torch.save(module.state_dict(), ckpt)
    src, folder = root / "transformer_fsdp+tp", root / "streamed"
    folder.mkdir()
    for name in ("model.py", "xconv.json"):
        shutil.copy(src / name, folder / name)
    convert_weights(ckpt, lambda: (module, (x,)), out=folder / "variables.orbax", format="orbax",
                    mesh="2x4", partitioning="fsdp+tp")  # fmt: skip
    gen = _import(folder / "model.py", "gen_streamed")
    _, got = gen.load(folder, mesh="2x4")
    _, want = gen.load(src, mesh="2x4")
    a, b = leaves(got), leaves(want)
    out["weights_stream"] = {
        "same_keys": sorted(a) == sorted(b),
        "max_abs": max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in b),
        "same_specs": all(a[k].sharding.spec == b[k].sharding.spec for k in b),
        "split": sum(1 for v in a.values() if any(e is not None for e in v.sharding.spec)),
        "devices": len(jax.devices()),
    }


def main(dest: str, mode: str = "default", only: str | None = None) -> None:
    import jax

    import xconv

    out: dict = {
        "devices": len(jax.devices()),
        "runs": [],
        "training": {},
        "nnx": {},
        "timings": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, (module, x) in fixtures().items():
            if only and name != only:
                continue
            t = time.perf_counter()
            model = xconv.from_torch(module, (x,))
            out["timings"][f"{name}_import"] = round(time.perf_counter() - t, 2)
            t = time.perf_counter()
            mesh_checks(name, module, x, model, root, out, mode == "full")
            out["timings"][f"{name}_mesh"] = round(time.perf_counter() - t, 2)
            if name == "transformer":
                t = time.perf_counter()
                training_step(name, module, x, model, root, out)
                out["timings"][f"{name}_train"] = round(time.perf_counter() - t, 2)
                t = time.perf_counter()
                nnx_check(name, module, x, model, root, out)
                out["timings"][f"{name}_nnx"] = round(time.perf_counter() - t, 2)
                constraint_check(name, x, root, out)
                to_jax_checks(model, x, out)
                cli_check(model, x, root, out)
                cli_convert(root, out, mode == "full")
                t = time.perf_counter()
                meta_route(root, out)
                out["timings"]["meta_route"] = round(time.perf_counter() - t, 2)
                if mode == "full":
                    weights_stream(module, x, root, out)
                again = xconv.to_flax(model, root / "again", partitioning="fsdp+tp")
                first = root / "transformer_fsdp+tp" / "model.py"
                out["deterministic"] = first.read_bytes() == (again / "model.py").read_bytes()
        if not only:
            # The torch side in the same launch: generated torch source under FSDP2 and DDP
            # on 2 gloo ranks (spawned: they re-import this module, so its top level
            # imports torch and numpy only).
            from tests.sharding.fsdp_worker import run as fsdp_run

            t = time.perf_counter()
            (root / "fsdp").mkdir()
            out["torch_fsdp"] = fsdp_run(root / "fsdp")
            out["timings"]["torch_fsdp"] = round(time.perf_counter() - t, 2)
    Path(dest).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
