"""How the Flax emitter names and reads IR values: bindings per layout, locals, weights,
constants (a mixin of ``emitter._Emitter``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import reshape_dims
from xconv.converters.flax.source import templates_resize as flax_ops_resize  # noqa: F401  (registers templates)
from xconv.converters.flax.source.templates import (
    array_literal,
    closed_form,
    dtype_expr,
)
from xconv.converters.ops import layout
from xconv.ir.metadata import ROLE, get_scope
from xconv.weights.flax_names import (
    raw_param_name,
)

_ROLES = frozenset({"x", "h", "residual", "q", "k", "v", "scores", "attn", "mask"})
_QKV = {
    **dict.fromkeys(("query", "q_proj", "q", "to_q", "q_lin"), "q"),
    **dict.fromkeys(("key", "k_proj", "k", "to_k", "k_lin"), "k"),
    **dict.fromkeys(("value", "v_proj", "v", "to_v", "v_lin"), "v"),
}


def _feeds_softmax(value: ir.Value, depth: int = 3) -> bool:
    """Whether ``value`` reaches a Softmax through at most ``depth`` elementwise ops."""
    for use in value.uses():
        op = use.node.op_type
        if op == "Softmax":
            return True
        elementwise = op in ("Add", "Div", "Mul", "Where", "Cast", "Sub")
        if depth and elementwise and any(_feeds_softmax(o, depth - 1) for o in use.node.outputs):
            return True
    return False


#: Ops an attention operand passes through on its way in (head split, layout, dtype).
_LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Cast"})


def _from_softmax(value: ir.Value | None, depth: int = 3) -> bool:
    """Whether ``value`` is a Softmax's output, through at most ``depth`` layout ops."""
    producer = value.producer() if value is not None else None
    if producer is None:
        return False
    if producer.op_type == "Softmax":
        return True
    layout_op = producer.op_type in _LAYOUT_OPS or producer.op_type == "Dropout"
    return bool(depth and layout_op and _from_softmax(producer.inputs[0], depth - 1))


