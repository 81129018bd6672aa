"""Sizes as Python expressions in generated Flax (a mixin of ``emitter._Emitter``).

A symbolic model computes its sizes in the graph: ``Shape(x)[1:2] → Squeeze → Reshape(-1)``
feeding a ``Slice`` end, ``Shape(x)[:1] → Concat([·, 1, 1])`` feeding an ``Expand``. Written
op by op that is numpy plumbing (``np.squeeze(np.asarray(x.shape[1:2]))``, ``_slice(...)``,
``jnp.broadcast_shapes(...)``). Here each such value is tracked as the Python expressions of
its elements instead (``x.shape[1]``, a traced dim written as its number), no statement is
written for it, and the ops that read sizes take them directly:

* ``Slice`` with bounds from sizes: ``table[:, :x.shape[1]]``;
* ``Expand`` to a size: ``jnp.broadcast_to(t, (x.shape[0], 1, 32))``, each output dim from
  the recorded shapes (a number, or the size expression or input dim the IR says it equals);
* ``Range`` of sizes: ``np.arange(x.shape[1], dtype=np.int64)``;
* ``Reshape`` to a size-built shape: ``jnp.reshape(h, (x.shape[0], x.shape[1], 96))``.

Any other reader gets the value as the numpy array it is (``np.asarray((x.shape[0],),
dtype=np.int64)``), so every op keeps its meaning. Integer arithmetic on sizes is exact in
Python (ONNX int64). A name a size expression reads is not reused for a new value while that
size has readers left (``x = self.embed(x)`` would change what ``x.shape[1]`` means).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from xconv.converters.flax.source.templates import INT64_MAX
from xconv.ir.passes._utils import constant_of, is_weight

#: A size element: its Python expression and the IR dim it equals (an int, a symbolic dim's
#: name, or None when the graph computes it).
Elem = tuple[str, "int | str | None"]

_INT = frozenset({ir.DataType.INT64})  # what Shape gives: a size is written as int64


@dataclass(frozen=True)
class Size:
    """An integer value known as Python expressions: a vector of ``elems`` or a scalar."""

    elems: tuple[Elem, ...]
    scalar: bool
    names: frozenset[str]  # the locals its expressions read

    def numpy(self) -> str:
        """The value as the numpy array the graph computes."""
        if self.scalar:
            return f"np.asarray({self.elems[0][0]}, dtype=np.int64)"
        inner = ", ".join(e for e, _ in self.elems) + ("," if len(self.elems) == 1 else "")
        return f"np.asarray(({inner}), dtype=np.int64)"


def _dim(d) -> int | str | None:
    if isinstance(d, int):
        return d
    return None if d is None or d.value is None else str(d.value)


def _paren(expr: str) -> str:
    return f"({expr})" if " " in expr else expr


class _Sizes:
    """Size values of ``_Emitter`` (see the module docstring)."""

    sizes: dict[ir.Value, Size]

    # ------------------------------------------------------------------ reading sizes

    def _size_or_const(self, v: ir.Value | None) -> Size | None:
        """``v`` as a size: a tracked one, or an integer constant (up to 8 elements)."""
        if v is None or not v.name:
            return None
        if v in self.sizes:
            return self.sizes[v]
        c = constant_of(v, self.annotated)
        if c is None or c.dtype.kind not in "iu" or c.ndim > 1 or c.size > 8:
            return None
        elems = tuple((str(int(x)), int(x)) for x in np.asarray(c).reshape(-1))
        return Size(elems, c.ndim == 0, frozenset())

    def _size_of_shape(self, node: ir.Node) -> Size | None:
        x = node.inputs[0]
        if x not in self.env or x.shape is None:
            return None
        rank = len(x.shape)
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", rank)
        start, end = (max(0, min(rank, a + rank if a < 0 else a)) for a in (start, end))
        perm = self.native.get(x)
        name = self.env[x][perm]
        elems = []
        for a in range(start, end):
            d = x.shape[a]
            if isinstance(d, int):
                elems.append((str(d), d))
            else:
                axis = a if perm is None else perm.index(a)
                elems.append((f"{name}.shape[{axis}]", _dim(d)))
        return Size(tuple(elems), False, frozenset({name}))

    def _propagate(self, node: ir.Node) -> Size | None:
        """The size ``node`` computes from sizes and constants, or None."""
        op = node.op_type
        if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            return None
        if node.outputs[0].dtype not in _INT:
            return None
        if op == "Shape":
            return self._size_of_shape(node)
        ins = [self._size_or_const(v) for v in node.inputs]
        if not ins or ins[0] is None or not any(v in self.sizes for v in node.inputs if v):
            return None
        s = ins[0]
        names = frozenset().union(*(i.names for i in ins if i is not None))
        if op in ("Identity", "Cast"):
            return s
        if op == "Squeeze" and len(s.elems) == 1 and not s.scalar:
            return Size(s.elems, True, names)
        if op in ("Unsqueeze", "Reshape") and len(node.inputs) == 2 and ins[1] is not None:
            target = [e for e, _ in ins[1].elems]
            # a scalar as a 1-vector (Unsqueeze axes [0] / [-1], Reshape [1] / [-1]); a
            # vector reshaped to [-1] as it is (an unsqueezed vector is 2-D: not a size)
            if s.scalar and target in ((["0"], ["-1"]) if op == "Unsqueeze" else (["1"], ["-1"])):
                return Size(s.elems, False, names)
            if not s.scalar and op == "Reshape" and target == ["-1"]:
                return Size(s.elems, False, names)
            return None
        if op == "Concat" and all(i is not None and not i.scalar for i in ins):
            return Size(tuple(e for i in ins for e in i.elems), False, names)
        if op == "Gather" and not s.scalar and len(ins) == 2 and ins[1] is not None:
            if ins[1].names or node.attributes.get_int("axis", 0) != 0:
                return None
            n = len(s.elems)
            idx = [int(e) for e, _ in ins[1].elems]
            if any(not -n <= i < n for i in idx):
                return None
            return Size(tuple(s.elems[i] for i in idx), ins[1].scalar, names)
        if op in ("Add", "Sub", "Mul") and len(ins) == 2 and all(ins):
            return self._arith(op, ins[0], ins[1], names)
        return None

    def _arith(self, op: str, a: Size, b: Size, names: frozenset[str]) -> Size | None:
        if len(a.elems) != len(b.elems) and 1 not in (len(a.elems), len(b.elems)):
            return None
        if not (a.scalar and b.scalar) and (a.scalar or b.scalar):
            return None  # a rank change by broadcasting: left to numpy
        n = max(len(a.elems), len(b.elems))
        ea = a.elems * n if len(a.elems) == 1 else a.elems
        eb = b.elems * n if len(b.elems) == 1 else b.elems
        sym = {"Add": "+", "Sub": "-", "Mul": "*"}[op]
        unit = "1" if op == "Mul" else "0"
        out = []
        for (x, dx), (y, dy) in zip(ea, eb, strict=True):
            if isinstance(dx, int) and isinstance(dy, int):
                v = {"Add": dx + dy, "Sub": dx - dy, "Mul": dx * dy}[op]
                out.append((str(v), v))
            elif y == unit:
                out.append((x, dx))
            elif x == unit and op != "Sub":
                out.append((y, dy))
            else:
                out.append((f"{_paren(x)} {sym} {_paren(y)}", None))
        return Size(tuple(out), a.scalar and b.scalar, names)

    # ------------------------------------------------------------------ writing

    def emit_size(self, node: ir.Node) -> bool:
        """Track ``node``'s output as a size (no statement), or write a reader of sizes
        (Slice, Expand, Range) with them; False when neither applies."""
        size = self._propagate(node)
        out = node.outputs[0] if node.outputs else None
        if size is not None and out is not None:
            self.sizes[out] = size
            self.bind(out, size.numpy(), None, static=True)
            return True
        expr = None
        if node.op_type == "Slice":
            expr = self._slice_by_sizes(node)
        elif node.op_type == "Expand":
            expr = self._expand_to_size(node)
        elif node.op_type == "Range":
            expr = self._range_of_sizes(node)
        elif node.op_type == "Reshape":
            expr = self._reshape_to_size(node)
        if expr is None:
            return False
        static = node.op_type == "Range" or node.inputs[0] in self.static
        target = self.local(out, [node.inputs[0]] if node.op_type != "Range" else ())
        self.src.body.append(f"{target} = {expr}{self._comment(node)}")
        self.bind(out, target, None, static)
        return True

    def _reads_sizes(self, node: ir.Node, first: int) -> bool:
        return any(v in self.sizes for v in node.inputs[first:] if v is not None)

    def _data(self, v: ir.Value) -> str | None:
        """A data input as the template would read it (plain layout), or None."""
        if v in self.env:
            return self.env[v][None] if self.native.get(v) is None else None
        c = constant_of(v, self.annotated)
        if c is not None:  # written as the templates write it (inline, or a stored constant)
            return self.constant(v, c, None, c.ndim, False)
        if is_weight(v, self.annotated) or (v.is_initializer() and v.const_value is not None):
            return self.weight(v)
        return None

    def _slice_by_sizes(self, node: ir.Node) -> str | None:
        ins = list(node.inputs) + [None] * (5 - len(node.inputs))
        if not self._reads_sizes(node, 1):
            return None
        x = ins[0]
        data = self._data(x) if x is not None else None
        if data is None or x.shape is None:
            return None
        starts, ends = self._size_or_const(ins[1]), self._size_or_const(ins[2])
        axes = self._size_or_const(ins[3]) if ins[3] is not None else None
        steps = self._size_or_const(ins[4]) if ins[4] is not None else None
        if starts is None or ends is None or (ins[3] is not None and axes is None):
            return None
        if ins[4] is not None and steps is None:
            return None
        n, rank = len(starts.elems), len(x.shape)
        if len(ends.elems) != n:
            return None
        try:
            ax = [int(e) for e, _ in axes.elems] if axes else list(range(n))
            st = [int(e) for e, _ in steps.elems] if steps else [1] * n
        except ValueError:
            return None  # axes or steps computed at run time
        if len(ax) != n or len(st) != n or any(s <= 0 for s in st):
            return None
        idx = [":"] * rank
        for (lo, _), (hi, _), a, s in zip(starts.elems, ends.elems, ax, st, strict=True):
            a = a + rank if a < 0 else a
            if not 0 <= a < rank:
                return None
            lo = "" if lo == "0" else lo
            hi = "" if hi.lstrip("-").isdigit() and abs(int(hi)) >= INT64_MAX // 2 else hi
            if lo.lstrip("-").isdigit() and abs(int(lo)) >= INT64_MAX // 2:
                return None
            idx[a] = f"{lo}:{hi}" + (f":{s}" if s != 1 else "")
        while idx and idx[-1] == ":":
            idx.pop()
        return f"{data.removesuffix('[...]')}[{', '.join(idx) or '...'}]"

    def _expand_to_size(self, node: ir.Node) -> str | None:
        if len(node.inputs) != 2 or node.inputs[1] not in self.sizes:
            return None
        x, out = node.inputs[0], node.outputs[0]
        target = self.sizes[node.inputs[1]]
        if x is None or x.shape is None or out.shape is None:
            return None
        data = self._data(x)
        if data is None or len(out.shape) != max(len(x.shape), len(target.elems)):
            return None
        rank = len(out.shape)
        ins = [None] * (rank - len(x.shape)) + [_dim(d) for d in x.shape]
        tgt = [None] * (rank - len(target.elems)) + list(target.elems)
        dims = []
        for i, d in enumerate(out.shape):
            d = _dim(d)
            if isinstance(d, int):
                dims.append(str(d))
            elif d is not None and tgt[i] is not None and tgt[i][1] == d:
                dims.append(tgt[i][0])
            elif d is not None and ins[i] == d:
                dims.append(f"{data}.shape[{i - (rank - len(x.shape))}]")
            else:
                return None
        xp = "np" if x in self.static else "jnp"
        return f"{xp}.broadcast_to({data}, ({', '.join(dims)}{',' if rank == 1 else ''}))"

    def _reshape_to_size(self, node: ir.Node) -> str | None:
        """A reshape to a size-built shape: its elements as they are, a constant 0 (ONNX's
        "this input dim", unless ``allowzero``) as that dim, -1 kept."""
        if len(node.inputs) != 2 or node.inputs[1] not in self.sizes:
            return None
        target, x = self.sizes[node.inputs[1]], node.inputs[0]
        allowzero = node.attributes.get_int("allowzero", 0)  # 1: a 0 is a size of 0
        if target.scalar or x is None:
            return None
        data = self._data(x)
        if data is None or x.shape is None:
            return None
        dims = []
        for i, (e, _) in enumerate(target.elems):
            if e == "0" and not allowzero:
                if i >= len(x.shape):
                    return None
                d = x.shape[i]
                e = str(d) if isinstance(d, int) else f"{data}.shape[{i}]"
            dims.append(e)
        xp = "np" if x in self.static else "jnp"
        return f"{xp}.reshape({data}, ({', '.join(dims)}{',' if len(dims) == 1 else ''}))"

    def _range_of_sizes(self, node: ir.Node) -> str | None:
        if not self._reads_sizes(node, 0):
            return None
        parts = [self._size_or_const(v) for v in node.inputs]
        if len(parts) != 3 or any(p is None or not p.scalar for p in parts):
            return None
        (start, _), (limit, _), (delta, _) = (p.elems[0] for p in parts)
        dtype = {ir.DataType.INT64: "np.int64", ir.DataType.INT32: "np.int32"}.get(
            node.outputs[0].dtype
        )
        if dtype is None:
            return None
        args = [limit] if (start, delta) == ("0", "1") else [start, limit, delta]
        if len(args) == 3 and delta == "1":
            args = args[:2]
        return f"np.arange({', '.join(args)}, dtype={dtype})"

    def size_pins(self, name: str) -> bool:
        """Whether a size with readers left reads the local ``name`` (it must not be
        rebound yet)."""
        for v, s in self.sizes.items():
            if name in s.names and not all(u.node in self.done for u in v.uses()):
                return True
        return False
