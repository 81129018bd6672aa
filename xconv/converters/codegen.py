"""Pieces every source emitter shares (Flax, PyTorch): names, attributes, layer bodies, files.

Framework-free: emitters build on these and add their own templates and layer rendering.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from xconv.converters.registry import REQUIRED, attribute_value, iter_nodes
from xconv.errors import (
    ConversionError,
    UnsupportedAttributeError,
)
from xconv.ir.metadata import ROLE, get_layer, get_scope
from xconv.ir.passes._utils import constant_of, is_annotated, is_weight
from xconv.ir.passes.simplify import DeadNodeRemovalPass


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs a node holds as attributes (If's branches, a Loop or Scan body)."""
    out: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.is_ref():
            continue
        if attr.type == ir.AttributeType.GRAPH:
            out.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            out += list(attr.value)
    return out


def with_subgraph_nodes(nodes: Iterable[ir.Node]) -> list[ir.Node]:
    """``nodes`` followed by every node of their subgraphs, at any depth: what an emitter
    that writes subgraphs as nested functions needs templates for."""
    nodes = list(nodes)
    return nodes + [m for n in nodes for g in subgraphs(n) for m in iter_nodes(g)]


def type_subgraph(graph: ir.Graph, opsets: Mapping[str, int]) -> None:
    """Give the untyped values of ``graph`` (a subgraph) the types ONNX shape inference finds
    for it as a model of its own: inference does not enter the subgraphs of ops it has no
    schema for (FlexAttention's score_mod / prob_mod, an ai.onnx.preview op), and templates
    need the dtypes (Range, Cast). Values typed already are kept; a subgraph that inference
    rejects stays as it was."""
    untyped = [o for n in graph for o in n.outputs if o.name and o.type is None]
    if not untyped:
        return
    import onnx

    proto = ir.serde.serialize_graph(graph)
    opset_ids = [onnx.helper.make_opsetid(d, v) for d, v in sorted(opsets.items())]
    try:
        inferred = onnx.shape_inference.infer_shapes(
            onnx.helper.make_model(proto, opset_imports=opset_ids), strict_mode=False
        )
    except Exception:  # noqa: BLE001  (inference is a best effort here)
        return
    found = {vi.name: vi.type for vi in inferred.graph.value_info}
    for o in untyped:
        t = found.get(o.name)
        if t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type:
            o.type = ir.serde.deserialize_type_proto_for_type(t)
            if o.shape is None and t.tensor_type.HasField("shape"):
                o.shape = ir.serde.deserialize_type_proto_for_shape(t)


class Namespace:
    """Unique, readable identifiers that never shadow builtins (after torch.fx's).

    Args:
        reserved: Names never handed out (builtins, keywords, the module's imports).
        avoid: Extra predicate for names to skip (e.g. a generated helper's name).
    """

    def __init__(self, reserved: Iterable[str], avoid: Callable[[str], bool] | None = None) -> None:
        self._used: set[str] = set(reserved)
        self._avoid = avoid

    def new(self, hint: str | None) -> str:
        base = re.sub(r"\W", "_", hint or "v").strip("_") or "v"
        base = re.sub(r"_+", "_", base)
        if base[0].isdigit():
            base = f"v_{base}"
        name, i = base, 0
        while name in self._used or (self._avoid is not None and self._avoid(name)):
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        return name

    def take(self, name: str) -> bool:
        """Claim ``name`` exactly; False when it is already used."""
        if name in self._used:
            return False
        self._used.add(name)
        return True


def parse_attrs(node: ir.Node, spec: Mapping[str, Any], emitter: str) -> dict[str, Any]:
    """Validate a node's attributes against ``spec`` (name -> default or REQUIRED)."""
    unknown = sorted(set(node.attributes) - set(spec))
    if unknown:
        raise UnsupportedAttributeError(
            f"attribute(s) {unknown} not supported by the {emitter} emitter; it understands "
            f"{sorted(spec) or 'no attributes'}",
            op=node.op_type,
            node=node.name,
            scope=get_scope(node),
        )
    out = {}
    for name, default in spec.items():
        attr = node.attributes.get(name)
        if attr is None:
            if default is REQUIRED:
                raise UnsupportedAttributeError(
                    f"required attribute {name!r} is missing", op=node.op_type, node=node.name
                )
            out[name] = default
        else:
            out[name] = attribute_value(attr)
    return out


