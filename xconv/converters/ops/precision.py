"""Compute precision of converted JAX / Flax models: float32 (default) or bfloat16.

``dtype="bfloat16"`` gives a model that computes the way a Flax user writes one with
``dtype=jnp.bfloat16, param_dtype=jnp.float32``; ``to_jax`` and the Flax emitter follow the
same rules, node by node, so the two agree:

* Parameters are stored float32. Float32 graph inputs are cast to bfloat16 on entry.
* An op with a run-time float operand (an activation or a parameter) computes in bfloat16:
  its float32 operands (parameters, constants) are cast to bfloat16 where it uses them, as
  Flax's ``promote_dtype`` does. Matmuls, convolutions, embedding gathers and the attention
  matmuls therefore run on bfloat16 operands.
* Norms (Layer/Batch/Group/Instance/RMS normalization) and softmax / log-softmax take their
  operands in float32 and round their result to bfloat16, as Flax's norm layers (float32
  statistics) and torch autocast (float32 softmax) do. Reductions accumulate in float32
  (``jnp.sum`` / ``jnp.mean`` of bfloat16 already do).
* A ``Cast`` to float32 of a bfloat16 activation is the compute dtype in this model: in a
  float32 export such a cast is a no-op, so it carries no request for float32.
* Attention runs its matmuls in bfloat16 and its softmax in float32.
* A parameter added to or multiplying an activation (a bias, a scale: :data:`BROADCASTING`,
  ``Gemm``'s ``C``) is cast where it is used, after its broadcast: the forward values are the
  same, and its gradient is summed in float32 (``to_jax``; Flax's ``nn.Dense`` sums it in
  bfloat16).
* Ops whose float operands configure them (``Resize`` scales) keep those operands.
* Nodes folded at trace time (shape arithmetic, constant subgraphs) stay float32.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir

from xconv.errors import ConversionError

#: Compute dtypes a conversion accepts (``dtype=`` / ``--dtype``); float32 is the default.
DTYPES = ("float32", "bfloat16")
_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}

#: Ops that take their float operands in float32 and round their result to bfloat16.
FLOAT32_OPS = frozenset(
    {
        "LayerNormalization",
        "BatchNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "RMSNormalization",
        "SimplifiedLayerNormalization",
        "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "LpNormalization",
        "MeanVarianceNormalization",
        "Softmax",
        "LogSoftmax",
    }
)

#: Ops computing a softmax inside (ONNX ``Attention``): given ``softmax_precision=FLOAT``
#: when it is unset, so the matmuls run in bfloat16 and the softmax in float32.
FLOAT32_SOFTMAX = frozenset({"Attention"})

#: Elementwise ops that combine an activation with a parameter (a bias, a scale): a float32
#: parameter is broadcast to the result's shape before its cast to bfloat16 (the same values),
#: so its gradient's sum over the broadcast axes accumulates in float32.
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "PRelu"})

#: Ops whose operands after the first configure them: only the first is cast.
_CONFIG_OPERANDS = frozenset({"Resize", "Upsample"})

#: Ops counted as one bfloat16 rounding stage on a path (see :func:`rounding_depth`).
MATMUL_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention"})


def resolve_dtype(dtype: Any) -> str | None:
    """``None`` for float32 (the default: nothing changes), ``"bfloat16"`` for bfloat16.

    Raises:
        ConversionError: any other value, naming the choices.
    """
    if dtype is None:
        return None
    name = getattr(dtype, "__name__", None) or getattr(dtype, "name", None) or str(dtype)
    name = _ALIASES.get(str(name).lower(), str(name).lower())
    if name not in DTYPES:
        raise ConversionError(
            f"unknown compute dtype {dtype!r}; choose one of {list(DTYPES)} (float32 is the "
            "default; bfloat16 computes in bfloat16 with float32 parameters)"
        )
    return None if name == "float32" else name


def mode(op_type: str) -> str:
    """How an op's float operands are treated: ``float32`` (norms, softmax), ``cast``
    (``Cast`` / ``CastLike``: their target dtype decides) or ``low`` (everything else)."""
    if op_type in FLOAT32_OPS:
        return "float32"
    if op_type in ("Cast", "CastLike"):
        return "cast"
    return "low"


def data_operands(op_type: str, n: int) -> range:
    """Indices of the operands the precision rules apply to."""
    return range(min(n, 1)) if op_type in _CONFIG_OPERANDS else range(n)


def rounding_depth(model: ir.Model) -> int:
    """The most matmul-like ops (:data:`MATMUL_OPS`) on any path from an input to an output:
    the number of bfloat16 rounding stages the parity bound grows with (at least 1)."""
    return max(_depth(model.graph), 1)


def _depth(graph: ir.Graph) -> int:
    depth: dict[ir.Value, int] = {}
    best = 0
    for node in graph:
        d = max((depth.get(v, 0) for v in node.inputs if v is not None), default=0)
        d += int(node.op_type in MATMUL_OPS) + sum(_depth(g) for g in _subgraphs(node))
        for out in node.outputs:
            depth[out] = d
        best = max(best, d)
    return best


def _subgraphs(node: ir.Node) -> list[ir.Graph]:
    found = []
    for attr in node.attributes.values():
        if attr.is_ref():
            continue
        if attr.type == ir.AttributeType.GRAPH:
            found.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            found.extend(attr.value)
    return found
