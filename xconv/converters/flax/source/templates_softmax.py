"""Flax source templates for Softmax, LogSoftmax and Hardmax, and the losses over
log-probabilities (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss). Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.flax.source.templates import OpCall, template


@template("Softmax", layout="axis", axis=-1)
def _softmax(c: OpCall) -> str:
    return f"jax.nn.softmax({c.args[0]}, axis={c.axis(c.attrs['axis'])})"


@template("LogSoftmax", layout="axis", axis=-1)
def _log_softmax(c: OpCall) -> str:
    return f"jax.nn.log_softmax({c.args[0]}, axis={c.axis(c.attrs['axis'])})"


@template("Hardmax", layout="axis", axis=-1)
def _hardmax(c: OpCall) -> str:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    x, a = c.args[0], c.axis(c.attrs["axis"])
    return f"jax.nn.one_hot(jnp.argmax({x}, axis={a}), {x}.shape[{a}], dtype={x}.dtype, axis={a})"


@template("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", **ex.LOSS_ATTRS)
def _loss(c: OpCall) -> str:
    """``_nll_loss`` (torch's ``F.nll_loss``, written in jnp) of the log-probabilities; for
    SoftmaxCrossEntropyLoss of ``jax.nn.log_softmax`` over the classes, and with its
    log_prob output ``_softmax_cross_entropy``, which returns both."""
    kw = ex.loss_keywords(c)
    args = [c.args[0], c.args[1], *([c.args[2]] if c.has(2) else [])]
    c.helpers.add("nll_loss")
    if c.node.op_type == "NegativeLogLikelihoodLoss":
        return f"_nll_loss({', '.join(args + kw)})"
    if len(c.node.outputs) > 1:
        c.helpers.add("softmax_cross_entropy")
        return f"_softmax_cross_entropy({', '.join(args + kw)})"
    args[0] = f"jax.nn.log_softmax({args[0]}, axis=1)"
    return f"_nll_loss({', '.join(args + kw)})"