@dataclass
class LayerBody:
    """One recognised layer: its anchor, the nodes of its scope, and what crosses the edge."""

    kind: str
    hyper: dict[str, Any]
    anchor: ir.Node
    body: list[ir.Node]
    scope: str | None
    #: Non-constant values from outside the body, in first-use order.
    inputs: list[ir.Value]
    #: Constant values from outside the body (Constant outputs, non-weight initializers).
    constants: list[ir.Value]
    outputs: list[ir.Value]
    weights: dict[str, ir.Value]
    last: ir.Node


def layer_bodies(graph: ir.Graph, annotated: bool) -> list[LayerBody]:
    """Every ``xconv.layer`` anchor with its body (see ``xconv/ir/layers.py``), in graph order.

    A body is left out when two weights share a role, or a consumer outside the body runs
    between the body's nodes (then replacing the body with one call would reorder them).
    """
    by_scope: dict[str, list[ir.Node]] = {}
    for node in graph:
        scope = get_scope(node)
        if scope:
            by_scope.setdefault(scope, []).append(node)
    order = {n: i for i, n in enumerate(graph)}
    seen: set[ir.Node] = set()
    out = []
    for node in graph:
        meta = get_layer(node)
        if not meta or node in seen:
            continue
        scope = get_scope(node)
        body = by_scope.get(scope, [node]) if scope else [node]
        layer = _body(node, meta, body, scope, annotated, order)
        if layer is not None:
            seen.update(body)
            out.append(layer)
    return out


def _body(anchor, meta, body, scope, annotated, order) -> LayerBody | None:
    kind = meta.pop("kind")
    body_set = set(body)
    inputs: list[ir.Value] = []
    constants: list[ir.Value] = []
    weights: dict[str, ir.Value] = {}
    outputs: list[ir.Value] = []
    for n in body:
        for v in n.inputs:
            if v is None or not v.name or v.producer() in body_set:
                continue
            if is_weight(v, annotated):
                role = v.metadata_props.get(ROLE)
                if role is None or weights.get(role, v) is not v:
                    return None
                weights[role] = v
            elif constant_of(v, annotated) is None:
                if v not in inputs:
                    inputs.append(v)
            elif v not in constants:
                constants.append(v)
        if n.op_type == "Constant":
            continue
        for o in n.outputs:
            if o.is_graph_output() or any(u.node not in body_set for u in o.uses()):
                outputs.append(o)
    if not outputs:
        return None
    last = max(body, key=order.__getitem__)
    for o in outputs:
        if any(
            u.node not in body_set and order.get(u.node, len(order)) < order[last] for u in o.uses()
        ):
            return None
    return LayerBody(kind, meta, anchor, body, scope, inputs, constants, outputs, weights, last)


