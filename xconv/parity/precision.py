"""The precision a row's float32 dots and convolutions ran at, and how deep they chain.

JAX computes float32 ``dot_general`` / ``conv_general_dilated`` at reduced precision on
accelerators by default: TF32 (inputs rounded to a 10-bit mantissa) on NVIDIA GPUs since
Ampere, one bfloat16 pass (7-bit mantissa) on TPUs; ``jax_default_matmul_precision`` (or the
``jax.default_matmul_precision`` context) moves that ('high': TF32 on GPUs, three bfloat16
passes on TPUs; 'highest': full float32). torch's float32 matmuls on CUDA run in TF32 only when
``allow_tf32`` / ``set_float32_matmul_precision('high' | 'medium')`` / ``fp32_precision='tf32'``
says so; its cuDNN convolutions do by default. CPUs compute float32 dots in float32.

The names here are the keys of :data:`xconv.parity.policies.DOT_UNIT_ROUNDOFF`: ``float32``,
``bf16_3x``, ``tf32``, ``bf16``. The parity policy widens its floor by that precision's unit
roundoff times ``sqrt(L)``, ``L`` the dot / conv stages on the longest path
(:func:`jaxpr_dot_depth`, :func:`torch_dot_depth`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from xconv.errors import ParityConfigError, require

#: What ``check_parity(precision=...)`` accepts: the device's default, or full float32.
REQUESTS = ("default", "highest")

# lax.Precision levels each legacy setting means (jax.default_matmul_precision's values).
_LEVEL = {
    None: "default",
    "default": "default",
    "fastest": "default",
    "bfloat16": "default",
    "high": "high",
    "tensorfloat32": "high",
    "bfloat16_3x": "high",
    "highest": "highest",
    "float32": "highest",
}
# Dot algorithm presets: the precision of their operands, whatever the device.
_PRESETS = {
    "BF16_BF16_BF16": "bf16",
    "BF16_BF16_F32": "bf16",
    "BF16_BF16_F32_X3": "bf16_3x",
    "BF16_BF16_F32_X6": "float32",
    "BF16_BF16_F32_X9": "float32",
    "TF32_TF32_F32": "tf32",
    "TF32_TF32_F32_X3": "float32",
    "F32_F32_F32": "float32",
    "F64_F64_F64": "float32",
    "F16_F16_F16": "tf32",  # a 10-bit mantissa, as TF32
    "F16_F16_F32": "tf32",
}


def check_request(precision: str | None) -> str:
    """``precision`` as ``check_parity`` takes it (None is ``"default"``)."""
    p = "default" if precision is None else str(precision).lower()
    if p not in REQUESTS:
        raise ParityConfigError(
            f"unknown precision {precision!r}; use one of {list(REQUESTS)} ('highest' runs the "
            "candidate with full float32 dots and judges it at float32)"
        )
    return p


def jax_precision(
    platform: str, device_kind: str = "", compute_capability: Any = None, setting: Any = None
) -> str:
    """The precision float32 dots run at on a JAX device under ``setting`` (the effective
    ``jax_default_matmul_precision``, None for JAX's default). Pure: tests pass fake devices."""
    platform = platform.lower()
    if setting is not None and str(setting).upper() in _PRESETS:
        return "float32" if platform == "cpu" else _PRESETS[str(setting).upper()]
    level = _LEVEL.get(None if setting is None else str(setting).lower(), "default")
    if platform in ("gpu", "cuda"):
        if level == "highest" or not _ampere_or_newer(device_kind, compute_capability):
            return "float32"
        return "tf32"
    if platform == "tpu":
        return {"default": "bf16", "high": "bf16_3x"}.get(level, "float32")
    return "float32"  # CPU (and ROCm, whose XLA default keeps float32 dots)


def _ampere_or_newer(device_kind: str, compute_capability: Any) -> bool:
    if compute_capability is not None:
        try:
            return float(str(compute_capability)) >= 8.0
        except ValueError:
            pass
    old = ("V100", "P100", "T4", "K80", "P4", "P40", "GTX", "TITAN V", "QUADRO")
    return not any(tag in device_kind.upper() for tag in old)


def jax_setting() -> Any:
    """The effective ``jax_default_matmul_precision``, a ``jax.default_matmul_precision``
    context included."""
    jax = require("jax", "jax")
    return jax.config.jax_default_matmul_precision


def jax_device_precision(device: Any) -> str:
    """:func:`jax_precision` of a ``jax.Device`` under the current setting."""
    return jax_precision(
        device.platform,
        getattr(device, "device_kind", ""),
        getattr(device, "compute_capability", None),
        jax_setting(),
    )


def blocks_policy(pol: Any, model: Any) -> Any:
    """``pol`` for the layerwise check's candidate blocks, which the JAX interpreter runs on
    JAX's default device: at that device's precision, ``L`` the IR's matmul / conv depth
    (:func:`xconv.converters.ops.precision.rounding_depth`, the whole model's: an upper bound
    for every block). Unchanged where the dots run at float32 or the IR is unknown."""
    jax = require("jax", "jax")
    precision = jax_device_precision(jax.devices()[0])
    if precision == "float32" or model is None:
        return pol
    from xconv.converters.ops.precision import rounding_depth

    return pol.at_precision(precision, rounding_depth(model))


def jax_context(request: str) -> contextlib.AbstractContextManager:
    """Run under full float32 dots for ``"highest"``; the setting as it is otherwise."""
    if request != "highest":
        return contextlib.nullcontext()
    return require("jax", "jax").default_matmul_precision("highest")


def torch_precision(device: str, has_conv: bool) -> str:
    """The precision torch's float32 matmuls (and convolutions, where ``has_conv``) run at on
    ``device``: TF32 on CUDA where its settings allow it, float32 elsewhere."""
    if not device.startswith("cuda"):
        return "float32"
    torch = require("torch", "torch")
    matmul = _torch_fp32(torch.backends.cuda.matmul)
    if matmul is None:
        mode = torch.get_float32_matmul_precision()
        matmul = {"medium": "bf16", "high": "tf32"}.get(
            mode, "tf32" if torch.backends.cuda.matmul.allow_tf32 else "float32"
        )
    conv = _torch_fp32(getattr(torch.backends.cudnn, "conv", None))
    if conv is None:
        conv = "tf32" if torch.backends.cudnn.allow_tf32 else "float32"
    order = ("float32", "bf16_3x", "tf32", "bf16")
    return max(matmul, conv if has_conv else "float32", key=order.index)


def _torch_fp32(backend: Any) -> str | None:
    """torch >= 2.9's ``fp32_precision`` of a backend ('tf32' / 'ieee'), or None to use the
    older flags ('none' inherits)."""
    value = getattr(backend, "fp32_precision", None)
    if value in ("tf32",):
        return "tf32"
    if value in ("ieee",):
        return "float32"
    if value == "bf16":
        return "bf16"
    return None


@contextlib.contextmanager
def torch_context(request: str) -> Iterator[None]:
    """Full float32 matmuls and convolutions on CUDA for ``"highest"`` (restored after)."""
    if request != "highest":
        yield
        return
    torch = require("torch", "torch")
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])


