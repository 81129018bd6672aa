"""The ``train.py`` written beside a converted training state (linen and nnx); ruff-clean
at the project's line length (100)."""

TRAIN_PY = '''"""Train the converted model from its converted torch training state (written by xconv).

    python train.py            # restores train_state/ and says its step

``load()`` returns ``(state, loss)``: a ``flax.training.train_state.TrainState`` (with
``batch_stats``) holding torch's parameters, optimizer state and step, and torch's loss as a
JAX function; ``train_step(state, inputs, target)`` is the jitted step (forward in train mode,
loss, gradient, torch's optimizer update and schedule).
"""

from pathlib import Path
from typing import Any

import jax
from flax.training import train_state

from xconv.training.state import load_train_state

HERE = Path(__file__).resolve().parent


class TrainState(train_state.TrainState):
    batch_stats: Any = None


def load(folder=HERE):
    model, tree, tx, loss, _ = load_train_state(folder)
    state = TrainState(
        step=tree["step"],
        apply_fn=model.apply,
        params=tree["params"],
        tx=tx,
        opt_state=tree["opt_state"],
        batch_stats=tree["batch_stats"],
    )
    return state, loss


def make_train_step(loss):
    @jax.jit
    def train_step(state, inputs, target):
        def objective(params):
            variables = {"params": params}
            if state.batch_stats:
                variables["batch_stats"] = state.batch_stats
                out, upd = state.apply_fn(variables, *inputs, train=True, mutable=["batch_stats"])
                return loss(out, target), upd["batch_stats"]
            return loss(state.apply_fn(variables, *inputs, train=False), target), None

        (value, stats), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads)
        if stats is not None:
            state = state.replace(batch_stats=stats)
        return state, value

    return train_step


if __name__ == "__main__":
    state, loss = load()
    print(
        f"restored the training state at step {int(state.step)}; train with "
        "make_train_step(loss)(state, (inputs,), target)"
    )
'''

TRAIN_PY_NNX = '''"""Train the converted model from its converted torch training state (written by xconv).

    python train.py            # restores train_state/ and says its step

``load()`` returns ``(model, optimizer, loss)``: the nnx model holding torch's parameters
(and BatchNorm statistics), an ``nnx.Optimizer`` holding torch's optimizer state, step and
schedule, and torch's loss as a JAX function; ``train_step(model, optimizer, inputs, target)``
is the jitted step (forward, in train mode when the model has BatchNorm, loss, gradient,
torch's optimizer update and schedule), updating both in place.
"""

from pathlib import Path

from flax import nnx

from xconv.training.state import load_train_state

HERE = Path(__file__).resolve().parent


def load(folder=HERE):
    model, optimizer, _, loss, _ = load_train_state(folder)
    return model, optimizer, loss


def make_train_step(loss):
    @nnx.jit
    def train_step(model, optimizer, inputs, target):
        train = bool(nnx.state(model, nnx.BatchStat))

        def objective(model):
            return loss(model(*inputs, train=train), target)

        value, grads = nnx.value_and_grad(objective)(model)
        optimizer.update(model, grads)
        return value

    return train_step


if __name__ == "__main__":
    model, optimizer, loss = load()
    print(
        f"restored the training state at step {int(optimizer.step[...])}; train with "
        "make_train_step(loss)(model, optimizer, (inputs,), target)"
    )
'''

__all__ = ["TRAIN_PY", "TRAIN_PY_NNX"]
