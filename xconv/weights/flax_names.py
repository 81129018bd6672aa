"""Where each IR weight lives in Flax: the (scope, role) <-> variable-path rule.

A recognised layer at scope ``layer1.0.conv1`` becomes the Flax submodule
``layer1_0_conv1``; its weights go to ``(collection, module, variable)``:

==============  =========================  ===========================================
layer kind      role                       Flax path
==============  =========================  ===========================================
dense, conv,    kernel / bias              ``params/<module>/kernel`` (IO, HWIO) / ``bias``
conv_transpose
batch_norm      scale / bias               ``params/<module>/scale`` / ``bias``
                mean / var                 ``batch_stats/<module>/mean`` / ``var``
layer_norm,     scale / bias               ``params/<module>/scale`` / ``bias``
group_norm,
rms_norm
embedding       embedding                  ``params/<module>/embedding``
==============  =========================  ===========================================

A recognised layer Flax has no native layer for (``attention``, or a layer whose body does not
fit the native one) becomes a generated submodule ``<module>`` holding each weight under its
role: ``params/<module>/<role>`` (``params/encoder_self_attn/in_proj_kernel``), in the IR's
layout. A weight outside any recognised layer is one raw parameter ``params/<name>`` where
``<name>`` is its initializer name made an identifier (``encoder.pos_embed`` ->
``encoder_pos_embed``). Large non-weight tensors (buffers) go to the ``constants`` collection
the same way. For nnx the same paths apply without the collection level.
"""

from __future__ import annotations

import keyword
import re

import numpy as np

#: kind -> {role: (collection, Flax variable name)}
FLAX_VARIABLES: dict[str, dict[str, tuple[str, str]]] = {
    "dense": {"kernel": ("params", "kernel"), "bias": ("params", "bias")},
    "conv": {"kernel": ("params", "kernel"), "bias": ("params", "bias")},
    "conv_transpose": {"kernel": ("params", "kernel"), "bias": ("params", "bias")},
    "batch_norm": {
        "scale": ("params", "scale"),
        "bias": ("params", "bias"),
        "mean": ("batch_stats", "mean"),
        "var": ("batch_stats", "var"),
    },
    "layer_norm": {"scale": ("params", "scale"), "bias": ("params", "bias")},
    "group_norm": {"scale": ("params", "scale"), "bias": ("params", "bias")},
    "rms_norm": {"scale": ("params", "scale")},
    "embedding": {"embedding": ("params", "embedding")},
}

#: Roles the source keeps that Flax has no variable for (torch's ``num_batches_tracked``).
DROPPED_ROLES = frozenset({"num_batches"})

_NON_IDENT = re.compile(r"\W")


def identifier(name: str) -> str:
    """``layer1.0.conv1`` -> ``layer1_0_conv1``; ``Block_0/Conv_0`` -> ``Block_0_Conv_0``."""
    out = _NON_IDENT.sub("_", name).strip("_") or "v"
    out = re.sub(r"_+", "_", out)
    if out[0].isdigit():
        out = f"m_{out}"
    if keyword.iskeyword(out):
        out += "_"
    return out


def module_name(scope: str) -> str:
    """The Flax submodule name of the layer at ``scope``."""
    return identifier(scope)


def flax_path(scope: str, role: str, kind: str) -> tuple[str, str, str] | None:
    """``(collection, module, variable)`` of a layer weight, or None for a dropped role.

    Raises:
        KeyError: the role has no Flax variable in a layer of that kind.
    """
    if role in DROPPED_ROLES:
        return None
    collection, var = FLAX_VARIABLES[kind][role]
    return collection, module_name(scope), var


def raw_param_name(initializer_name: str) -> str:
    """The top-level ``params`` name of a weight that belongs to no recognised layer."""
    return identifier(initializer_name)


def kernel_permutation(layout: str, target: str) -> tuple[int, ...]:
    """Axis permutation turning a kernel in ``layout`` into ``target`` (``OIHW`` -> ``HWIO``)."""
    if sorted(layout) != sorted(target) or len(set(layout)) != len(layout):
        raise ValueError(f"cannot permute layout {layout!r} into {target!r}")
    return tuple(layout.index(c) for c in target)


def flax_kernel_layout(layout: str) -> str:
    """The Flax layout for an IR kernel layout: spatial dims first, then I, then O."""
    spatial = "".join(c for c in layout if c not in "OI")
    return f"{spatial}IO"


def to_flax_kernel(array: np.ndarray, layout: str) -> np.ndarray:
    """Transpose a kernel from its IR layout (``OIHW``, ``OI``) to Flax's (``HWIO``, ``IO``)."""
    perm = kernel_permutation(layout, flax_kernel_layout(layout))
    out = np.transpose(array, perm)
    # A weight of a model traced without its data is a stand-in recording the transpose.
    return np.ascontiguousarray(out) if isinstance(out, np.ndarray) else out


def from_flax_kernel(array: np.ndarray, layout: str) -> np.ndarray:
    """Inverse of :func:`to_flax_kernel`: Flax kernel back to the IR ``layout``."""
    perm = kernel_permutation(flax_kernel_layout(layout), layout)
    return np.ascontiguousarray(np.transpose(array, perm))
