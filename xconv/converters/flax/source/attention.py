"""Attention as the source wrote it: one ``jax.nn.dot_product_attention``-style call on
(B, S, H, D) arrays.

A torch attention block splits heads with ``view(b, t, h, d).transpose(1, 2)``, calls
``F.scaled_dot_product_attention`` on (B, H, S, D) and transposes back. ONNX ``Attention``
keeps that layout, so a literal translation transposes q, k, v into (B, H, S, D) and the
result out of it. ``jax.nn.dot_product_attention`` takes (B, S, H, D): :func:`fold_head_transposes`
drops those four transposes from the emitter's copy of the graph and marks the node
(:data:`BSHD`), and the ``Attention`` template writes one ``jax.nn.dot_product_attention``
call on the untransposed arrays, as a person writes it. A faster formulation for one backend
(head-major einsums on XLA:CPU, ``benchmarks/attention_core.md``) belongs to ``to_jax``, not
to the generated source.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import scalar_literal
from xconv.converters.ops import formulation

#: Node metadata: this ``Attention`` node's q, k, v and output are (B, S, H, D).
BSHD = "xconv.flax.bshd"
_HEADS = [0, 2, 1, 3]


def _transpose(node: ir.Node | None) -> bool:
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    perm = node.attributes.get("perm")
    return perm is not None and list(perm.as_ints()) == _HEADS


def _causal_const(value: ir.Value) -> bool:
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return False
    mask = tensor.numpy()
    if mask.ndim < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    tril = np.broadcast_to(np.tril(np.ones(mask.shape[-2:], dtype=bool)), mask.shape)
    if mask.dtype == np.bool_:
        return bool(np.array_equal(mask, tril))
    return mask.dtype.kind == "f" and bool(np.all(np.where(tril, mask == 0, np.isneginf(mask))))


def _foldable(node: ir.Node) -> list[ir.Node] | None:
    """The transposes around ``node`` (q, k, v inputs, then the output) when they can go."""
    ins = list(node.inputs)
    if len(ins) < 3 or any(v is None for v in ins[:3]):
        return None
    if any(v is not None and v.name for v in ins[4:]):
        return None  # past key / value
    if len(ins) > 3 and ins[3] is not None and ins[3].name and not _causal_const(ins[3]):
        return None
    for key in ("q_num_heads", "kv_num_heads", "qk_matmul_output_mode", "softcap"):
        attr = node.attributes.get(key)
        if attr is not None and attr.value:
            return None
    if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
        return None
    out = node.outputs[0]
    users = [u for u, _ in out.uses()]
    if out.is_graph_output() or len(users) != 1 or not _transpose(users[0]):
        return None
    if users[0].outputs[0].is_graph_output():
        return None
    found = []
    for v in ins[:3]:
        t = v.producer()
        if not _transpose(t) or v.is_graph_output():
            return None
        if any(u is not node for u, _ in v.uses()):
            return None
        if t not in found:
            found.append(t)
    return [*found, users[0]]


def bhsd_operands(c) -> list[str]:
    """q, k, v of an ``Attention`` call as the ``_attention`` helper takes them: (B, H, S, D)."""
    if c.node.metadata_props.get(BSHD):
        return [f"jnp.swapaxes({a}, 1, 2)" for a in c.args[:3]]
    return list(c.args[:3])


def fold_head_transposes(model: ir.Model, low: bool = False) -> ir.Model:
    """Drop the head transposes around 4-D ``Attention`` nodes of ``model`` (in place) that
    :func:`dot_product_attention` will write as one call (float32, not ``low`` = bfloat16
    compute, the ``auto`` attention formulation)."""
    if low or formulation.get("attention") != "auto":
        return model
    graph = model.graph
    for node in [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]:
        if any(v is None or v.dtype != ir.DataType.FLOAT for v in node.inputs[:3]):
            continue
        if not _one_head_size(node):
            continue
        around = _foldable(node)
        if around is None:
            continue
        *ins, after = around
        for i in range(3):
            t = node.inputs[i].producer()
            node.replace_input_with(i, t.inputs[0])
        out, old = node.outputs[0], after.outputs[0]
        out.shape, out.dtype = old.shape, old.dtype
        ir.convenience.replace_all_uses_with(old, out)
        graph.remove([*ins, after], safe=True)
        node.metadata_props[BSHD] = "1"
    return model


def dot_product_attention(c, mask: str, causal: bool) -> str | None:
    """``jax.nn.dot_product_attention(q, k, v)`` for an ``Attention`` call (an ``OpCall``)
    without a mask (or with the causal one), float32 4-D inputs and ONNX's default scale
    semantics; None where the ``_attention`` helper is needed (masks, 3-D inputs, bfloat16
    compute, other dtypes). (B, H, S, D) inputs are swapped to jax's (B, S, H, D) and back
    unless :func:`fold_head_transposes` already made them (B, S, H, D)."""
    if mask != "None" or c.low or c.attrs["q_num_heads"] or c.attrs["kv_num_heads"]:
        return None
    if any(c.rank(i) != 4 for i in range(3)):
        return None
    if any(v.dtype != ir.DataType.FLOAT for v in c.node.inputs[:3]):
        return None
    if not _one_head_size(c.node):
        return None
    kw = ", is_causal=True" if causal else ""
    if c.attrs["scale"] is not None:
        kw += f", scale={scalar_literal(c.attrs['scale'])}"
    call = "jax.nn.dot_product_attention"
    if c.node.metadata_props.get(BSHD):
        return f"{call}({c.args[0]}, {c.args[1]}, {c.args[2]}{kw})"
    qkv = ", ".join(c.args[:3])
    return f"{call}(*(t.swapaxes(1, 2) for t in ({qkv})){kw}).swapaxes(1, 2)"


def _one_head_size(node: ir.Node) -> bool:
    """Whether the values' head size is known to be the queries' (``jax.nn.dot_product_attention``
    takes one head size; ONNX ``Attention`` allows v's to differ)."""
    q, v = node.inputs[0], node.inputs[2]
    if q.shape is None or v.shape is None:
        return False
    dq, dv = q.shape[-1], v.shape[-1]
    if isinstance(dq, int) or isinstance(dv, int):
        return dq == dv
    return dq.value is not None and dq.value == dv.value


_PACKED = frozenset({"in_proj_kernel", "in_proj_bias", "out_proj_kernel", "out_proj_bias"})
_PACKED_OPS = frozenset(
    {"Transpose", "MatMul", "Gemm", "Add", "Reshape", "Unsqueeze", "Squeeze", "Gather"}
    | {"Split", "Slice", "Attention", "Constant", "Identity"}
)
#: Integer arithmetic over the input's sizes (the symbolic batch and sequence length).
_SIZE_OPS = frozenset({"Shape", "Concat", "Add", "Sub", "Mul", "Div", "Cast"})


def _packed_op(node: ir.Node) -> bool:
    """A projection or layout op, or a shape built from sizes (a symbolic batch or sequence
    length's ``view`` target, which ``_torch_mha`` reads from its input instead)."""
    return node.op_type in _PACKED_OPS or _size_op(node)


def _size_op(node: ir.Node) -> bool:
    return node.op_type in _SIZE_OPS and all(o.dtype == ir.DataType.INT64 for o in node.outputs)


def packed_self_attention(p) -> bool:
    """Whether a torch ``nn.MultiheadAttention`` layer plan (a ``LayerPlan`` of kind
    ``attention``) is what the ``_torch_mha`` helper computes: self-attention (one input,
    batch first, (B, T, E)), packed q/k/v weights with biases, no dropout, one output, and a
    body of one unmasked, non-causal ``Attention`` at the default scale plus projections and
    layout ops, each ``Add`` (or ``Gemm``) adding one of the layer's own biases."""
    h = p.hyper
    e = h.get("embed_dim")
    if p.kind != "attention" or set(p.weights) != _PACKED or not h.get("use_bias"):
        return False
    if not h.get("batch_first") or h.get("dropout") or h.get("kdim") != e or h.get("vdim") != e:
        return False
    if len(p.inputs) != 1 or len(p.outputs) != 1:
        return False
    shape = p.inputs[0].shape
    if shape is None or len(shape) != 3 or shape[-1] != e:
        return False
    if any(n.domain not in ("", "ai.onnx") or not _packed_op(n) for n in p.body):
        return False
    att = [n for n in p.body if n.op_type == "Attention"]
    if len(att) != 1 or any(v is not None and v.name for v in att[0].inputs[3:]):
        return False
    for key in ("is_causal", "q_num_heads", "kv_num_heads", "softcap", "qk_matmul_output_mode"):
        attr = att[0].attributes.get(key)
        if attr is not None and attr.value:
            return False
    scale = att[0].attributes.get("scale")
    d = e // h["num_heads"]
    if scale is not None and not np.isclose(scale.value, 1 / np.sqrt(d), rtol=1e-6):
        return False
    biases = {p.weights["in_proj_bias"], p.weights["out_proj_bias"]}
    adds = [n for n in p.body if n.op_type in ("Add", "Gemm") and not _size_op(n)]
    for n in adds:
        scaled = [n.attributes.get(k) for k in ("alpha", "beta")]
        if any(a is not None and a.value != 1 for a in scaled):
            return False
    return len(adds) == 2 and all(set(n.inputs) & biases for n in adds)
