"""Training checkpoints: a torch ``{"model", "optimizer", "scheduler", "step"}`` checkpoint as
a Flax training state in Orbax, with a generated ``train.py``, and back.

:func:`write_train_state` writes, into a ``torch-to-flax`` output folder (linen):

* ``train_state/``: Orbax (``StandardCheckpointer``) of ``{"step", "params", "batch_stats",
  "opt_state"}``, the fields of ``flax.training.train_state.TrainState`` plus the BatchNorm
  statistics (``opt_state`` is the state of :func:`~xconv.training.from_torch_optimizer`);
* ``train_config.json``: the optimizer (class, per-group hyper-parameters, which variables
  each group trains, by torch name and Flax path), the scheduler (class and ``state_dict``)
  and the loss (class and options), from which :func:`load_train_state` rebuilds the optax
  transform and loss without torch;
* ``train.py``: ``load()`` -> ``(TrainState, loss)`` and a jitted ``train_step``.

nnx folders get the same, with ``train_state/`` holding ``{"model": Param and BatchStat state,
"optimizer": nnx.Optimizer state}`` and ``train.py``'s ``load()`` -> ``(model, nnx.Optimizer,
loss)`` (:mod:`xconv.training.nnx_state`).

:func:`train_state_to_torch` goes back: the torch optimizer (and scheduler) state of a
training state, for the torch module the checkpoint came from.

The scheduler is recorded as a description (:func:`describe_scheduler`): its class, its
``state_dict``, the param-group values it reads (``initial_lr``; OneCycleLR's ``max_lr``,
``min_lr``, momenta) and, for ``SequentialLR``, its children's descriptions. Each child's class
is read off its state's keys, as torch does not save it.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np

from xconv.errors import ConversionError, UnsupportedAttributeError

STATE_DIR = "train_state"
CONFIG = "train_config.json"

_LOSS_OPTIONS = (
    "reduction",
    "ignore_index",
    "label_smoothing",
    "beta",
    "delta",
    "margin",
    "log_target",
)
_SCHEDULERS = (
    "StepLR",
    "MultiStepLR",
    "ExponentialLR",
    "CosineAnnealingLR",
    "LinearLR",
    "ConstantLR",
    "PolynomialLR",
    "OneCycleLR",
    "SequentialLR",
)
#: param-group values a scheduler reads (the rest of its state is in its state_dict)
_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum")


def _jsonable(v):
    if isinstance(v, collections.Counter):
        return {"__counter__": {str(k): int(n) for k, n in v.items()}}
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return v.item()
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    raise ConversionError(f"cannot record {type(v).__name__} in {CONFIG}")


def _from_json(v):
    if isinstance(v, dict):
        if "__counter__" in v:
            return collections.Counter({int(k): n for k, n in v["__counter__"].items()})
        return {k: _from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    return v


# ------------------------------------------------------------------ torch checkpoint


def load_torch_checkpoint(path: Path) -> dict:
    """``torch.load(path, weights_only=True)`` of a training checkpoint, its keys checked."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is the same user error
        raise ConversionError(f"{path}: not a weights-only torch checkpoint ({e})") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt or "optimizer" not in ckpt:
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ConversionError(
            f"{path}: --train-state needs a dict with 'model' and 'optimizer' (and optionally "
            f"'scheduler', 'step' or 'epoch'); found {keys}"
        )
    return ckpt


def _optimizer_class(groups: list[dict], name: str | None):
    import torch

    if name:
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise ConversionError(f"torch.optim has no optimizer {name!r}")
        return cls
    keys = set(groups[0])
    if "nesterov" in keys:
        return torch.optim.SGD
    if "centered" in keys:
        return torch.optim.RMSprop
    if "lr_decay" in keys:
        return torch.optim.Adagrad
    if "momentum_decay" in keys:
        return torch.optim.NAdam
    if "amsgrad" in keys:
        # AdamW is Adam with decoupled decay; torch >= 2.6 records it in the group.
        return torch.optim.AdamW if groups[0].get("decoupled_weight_decay") else torch.optim.Adam
    raise ConversionError(
        "cannot tell the optimizer class from its state_dict (Adamax and RAdam keep the same "
        "keys); pass --optimizer NAME (a torch.optim class)"
    )


