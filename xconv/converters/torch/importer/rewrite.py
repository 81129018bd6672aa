"""Rewrites of a ``torch.export`` program before torch.onnx decomposes and translates it.

**Attention.** torch.onnx re-traces the program to decompose it, and on that second trace
``aten.scaled_dot_product_attention`` gets a fake output with other strides than on the first
(the CPU flash kernel's layout versus the math path's), so the ``transpose → view`` that models
such as T5 and Swin apply to the attention output fails ("Failed to decompose the FX graph").
torchlib's translation also rejects key/value with fewer heads than the query unless
``enable_gqa`` is set, although torch broadcasts a single key/value head (multi-query
attention). Every rank-3/4 SDPA call without dropout is therefore replaced by the opaque op
``xconv::attention`` (a fixed, contiguous fake output; never decomposed) that translates straight
to one ONNX ``Attention`` node: float or bool mask, ``is_causal``, ``scale``, grouped and
multi-query key/value heads. ``need_weights=True`` attention never reaches SDPA, so it keeps its
explicit ``MatMul``/``Softmax`` path.

**Library custom ops.** An op a model library registers (``torch.ops.<lib>.<op>``, e.g. a
mixture-of-experts grouped matmul) has no ONNX translation. When it was defined with
``torch.library.custom_op``, its Python implementation is traced in its place
(``run_decompositions`` with that one entry), so the graph holds the aten ops it computes with.
A few library ops whose own implementation loops over data (transformers' mixture-of-experts
``grouped_mm_fallback`` walks its group offsets with ``offs.tolist()``) are traced through an
equivalent written here without data-dependent control flow (:data:`_TRACEABLE`). An op
without a traceable Python implementation stops the import with one
:class:`UnsupportedTorchOpError` naming every such op, its count, module scope and source line.

The program is rewritten in place for the export and restored afterwards (:func:`rewritten`),
so a caller's ``ExportedProgram`` is left as it was given (a decomposition makes a new one).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from xconv.errors import ConversionError, MissingOp, UnsupportedOpError

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: Op namespaces torch.onnx translates itself (or that this module introduces).
_KNOWN_NAMESPACES = frozenset({"aten", "prims", "xconv", "torchvision", "quantized_decomposed"})


class UnsupportedTorchOpError(UnsupportedOpError):
    """Library ops (``torch.ops.<lib>.*``) with neither an ONNX translation nor a traceable
    Python implementation; all of them at once."""

    def __init__(self, missing: list[MissingOp], reasons: dict[str, str]) -> None:
        self.backend = "torch importer"
        self.missing = tuple(missing)
        lines = [f"{len(self.missing)} library op type(s) cannot be translated to the IR:"]
        for m in self.missing:
            where = f" (scope {m.first_scope!r})" if m.first_scope else ""
            if m.source_line:
                where += f" [{m.source_line}]"
            reason = reasons.get(m.op_type)
            lines.append(f"  - {m.op_type} x{m.count}{where}" + (f": {reason}" if reason else ""))
        lines.append(
            "Define each with torch.library.custom_op and a Python implementation made of "
            "torch operations (it is traced in the op's place), or export the model with "
            "the library's reference (non-kernel) implementation."
        )
        first = self.missing[0] if self.missing else None
        ConversionError.__init__(
            self,
            "\n".join(lines),
            op=first.op_type if first else None,
            scope=first.first_scope if first else None,
        )


@functools.cache
def _attention_op() -> Any:
    """Define ``xconv::attention`` once per process (torch.library registrations are global)."""

    @torch.library.custom_op("xconv::attention", mutates_args=())
    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        heads, kv_heads = query.shape[-3], key.shape[-3]
        return torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=heads != kv_heads,
        ).contiguous()

    @attention.register_fake
    def _(query, key, value, attn_mask, is_causal, scale):
        return query.new_empty((*query.shape[:-1], value.shape[-1]))

    return torch.ops.xconv.attention.default


def _attention_onnx(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """``xconv::attention`` -> ONNX ``Attention`` (opset 23), rank-3 inputs lifted to rank 4."""
    from onnxscript import opset23 as op

    rank = len(query.shape)
    if rank == 3:
        axis = op.Constant(value_ints=[0])
        query, key, value = (op.Unsqueeze(t, axis) for t in (query, key, value))
    kwargs: dict[str, Any] = {"is_causal": 1 if is_causal else 0}
    if scale is not None:
        kwargs["scale"] = float(scale)
    if attn_mask is not None:
        kwargs["attn_mask"] = attn_mask
    out, *_ = op.Attention(query, key, value, **kwargs)
    if rank == 3:
        out = op.Squeeze(out, op.Constant(value_ints=[0]))
    return out


def translation_table() -> dict[Callable, Callable]:
    """The ``custom_translation_table`` entries for the ops this module introduces."""
    return {_attention_op(): _attention_onnx}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _rewritable(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """The ``xconv::attention`` args for an SDPA call this rewrite can take, else None."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    query, key, value = (_val(bound.get(n)) for n in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return None
    mask = bound.get("attn_mask")
    dropout = bound.get("dropout_p", 0.0)
    if not isinstance(dropout, int | float) or dropout != 0:
        return None
    rank = query.dim()
    if rank not in (3, 4) or key.dim() != rank or value.dim() != rank:
        return None
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
        return None  # broadcast batch dims: torchlib's decomposition path keeps them
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads:
        return None
    scale = bound.get("scale")
    if scale is not None and not (isinstance(scale, float | int) and math.isfinite(scale)):
        return None
    is_causal = bool(bound.get("is_causal", False))
    if is_causal and mask is not None:
        return None
    return (bound["query"], bound["key"], bound["value"], mask, is_causal, scale)