def _attention_operand(value: ir.Value, depth: int = 4) -> str | None:
    """``q``, ``k`` or ``v``: the attention operand ``value`` is, read only by an attention
    (an ``Attention`` node's query / key / value, or a ``MatMul`` computing the scores or
    weighting the values) through at most ``depth`` layout ops (head split, transposes)."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node, i = uses[0]
    op = node.op_type
    if op == "Attention" and i < 3:
        return "qkv"[i]
    if op in _LAYOUT_OPS and i == 0:
        return _attention_operand(node.outputs[0], depth - 1) if depth else None
    if op == "MatMul":
        if _feeds_softmax(node.outputs[0]):
            return "qk"[i]
        if i == 1 and _from_softmax(node.inputs[0]):
            return "v"
    return None


_FLOAT = ir.DataType.FLOAT


def _f32(value: ir.Value) -> bool:
    return value.dtype == _FLOAT


def _dims(value: ir.Value) -> list[int | None] | None:
    if value.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in value.shape]


#: Constants up to this many elements are written inline; larger ones are stored variables.
INLINE_LIMIT = 64
#: ... and up to this many characters; a longer one is written in closed form
#: (:func:`~xconv.converters.flax.source.templates.closed_form`) or stored.
LITERAL_WIDTH = 60


@dataclass
class _Var:
    """One emitted variable: where it lives and what it came from.

    ``scope`` / ``role`` / ``kind`` are the source layer's scope, the weight's role in it
    (``kernel``, ``mean``) and the layer kind (``conv``; ``raw`` for a weight outside a native
    layer, ``constant`` for a stored buffer): what partitioning rules key on.
    """

    collection: str
    path: tuple[str, ...]
    value: np.ndarray
    source: str | None = None  # the IR initializer (source weight) name
    scope: str | None = None
    role: str | None = None
    kind: str = "raw"


class _Values:
    """Value names of ``_Emitter`` (``self.env``, ``self.raw``)."""

    # ------------------------------------------------------------ values

    def bind(self, value: ir.Value, name: str, perm: layout.Perm, static: bool = False) -> None:
        self.env[value] = {perm: name}
        self.native[value] = perm
        if static:
            self.static.add(value)

    def rank(self, value: ir.Value) -> int | None:
        return None if value.shape is None else len(value.shape)

    def get(self, value: ir.Value, perm: layout.Perm) -> str:
        names = self.env[value]
        if perm in names:
            return names[perm]
        src = self.native[value]
        rank = len(src or perm)
        t = layout.conversion(src, perm, rank)
        suffix = "nhwc" if perm == layout.channels_last(rank) else "nchw" if perm is None else "t"
        name = self.ns.new(f"{names[src]}_{suffix}")
        xp = "np" if value in self.static else "jnp"
        shape = _dims(value)
        target = shape and tuple(shape[a] for a in (perm or range(rank)))
        if target and layout.moves_only_unit_axes(t, [shape[a] for a in (src or range(rank))]):
            # Only size-1 axes move (a pooled N,1,1,C): a reshape, which costs nothing. The
            # leading axes that stay put are read from the array (its batch size), the rest
            # written as numbers where known.
            k = next((i for i, a in enumerate(t) if a != i), len(t))
            dims = ", ".join(
                reshape_dims(names[src], target[:k], [0] * k, False)
                + [
                    str(d) if d is not None else f"{names[src]}.shape[{t[i]}]"
                    for i, d in enumerate(target[k:], start=k)
                ]
            )
            self.src.body.append(f"{name} = {xp}.reshape({names[src]}, ({dims}))")
        else:
            self.src.body.append(f"{name} = {xp}.transpose({names[src]}, {t})")
        names[perm] = name
        return name

    def local(self, value: ir.Value, inputs=(), scope: str | None = None) -> str:
        """The local a node's output is bound to.

        The name of the node's first data input when this node is that input's last reader
        (``x = self.conv1(x)``, ``h = h + x``): a chain reads as the source's does. Otherwise
        a new name for the value's role (:meth:`role`), never the exporter's value name.
        """
        role = self.role(value, scope)
        # Inside a nested function (an If branch, a loop body) a reused name would be a local
        # of that function, shadowing the enclosing value it reads: every value is new.
        inputs = list(inputs) if not self.nested else []
        for v in inputs[:1]:
            names = self.env.get(v)
            if not names or v.is_graph_output() or v not in self.native:
                break
            base = names[self.native[v]]
            base_role = re.sub(r"_\d+$", "", base)
            if base_role not in _ROLES:
                break  # a source input keeps its name (``input_ids``), its result is new
            if role != "h" and role != base_role:
                break  # the value changes role: ``attn = softmax(scores)``
            if self.size_pins(base):
                break  # a size still to be read is written with this name (``x.shape[1]``)
            if role == "h" and (
                base_role in ("scores", "attn", "mask")
                or (base_role in ("q", "k", "v") and len(inputs) > 1)
            ):
                break  # ``h = attn @ v``, ``h = _attention(q, k, v)``
            # A class's argument: the caller's reads are of the caller's own local.
            argument = self.body is not None and v.producer() not in self.body
            if all(u.node in self.done for u in v.uses() if not argument or u.node in self.body):
                return base
        return self.ns.new(role)

    def role(self, value: ir.Value, scope: str | None = None) -> str:
        """A readable name for what a value is: ``q``/``k``/``v`` (by its layer's name, or
        the attention input it feeds), ``scores``, ``attn``, ``mask``, ``residual``,
        ``shape``, else ``h``."""
        if value.dtype == ir.DataType.BOOL:
            return "mask"
        producer = value.producer()
        op = producer.op_type if producer is not None else ""
        if op == "Softmax":
            return "attn"
        if op in ("Shape", "Size"):
            return "shape"
        if op in ("MatMul", "Einsum", "Div", "Mul", "Add", "Sub", "Where") and _feeds_softmax(
            value
        ):
            return "scores"
        scope = scope or (get_scope(producer) if producer is not None else None) or ""
        leaf = scope.rsplit(".", 1)[-1]
        if leaf in _QKV:
            return _QKV[leaf]
        operand = _attention_operand(value)
        if operand is not None:
            return operand
        if {"downsample", "shortcut"} & set(scope.split(".")):
            return "residual"
        return "h"

    def hint(self, value: ir.Value) -> str | None:
        """The name hint of a value: its source name, or its op type in generated classes."""
        producer = value.producer()
        if self.canonical and producer is not None:
            return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", producer.op_type).lower()
        return value.name

    def weight(self, value: ir.Value) -> str:
        if value not in self.raw:
            attr = self.attrs.new(
                self.weight_names.get(value) or raw_param_name(self._relative(value.name))
            )
            arr = value.const_value.numpy()
            shape, dt = tuple(arr.shape), dtype_expr(value.dtype)
            # linen's param takes the loaded value; its initializer's dtype is float32 unless
            # the weight is not (then it is spelled out)
            pdt = "" if value.dtype == ir.DataType.FLOAT else f", {dt}"
            self.src.setup.append(
                (
                    f'self.{attr} = self.param("{attr}", nn.initializers.zeros_init(), '
                    f"{shape}{pdt})",
                    f"self.{attr} = nnx.Param(jnp.zeros({shape}, {dt}))",
                )
            )
            role = value.metadata_props.get(ROLE)
            scope = value.name.rpartition(".")[0] if value.name else None
            self.src.variables.append(_Var("params", (attr,), arr, value.name, scope, role))
            self.raw[value] = f"self.{attr}[...]"
        return self.raw[value]

    def constant(
        self, value: ir.Value, arr: np.ndarray, perm: layout.Perm, rank: int | None, bare: bool
    ) -> str:
        if perm is not None and rank is not None:
            arr = layout.permute_constant(arr, perm, rank)
        if arr.size <= INLINE_LIMIT:
            literal = array_literal(arr, bare_scalar=bare)
            if len(literal) <= LITERAL_WIDTH:
                return literal
            # A long literal: its closed form when it has one, else a stored constant, so
            # the statement stays within the line length (a rotary table, a causal mask).
            closed = closed_form(arr)
            if closed is not None and len(closed) < len(literal):
                return closed
            if arr.dtype.kind != "f":
                return literal  # integers may index or shape: they stay numpy (static)
        key = (value, perm)
        if key not in self.raw:
            self.has_constants = True
            # A source buffer keeps its name (the weights mapping looks it up); a folded
            # constant's name is the exporter's, and would differ between the instances of
            # a block class: it is a ``table``.
            hint = value.name if value.is_initializer() else None
            attr = self.attrs.new(raw_param_name(hint or "table"))
            shape, dt = tuple(arr.shape), dtype_expr(ir.DataType.from_numpy(arr.dtype))
            self.src.setup.append(
                (
                    f'self.{attr} = self.variable("constants", "{attr}", jnp.zeros, '
                    f"{shape}, {dt}).value",
                    f"self.{attr} = Constant(jnp.zeros({shape}, {dt}))",
                )
            )
            self.src.variables.append(_Var("constants", (attr,), arr, value.name, kind="constant"))
            self.raw[key] = f"self.{attr}[...]"
        return self.raw[key]