def rebuild_torch_training(module, ckpt: dict, *, optimizer: str | None = None):
    """The torch optimizer of a checkpoint, over ``module``'s parameters in order (how
    ``Optimizer(module.parameters())`` numbers them), its state loaded; and the description
    of its scheduler (:func:`describe_scheduler`), or None."""
    osd = ckpt["optimizer"]
    params = list(module.parameters())
    n = sum(len(g["params"]) for g in osd["param_groups"])
    if n != len(params):
        raise ConversionError(
            f"the optimizer state holds {n} parameters, the module {len(params)}: --train-state "
            "needs an optimizer built over module.parameters() (param groups in that order)"
        )
    cls = _optimizer_class(osd["param_groups"], optimizer)
    groups = []
    for g in osd["param_groups"]:
        hp = {k: v for k, v in g.items() if k not in ("params", "initial_lr")}
        groups.append({"params": [params[i] for i in g["params"]], **hp})
    opt = cls(groups)
    opt.load_state_dict(osd)
    ssd = ckpt.get("scheduler")
    return opt, (describe_scheduler(ssd, opt.param_groups) if ssd else None)


def describe_scheduler(scheduler, param_groups=None, *, name: str | None = None) -> dict:
    """``{"class", "state", "groups"[, "children"]}`` of a torch scheduler, or of its
    ``state_dict`` (then the class comes from ``name``, ``_xconv_class`` or the state's keys,
    and ``param_groups`` are the optimizer's)."""
    if isinstance(scheduler, dict):
        state = scheduler
        name = name or state.get("_xconv_class") or _scheduler_class_name(state)
        children = state.get("_schedulers")
        children = [describe_scheduler(c, param_groups) for c in children or []]
    else:
        name = type(scheduler).__name__
        state = scheduler.state_dict()
        param_groups = scheduler.optimizer.param_groups
        children = [
            describe_scheduler(c.state_dict(), param_groups, name=type(c).__name__)
            for c in getattr(scheduler, "_schedulers", [])
        ]
    if name not in _SCHEDULERS:
        _scheduler_class_name({})  # the error listing the supported ones
    if name == "SequentialLR" and any(c["class"] == "SequentialLR" for c in children):
        raise UnsupportedAttributeError("a SequentialLR inside a SequentialLR is not supported")
    desc = {
        "class": name,
        "state": _jsonable({k: v for k, v in state.items() if k != "_schedulers"}),
        "groups": [{k: float(g[k]) for k in _GROUP_KEYS if k in g} for g in param_groups or []],
    }
    if name == "SequentialLR":
        desc["children"] = children
    return desc


def scheduler_from_description(desc: dict):
    """A stand-in for the torch scheduler of :func:`describe_scheduler`, with the attributes
    :mod:`xconv.training.schedules` reads (no torch needed)."""
    import types

    fake = type(desc["class"], (), {})()
    for k, v in _from_json(desc["state"]).items():
        setattr(fake, k, v)
    fake.optimizer = types.SimpleNamespace(param_groups=desc.get("groups") or [])
    if desc["class"] == "SequentialLR":
        fake._schedulers = [scheduler_from_description(c) for c in desc["children"]]
    return fake


