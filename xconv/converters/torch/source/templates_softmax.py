"""PyTorch source templates for Softmax, LogSoftmax and Hardmax, and the losses over
log-probabilities (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss). Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

import onnx_ir as ir

from xconv.converters import expressions as ex
from xconv.converters.torch.source.templates import OpCall, template


@template("Softmax", axis=-1)
def _softmax(c: OpCall) -> str:
    return f"torch.softmax({c.args[0]}, dim={c.attrs['axis']})"


@template("LogSoftmax", axis=-1)
def _log_softmax(c: OpCall) -> str:
    return f"torch.log_softmax({c.args[0]}, dim={c.attrs['axis']})"


@template("Hardmax", axis=-1)
def _hardmax(c: OpCall) -> str:
    """1 at the first maximum along ``axis``, 0 elsewhere (F.one_hot adds its axis last)."""
    x, a = c.args[0], c.attrs["axis"]
    hot = f"F.one_hot(torch.argmax({x}, dim={a}), {x}.shape[{a}])"
    if a not in (-1, c.need_rank() - 1):
        hot = f"torch.movedim({hot}, -1, {a})"
    return f"{hot}.to({x}.dtype)"


@template("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", **ex.LOSS_ATTRS)
def _loss(c: OpCall) -> str:
    """``F.nll_loss`` / ``F.cross_entropy``: ONNX defined both after them (the mean over the
    weights of the targets kept; torch wants int64 targets); SoftmaxCrossEntropyLoss's
    log_prob output is ``F.log_softmax`` over the classes."""
    kw = ex.loss_keywords(c)
    target = c.args[1]
    if c.node.inputs[1].dtype != ir.DataType.INT64:
        target = f"{target}.long()"
    if c.has(2):
        kw.insert(0, f"weight={c.args[2]}")
    nll = c.node.op_type == "NegativeLogLikelihoodLoss"
    call = f"F.{'nll_loss' if nll else 'cross_entropy'}({', '.join([c.args[0], target, *kw])})"
    if len(c.node.outputs) > 1:
        return f"{call}, F.log_softmax({c.args[0]}, dim=1)"
    return call
