"""Flax source templates for the ops that select by value, whose output shapes depend on the
numbers: Unique and NonMaxSuppression. A generated ``_eagerly`` reads their array inputs
eagerly (``_static``; a named ValueError under jax.jit, as ``to_jax`` raises) and applies the
numpy text shared with the torch source (``exs.UNIQUE`` / ``NON_MAX_SUPPRESSION``),
the results as jax arrays. Importing this module registers them in ``templates.registry``.
"""

from __future__ import annotations

from xconv.converters import expressions_structured as exs
from xconv.converters.flax.source.templates import OpCall, registry, template

registry.helpers["unique"] = exs.UNIQUE
registry.helpers["non_max_suppression"] = exs.NON_MAX_SUPPRESSION
registry.helpers["eagerly"] = '''
def _eagerly(fn, op, **kwargs):
    """The numpy function ``fn`` on ``kwargs``, the jax arrays among them read eagerly
    (``_static``: their numbers fix the shapes of its outputs), its results as jax arrays."""
    kwargs = {
        k: np.reshape(_static(v, f"{op} {k}"), jnp.shape(v)) if isinstance(v, jax.Array) else v
        for k, v in kwargs.items()
    }
    return jax.tree_util.tree_map(jnp.asarray, fn(**kwargs))
'''


def _eagerly(c: OpCall, call: str) -> str:
    """``call`` (``_fn(x, ...)``, its array arguments by keyword) as ``_eagerly(_fn, op, ...)``."""
    c.helpers |= {"static_ints", "eagerly"}
    fn, rest = call.split("(", 1)
    return f'_eagerly({fn}, "{c.node.op_type}", {rest}'


@template("Unique", axis=None, sorted=1)
def _unique(c: OpCall) -> str:
    """(Y, indices, inverse_indices, counts) as jax arrays, as many as the node has."""
    return _eagerly(c, exs.unique_call(c, f"x={c.args[0]}")) + exs.unique_outputs(c)


@template("NonMaxSuppression", center_point_box=0)
def _non_max_suppression(c: OpCall) -> str:
    """The (batch, class, box) indices of the boxes kept, (n, 3) int64."""
    call = exs.non_max_suppression_call(c)
    return _eagerly(c, call)
