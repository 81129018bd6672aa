"""``torch.nn`` loss modules as JAX loss functions with torch's exact definition.

``from_torch_loss(module)`` reads the module's options (``reduction``, ``weight``,
``ignore_index``, ``label_smoothing``, ``pos_weight``, ``beta``, ``delta``, ``margin``,
``log_target``) and returns ``loss(*inputs)`` taking the same arguments as the module
(``loss(logits, target)``; ``loss(x1, x2, y)`` for ``CosineEmbeddingLoss``). An option the
conversion does not know is an error, never ignored.

Class dimension: torch puts classes on axis 1 (``N, C, H, W``). A converted model that emits
channel-last outputs (``N, H, W, C``) passes ``channel_axis=-1``; class-index targets keep
their shape (``N, H, W``), probability targets are channel-last like the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xconv.errors import UnsupportedAttributeError

SUPPORTED = (
    "CrossEntropyLoss",
    "NLLLoss",
    "MSELoss",
    "L1Loss",
    "SmoothL1Loss",
    "HuberLoss",
    "BCELoss",
    "BCEWithLogitsLoss",
    "KLDivLoss",
    "CosineEmbeddingLoss",
)


def _np(t):
    return None if t is None else t.detach().cpu().numpy().copy()


def _reduce(x, reduction: str):
    import jax.numpy as jnp

    if reduction == "mean":
        return jnp.mean(x)
    if reduction == "sum":
        return jnp.sum(x)
    return x


def _move_classes(x, axis: int):
    """Classes to axis -1 (where the math below takes them)."""
    import jax.numpy as jnp

    return jnp.moveaxis(x, axis, -1) if x.ndim > 1 else x


def _nll(logp, target, *, weight, ignore_index, label_smoothing, reduction, axis):
    """torch's ``nll_loss`` / ``cross_entropy`` on log-probabilities (``logp``)."""
    import jax.numpy as jnp

    logp = _move_classes(logp, axis)
    n_classes = logp.shape[-1]
    w = jnp.ones((n_classes,), logp.dtype) if weight is None else jnp.asarray(weight, logp.dtype)
    if jnp.issubdtype(target.dtype, jnp.floating):  # class probabilities
        target = _move_classes(target, axis)
        if label_smoothing:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        per = -jnp.sum(w * target * logp, axis=-1)
        if reduction == "mean":
            return jnp.sum(per) / per.size
        return _reduce(per, reduction)
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0).astype(jnp.int32)
    picked = jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    wt = jnp.where(valid, w[safe], 0)
    nll = -wt * picked
    if reduction == "none":
        out = nll
    elif reduction == "sum":
        out = jnp.sum(nll)
    else:
        out = jnp.sum(nll) / jnp.sum(wt)
    if not label_smoothing:
        return out
    smooth = jnp.where(valid, -jnp.sum(w * logp, axis=-1), 0)
    if reduction == "none":
        s = smooth
    elif reduction == "sum":
        s = jnp.sum(smooth)
    elif weight is not None:
        s = jnp.sum(smooth) / jnp.sum(wt)
    else:
        s = jnp.sum(smooth) / jnp.sum(valid)
    return (1 - label_smoothing) * out + s * (label_smoothing / n_classes)


def _check(module, known: set[str]) -> None:
    """Every option on the module must be one the conversion reads (or torch's defaults)."""
    defaults = {"size_average": None, "reduce": None}
    extra = {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_") and k != "training" and k not in known and v != defaults.get(k)
    }
    if extra:
        raise UnsupportedAttributeError(
            f"{type(module).__name__} option(s) {sorted(extra)} are not converted"
        )


def from_torch_loss(loss_module: Any, *, channel_axis: int = 1) -> Callable[..., Any]:
    """A JAX function computing ``loss_module`` exactly as torch does.

    Args:
        loss_module: One of the ``torch.nn`` losses in ``SUPPORTED``.
        channel_axis: Axis of the class / channel dimension of the model's output: 1 as in
            torch, -1 for a channel-last (NHWC) converted model.

    Raises:
        UnsupportedAttributeError: another loss class, or an option not converted.
    """
    kind = type(loss_module).__name__
    reduction = getattr(loss_module, "reduction", "mean")
    buffers = {n: _np(b) for n, b in loss_module.named_buffers()}
    build = _LOSSES.get(kind)
    if build is None:
        raise UnsupportedAttributeError(
            f"loss {kind} has no JAX conversion; supported: {', '.join(SUPPORTED)}"
        )
    return build(loss_module, reduction, buffers, channel_axis)


# One builder per loss class: (module, reduction, buffers, channel_axis) -> the JAX function.