def advance_scheduler_state(desc: dict, last_epoch: int, lrs: list[float]) -> dict:
    """The torch ``state_dict`` of the described scheduler stepped on to ``last_epoch``
    (``SequentialLR``: its children stepped as its ``step()`` steps them)."""
    import bisect

    state = _from_json(desc["state"])
    start = int(state["last_epoch"])
    n = last_epoch - start
    state["last_epoch"] = last_epoch
    if "_step_count" in state:
        state["_step_count"] += n
    state["_last_lr"] = list(lrs)
    if desc["class"] == "SequentialLR":
        children = [_from_json(c["state"]) for c in desc["children"]]
        milestones = state["_milestones"]
        for e in range(start + 1, last_epoch + 1):
            child = children[bisect.bisect_right(milestones, e)]
            if milestones and e in milestones:
                child["last_epoch"] = 0
            else:
                child["last_epoch"] += 1
                child["_step_count"] = child.get("_step_count", 1) + 1
        active = children[bisect.bisect_right(milestones, last_epoch)]
        active["_last_lr"] = list(lrs)
        state["_schedulers"] = children
    return state


def _scheduler_class_name(ssd: dict) -> str:
    keys = set(ssd)
    for name, needs in (
        ("SequentialLR", {"_milestones"}),
        ("OneCycleLR", {"total_steps"}),
        ("MultiStepLR", {"milestones"}),
        ("StepLR", {"step_size"}),
        ("CosineAnnealingLR", {"T_max"}),
        ("LinearLR", {"start_factor"}),
        ("ConstantLR", {"factor", "total_iters"}),
        ("PolynomialLR", {"power"}),
        ("ExponentialLR", {"gamma"}),
    ):
        if needs <= keys:
            return name
    raise UnsupportedAttributeError(
        f"cannot tell the scheduler class from its state_dict keys {sorted(keys)}; supported: "
        f"{', '.join(_SCHEDULERS)} (LambdaLR / MultiplicativeLR run Python each step and do "
        "not convert)"
    )


# ------------------------------------------------------------------ config


def loss_config(loss_module) -> dict:
    """A loss module's class and options (``weight`` / ``pos_weight`` buffers as lists)."""
    from xconv.training.losses import from_torch_loss

    from_torch_loss(loss_module)  # rejects what does not convert, before anything is written
    opts = {k: _jsonable(getattr(loss_module, k)) for k in _LOSS_OPTIONS if hasattr(loss_module, k)}
    buffers = {n: b.detach().cpu().numpy().tolist() for n, b in loss_module.named_buffers()}
    return {"class": type(loss_module).__name__, "options": opts, "buffers": buffers}


class _Buffer:
    def __init__(self, value):
        self.value = np.asarray(value, np.float32)

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.value


def loss_from_config(cfg: dict, *, channel_axis: int = 1):
    """The JAX loss of :func:`loss_config` (no torch needed)."""
    from xconv.training.losses import from_torch_loss

    buffers = {k: _Buffer(v) for k, v in cfg.get("buffers", {}).items()}
    cls = type(cfg["class"], (), {"named_buffers": lambda self: buffers.items()})
    fake = cls()
    for k, v in cfg["options"].items():
        setattr(fake, k, v)
    return from_torch_loss(fake, channel_axis=channel_axis)


def training_config(tx, scheduler, loss_module, *, clip_grad_norm=None, step=None) -> dict:
    """The JSON record of a converted optimizer (``tx`` of ``from_torch_optimizer``), its
    scheduler (a torch scheduler or its :func:`describe_scheduler`) and loss."""
    spec = tx.spec
    sched = scheduler
    if scheduler is not None and not isinstance(scheduler, dict):
        sched = describe_scheduler(scheduler)
    return {
        "format": 2,
        "optimizer": {
            "class": spec.torch_class,
            "kind": spec.kind,
            "groups": [_jsonable(g) for g in spec.groups],
            "names": [list(n) for n in spec.group_names],
            "paths": [
                [list(tx.leaves[n].path[len(tx.prefix) :]) for n in ns] for ns in spec.group_names
            ],
        },
        "scheduler": sched,
        "loss": loss_config(loss_module),
        "clip_grad_norm": clip_grad_norm,
        "step": step,
    }


