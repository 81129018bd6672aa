"""Causal masks computed from sizes, recognised as ``is_causal``.

A decoder traced without an ``attention_mask`` (transformers' Llama, Qwen2, GPT-2 at a symbolic
batch and sequence) builds its causal mask at run time from the input's shape: an ``arange``
of positions, index tensors broadcast against each other, gathers, comparisons. Written out,
that is dozens of lines of index bookkeeping in front of every generated model; what the
source's author wrote is ``is_causal=True``. :func:`fold_causal_masks` replaces such a mask by
the ``Attention`` node's ``is_causal`` attribute where it provably reads no data and, evaluated
at several sizes, is exactly ONNX's causal mask (the lower triangle, aligned top-left, as
``is_causal`` computes it).

What counts as reading no data: every path from the mask back to a graph input ends in
``Shape`` or ``Size`` of that input, and everything else it reads is a constant. The sizes it is evaluated at
are four assignments of 1, 2, 5 and 7 to the input's symbolic dims and one past every integer
constant the mask reads (so a sliding window of ``w`` positions, equal to the causal mask
below ``w``, is evaluated past it); a mask whose constants go past :data:`MAX_CHECKED` is left
as it is, as is one whose evaluation fails at any of them.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from xconv.ir.passes._utils import constant_of, is_annotated
from xconv.ir.passes.folding import NON_FOLDABLE, evaluate_node
from xconv.ir.passes.simplify import DeadNodeRemovalPass

logger = logging.getLogger(__name__)

#: The largest size a mask is evaluated at (its integer constants + 1): past it, a mask is
#: left as it is (a 2,048-position mask is 4 M entries per batch row).
MAX_CHECKED = 2048

#: Integer constants at least this large are sentinels (``INT64_MAX`` slice ends), not sizes.
_SENTINEL = 1 << 31

_SIZES = (1, 2, 5, 7)


def fold_causal_masks(model: ir.Model) -> int:
    """Give each ``Attention`` node of ``model`` whose mask is a size-computed causal mask
    ``is_causal=1`` and no mask (in place); drop what computed the masks. Returns the number
    of nodes changed."""
    graph = model.graph
    annotated = is_annotated(graph)
    opset = model.opset_imports.get("", 1)
    verdicts: dict[ir.Value, bool] = {}
    changed = 0
    for node in [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]:
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if mask is None or any(v is not None for v in node.inputs[4:]):
            continue  # no mask, or a KV cache (its mask is offset by the past length)
        if mask not in verdicts:
            verdicts[mask] = _aligned(node) and _is_causal(mask, annotated, opset)
        if not verdicts[mask]:
            continue
        node.replace_input_with(3, None)
        node.attributes["is_causal"] = ir.AttrInt64("is_causal", 1)
        changed += 1
    if changed:
        DeadNodeRemovalPass()(model)
    return changed


def _aligned(node: ir.Node) -> bool:
    """Whether the mask's last two dims are the query's and the key's sequence dims (so the
    mask evaluated alone has the shape the attention applies it at)."""
    q, k, mask = node.inputs[0], node.inputs[1], node.inputs[3]
    if any(v.shape is None for v in (q, k, mask)) or len(mask.shape) < 2:
        return False
    seq = 2 if len(q.shape) == 4 else 1
    if len(q.shape) not in (3, 4) or len(k.shape) != len(q.shape):
        return False
    want = (q.shape[seq], k.shape[seq])
    return all(_same(a, b) for a, b in zip(mask.shape[-2:], want, strict=True))


def _same(a, b) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a.value is not None and a.value == b.value


def _cone(mask: ir.Value, annotated: bool) -> tuple[list[ir.Node], set[ir.Value]] | None:
    """The nodes computing ``mask`` (in graph order) and the graph inputs they read only the
    shape of; None when the mask reads data, a weight, a subgraph or a random op."""
    nodes: set[ir.Node] = set()
    shaped: set[ir.Value] = set()
    stack = [mask]
    seen: set[ir.Value] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if constant_of(v, annotated) is not None:
            continue
        node = v.producer()
        if node is None:
            return None  # a graph input or a weight read as data
        if node.domain not in ("", "ai.onnx") or node.op_type in NON_FOLDABLE:
            return None
        if any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in node.attributes.values()
            if not a.is_ref()
        ):
            return None
        nodes.add(node)
        if node.op_type in ("Shape", "Size") and node.inputs[0].is_graph_input():
            src = node.inputs[0]
            if src.shape is None or any(
                not isinstance(d, int) and d.value is None for d in src.shape
            ):
                return None
            shaped.add(src)
            continue
        stack.extend(x for x in node.inputs if x is not None)
    graph = mask.graph
    return [n for n in graph if n in nodes], shaped


def _is_causal(mask: ir.Value, annotated: bool, opset: int) -> bool:
    cone = _cone(mask, annotated)
    if cone is None:
        return False
    nodes, shaped = cone
    if not shaped:
        return False  # a constant mask: the emitters already read it as one
    dims = sorted({d.value for v in shaped for d in v.shape if not isinstance(d, int)})
    if not dims:
        return False
    largest = 0
    for node in nodes:
        for x in node.inputs:
            c = constant_of(x, annotated)
            if c is not None and c.dtype.kind in "iu" and c.size:
                small = np.abs(c[np.abs(c) < _SENTINEL].astype(np.int64))
                largest = max(largest, int(small.max()) if small.size else 0)
    if largest + 1 > MAX_CHECKED:
        return False
    samples = [
        {d: _SIZES[(i + 2 * j) % len(_SIZES)] for j, d in enumerate(dims)}
        for i in range(len(_SIZES))
    ]
    samples.append({d: max(largest + 1, 8) for d in dims})
    for sizes in samples:
        try:
            value = _evaluate(nodes, shaped, sizes, mask, annotated, opset)
        except Exception as e:  # the reference evaluator raises many kinds: keep the mask
            logger.debug("mask %s not evaluated at %s: %s", mask.name, sizes, e)
            return False
        if not _causal(value):
            return False
    return True


def _evaluate(nodes, shaped, sizes, mask, annotated, opset) -> np.ndarray:
    """``mask``'s value when the inputs whose shape it reads have the symbolic dims ``sizes``."""
    values: dict[ir.Value, np.ndarray] = {}

    def get(v: ir.Value) -> np.ndarray:
        if v in values:
            return values[v]
        return constant_of(v, annotated)

    for node in nodes:
        if node.op_type in ("Shape", "Size") and node.inputs[0] in shaped:
            src = node.inputs[0]
            shape = [d if isinstance(d, int) else sizes[d.value] for d in src.shape]
            if node.op_type == "Size":
                values[node.outputs[0]] = np.asarray(int(np.prod(shape)), dtype=np.int64)
                continue
            start = node.attributes.get("start")
            end = node.attributes.get("end")
            s = slice(start.as_int() if start else None, end.as_int() if end else None)
            values[node.outputs[0]] = np.asarray(shape[s], dtype=np.int64)
            continue
        args = [None if x is None or not x.name else get(x) for x in node.inputs]
        results = evaluate_node(node, args, node.version or opset)
        for out, r in zip(node.outputs, results, strict=False):
            values[out] = r
    return values[mask]


def _causal(value: np.ndarray) -> bool:
    """Whether ``value`` is ONNX's causal mask: bool, or additive 0 / -inf (or the dtype's
    lowest), the lower triangle of its last two dims, the same for every leading index."""
    if value.ndim < 2:
        return False
    rows, cols = value.shape[-2:]
    tril = np.broadcast_to(np.tril(np.ones((rows, cols), dtype=bool)), value.shape)
    if value.dtype == np.bool_:
        return bool(np.array_equal(value, tril))
    if value.dtype.kind != "f":
        return False
    masked = np.isneginf(value) | (value == np.finfo(value.dtype).min)
    return bool(np.all(np.where(tril, value == 0, masked)))
