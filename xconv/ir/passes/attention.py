"""What the source wrote around an ``Attention`` node, recovered from the trace: a causal mask
computed from sizes is ``is_causal`` (:func:`fold_causal_masks`), and keys and values repeated
for grouped-query attention are the grouped ones (:func:`fold_repeated_kv`).

Causal masks.

A decoder traced without an ``attention_mask`` (transformers' Llama, Qwen2, GPT-2 at a symbolic
batch and sequence) builds its causal mask at run time from the input's shape: an ``arange``
of positions, index tensors broadcast against each other, gathers, comparisons. Written out,
that is dozens of lines of index bookkeeping in front of every generated model; what the
source's author wrote is ``is_causal=True``. :func:`fold_causal_masks` replaces such a mask by
the ``Attention`` node's ``is_causal`` attribute where it provably reads no data and, evaluated
at several sizes, is exactly ONNX's causal mask (the lower triangle, aligned top-left, as
``is_causal`` computes it).

What counts as reading no data: every path from the mask back to a graph input ends in
``Shape`` or ``Size`` of that input, and everything else it reads is a constant. The sizes it
is evaluated at are four assignments of 1, 2, 5 and 7 to the input's symbolic dims and one
past every integer constant the mask reads (so a sliding window of ``w`` positions, equal to
the causal mask below ``w``, is evaluated past it); a mask whose constants go past
:data:`MAX_CHECKED` is left as it is, as is one whose evaluation fails at any of them.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from xconv.ir.passes._utils import constant_of, is_annotated
from xconv.ir.passes.folding import _same as same_symbol
from xconv.ir.passes.folding import evaluable, evaluate_node
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
    ``is_causal=1`` and no mask, and drop a size-computed mask that allows every position (a
    BERT traced without an ``attention_mask``), in place; drop what computed the masks.
    Returns the number of nodes changed."""
    graph = model.graph
    annotated = is_annotated(graph)
    opset = model.opset_imports.get("", 1)
    kinds: dict[ir.Value, str | None] = {}
    changed = 0
    for node in [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]:
        mask = node.inputs[3] if len(node.inputs) > 3 else None
        if mask is None or any(v is not None for v in node.inputs[4:]):
            continue  # no mask, or a KV cache (its mask is offset by the past length)
        if mask not in kinds:
            kinds[mask] = _mask_kind(mask, annotated, opset) if _aligned(node) else None
        if kinds[mask] is None:
            continue
        node.replace_input_with(3, None)
        if kinds[mask] == "causal":
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
    """Whether two dims are known equal: equal ints, or the same named symbol."""
    return a == b if isinstance(a, int) or isinstance(b, int) else same_symbol(a, b)


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
        if not evaluable(node):
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


def _mask_kind(mask: ir.Value, annotated: bool, opset: int) -> str | None:
    """ "causal" or "all" (it allows every position) where ``mask`` is computed from sizes
    only and is that at every sampled size; else None."""
    cone = _cone(mask, annotated)
    if cone is None:
        return None
    nodes, shaped = cone
    if not shaped:
        return None  # a constant mask: the emitters already read it as one
    dims = sorted({d.value for v in shaped for d in v.shape if not isinstance(d, int)})
    if not dims:
        return None
    largest = 0
    for node in nodes:
        for x in node.inputs:
            c = constant_of(x, annotated)
            if c is not None and c.dtype.kind in "iu" and c.size:
                small = np.abs(c[np.abs(c) < _SENTINEL].astype(np.int64))
                largest = max(largest, int(small.max()) if small.size else 0)
    if largest + 1 > MAX_CHECKED:
        return None
    samples = [
        {d: _SIZES[(i + 2 * j) % len(_SIZES)] for j, d in enumerate(dims)}
        for i in range(len(_SIZES))
    ]
    samples.append({d: max(largest + 1, 8) for d in dims})
    kinds = set()
    for sizes in samples:
        try:
            value = _evaluate(nodes, shaped, sizes, mask, annotated, opset)
        except Exception as e:  # the reference evaluator raises many kinds: keep the mask
            logger.debug("mask %s not evaluated at %s: %s", mask.name, sizes, e)
            return None
        kinds.add(_kind(value))
    kinds.discard("either")
    return kinds.pop() if len(kinds) == 1 else None


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