def schedules_from_config(cfg: dict):
    """``(learning rates, momenta)`` per group of a :func:`training_config`'s scheduler
    (constants and None without one)."""
    from xconv.training.schedules import momentum_for, schedule_for

    groups = cfg["optimizer"]["groups"]
    if not cfg["scheduler"]:
        return [g["lr"] for g in groups], None
    fake = scheduler_from_description(cfg["scheduler"])
    lrs = [schedule_for(fake, gi) for gi in range(len(groups))]
    momenta = [momentum_for(fake, gi) for gi in range(len(groups))]
    return lrs, (momenta if any(momenta) else None)


def tx_from_config(cfg: dict, params):
    """The optax transform of :func:`training_config` over ``params`` (no torch needed)."""
    from xconv.training.names import flatten_tree
    from xconv.training.optimizers import FROZEN, _set_path, build_tx

    o = cfg["optimizer"]
    groups = []
    for g in o["groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    labels: dict = {}
    for path in flatten_tree(params):
        _set_path(labels, path, FROZEN)
    for gi, paths in enumerate(o["paths"]):
        for path in paths:
            _set_path(labels, tuple(path), f"group_{gi}")
    lrs, momenta = schedules_from_config(cfg)
    clip = cfg.get("clip_grad_norm")
    clip = tuple(clip) if isinstance(clip, list) else clip
    return build_tx(o["kind"], groups, labels, lrs, clip_grad_norm=clip, momenta=momenta)


# ------------------------------------------------------------------ write / load


def _folder_model(folder: Path):
    """``(api, model, variables, params)`` of a ``torch-to-flax`` folder: linen's
    ``(module, {"params", "batch_stats"})``, or the nnx module with its ``Param`` and
    ``BatchStat`` state as one tree (``params``: the trainable tree)."""
    from xconv.training.check import _load_folder

    loaded = _load_folder(folder)
    if isinstance(loaded, tuple) and len(loaded) == 2:
        model, variables = loaded
        variables = dict(variables)
        return "linen", model, variables, dict(variables["params"])
    from flax import nnx

    if isinstance(loaded, nnx.Module):
        from xconv.training.nnx_state import model_state, param_dict

        return "nnx", loaded, model_state(loaded), param_dict(loaded)
    raise UnsupportedAttributeError(
        f"{folder}: --train-state needs a torch-to-flax folder (linen or nnx); its load() "
        f"returned {type(loaded).__name__}"
    )


def write_train_state(
    folder: Path,
    module,
    ckpt: dict,
    loss_module,
    *,
    optimizer: str | None = None,
    clip_grad_norm=None,
) -> list[Path]:
    """Write the training state of a torch checkpoint into a ``torch-to-flax`` folder (linen:
    a ``TrainState``'s fields; nnx: an ``nnx.Optimizer``), with ``train_config.json`` and
    ``train.py``; returns the paths written. The folder must hold the checkpoint's weights."""
    import shutil

    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from xconv.training.names import match_leaves
    from xconv.training.optimizers import from_torch_optimizer
    from xconv.training.train_py import TRAIN_PY, TRAIN_PY_NNX

    folder = Path(folder).resolve()
    module.load_state_dict(ckpt["model"])
    opt, sched = rebuild_torch_training(module, ckpt, optimizer=optimizer)
    fake_sched = scheduler_from_description(sched) if sched else None
    api, model, variables, params = _folder_model(folder)
    tx, opt_state = from_torch_optimizer(
        opt,
        variables if api == "linen" else params,
        scheduler=fake_sched,
        model=module,
        clip_grad_norm=clip_grad_norm,
    )
    step = ckpt.get("step", ckpt.get("epoch"))
    step = int(step) if step is not None else int(fake_sched.last_epoch) if sched else 0
    cfg = training_config(tx, sched, loss_module, clip_grad_norm=clip_grad_norm, step=step)
    entries = {
        k: v for k, v in module.state_dict().items() if not k.endswith("num_batches_tracked")
    }
    cfg["api"] = api
    # torch-only: counted once per train-mode forward, one per step from here on
    cfg["num_batches_tracked"] = {
        k: int(v) for k, v in module.state_dict().items() if k.endswith("num_batches_tracked")
    }
    cfg["leaves"] = {
        name: [list(leaf.path), list(leaf.perm) if leaf.perm is not None else None]
        for name, leaf in match_leaves(entries, variables, what="the variables").items()
    }
    target = folder / STATE_DIR
    if target.exists():
        shutil.rmtree(target)
    if api == "nnx":
        from xconv.training import nnx_state

        nnx_state.save(target, model, tx, opt_state, step)
    else:
        tree = {
            "step": jnp.asarray(step, jnp.int32),
            "params": variables["params"],
            "batch_stats": variables.get("batch_stats", {}),
            "opt_state": opt_state,
        }
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(target, tree)
    (folder / CONFIG).write_text(json.dumps(cfg, indent=1))
    (folder / "train.py").write_text(TRAIN_PY_NNX if api == "nnx" else TRAIN_PY)
    return [target, folder / CONFIG, folder / "train.py"]


def load_train_state(folder: Path):
    """``(model, state, tx, loss, config)`` of a folder written by :func:`write_train_state`.

    linen: ``model`` is the Flax module and ``state`` the restored ``{"step", "params",
    "batch_stats", "opt_state"}`` tree; nnx: ``model`` is the nnx module holding the restored
    weights and ``state`` its restored ``nnx.Optimizer``. ``tx`` works on pure dicts (nnx:
    ``nnx_state.nnx_transform(tx)`` is the optimizer's)."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    folder = Path(folder).resolve()
    if not (folder / CONFIG).exists():
        raise ConversionError(f"{folder} has no {CONFIG}: convert with --train-state")
    cfg = json.loads((folder / CONFIG).read_text())
    api, model, variables, params = _folder_model(folder)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    tx = tx_from_config(cfg, params)
    if api != cfg.get("api", "linen"):
        raise ConversionError(f"{folder}: the training state is {cfg.get('api')}, model.py {api}")
    if api == "nnx":
        from xconv.training import nnx_state

        state = nnx_state.restore(folder / STATE_DIR, model, tx)
        return model, state, tx, loss_from_config(cfg["loss"]), cfg
    template = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "batch_stats": jax.tree_util.tree_map(jnp.asarray, dict(variables.get("batch_stats", {}))),
        "opt_state": tx.init(params),
    }
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(folder / STATE_DIR, template)
    return model, state, tx, loss_from_config(cfg["loss"]), cfg


def train_state_to_torch(folder: Path, module, *, state=None) -> dict:
    """A torch training checkpoint ``{"model", "optimizer", "scheduler", "step"}`` of the
    training state in ``folder`` (or ``state``: a ``{"step", "params", "batch_stats",
    "opt_state"}`` tree, or nnx's ``(model, nnx.Optimizer)`` after more steps), for ``module``
    (the torch module the state was converted from)."""
    import torch

    from xconv.training.names import Leaf
    from xconv.training.optimizers import OptimizerSpec, _torch_optax_class, to_torch_optimizer

    model, restored, tx, _, cfg = load_train_state(folder)
    nnx = cfg.get("api") == "nnx"
    if nnx:
        from xconv.training.nnx_state import tree_of

        state = tree_of(*(state if state is not None else (model, restored)))
    state = restored if state is None else state
    o = cfg["optimizer"]
    if nnx:
        from xconv.training.check import _merge

        variables, prefix = _merge(state["params"], state["batch_stats"]), ()
    else:
        variables = {"params": state["params"], "batch_stats": state["batch_stats"]}
        prefix = ("params",)
    named = dict(module.named_parameters())
    sd = module.state_dict()
    leaves_all = {
        n: Leaf(n, tuple(path), tuple(perm) if perm is not None else None)
        for n, (path, perm) in cfg["leaves"].items()
    }
    missing = sorted(set(leaves_all) - set(sd))
    if missing:
        raise ConversionError(
            f"the --template module has no {', '.join(missing[:5])}: give the torch module "
            "the training checkpoint came from"
        )
    flat = _flat(variables)
    with torch.no_grad():
        for name, leaf in leaves_all.items():
            value = leaf.to_torch(np.asarray(flat[leaf.path]))
            sd[name].copy_(torch.from_numpy(np.array(value)).to(sd[name].dtype))
        steps_since = int(state["step"]) - int(cfg.get("step") or 0)
        for name, count in cfg.get("num_batches_tracked", {}).items():
            if name in sd:
                sd[name].fill_(count + steps_since)
    groups = []
    for g in o["groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    spec = OptimizerSpec(o["class"], o["kind"], tuple(groups), tuple(map(tuple, o["names"])))
    leaves = {n: leaves_all[n] for ns in spec.group_names for n in ns if n in named}
    rich = _torch_optax_class()(tx.init, tx.update)
    rich.spec, rich.leaves, rich.prefix = spec, leaves, prefix
    lrs, rich.momenta = schedules_from_config(cfg)
    rich.schedules = lrs if cfg["scheduler"] else None
    opt = to_torch_optimizer(rich, state["opt_state"], module)
    out = {"model": module.state_dict(), "optimizer": opt.state_dict(), "step": int(state["step"])}
    if cfg["scheduler"]:
        out["scheduler"] = advance_scheduler_state(
            cfg["scheduler"], opt.xconv_last_epoch, [g["lr"] for g in opt.param_groups]
        )
    return out


def _flat(tree):
    from xconv.training.names import flatten_tree

    return flatten_tree(tree)


def _torch_module(factory):
    from xconv.factories import resolve_factory

    built = resolve_factory(factory)()
    return built[0] if isinstance(built, tuple) else built


def _loss_module(loss: str | None):
    import torch

    if not loss:
        return torch.nn.CrossEntropyLoss()
    if ":" in loss:
        from xconv.factories import resolve_factory

        return resolve_factory(loss)()
    cls = getattr(torch.nn, loss, None)
    if cls is None:
        raise ConversionError(
            f"torch.nn has no loss {loss!r}; give a class name or pkg.mod:factory"
        )
    return cls()


def convert_train_checkpoint(
    checkpoint: Path,
    module_factory: str,
    convert_model,
    *,
    loss: str | None = None,
    optimizer: str | None = None,
    clip_grad_norm: float | None = None,
) -> list[Path]:
    """``torch-to-flax --train-state``: ``convert_model(state_dict_file) -> out folder``
    converts the checkpoint's ``"model"`` (the usual pipeline); then the training state is
    written into that folder (:func:`write_train_state`)."""
    import tempfile

    import torch

    ckpt = load_torch_checkpoint(Path(checkpoint))
    loss_module = _loss_module(loss)
    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp) / (Path(checkpoint).stem + ".pt")
        torch.save(ckpt["model"], model_file)
        folder = convert_model(model_file)
    return write_train_state(
        folder,
        _torch_module(module_factory),
        ckpt,
        loss_module,
        optimizer=optimizer,
        clip_grad_norm=clip_grad_norm,
    )


def write_torch_train_checkpoint(folder: Path, module_factory: str, out: Path) -> Path:
    """``flax-to-torch --train-state``: the folder's training state as a torch checkpoint."""
    import torch

    ckpt = train_state_to_torch(folder, _torch_module(module_factory))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, out)
    return out


__all__ = [
    "advance_scheduler_state",
    "convert_train_checkpoint",
    "describe_scheduler",
    "load_torch_checkpoint",
    "load_train_state",
    "rebuild_torch_training",
    "scheduler_from_description",
    "train_state_to_torch",
    "tx_from_config",
    "write_torch_train_checkpoint",
    "write_train_state",
]