def _cross_entropy(m, reduction, buffers, channel_axis):
    import jax
    import jax.numpy as jnp

    _check(m, {"reduction", "ignore_index", "label_smoothing"})
    smoothing = float(getattr(m, "label_smoothing", 0.0))
    opts = dict(
        weight=buffers.get("weight"),
        ignore_index=m.ignore_index,
        label_smoothing=smoothing,
        reduction=reduction,
        axis=channel_axis,
    )

    def cross_entropy(input, target):
        x = jnp.asarray(input)
        logp = jax.nn.log_softmax(x, axis=channel_axis if x.ndim > 1 else 0)
        return _nll(logp, jnp.asarray(target), **opts)

    def nll_loss(input, target):
        return _nll(jnp.asarray(input), jnp.asarray(target), **opts)

    return cross_entropy if type(m).__name__ == "CrossEntropyLoss" else nll_loss


def _pointwise(m, reduction, buffers, channel_axis):
    import jax.numpy as jnp

    _check(m, {"reduction"})
    square = type(m).__name__ == "MSELoss"

    def pointwise(input, target):
        d = jnp.asarray(input) - jnp.asarray(target)
        return _reduce(d * d if square else jnp.abs(d), reduction)

    return pointwise


def _smooth_l1(m, reduction, buffers, channel_axis):
    import jax.numpy as jnp

    _check(m, {"reduction", "beta", "delta"})
    beta = float(getattr(m, "beta", 1.0))
    delta = float(getattr(m, "delta", 1.0))

    def smooth_l1(input, target):
        d = jnp.abs(jnp.asarray(input) - jnp.asarray(target))
        if beta == 0:
            return _reduce(d, reduction)
        return _reduce(jnp.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta), reduction)

    def huber(input, target):
        d = jnp.abs(jnp.asarray(input) - jnp.asarray(target))
        out = jnp.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
        return _reduce(out, reduction)

    return smooth_l1 if type(m).__name__ == "SmoothL1Loss" else huber


def _bce(m, reduction, buffers, channel_axis):
    import jax.numpy as jnp

    _check(m, {"reduction"})
    weight = buffers.get("weight")

    def bce(input, target):
        x, y = jnp.asarray(input), jnp.asarray(target)
        # torch clamps each log at -100 so that 0 and 1 give finite losses.
        out = -(y * jnp.maximum(jnp.log(x), -100) + (1 - y) * jnp.maximum(jnp.log1p(-x), -100))
        if weight is not None:
            out = out * weight
        return _reduce(out, reduction)

    return bce


def _bce_logits(m, reduction, buffers, channel_axis):
    import jax.numpy as jnp

    _check(m, {"reduction"})
    weight, pos_weight = buffers.get("weight"), buffers.get("pos_weight")

    def bce_logits(input, target):
        x, y = jnp.asarray(input), jnp.asarray(target)
        # pos_weight broadcasts against the last axis, as in torch.
        pw = pos_weight
        softplus_neg = jnp.log1p(jnp.exp(-jnp.abs(x))) + jnp.maximum(-x, 0)
        if pw is not None:
            out = (1 - y) * x + ((pw - 1) * y + 1) * softplus_neg
        else:
            out = (1 - y) * x + softplus_neg
        if weight is not None:
            out = out * weight
        return _reduce(out, reduction)

    return bce_logits


def _kl_div(m, reduction, buffers, channel_axis):
    import jax
    import jax.numpy as jnp

    _check(m, {"reduction", "log_target"})
    log_target = bool(m.log_target)

    def kl_div(input, target):
        x, y = jnp.asarray(input), jnp.asarray(target)
        out = jnp.exp(y) * (y - x) if log_target else jax.scipy.special.xlogy(y, y) - y * x
        if reduction == "batchmean":
            return jnp.sum(out) / x.shape[0]
        return _reduce(out, reduction)

    return kl_div


def _cosine_embedding(m, reduction, buffers, channel_axis):
    import jax.numpy as jnp

    _check(m, {"reduction", "margin"})
    margin = float(m.margin)

    def cosine_embedding(x1, x2, y):
        a, b, y = jnp.asarray(x1), jnp.asarray(x2), jnp.asarray(y)
        eps = 1e-12
        prod = jnp.sum(a * b, axis=-1)
        mag = jnp.sqrt((jnp.sum(a * a, axis=-1) + eps) * (jnp.sum(b * b, axis=-1) + eps))
        cos = prod / mag
        out = jnp.where(y == 1, 1 - cos, 0) + jnp.where(y == -1, jnp.maximum(cos - margin, 0), 0)
        return _reduce(out, reduction)

    return cosine_embedding


#: torch loss class name -> its builder.
_LOSSES: dict[str, Callable[..., Callable[..., Any]]] = {
    "CrossEntropyLoss": _cross_entropy,
    "NLLLoss": _cross_entropy,
    "MSELoss": _pointwise,
    "L1Loss": _pointwise,
    "SmoothL1Loss": _smooth_l1,
    "HuberLoss": _smooth_l1,
    "BCELoss": _bce,
    "BCEWithLogitsLoss": _bce_logits,
    "KLDivLoss": _kl_div,
    "CosineEmbeddingLoss": _cosine_embedding,
}


__all__ = ["SUPPORTED", "from_torch_loss"]
