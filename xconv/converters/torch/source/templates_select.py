"""PyTorch source templates for the ops that select by value, whose output shapes depend on
the numbers: Unique and NonMaxSuppression. A generated ``_eagerly`` applies the numpy text
shared with the Flax source (``exs.UNIQUE`` / ``NON_MAX_SUPPRESSION``) to the inputs'
numbers, as the torch runtime computes them, the results as tensors on the input's device.
Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_structured as exs
from xconv.converters.torch.source.templates import OpCall, registry, template

registry.helpers["unique"] = exs.UNIQUE
registry.helpers["non_max_suppression"] = exs.NON_MAX_SUPPRESSION
registry.helpers["eagerly"] = '''
def _eagerly(fn, **kwargs):
    """The numpy function ``fn`` on ``kwargs``, the tensors among them as numpy arrays
    (bfloat16 as float32), its results as tensors on the first one's device (a float result
    in its dtype)."""
    like = next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
    out = fn(**{
        k: (v.float() if v.dtype == torch.bfloat16 else v).numpy(force=True)
        if isinstance(v, torch.Tensor) else v
        for k, v in kwargs.items()
    })
    out = [torch.from_numpy(a).to(like.device) for a in (out if isinstance(out, tuple) else [out])]
    out = [a.to(like.dtype) if a.is_floating_point() else a for a in out]
    return tuple(out) if len(out) > 1 else out[0]
'''


def _eagerly(c: OpCall, call: str) -> str:
    """``call`` (``_fn(x=..., ...)``, its array arguments by keyword) as
    ``_eagerly(_fn, ...)``."""
    c.helpers.add("eagerly")
    fn, rest = call.split("(", 1)
    return f"_eagerly({fn}, {rest}"


@template("Unique", axis=None, sorted=1)
def _unique(c: OpCall) -> str:
    """(Y, indices, inverse_indices, counts) as tensors, as many as the node has."""
    return _eagerly(c, exs.unique_call(c, f"x={c.args[0]}")) + exs.unique_outputs(c)


@template("NonMaxSuppression", center_point_box=0)
def _non_max_suppression(c: OpCall) -> str:
    """The (batch, class, box) indices of the boxes kept, (n, 3) int64."""
    return _eagerly(c, exs.non_max_suppression_call(c))
