"""The Flax emitter's per-node writing: one template call per node, its layout and
precision (a mixin of ``emitter._Emitter``).
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import parse_attrs, type_subgraph
from xconv.converters.flax.source import templates_resize as flax_ops_resize  # noqa: F401  (registers templates)
from xconv.converters.flax.source.templates import (
    OpCall,
    find_template,
)
from xconv.converters.flax.source.values import _FLOAT, _f32
from xconv.converters.ops import layout, precision
from xconv.errors import UnsupportedAttributeError
from xconv.ir.passes._utils import constant_of, is_weight


class _Nodes:
    """Node statements of ``_Emitter``."""

    def emit_node(self, node: ir.Node) -> None:
        if self.emit_size(node):
            return
        if node.op_type in ("Shape", "Size") and self._emit_shape(node):
            return
        tpl = find_template(node, self.model.opset_imports)
        attrs = parse_attrs(node, tpl.attrs, "Flax")
        for key, graph in [(k, g) for k, g in attrs.items() if isinstance(g, ir.Graph)]:
            attrs[key] = self.subgraph_function(node, key, graph)  # its nested def's name
        ins = list(node.inputs)
        consts = [None if v is None or not v.name else constant_of(v, self.annotated) for v in ins]
        data = [
            v for v, c in zip(ins, consts, strict=True) if v is not None and v.name and c is None
        ]
        out_rank = self.rank(node.outputs[0]) if node.outputs else None
        perm = self._choose_perm(tpl.layout, node, data, out_rank)
        static = node.op_type in ("Shape", "Size") or (
            tpl.static_ok and all(v in self.static for v in data)
        )
        xp = "np" if static else "jnp"
        bare = tpl.layout == "binary"
        args: list[str | None] = []
        stored = set(self.raw)
        for v, c in zip(ins, consts, strict=True):
            if v is None or not v.name:
                args.append(None)
            elif c is not None:
                cperm = perm if tpl.layout in ("binary", "axis") else None
                args.append(self.constant(v, c, cperm, out_rank, bare))
            elif is_weight(v, self.annotated) or (v.is_initializer() and v.const_value is not None):
                args.append(self.weight(v))
            elif tpl.layout in ("binary", "axis") and self.rank(v) != out_rank:
                args.append(self.get(v, None))
            else:
                args.append(self.get(v, perm if tpl.layout != "plain" else None))
        if static and any(
            c is not None and a is not None and a.startswith("self.")
            for a, c in zip(args, consts, strict=True)
        ):
            # A constant stored as a variable is a traced array under jit, not a numpy one:
            # an op taking one computes with jnp (BERT's mask Expand of a (1, 1, 128, 1) table).
            static, xp = False, "jnp"
        shapes = [
            None
            if v is None or v.shape is None
            else tuple(d if isinstance(d, int) else None for d in v.shape)
            for v in ins
        ]
        lowered = None
        if self.low_dtype and not static:
            lowered = self._lower(node, args, consts, attrs, bare)
        rounds = lowered == "round"
        call = OpCall(node, args, consts, shapes, attrs, xp=xp, perm=perm, low=self.low_dtype)
        expr = tpl.fn(call)
        self._drop_unused_constants(stored, expr)
        self.src.helpers |= call.helpers
        outs = []
        used = [o for o in node.outputs if o.name and (o.uses() or o.is_graph_output())]
        for o in node.outputs:
            if o in used:
                outs.append(self.local(o, data if len(used) == 1 else ()))
            else:
                outs.append("_")
        target = outs[0] if len(outs) == 1 else ", ".join(outs)
        floats = [n for o, n in zip(node.outputs, outs, strict=True) if n != "_" and _f32(o)]
        if rounds and len(outs) == 1 and floats:
            expr = f"({expr}).astype(jnp.bfloat16)"  # a float32 op's result, in bfloat16
        self.src.body.append(f"{target} = {expr}{self._comment(node)}")
        if rounds and len(outs) > 1:
            self.src.body.extend(f"{n} = {n}.astype(jnp.bfloat16)" for n in floats)
        out_perm = perm
        if tpl.layout == "reduce":
            out_perm = self._reduce_perm(node, attrs, consts, perm)
        elif tpl.layout == "plain":
            out_perm = None
        for o, name in zip(node.outputs, outs, strict=True):
            if name != "_":
                self.bind(o, name, out_perm if o is node.outputs[0] else None, static)
        if lowered is not None:
            self.low |= {o for o in node.outputs if _f32(o)}

    def subgraph_function(self, node: ir.Node, key: str, graph: ir.Graph) -> str:
        """Write ``graph`` (an If branch, a Loop or Scan body) as a function nested in
        ``__call__``: its parameters are the graph's inputs, its body the graph's statements
        (reading the enclosing values by closure), and it returns the tuple of its outputs.
        Returns the function's name."""
        if self.low_dtype:
            raise UnsupportedAttributeError(
                f"{node.op_type} under dtype={self.options.dtype!r} (its subgraph would mix "
                "bfloat16 and float32 values); convert in float32",
                op=node.op_type,
                node=node.name,
            )
        type_subgraph(graph, self.model.opset_imports)
        name = self.ns.new(key if key != "body" else f"{node.op_type.lower()}_body")
        outer = self.src.body
        env = {v: dict(names) for v, names in self.env.items()}
        native, static = dict(self.native), set(self.static)
        self.src.body = []
        self.nested += 1
        try:
            params = []
            for v in graph.inputs:
                params.append(self.ns.new(v.name or "x"))
                self.bind(v, params[-1], None)
            for inner in graph:
                if inner.op_type != "Constant":
                    self.done.add(inner)
                    self.emit_node(inner)
            outs = []
            for v in graph.outputs:
                c = constant_of(v, self.annotated)
                if c is not None:
                    outs.append(f"jnp.asarray({self.constant(v, c, None, None, False)})")
                elif is_weight(v, self.annotated) or v.const_value is not None:
                    outs.append(self.weight(v))
                else:
                    outs.append(self.get(v, None))
            lines = self.src.body
        finally:
            self.nested -= 1
            self.src.body = outer
            # names bound inside the function are its locals: unknown after it
            self.env, self.native, self.static = env, native, static
        ret = f"({outs[0]},)" if len(outs) == 1 else ", ".join(outs)
        self.src.body += [
            f"def {name}({', '.join(params)}):",
            *(f"    {line}" for line in lines),
            f"    return {ret}",
        ]
        return name

    def _lower(
        self, node: ir.Node, args: list, consts: list, attrs: dict, bare: bool
    ) -> str | None:
        """The bfloat16 rules of :mod:`~xconv.converters.ops.precision` for one statement,
        as ``interpreter._lower`` applies them: edits ``args`` / ``attrs`` in place. Returns
        ``"round"`` (a float32 op: its result is rounded to bfloat16), ``"low"`` (it computes
        in bfloat16) or None (its float results, if any, stay float32)."""
        op, ins = node.op_type, list(node.inputs)
        floats = [
            i
            for i in precision.data_operands(op, len(ins))
            if ins[i] is not None and ins[i].name and (ins[i] in self.low or _f32(ins[i]))
        ]
        if all(consts[i] is not None or ins[i] in self.static for i in floats):
            return None  # no run-time float operand
        how = precision.mode(op)
        if how == "float32":
            for i in floats:
                if ins[i] in self.low:
                    args[i] = f"{args[i]}.astype(jnp.float32)"
            return "round"
        if how == "cast":
            target = attrs.get("to") if op == "Cast" else ins[1].dtype
            if ins[0] in self.low and target is not None and ir.DataType(target) == _FLOAT:
                if op == "Cast":
                    attrs["to"] = int(ir.DataType.BFLOAT16)
                else:
                    args[1] = args[0]  # CastLike(x, x): x as it is
                return "low"
            return None
        for i in floats:
            scalar = bare and consts[i] is not None and consts[i].ndim == 0  # weakly typed
            if ins[i] not in self.low and not scalar:
                args[i] = f"{args[i]}.astype(jnp.bfloat16)"
        return "low"

    def _drop_unused_constants(self, before: set, expr: str) -> None:
        """Forget stored constants made for this node that its template did not use (zero
        initial states a template writes as ``None``)."""
        for key in [k for k in self.raw if k not in before]:
            ref = self.raw[key]
            if re.search(re.escape(ref), expr):
                continue
            attr = ref.removeprefix("self.").removesuffix("[...]")
            del self.raw[key]
            self.src.setup = [s for s in self.src.setup if not s[0].startswith(f"self.{attr} =")]
            self.src.variables = [v for v in self.src.variables if v.path != (attr,)]
            self.has_constants = any(v.collection == "constants" for v in self.src.variables)

    def _emit_shape(self, node: ir.Node) -> bool:
        """Shape/Size read a channels-last value directly, without transposing it back."""
        x = node.inputs[0]
        perm = self.native.get(x)
        if perm is None or x not in self.env or node.attributes:
            return False
        name = self.env[x][perm]
        out = node.outputs[0]
        target = self.local(out, ())
        if node.op_type == "Size":
            expr = f"np.asarray({name}.size, dtype=np.int64)"
        else:
            dims = ", ".join(f"{name}.shape[{perm.index(a)}]" for a in range(len(perm)))
            expr = f"np.asarray([{dims}], dtype=np.int64)"
        self.src.body.append(f"{target} = {expr}{self._comment(node)}")
        self.bind(out, target, None, static=True)
        return True

    def _choose_perm(
        self, kind: str, node: ir.Node, data: list[ir.Value], out_rank: int | None
    ) -> layout.Perm:
        if kind == "plain" or not data:
            return None
        if kind == "channels_last":
            r = self.rank(data[0])
            return layout.channels_last(r) if r is not None else None
        if kind in ("unary", "reduce"):
            return self.native.get(data[0])
        if out_rank is None:
            return None
        perms = [self.native.get(v) for v in data if self.rank(v) == out_rank]
        for v in data:
            if self.rank(v) != out_rank and self.native.get(v) is not None:
                return None
        if kind == "axis":
            return perms[0] if perms else None
        if any(self.rank(v) != out_rank for v in data):
            return None
        chosen = [p for p in perms if p is not None]
        return chosen[0] if chosen else None

    def _reduce_perm(self, node, attrs, consts, perm) -> layout.Perm:
        if perm is None or attrs["keepdims"]:
            return perm
        axes = consts[1] if len(consts) > 1 and consts[1] is not None else attrs.get("axes")
        if axes is None or len(np.asarray(axes).reshape(-1)) == 0:
            return None
        rank = len(perm)
        ax = [int(a) + rank if a < 0 else int(a) for a in np.asarray(axes).reshape(-1)]
        return layout.after_reduce(perm, ax, rank)