def write_dir_atomic(
    out_dir: str | os.PathLike,
    files: Mapping[str, Any],
    write: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``files`` (name -> bytes, or a function writing to a binary file) into
    ``out_dir``: a temp sibling, then one rename. ``write``, when given, is called with the
    temp folder after the files (for what writes a folder of its own, an Orbax checkpoint).

    An existing ``out_dir`` is replaced; on any error nothing is left half-written.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        for name, data in files.items():
            if callable(data):
                with open(tmp / name, "wb") as f:
                    data(f)
            else:
                (tmp / name).write_bytes(data)
        if write is not None:
            write(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete folder ``src`` to ``dst`` (same file system). An existing ``dst``
    is moved aside first and deleted after, so ``dst`` is never half-written."""
    if dst.exists():
        if not dst.is_dir():
            raise ConversionError(f"{dst} exists and is not a folder")
        old = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.old."))
        os.replace(dst, old / dst.name)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


_F32_MAX = float(np.finfo(np.float32).max)


def scalar_literal(v: Any) -> str:
    """A Python literal for a scalar; a float32 value in its shortest float32 spelling."""
    if isinstance(v, np.bool_ | bool):
        return repr(bool(v))
    if isinstance(v, np.integer | int):
        return repr(int(v))
    f = float(v)
    if np.isfinite(f) and float(np.float32(f)) == f:
        # A float32 value: its shortest float32 spelling reads better and rounds back exactly,
        # unless it lies past float32's range as a double (finfo.min spells -3.4028235e+38,
        # which torch refuses to fill a float32 tensor with: "cannot be converted to type
        # float without overflow"); that one keeps its exact spelling.
        short = float(str(np.float32(f)))
        f = short if abs(short) <= _F32_MAX else f
    if math.isnan(f):
        return 'float("nan")'
    if math.isinf(f):
        return 'float("inf")' if f > 0 else '-float("inf")'
    return repr(f)


def nested_literal(a: np.ndarray) -> str:
    """A (nested) Python list literal of an array's values; a scalar for a 0-d array."""
    if a.ndim == 0:
        return scalar_literal(a[()])
    return "[" + ", ".join(nested_literal(x) for x in a) + "]"


def int_tuple(values: Any) -> str:
    """A tuple literal of ints (``(3,)`` for one)."""
    items = [int(v) for v in np.asarray(values).reshape(-1)]
    return "(" + ", ".join(map(str, items)) + ("," if len(items) == 1 else "") + ")"


def reshape_dims(
    arg: str, in_shape: Iterable[int | None] | None, target: Iterable[int], allowzero: bool
) -> list[str]:
    """The dimensions of a Reshape of ``arg`` to the constant ``target`` as source text.

    The leading dimensions the target shares with the input's static shape (``in_shape``),
    and any ``0`` (copy the input's dimension), are read from ``arg.shape`` rather than
    written as the traced example's numbers, so the generated model runs at another batch
    (and sequence) length: ``["*h.shape[:2]", "4", "8"]`` for ``(2, 10, 32) -> (2, 10, 4, 8)``,
    ``["h.shape[0]", "16"]`` for ``(2, 16, 1, 1) -> (2, 16)``. Identical on the traced shapes.
    The rest stay literal; so does everything when ``arg`` is not a plain name (a weight, a
    literal) or the input's shape is unknown.
    """
    dims = [int(t) for t in target]
    shape = list(in_shape) if in_shape is not None else []
    copy = [d == 0 and not allowzero for d in dims]
    named, k = arg.isidentifier(), 0
    while named and k < min(len(dims), len(shape)) and (copy[k] or dims[k] == shape[k]):
        k += 1
    out = [] if k == 0 else [f"{arg}.shape[0]"] if k == 1 else [f"*{arg}.shape[:{k}]"]
    for i in range(k, len(dims)):
        if not copy[i]:
            out.append(str(dims[i]))
        elif not named and i < len(shape) and shape[i] is not None:
            out.append(str(shape[i]))
        else:
            out.append(f"{arg}.shape[{i}]")
    return out


_REDUCES = frozenset(
    {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2"}
)


def fold_reduce_reshapes(model: ir.Model) -> ir.Model:
    """A reduction with ``keepdims=1`` read only by a Reshape that just drops its reduced unit
    axes becomes one reduction with ``keepdims=0`` (in place): ``jnp.mean(x, axis=(1, 2))``,
    not a keepdims mean then a reshape (a global average pool before the classifier).

    The Reshape's output shape (as recorded, symbolic dims by name; else its constant target)
    equals the reduction's input shape with exactly the reduced axes removed; anything else is
    left as it is. Size arithmetic that built the target goes with the Reshape.
    """
    graph = model.graph
    annotated, folded = is_annotated(graph), False
    for node in [n for n in graph if n.op_type in _REDUCES and n.domain in ("", "ai.onnx")]:
        keep = node.attributes.get("keepdims")
        if keep is not None and not keep.value:
            continue
        if any(k not in ("axes", "keepdims", "noop_with_empty_axes") for k in node.attributes):
            continue
        out = node.outputs[0]
        users = [u for u, _ in out.uses()]
        if out.is_graph_output() or len(users) != 1 or users[0].op_type != "Reshape":
            continue
        reshape = users[0]
        if reshape.inputs[0] is not out or reshape.outputs[0].is_graph_output():
            continue
        if any(k != "allowzero" for k in reshape.attributes):
            continue
        shape = _dims_of(node.inputs[0])
        target = _dims_of(reshape.outputs[0])  # the recorded shape, symbolic dims by name
        if target is None:
            const = constant_of(reshape.inputs[1], annotated)
            target = None if const is None else [int(t) for t in np.asarray(const).reshape(-1)]
        if shape is None or target is None:
            continue
        if len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].name:
            axes = constant_of(node.inputs[1], annotated)
        else:
            attr = node.attributes.get("axes")
            axes = None if attr is None else np.asarray(attr.value)
        if axes is None or np.asarray(axes).size == 0:
            continue
        rank = len(shape)
        reduced = {int(a) % rank for a in np.asarray(axes).reshape(-1)}
        kept = [d for i, d in enumerate(shape) if i not in reduced]
        if target != kept:
            continue
        node.attributes["keepdims"] = ir.AttrInt64("keepdims", 0)
        old = reshape.outputs[0]
        out.shape, out.dtype = old.shape, old.dtype
        ir.convenience.replace_all_uses_with(old, out)
        graph.remove(reshape, safe=True)
        folded = True
    if folded:  # the size arithmetic that built a target
        DeadNodeRemovalPass()(model)
    return model


def _dims_of(v: ir.Value) -> list[int | str] | None:
    """A value's dimensions: ints, and the names of symbolic ones; None where any is unknown."""
    if v.shape is None:
        return None
    dims: list[int | str] = []
    for d in v.shape:
        if isinstance(d, int):
            dims.append(int(d))
        elif getattr(d, "value", None):
            dims.append(str(d.value))
        else:
            return None
    return dims


def drop_noop_attention_masks(model: ir.Model) -> ir.Model:
    """Drop the mask of ``Attention`` nodes (in place) where it is a constant that masks
    nothing: a bool mask all True, or an additive float mask all 0.0 (transformers' BERT run
    without an ``attention_mask`` builds one). Written out, such a constant fixes the batch
    and sequence length of the traced example; without it the attention is the same numbers.
    A Constant node left unread goes too.
    """
    graph = model.graph
    annotated = is_annotated(graph)
    for node in [n for n in graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]:
        if len(node.inputs) < 4 or node.inputs[3] is None or not node.inputs[3].name:
            continue
        mask = node.inputs[3]
        value = constant_of(mask, annotated)
        if value is None or mask.is_graph_input() or mask.is_graph_output():
            continue
        if value.dtype == np.bool_:
            noop = bool(np.all(value))
        else:
            noop = value.dtype.kind == "f" and not np.any(value)
        if not noop:
            continue
        node.replace_input_with(3, None)
        producer = mask.producer()
        if producer is not None and not mask.uses():
            graph.remove(producer, safe=True)
    return model


@dataclass
class TemplateCall:
    """What a source template sees for one node (each emitter's ``OpCall`` extends it)."""

    node: ir.Node
    args: list[str | None]
    consts: list[np.ndarray | None]
    shapes: list[tuple[int | None, ...] | None]
    attrs: dict[str, Any]

    #: The emitter's name in messages.
    emitter: ClassVar[str] = "source emitter"

    def const(self, i: int, what: str) -> np.ndarray:
        """A constant input's value; an error when it is computed at run time."""
        c = self.consts[i] if i < len(self.consts) else None
        if c is None:
            raise ConversionError(
                f"{what} must be a constant for the {self.emitter} (it is computed at run time)",
                op=self.node.op_type,
                node=self.node.name,
            )
        return c

    def has(self, i: int) -> bool:
        return i < len(self.args) and self.args[i] is not None

    def rank(self, i: int = 0) -> int | None:
        s = self.shapes[i] if i < len(self.shapes) else None
        return None if s is None else len(s)

    def need_rank(self, i: int = 0) -> int:
        """The rank of input ``i``; an error naming the op when shape inference gave none."""
        r = self.rank(i)
        if r is None:
            raise ConversionError(
                "the input's rank is unknown (ONNX shape inference could not infer it); "
                "give the model's inputs static ranks",
                op=self.node.op_type,
                node=self.node.name,
            )
        return r

    def fail(self, message: str) -> UnsupportedAttributeError:
        return UnsupportedAttributeError(message, op=self.node.op_type, node=self.node.name)
