"""The nnx side of training checkpoints: an ``nnx.Optimizer`` holding the converted torch
optimizer state, saved to / restored from Orbax beside the model's ``Param`` and
``BatchStat`` state.

The optax transforms of :mod:`xconv.training.optimizers` work on plain nested dicts (their
labels and state are laid out like ``nnx.state(model, nnx.Param).to_pure_dict()``);
:func:`nnx_transform` lets ``nnx.Optimizer`` hand them its ``nnx.State`` trees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_MODEL_FILTER = ("Param", "BatchStat")


def nnx_transform(tx, init_state=None):
    """``tx`` over ``nnx.State`` trees (what ``nnx.Optimizer`` passes): states become pure
    dicts going in and the updates an ``nnx.State`` coming out. ``init_state``: the state
    ``init`` returns (a converted torch state) instead of ``tx.init``'s."""
    import optax
    from flax import nnx

    def pure(tree):
        return tree.to_pure_dict() if isinstance(tree, nnx.State) else tree

    def init_fn(params):
        return init_state if init_state is not None else tx.init(pure(params))

    def update_fn(updates, state, params=None):
        new, state = tx.update(pure(updates), state, pure(params))
        return (nnx.State(new) if isinstance(updates, nnx.State) else new), state

    return optax.GradientTransformation(init_fn, update_fn)


def model_state(model):
    """The model's ``Param`` and ``BatchStat`` state as one pure dict."""
    from flax import nnx

    return nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)).to_pure_dict()


def param_dict(model) -> dict:
    from flax import nnx

    return nnx.state(model, nnx.Param).to_pure_dict()


def tree_of(model, optimizer) -> dict[str, Any]:
    """``{"step", "params", "batch_stats", "opt_state"}`` of an nnx model and its optimizer
    (the tree :func:`xconv.training.state.train_state_to_torch` takes)."""
    import jax.numpy as jnp
    from flax import nnx

    return {
        "step": jnp.asarray(optimizer.step[...], jnp.int32),
        "params": param_dict(model),
        "batch_stats": nnx.state(model, nnx.BatchStat).to_pure_dict(),
        "opt_state": nnx.as_pure(optimizer.opt_state),
    }


def save(target: Path, model, tx, opt_state, step: int) -> None:
    """Orbax ``{"model": Param + BatchStat state, "optimizer": nnx.Optimizer state}``."""
    import orbax.checkpoint as ocp
    from flax import nnx

    optimizer = nnx.Optimizer(model, nnx_transform(tx, opt_state), wrt=nnx.Param)
    optimizer.step[...] = step
    tree = {"model": model_state(model), "optimizer": nnx.state(optimizer).to_pure_dict()}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(target, tree)


def restore(target: Path, model, tx):
    """The ``nnx.Optimizer`` of :func:`save`, with ``model`` updated to the saved state."""
    import orbax.checkpoint as ocp
    from flax import nnx

    optimizer = nnx.Optimizer(model, nnx_transform(tx), wrt=nnx.Param)
    model_st = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    opt_st = nnx.state(optimizer)
    template = {"model": model_st.to_pure_dict(), "optimizer": opt_st.to_pure_dict()}
    with ocp.StandardCheckpointer() as ckptr:
        saved = ckptr.restore(target, template)
    nnx.replace_by_pure_dict(model_st, saved["model"])
    nnx.update(model, model_st)
    nnx.replace_by_pure_dict(opt_st, saved["optimizer"])
    nnx.update(optimizer, opt_st)
    return optimizer


__all__ = ["model_state", "nnx_transform", "restore", "save", "tree_of"]