def _rewrite_attention(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Replace each rewritable SDPA call; return ``(original, replacement)`` pairs."""
    pairs = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        args = _rewritable(node)
        if args is None:
            continue
        with graph.inserting_after(node):
            new = graph.call_function(_attention_op(), args)
        new.meta = dict(node.meta)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            new.meta["val"] = val.new_empty(val.shape)
        node.replace_all_uses_with(new)
        pairs.append((node, new))
    return pairs


def _restore_attention(
    graph: torch.fx.Graph, pairs: list[tuple[torch.fx.Node, torch.fx.Node]]
) -> None:
    for original, new in pairs:
        new.replace_all_uses_with(original)
        graph.erase_node(new)


def _library_ops(graph: torch.fx.Graph) -> dict[Any, list[torch.fx.Node]]:
    """``{op overload: calls}`` of ops from namespaces torch.onnx does not translate."""
    found: dict[Any, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace in _KNOWN_NAMESPACES:
            continue
        found.setdefault(target, []).append(node)
    return found


def _grouped_mm_by_rows(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor):
    """``transformers::grouped_mm_fallback`` without its loop over ``offs.tolist()``.

    Rows of ``input`` (S, K) are sorted by group and group ``g`` ends at row ``offs[g]``
    (cumulative); each row is multiplied by its group's (K, N) matrix of ``weight`` (G, K, N).
    The group of row ``s`` is the number of offsets at or below ``s``; rows past the last
    offset stay zero, as in the loop.
    """
    rows = torch.arange(input.shape[0], device=input.device, dtype=offs.dtype)
    group = (offs.unsqueeze(0) <= rows.unsqueeze(1)).sum(dim=1)  # (S,)
    inside = group < weight.shape[0]
    picked = weight[group.clamp(max=weight.shape[0] - 1)]  # (S, K, N)
    out = torch.bmm(input.unsqueeze(1), picked).squeeze(1)
    return torch.where(inside.unsqueeze(1), out, torch.zeros_like(out))


#: Library ops traced through an equivalent written here, by op name: their own Python
#: implementation branches on tensor values, which ``torch.export`` cannot trace.
_TRACEABLE: dict[str, Callable] = {"transformers::grouped_mm_fallback": _grouped_mm_by_rows}


def _python_impl(op: Any) -> Callable | None:
    """The Python function a ``torch.library.custom_op`` was defined with (CPU's, if given),
    or this module's data-independent equivalent of a known library op."""
    from torch._library.custom_ops import _maybe_get_opdef

    if op._name in _TRACEABLE:
        return _TRACEABLE[op._name]
    opdef = _maybe_get_opdef(op._name)
    if opdef is None:
        return None
    return opdef._backend_fns.get("cpu") or opdef._init_fn


def _scope_of(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values()]
    return paths[-1] if paths else None


def decompose_library_ops(
    program: torch.export.ExportedProgram,
) -> torch.export.ExportedProgram:
    """Trace each library op's Python implementation in its place; a new program if any.

    Raises:
        UnsupportedTorchOpError: ops with no traceable Python implementation, all of them.
    """
    from xconv.converters.torch.importer.trace import source_line

    calls = _library_ops(program.graph)
    if not calls:
        return program
    table = {op: impl for op in calls if (impl := _python_impl(op)) is not None}
    reasons = {op._name: "no Python implementation registered" for op in calls if op not in table}
    if table and not reasons:
        decompositions = torch.export.default_decompositions()
        for op in list(decompositions.keys()):
            decompositions.pop(op)  # keep every other op (SDPA above all) as it is
        for op, impl in table.items():
            decompositions[op] = impl
        try:
            program = program.run_decompositions(decompositions)
        except Exception as e:  # noqa: BLE001 (reported with the ops)
            text = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            reasons = {
                op._name: f"its Python implementation does not trace ({text})" for op in table
            }
        else:
            left = _library_ops(program.graph)
            reasons = {op._name: "still present after tracing its implementation" for op in left}
            calls = left
    if not reasons:
        return program
    missing = []
    for op, nodes in sorted(calls.items(), key=lambda item: item[0]._name):
        if op._name not in reasons:
            continue
        first = nodes[0]
        missing.append(
            MissingOp(
                op._name,
                op.namespace,
                len(nodes),
                first_node=first.name,
                first_scope=_scope_of(first),
                source_line=source_line(first.meta.get("stack_trace")),
            )
        )
    raise UnsupportedTorchOpError(missing, reasons)


@contextlib.contextmanager
def rewritten(
    program: torch.export.ExportedProgram,
) -> Iterator[tuple[torch.export.ExportedProgram, dict[Callable, Callable]]]:
    """Rewrite ``program`` for torch.onnx; yield the program to export and the translation
    table its new ops need."""
    graph_module = getattr(program, "graph_module", None)
    if graph_module is None:  # not an ExportedProgram: nothing to rewrite
        yield program, {}
        return
    graph = graph_module.graph
    # Attention first: a decomposition re-traces the program, which SDPA's strides break.
    pairs = _rewrite_attention(graph)
    if pairs:
        graph_module.recompile()
    try:
        yield decompose_library_ops(program), translation_table() if pairs else {}
    finally:
        if pairs:
            _restore_attention(graph, pairs)
            graph_module.recompile()


__all__ = ["UnsupportedTorchOpError", "decompose_library_ops", "rewritten", "translation_table"]
