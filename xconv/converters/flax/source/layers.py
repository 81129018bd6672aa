"""Constructor expressions for the native Flax layers the emitter writes (linen and nnx).

Arguments equal to the Flax default are left out, uniform tuples are written as one int,
as a person writes them: ``nn.Conv(16, (3, 3), strides=2, padding=1, use_bias=False)``.
"""

from __future__ import annotations

from typing import Any

from xconv.converters.flax.source.templates import scalar_literal


def _uniform(values: tuple[int, ...]) -> int | tuple[int, ...]:
    return values[0] if values and len(set(values)) == 1 else values


def _padding(pad: tuple[tuple[int, int], ...]) -> str:
    flat = {p for pair in pad for p in pair}
    if flat == {0}:
        return '"VALID"'
    if len(flat) == 1:
        return str(flat.pop())
    return str(pad)


def _args(*positional: Any, **kw: tuple[Any, Any]) -> str:
    """``positional`` as they are; each keyword ``name=(value, default)`` unless default."""
    parts = [str(p) for p in positional]
    parts += [f"{k}={v}" for k, (v, default) in kw.items() if v != default]
    return ", ".join(parts)


def _num(value: float) -> str:
    return scalar_literal(value)


def layer_ctor(kind: str, h: dict[str, Any], pdt: str, dt: str = "") -> tuple[str, str]:
    """``(linen, nnx)`` constructor expressions of a native layer of ``kind``.

    Args:
        kind: The layer kind (``conv``, ``dense``, ``batch_norm``, ...).
        h: Its hyper-parameters (``xconv.layer`` metadata).
        pdt: The ``param_dtype`` expression (``jnp.bfloat16``), or ``""`` for float32.
        dt: The compute ``dtype`` expression (``jnp.bfloat16``), or ``""`` (the inputs').
    """
    extra = {"dtype": (dt, ""), "param_dtype": (pdt, "")}
    norm = {"dtype": (dt, "")}
    return _CTORS.get(kind, _dropout)(h, extra, norm)


_Kw = dict[str, tuple[Any, Any]]


def _dense(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    bias = {"use_bias": (bool(h["use_bias"]), True), **extra}
    return (
        f"nn.Dense({_args(h['out_features'], **bias)})",
        f"nnx.Linear({_args(h['in_features'], h['out_features'], **bias)}, rngs=rngs)",
    )


def _conv(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    k = tuple(h["kernel_size"])
    pad = tuple(tuple(int(x) for x in pp) for pp in h["padding"])
    kw = {
        "strides": (_uniform(tuple(h["strides"])), 1),
        # a 1x1 kernel pads nothing under Flax's default "SAME" either
        "padding": (_padding(pad), '"VALID"' if set(k) == {1} else None),
        "kernel_dilation": (_uniform(tuple(h["dilations"])), 1),
        "feature_group_count": (h["groups"], 1),
        "use_bias": (bool(h["use_bias"]), True),
        **extra,
    }
    return (
        f"nn.Conv({_args(h['out_channels'], k, **kw)})",
        f"nnx.Conv({_args(h['in_channels'], h['out_channels'], k, **kw)}, rngs=rngs)",
    )


def _batch_norm(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    aff = bool(h["affine"])
    kw = {
        "momentum": (_num(1.0 - float(h["momentum"])), _num(0.99)),
        "epsilon": (_num(h["epsilon"]), _num(1e-5)),
        "use_scale": (aff, True),
        "use_bias": (aff, True),
    }
    # nnx's BatchNorm casts its running statistics to ``dtype`` before rsqrt: it is left
    # float32 (the emitter rounds its result); linen's computes in float32 either way.
    return f"nn.BatchNorm({_args(**kw, **norm)})", (
        f"nnx.BatchNorm({_args(h['num_features'], **kw)}, rngs=rngs)"
    )


def _layer_norm(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    aff = bool(h["elementwise_affine"])
    kw = {
        "epsilon": (_num(h["epsilon"]), _num(1e-6)),
        "use_scale": (aff, True),
        "use_bias": (aff and bool(h["use_bias"]), True),
        **norm,
    }
    return f"nn.LayerNorm({_args(**kw)})", (
        f"nnx.LayerNorm({_args(h['normalized_shape'][0], **kw)}, rngs=rngs)"
    )


def _group_norm(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    aff = bool(h["affine"])
    kw = {
        "num_groups": (h["num_groups"], None),
        "epsilon": (_num(h["epsilon"]), _num(1e-6)),
        "use_scale": (aff, True),
        "use_bias": (aff, True),
        **norm,
    }
    return f"nn.GroupNorm({_args(**kw)})", (
        f"nnx.GroupNorm({_args(h['num_channels'], **kw)}, rngs=rngs)"
    )


def _rms_norm(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    kw = {
        "epsilon": (_num(h["epsilon"]), _num(1e-6)),
        "use_scale": (bool(h["elementwise_affine"]), True),
        **norm,
    }
    return f"nn.RMSNorm({_args(**kw)})", (
        f"nnx.RMSNorm({_args(h['normalized_shape'][-1], **kw)}, rngs=rngs)"
    )


def _embedding(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    emb = _args(h["num_embeddings"], h["features"], **norm)
    return f"nn.Embed({emb})", f"nnx.Embed({emb}, rngs=rngs)"


def _dropout(h: dict[str, Any], extra: _Kw, norm: _Kw) -> tuple[str, str]:
    rate = _num(h["rate"])
    return f"nn.Dropout({rate})", f"nnx.Dropout({rate}, rngs=rngs)"


def _conv_transpose(h: dict[str, Any], extra: dict[str, tuple[Any, Any]]) -> tuple[str, str]:
    n = h["ndim"]
    k, s, d = tuple(h["kernel_size"]), tuple(h["strides"]), tuple(h["dilations"])
    # Explicit padding of the stride-dilated input, as lax.conv_transpose takes it.
    pad = tuple(
        (
            d[i] * (k[i] - 1) - int(h["padding"][i][0]),
            d[i] * (k[i] - 1) - int(h["padding"][i][1]) + int(h["output_padding"][i]),
        )
        for i in range(n)
    )
    ones = (1,) * n
    kw = {
        "strides": (s, ones),
        "padding": (str(pad), None),
        "kernel_dilation": (d, ones),
        "use_bias": (bool(h["use_bias"]), True),
        "transpose_kernel": (True, False),
        **extra,
    }
    return (
        f"nn.ConvTranspose({_args(h['out_channels'], k, **kw)})",
        f"nnx.ConvTranspose({_args(h['in_channels'], h['out_channels'], k, **kw)}, rngs=rngs)",
    )


#: Layer kind (``xconv/ir/layers.py``) -> ``(h, extra, norm) -> (linen, nnx)`` constructors;
#: any other kind is a dropout.
_CTORS = {
    "dense": _dense,
    "conv": _conv,
    "conv_transpose": lambda h, extra, norm: _conv_transpose(h, extra),
    "batch_norm": _batch_norm,
    "layer_norm": _layer_norm,
    "group_norm": _group_norm,
    "rms_norm": _rms_norm,
    "embedding": _embedding,
}