# --------------------------------------------------------------------------- depth

_DOT_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")


def jaxpr_dot_depth(fn: Callable[..., Any], *args: Any) -> int:
    """The most ``dot_general`` / ``conv_general_dilated`` on any path from an input to an
    output of ``fn(*args)``'s jaxpr (sub-jaxprs inlined, a scan body counted ``length``
    times); at least 1."""
    jax = require("jax", "jax")
    closed = jax.make_jaxpr(fn)(*args)
    return max(_jaxpr_depth(closed.jaxpr, [0] * len(closed.jaxpr.invars))[1], 1)


def _jaxpr_depth(jaxpr: Any, in_depths: Sequence[int]) -> tuple[list[int], int]:
    """Depth of each output of ``jaxpr`` given its inputs' depths, and the deepest value."""
    depth: dict[Any, int] = dict(zip(jaxpr.invars, in_depths, strict=True))
    best = max(in_depths, default=0)
    for eqn in jaxpr.eqns:
        d = max((depth.get(v, 0) for v in eqn.invars if not _is_literal(v)), default=0)
        inner = [_inner_depth(sub) for sub in _sub_jaxprs(eqn.params)]
        d += max(inner, default=0) * int(eqn.params.get("length", 1) or 1)
        d += int(eqn.primitive.name in _DOT_PRIMITIVES)
        for v in eqn.outvars:
            depth[v] = d
        best = max(best, d)
    return [0 if _is_literal(v) else depth.get(v, 0) for v in jaxpr.outvars], best


def _inner_depth(sub: Any) -> int:
    jaxpr = getattr(sub, "jaxpr", sub)
    return _jaxpr_depth(jaxpr, [0] * len(jaxpr.invars))[1]


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                found.append(v)
    return found


def _is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


_TORCH_DOTS = (
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "einsum",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "scaled_dot_product_attention",
)


def torch_dot_depth(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[int, bool]:
    """The most matmul / convolution ops on any path from an input to an output of one run of
    ``fn(*args)`` (attention counted as its two matmuls), and whether it ran a convolution."""
    torch = require("torch", "torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    depth: dict[int, int] = {}
    keep: list[Any] = []  # holds every tensor seen, so an id is never reused during the run
    seen_conv = [False]

    class _Depth(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            d = max((depth.get(id(t), 0) for t in ins), default=0)
            name = func.overloadpacket.__name__
            if name in _TORCH_DOTS:
                d += 2 if "attention" in name else 1
                seen_conv[0] = seen_conv[0] or "conv" in name
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    depth[id(t)] = d
                    keep.append(t)
            return out

    with torch.no_grad(), _Depth():
        fn(*args)
    return max(max(depth.values(), default=0), 1), seen_conv[0]
