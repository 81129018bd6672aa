"""The normalisations written once against ``xp``: InstanceNormalization, LayerNormalization,
GroupNormalization, RMSNormalization, LpNormalization, MeanVarianceNormalization.

Statistics are computed in float32 for ``stash_type`` 1 (never below the input's type).
BatchNormalization too (a torch layer in training mode updates its running buffers in place:
a backend hook). LRN (a window sum) and Dropout (random) stay per backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from xconv.converters.ops.arrays import astype, is_float


class NormKernel(Protocol):
    """What a backend provides for the normalisations."""

    def run(self, fn: Callable[..., Any], *arrays: Any) -> Any:
        """``fn(xp, *arrays)`` in the namespace this backend picks for ``arrays``."""

    def rsqrt(self, xp: Any, x: Any) -> Any:
        """``1 / sqrt(x)`` (the backend's fused primitive where it has one)."""


def _stash(xp, x, stash_type: int):
    """The dtype statistics are computed in: float32 for stash_type 1 (never below x's)."""
    if stash_type == 1 and is_float(xp, x.dtype):
        return xp.promote_types(x.dtype, xp.float32)
    return x.dtype


def _channel(xp, v, ndim: int, dtype, axis: int = 1):
    """A per-channel vector shaped to broadcast against an input whose channels are on
    ``axis`` (1: the IR's N, C, ...; -1: channels-last)."""
    shape = [1] * ndim
    shape[axis] = -1
    return astype(xp, xp.reshape(v, tuple(shape)), dtype)


def apply_batch_norm(k, xp, x, scale, b, mean, var, epsilon, axis: int = 1):
    """``(x - mean) / sqrt(var + epsilon) * scale + b`` with per-channel statistics (the
    running ones at inference, the batch's in training), the channels on ``axis`` (the JAX
    runtime's channels-last execution calls it with -1)."""

    def bc(v):
        return _channel(xp, v, x.ndim, x.dtype, axis)

    return (x - bc(mean)) * k.rsqrt(xp, bc(var) + epsilon) * bc(scale) + bc(b)


def _instance_norm(k, xp, x, scale, b, epsilon):
    axes = tuple(range(2, x.ndim))
    mean = xp.mean(x, axis=axes, keepdims=True)
    var = xp.var(x, axis=axes, keepdims=True)
    y = (x - mean) * k.rsqrt(xp, var + epsilon)
    return y * _channel(xp, scale, x.ndim, x.dtype) + _channel(xp, b, x.ndim, x.dtype)


def _layer_norm(ctx, k, xp, x, scale, b, axis, epsilon, stash_type):
    axes = tuple(range(axis % x.ndim, x.ndim))
    xs = astype(xp, x, _stash(xp, x, stash_type))
    mean = xp.mean(xs, axis=axes, keepdims=True)
    diff = xs - mean
    inv = k.rsqrt(xp, xp.mean(diff * diff, axis=axes, keepdims=True) + epsilon)
    y = astype(xp, diff * inv, x.dtype) * astype(xp, scale, x.dtype)
    if b is not None:
        y = y + astype(xp, b, x.dtype)
    n_out = len(ctx.node.outputs)
    if n_out == 1:
        return y
    stat_dtype = ctx.output_dtype(1) or xs.dtype
    return (y, astype(xp, mean, stat_dtype), astype(xp, inv, stat_dtype))[:n_out]


def _group_norm(k, xp, x, scale, b, epsilon, g: int, stash_type):
    nb, c = x.shape[:2]
    xs = xp.reshape(astype(xp, x, _stash(xp, x, stash_type)), (nb, g, -1))
    mean = xp.mean(xs, axis=-1, keepdims=True)
    diff = xs - mean
    inv = k.rsqrt(xp, xp.mean(diff * diff, axis=-1, keepdims=True) + epsilon)
    y = astype(xp, xp.reshape(diff * inv, tuple(x.shape)), x.dtype)
    # Opset 18 scales per group; a model upgraded by the version converter keeps such a
    # scale, and opset 21 requires one per channel, so the shape tells them apart.
    if scale.shape[0] == g and g != c:
        scale, b = xp.repeat(scale, c // g), xp.repeat(b, c // g)
    return y * _channel(xp, scale, x.ndim, x.dtype) + _channel(xp, b, x.ndim, x.dtype)


def _rms_norm(k, xp, x, scale, axis, epsilon, stash_type):
    axes = tuple(range(axis % x.ndim, x.ndim))
    xs = astype(xp, x, _stash(xp, x, stash_type))
    inv = k.rsqrt(xp, xp.mean(xs * xs, axis=axes, keepdims=True) + epsilon)
    return astype(xp, xs * inv, x.dtype) * astype(xp, scale, x.dtype)


def _lp_norm(ctx, xp, x, axis, p):
    if p == 1:
        norm = xp.sum(xp.abs(x), axis=axis, keepdims=True)
    elif p == 2:
        norm = xp.sqrt(xp.sum(x * x, axis=axis, keepdims=True))
    else:
        raise ctx.error(f"p={p}; supported: 1, 2")
    zero = norm == 0
    # A zero norm gives 0, not NaN (as the ONNX reference does).
    safe = astype(xp, xp.where(zero, xp.ones_like(norm), norm), x.dtype)
    return xp.where(zero, xp.zeros_like(x), x / safe)


def _mean_variance_norm(xp, x, axes):
    mean = xp.mean(x, axis=axes, keepdims=True)
    var = xp.mean(x * x, axis=axes, keepdims=True) - mean * mean
    return (x - mean) / (xp.sqrt(var) + 1e-9)


BATCH_NORM_ATTRS = {
    "epsilon": 1e-5,
    "momentum": 0.9,
    "training_mode": 0,
    "spatial": 1,
    "is_test": 0,
    "consumed_inputs": None,
}


def _batch_norm(ctx, k, xp, x, scale, b, mean, var, epsilon, momentum, training, n_out):
    if not training:
        y = apply_batch_norm(k, xp, x, scale, b, mean, var, epsilon)
        return (y, *([None] * (n_out - 1))) if n_out > 1 else y
    axes = (0,) + tuple(range(2, x.ndim))
    batch_mean = xp.mean(x, axis=axes)
    batch_var = xp.var(x, axis=axes)
    y = apply_batch_norm(k, xp, x, scale, b, batch_mean, batch_var, epsilon)
    run_mean = mean * momentum + astype(xp, batch_mean, mean.dtype) * (1 - momentum)
    run_var = var * momentum + astype(xp, batch_var, var.dtype) * (1 - momentum)
    run_mean, run_var = astype(xp, run_mean, mean.dtype), astype(xp, run_var, var.dtype)
    if ctx.opset >= 15:
        return y, run_mean, run_var
    return y, run_mean, run_var, batch_mean, batch_var


def register_batch_norm(
    builtin: Callable[..., Any], k: NormKernel, module_training: Callable[..., Any] | None = None
) -> None:
    """Register BatchNormalization; ``module_training(ctx, x, scale, b, mean, var, epsilon,
    momentum)`` may take a node over first (torch: a layer of a module in training mode,
    whose running buffers update in place), returning Y, or None to decline."""

    @builtin("BatchNormalization", attrs=BATCH_NORM_ATTRS)
    def batch_normalization(
        ctx,
        x,
        scale,
        b,
        mean,
        var,
        *,
        epsilon,
        momentum,
        training_mode,
        spatial,
        is_test,
        consumed_inputs,
    ):
        """BatchNormalization(X, scale, B, input_mean, input_var) -> (Y, running_mean?,
        running_var?).

        Opsets 9-14 train when the node asks for more than one output, and then also return
        the saved (batch) mean and variance.
        """
        outputs = [v for v in ctx.node.outputs if v.name]
        training = bool(training_mode) if ctx.opset >= 15 else (len(outputs) > 1 and not is_test)
        if not spatial and ctx.opset < 9:
            raise ctx.error("spatial=0 is not supported; use spatial=1 (per-channel statistics)")
        n_out = len(ctx.node.outputs)
        if module_training is not None:
            y = module_training(ctx, x, scale, b, mean, var, epsilon, momentum)
            if y is not None:
                return (y, *([None] * (n_out - 1)))
        return k.run(
            lambda xp, *a: _batch_norm(ctx, k, xp, *a, epsilon, momentum, training, n_out),
            x,
            scale,
            b,
            mean,
            var,
        )


def register_normalization_ops(builtin: Callable[..., Any], k: NormKernel, required: Any) -> None:
    """Register the normalisations with a backend's ``builtin`` and kernel ``k``."""

    @builtin("InstanceNormalization", attrs={"epsilon": 1e-5})
    def instance_normalization(ctx, x, scale, b, *, epsilon):
        """InstanceNormalization(input, scale, B) -> output: normalise each (n, c) over space."""
        return k.run(lambda xp, *a: _instance_norm(k, xp, *a, epsilon), x, scale, b)

    @builtin("LayerNormalization", attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1})
    def layer_normalization(ctx, x, scale, b=None, *, axis, epsilon, stash_type):
        """LayerNormalization(X, Scale, B?) -> (Y, Mean?, InvStdDev?) over axes [axis, rank)."""
        return k.run(
            lambda xp, *a: _layer_norm(ctx, k, xp, *a, axis, epsilon, stash_type), x, scale, b
        )

    @builtin("GroupNormalization", attrs={"epsilon": 1e-5, "num_groups": required, "stash_type": 1})
    def group_normalization(ctx, x, scale, b, *, epsilon, num_groups, stash_type):
        """GroupNormalization(X, scale, bias) -> Y; scale/bias per channel (opset 21) or per
        group (opset 18)."""
        g = int(num_groups)
        return k.run(lambda xp, *a: _group_norm(k, xp, *a, epsilon, g, stash_type), x, scale, b)

    @builtin("RMSNormalization", attrs={"axis": -1, "epsilon": 1e-5, "stash_type": 1})
    def rms_normalization(ctx, x, scale, *, axis, epsilon, stash_type):
        """RMSNormalization(X, scale) -> Y = X / sqrt(mean(X^2 over [axis, rank)) + eps) *
        scale."""
        return k.run(lambda xp, *a: _rms_norm(k, xp, *a, axis, epsilon, stash_type), x, scale)

    @builtin("LpNormalization", attrs={"axis": -1, "p": 2})
    def lp_normalization(ctx, x, *, axis, p):
        """LpNormalization(input) -> output: divide by the L1 or L2 norm along axis."""
        return k.run(lambda xp, x: _lp_norm(ctx, xp, x, axis, p), x)

    @builtin("MeanVarianceNormalization", attrs={"axes": (0, 2, 3)})
    def mean_variance_normalization(ctx, x, *, axes):
        """MeanVarianceNormalization(X) -> Y = (X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9)."""
        axes = tuple(int(a) for a in axes)
        return k.run(lambda xp, x: _mean_variance_norm(xp, x, axes), x)
