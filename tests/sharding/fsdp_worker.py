"""Generated torch source under FSDP2 and DDP on 2 gloo CPU processes, against one process.

``tests/sharding/test_torch_fsdp.py`` runs ``python -m tests.sharding.fsdp_worker OUT_DIR
[--compile]``: the parent converts the Flax transformer fixture to torch source
(``xconv.to_torch_source``), runs it in one process (forward, loss, backward, one SGD step),
then spawns 2 ranks that run the same step under ``fully_shard`` (per unit, then the root) and
under DDP, each on half of the batch. Everything it finds goes to ``OUT_DIR/result.json``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

WORLD = 2
LR, MOMENTUM = 0.1, 0.9


def _load(folder: Path):
    spec = importlib.util.spec_from_file_location("gen_fsdp", folder / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.Model()
    model.load_state_dict(torch.load(folder / "state.pt", weights_only=True))
    return model.eval()  # dropout off: the runs must be deterministic


def _step(model, ids):
    """Forward, mean-square loss, backward, one SGD step; returns (outputs, loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = model(ids)
    loss = out.float().pow(2).mean()
    loss.backward()
    opt.step()
    return out.detach(), loss.detach()


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().numpy()


def rank_main(rank: int, folder: str) -> None:
    import faulthandler

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from xconv.sharding.torch import fsdp_units, fully_shard_generated

    faulthandler.enable()  # a native abort in a rank prints where it happened
    folder = Path(folder)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rdzv", rank=rank, world_size=WORLD
    )
    try:
        ids = torch.from_numpy(np.load(folder / "ids.npy"))
        half = ids.shape[0] // WORLD
        mine = ids[rank * half : (rank + 1) * half]
        result = {}
        model = _load(folder)
        result["units"] = [type(u).__name__ for u in fsdp_units(model)]
        # The block classes the generated file defines (besides the root Model).
        result["blocks"] = sorted(
            {type(m).__name__ for m in model.modules()
             if type(m).__module__ == type(model).__module__ and m is not model}
        )  # fmt: skip
        fully_shard_generated(model)
        out, loss = _step(model, mine)
        params = {n: _full(p) for n, p in model.named_parameters()}
        local = sum(p.to_local().numel() for p in model.parameters())
        result["local_numel"] = int(local)
        result["dtensor"] = all(hasattr(p, "to_local") for p in model.parameters())
        ddp = DDP(_load(folder))
        d_out, _ = _step(ddp, mine)
        d_params = {
            n.removeprefix("module."): p.detach().numpy() for n, p in ddp.named_parameters()
        }
        np.savez(folder / f"rank{rank}.npz", out=out.numpy(), ddp_out=d_out.numpy(),
                 **{f"p:{k}": v for k, v in params.items()},
                 **{f"d:{k}": v for k, v in d_params.items()})  # fmt: skip
        (folder / f"rank{rank}.json").write_text(json.dumps({**result, "loss": float(loss)}))
        # Both ranks done communicating, and the wrappers that hold the group gone, before
        # either shuts its gloo pairs down.
        del model, ddp
        dist.barrier()
    finally:
        dist.destroy_process_group()


