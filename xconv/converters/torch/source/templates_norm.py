"""PyTorch source templates for the normalisations: BatchNormalization (eval mode),
LayerNormalization (and its statistics), RMSNormalization, GroupNormalization,
InstanceNormalization, LRN, MeanVarianceNormalization, LpNormalization. Importing this module
registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions as ex
from xconv.converters.codegen import int_tuple, scalar_literal
from xconv.converters.registry import REQUIRED
from xconv.converters.torch.source.templates import OpCall, registry, template


@template("BatchNormalization", epsilon=1e-5, momentum=0.9, training_mode=0)
def _batch_norm(c: OpCall) -> str:
    if c.attrs["training_mode"] or len(c.node.outputs) > 1:
        raise c.fail("training-mode BatchNormalization nodes are not supported")
    x, s, b, m, v = c.args[:5]
    eps = scalar_literal(c.attrs["epsilon"])
    # eval mode: torch's training=False and momentum (unused then) are the defaults
    return (
        f"F.batch_norm({x}, {m}, {v}, {s}, {b}" + ("" if eps == "1e-05" else f", eps={eps}") + ")"
    )


def _norm_shape(c: OpCall, axis: int) -> str:
    r = c.need_rank()
    a = axis + r if axis < 0 else axis
    shape = c.shapes[1] if c.shapes[1] is not None and len(c.shapes[1]) == r - a else None
    if shape is not None and all(isinstance(d, int) for d in shape):
        return int_tuple(shape)
    return f"{c.args[0]}.shape[{a}:]"


registry.helpers["layer_norm_stats"] = '''
def _layer_norm_stats(x, weight, bias, axis, eps):
    """(Y, Mean, InvStdDev) of ONNX's LayerNormalization: the statistics in float32 over the
    dims from ``axis``, kept as size-1 dims."""
    xs = x.float()
    var, mean = torch.var_mean(xs, dim=tuple(range(axis % x.dim(), x.dim())), correction=0,
                               keepdim=True)
    inv = torch.rsqrt(var + eps)
    y = ((xs - mean) * inv).to(x.dtype) * weight
    return (y if bias is None else y + bias), mean, inv
'''


@template("LayerNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _layer_norm(c: OpCall) -> str:
    n = len(c.node.outputs)
    b = c.args[2] if c.has(2) else "None"
    eps = scalar_literal(c.attrs["epsilon"])
    if n > 1 and any(o.uses() or o.is_graph_output() for o in c.node.outputs[1:]):
        if c.attrs["stash_type"] != 1:
            raise c.fail(f"LayerNormalization statistics in stash_type={c.attrs['stash_type']}")
        c.helpers.add("layer_norm_stats")
        call = f"_layer_norm_stats({c.args[0]}, {c.args[1]}, {b}, {c.attrs['axis']}, {eps})"
        return call if n == 3 else f"{call}[:{n}]"
    call = f"F.layer_norm({c.args[0]}, {_norm_shape(c, c.attrs['axis'])}, {c.args[1]}, {b}, {eps})"
    return call if n == 1 else f"{call}, " + ", ".join(["None"] * (n - 1))


@template("RMSNormalization", axis=-1, epsilon=1e-5, stash_type=1)
def _rms_norm(c: OpCall) -> str:
    return (
        f"F.rms_norm({c.args[0]}, {_norm_shape(c, c.attrs['axis'])}, {c.args[1]}, "
        f"{scalar_literal(c.attrs['epsilon'])})"
    )


@template("GroupNormalization", epsilon=1e-5, num_groups=REQUIRED, stash_type=1)
def _group_norm(c: OpCall) -> str:
    return (
        f"F.group_norm({c.args[0]}, {c.attrs['num_groups']}, {c.args[1]}, {c.args[2]}, "
        f"{scalar_literal(c.attrs['epsilon'])})"
    )


@template("InstanceNormalization", epsilon=1e-5)
def _instance_norm(c: OpCall) -> str:
    x, scale, bias = c.args[:3]
    eps = scalar_literal(c.attrs["epsilon"])
    return f"F.instance_norm({x}, weight={scale}, bias={bias}, eps={eps})"


@template("LRN", alpha=0.0001, beta=0.75, bias=1.0, size=REQUIRED)
def _lrn(c: OpCall) -> str:
    before, after = ex.lrn_window(c)
    if before != after:  # F.local_response_norm puts the longer side before the channel
        raise c.fail(
            f"LRN of even size {c.attrs['size']} (F.local_response_norm centres it otherwise)"
        )
    a = ", ".join(scalar_literal(c.attrs[n]) for n in ("alpha", "beta", "bias"))
    return f"F.local_response_norm({c.args[0]}, {int(c.attrs['size'])}, {a})"


registry.helpers["mean_variance_normalization"] = '''
def _mean_variance_normalization(x, dims):
    """ONNX MeanVarianceNormalization: (x - E[x]) / (sqrt(E[x**2] - E[x]**2) + 1e-9)."""
    mean = torch.mean(x, dim=dims, keepdim=True)
    std = torch.sqrt(torch.mean(torch.square(x), dim=dims, keepdim=True) - torch.square(mean))
    return (x - mean) / (std + 1e-9)
'''


registry.builtin("MeanVarianceNormalization", attrs={"axes": (0, 2, 3)})(ex.mean_variance_call)


@template("LpNormalization", axis=-1, p=2)
def _lp_normalization(c: OpCall) -> str:
    """``F.normalize``: x over its L1 / L2 norm along ``axis`` (a norm under 1e-12 counted as
    1e-12, so a zero vector stays zero as ONNX's reference gives it)."""
    if c.attrs["p"] not in (1, 2):
        raise c.fail(f"p={c.attrs['p']}; ONNX defines 1, 2")
    return f"F.normalize({c.args[0]}, p={c.attrs['p']}, dim={c.attrs['axis']})"
