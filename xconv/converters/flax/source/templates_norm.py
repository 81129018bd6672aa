"""Flax source templates for the normalisations: BatchNormalization (eval mode),
LayerNormalization (and its statistics), RMSNormalization, GroupNormalization,
InstanceNormalization, LRN, MeanVarianceNormalization, LpNormalization. Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.codegen import scalar_literal
from xconv.converters.flax.source.templates import OpCall, registry, template
from xconv.converters.flax.source.templates_conv import channel_shape
from xconv.converters.registry import REQUIRED


@template("BatchNormalization", epsilon=1e-5, momentum=0.9, training_mode=0)
def _batch_norm(c: OpCall) -> str:
    if c.attrs["training_mode"]:
        raise c.fail("training_mode=1 outside a recognised batch_norm layer")
    x, scale, bias, mean, var = c.args[:5]
    r = c.rank()
    shape = channel_shape(r - 2) if r is not None else f"(-1,) + (1,) * ({x}.ndim - 2)"
    eps = scalar_literal(c.attrs["epsilon"])
    return (
        f"({x} - {mean}.reshape({shape})) * lax.rsqrt({var}.reshape({shape}) + {eps}) "
        f"* {scale}.reshape({shape}) + {bias}.reshape({shape})"
    )


@template("LayerNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _layer_norm(c: OpCall) -> str:
    n = len(c.node.outputs)
    stats = n > 1 and any(o.uses() or o.is_graph_output() for o in c.node.outputs[1:])
    if stats and c.attrs["stash_type"] != 1:
        raise c.fail(f"LayerNormalization statistics in stash_type={c.attrs['stash_type']}")
    name = "layer_norm_stats" if stats else "layer_norm"
    c.helpers.add(name)
    bias = c.args[2] if c.has(2) else "None"
    call = (
        f"_{name}({c.args[0]}, {c.args[1]}, {bias}, axis={c.attrs['axis']}, "
        f"epsilon={scalar_literal(c.attrs['epsilon'])})"
    )
    if not stats:
        return call if n == 1 else f"({call},) + (None,) * {n - 1}"
    return call if n == 3 else f"{call}[:{n}]"


@template("RMSNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _rms_norm(c: OpCall) -> str:
    c.helpers.add("rms_norm")
    return (
        f"_rms_norm({c.args[0]}, {c.args[1]}, axis={c.attrs['axis']}, "
        f"epsilon={scalar_literal(c.attrs['epsilon'])})"
    )


@template("GroupNormalization", epsilon=1e-5, num_groups=REQUIRED, stash_type=1)
def _group_norm(c: OpCall) -> str:
    c.helpers.add("group_norm")
    return (
        f"_group_norm({c.args[0]}, {c.args[1]}, {c.args[2]}, "
        f"num_groups={c.attrs['num_groups']}, epsilon={scalar_literal(c.attrs['epsilon'])})"
    )


@template("InstanceNormalization", epsilon=1e-5)
def _instance_norm(c: OpCall) -> str:
    """GroupNormalization with a group per channel."""
    c.helpers.add("group_norm")
    x, scale, bias = c.args[:3]
    eps = scalar_literal(c.attrs["epsilon"])
    return f"_group_norm({x}, {scale}, {bias}, num_groups={x}.shape[1], epsilon={eps})"


registry.helpers["lrn"] = '''
def _lrn(x, size, alpha, beta, bias, before, after):
    """ONNX LRN on (N, C, ...): x / (bias + alpha / size * the sum of x**2 over channels
    c - before .. c + after) ** beta."""
    pads = [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2)
    window = (1, size) + (1,) * (x.ndim - 2)
    squares = jnp.pad(jnp.square(x), pads)
    sums = lax.reduce_window(squares, 0.0, lax.add, window, (1,) * x.ndim, "VALID")
    return x / (bias + alpha / size * sums) ** beta
'''


@template("LRN", alpha=0.0001, beta=0.75, bias=1.0, size=REQUIRED)
def _lrn(c: OpCall) -> str:
    c.helpers.add("lrn")
    before, after = ex.lrn_window(c)
    a = ", ".join(scalar_literal(c.attrs[n]) for n in ("alpha", "beta", "bias"))
    return f"_lrn({c.args[0]}, {int(c.attrs['size'])}, {a}, {before}, {after})"


registry.helpers["mean_variance_normalization"] = '''
def _mean_variance_normalization(x, axes):
    """ONNX MeanVarianceNormalization: (x - E[x]) / (sqrt(E[x**2] - E[x]**2) + 1e-9)."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    std = jnp.sqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) - jnp.square(mean))
    return (x - mean) / (std + 1e-9)
'''


registry.builtin("MeanVarianceNormalization", attrs={"axes": (0, 2, 3)})(ex.mean_variance_call)


@template("LpNormalization", layout="axis", axis=-1, p=2)
def _lp_normalization(c: OpCall) -> str:
    """x over its L1 / L2 norm along ``axis`` (torch's F.normalize: a norm under 1e-12
    counted as 1e-12, so a zero vector stays zero as ONNX's reference gives it)."""
    if c.attrs["p"] not in (1, 2):
        raise c.fail(f"p={c.attrs['p']}; ONNX defines 1, 2")
    x, a = c.args[0], c.axis(c.attrs["axis"])
    norm = f"jnp.linalg.norm({x}, ord={c.attrs['p']}, axis={a}, keepdims=True)"
    return f"{x} / jnp.maximum({norm}, 1e-12)"