def prepare(folder: Path) -> dict:
    """Flax fixture -> IR -> generated torch source + state dict; the single-process run."""
    import jax

    import xconv
    from fixtures.flax_models import LinenTransformer

    # fixtures.flax_models.linen_transformer()'s module and init, jitted: one compile
    # instead of op-by-op initialisers (~5 s).
    module = LinenTransformer()
    ids = np.random.default_rng(0).integers(1, 50, (4, 7)).astype(np.int64)
    variables = jax.jit(module.init)(jax.random.PRNGKey(0), ids[:2].astype(np.int32))
    model = xconv.from_flax(module, variables, (ids.astype(np.int32),))
    source, state = xconv.to_torch_source(model)
    (folder / "model.py").write_text(source)
    torch.save(state, folder / "state.pt")
    np.save(folder / "ids.npy", ids)
    single = _load(folder)
    with torch.no_grad():
        flax_out = np.asarray(jax.jit(module.apply)(variables, ids.astype(np.int32)))
        gen_out = single(torch.from_numpy(ids)).numpy()
    before = {n: p.detach().clone() for n, p in single.named_parameters()}
    out, loss = _step(single, torch.from_numpy(ids))
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in single.named_parameters())
    np.savez(folder / "single.npz", out=out.numpy(),
             **{f"p:{n}": p.detach().numpy() for n, p in single.named_parameters()})  # fmt: skip
    return {
        "loss": float(loss),
        "vs_flax": float(np.max(np.abs(gen_out - flax_out))),
        "moved": moved,
    }


def compile_check(folder: Path) -> dict:
    model = _load(folder)
    ids = torch.from_numpy(np.load(folder / "ids.npy"))
    t = time.perf_counter()
    compiled = torch.compile(model)
    with torch.no_grad():
        got = compiled(ids)
        want = model(ids)
    return {"max_abs": float((got - want).abs().max()), "seconds": time.perf_counter() - t}


def run(root: Path, *flags: str) -> dict:
    """Everything above in ``root``; returns the findings (also written to result.json)."""
    import torch.multiprocessing as mp

    t = time.perf_counter()
    result = {"single": prepare(root)}
    result["prepare_s"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        mp.spawn(rank_main, args=(str(root),), nprocs=WORLD, join=True)
    except mp.ProcessExitedException as e:
        # A rank killed by a signal (once in CI: SIGABRT, "terminate called without an active
        # exception", after both ranks had begun the FSDP step) is run again, once; a Python
        # error in a rank (ProcessRaisedException) is not, nor a second signal.
        if e.signal_name is None:
            raise
        result["spawn_retried"] = f"rank {e.error_index}: {e.signal_name}"
        for r in range(WORLD):
            (root / f"rank{r}.npz").unlink(missing_ok=True)
            (root / f"rank{r}.json").unlink(missing_ok=True)
        (root / "rdzv").unlink(missing_ok=True)
        mp.spawn(rank_main, args=(str(root),), nprocs=WORLD, join=True)
    result["spawn_s"] = time.perf_counter() - t
    single = np.load(root / "single.npz")
    ranks = [np.load(root / f"rank{r}.npz") for r in range(WORLD)]
    meta = [json.loads((root / f"rank{r}.json").read_text()) for r in range(WORLD)]
    out = np.concatenate([r["out"] for r in ranks])
    ddp_out = np.concatenate([r["ddp_out"] for r in ranks])
    names = [k[2:] for k in single.files if k.startswith("p:")]
    result["fsdp"] = {
        "out_max_abs": float(np.max(np.abs(out - single["out"]))),
        "param_max_abs": max(
            float(np.max(np.abs(ranks[0][f"p:{n}"] - single[f"p:{n}"]))) for n in names
        ),
        "ranks_agree": all(np.array_equal(ranks[0][f"p:{n}"], ranks[1][f"p:{n}"]) for n in names),
        "units": meta[0]["units"],
        "blocks": meta[0]["blocks"],
        "dtensor": meta[0]["dtensor"],
        "local_numel": [m["local_numel"] for m in meta],
        "total_numel": int(sum(single[f"p:{n}"].size for n in names)),
    }
    result["ddp"] = {
        "out_max_abs": float(np.max(np.abs(ddp_out - single["out"]))),
        "param_max_abs": max(
            float(np.max(np.abs(ranks[1][f"d:{n}"] - single[f"p:{n}"]))) for n in names
        ),
    }
    if "--compile" in flags:
        result["compile"] = compile_check(root)
    (root / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(folder: str, *flags: str) -> None:
    run(Path(folder), *flags)


if __name__ == "__main__":
    main(*sys.argv[1:])