def _kind(value: np.ndarray) -> str | None:
    """ "all" where ``value`` (bool, or additive float) masks nothing, "causal" where it is
    ONNX's causal mask (the lower triangle of its last two dims, aligned top-left; additive:
    0 / -inf or the dtype's lowest), the same for every leading index; "either" where it is
    both (one key position); else None."""
    if value.ndim < 2:
        return None
    if value.dtype == np.bool_:
        allowed = value
    elif value.dtype.kind == "f":
        masked = np.isneginf(value) | (value == np.finfo(value.dtype).min)
        if not np.all((value == 0) | masked):
            return None
        allowed = value == 0
    else:
        return None
    rows, cols = value.shape[-2:]
    tril = np.broadcast_to(np.tril(np.ones((rows, cols), dtype=bool)), value.shape)
    if np.all(allowed):
        return "either" if np.all(tril) else "all"
    return "causal" if np.array_equal(allowed, tril) else None


def fold_repeated_kv(model: ir.Model) -> int:
    """Read the grouped keys and values of each 4-D ``Attention`` node of ``model`` (in place)
    where its key or value input is transformers' ``repeat_kv`` of them: ``Unsqueeze`` at axis
    2, an ``Expand`` of that axis to ``n``, a ``Reshape`` merging it into the heads (with
    ``Identity`` and full ``Slice`` nodes between). ONNX's Attention repeats each key / value
    head for its ``n`` query heads itself, in that order (``np.repeat`` on the heads), so the
    numbers are the same; the emitters then write the source's one attention call on the
    grouped heads. Returns the number of inputs changed; the repeats' nodes go."""
    changed = 0
    for node in [
        n for n in model.graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")
    ]:
        q = node.inputs[0]
        if q is None or q.shape is None or len(q.shape) != 4:
            continue
        for i in (1, 2):
            grouped = _grouped(node.inputs[i], q.shape[1])
            if grouped is not None:
                node.replace_input_with(i, grouped)
                changed += 1
    if changed:
        DeadNodeRemovalPass()(model)
    return changed


def _through(v: ir.Value) -> ir.Node | None:
    """``v``'s producer, past ``Identity`` nodes and ``Slice`` nodes that copy their input."""
    node = v.producer()
    while node is not None and (node.op_type == "Identity" or _full_slice(node)):
        node = node.inputs[0].producer()
    return node


def _full_slice(node: ir.Node) -> bool:
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx"):
        return False
    x, y = node.inputs[0], node.outputs[0]
    if x.shape is None or y.shape is None or len(x.shape) != len(y.shape):
        return False
    if not all(_same(a, b) for a, b in zip(x.shape, y.shape, strict=True)):
        return False
    starts = constant_of(node.inputs[1], False)
    steps = constant_of(node.inputs[4], False) if len(node.inputs) > 4 and node.inputs[4] else None
    return starts is not None and not np.any(starts) and (steps is None or np.all(steps == 1))


def _grouped(v: ir.Value | None, heads) -> ir.Value | None:
    """The (B, KV, S, D) value ``v`` (B, KV * n, S, D) repeats ``n`` times per head, or None."""
    if v is None or v.shape is None or len(v.shape) != 4 or not _same(v.shape[1], heads):
        return None
    reshape = v.producer()
    while reshape is not None and reshape.op_type == "Identity":
        reshape = reshape.inputs[0].producer()
    if reshape is None or reshape.op_type != "Reshape":
        return None
    expand = _through(reshape.inputs[0])
    if expand is None or expand.op_type != "Expand":
        return None
    unsqueeze = _through(expand.inputs[0])
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return None
    axes = constant_of(unsqueeze.inputs[1], False) if len(unsqueeze.inputs) > 1 else None
    if axes is None or [int(a) for a in np.reshape(axes, -1)] != [2]:
        return None
    grouped, wide = unsqueeze.inputs[0], expand.outputs[0].shape
    copy = grouped.producer()
    while copy is not None and (copy.op_type == "Identity" or _full_slice(copy)):
        grouped, copy = copy.inputs[0], copy.inputs[0].producer()
    if grouped.shape is None or len(grouped.shape) != 4 or wide is None or len(wide) != 5:
        return None
    batch, kv, seq, dim = grouped.shape
    n = wide[2]
    if not isinstance(n, int) or not isinstance(kv, int) or not isinstance(heads, int):
        return None
    if heads != kv * n or n < 2:
        return None
    kept = (wide[0], wide[1], wide[3], wide[4])
    if not all(_same(x, y) for x, y in zip(kept, (batch, kv, seq, dim), strict=True)):
        return None
    out = v.shape
    if not (_same(out[0], batch) and _same(out[2], seq) and _same(out[3], dim)):
        return None
    return grouped
