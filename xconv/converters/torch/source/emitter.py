"""IR -> readable PyTorch source: ``to_torch_source(model) -> (source, state_dict)``.

Node groups whose anchor carries ``xconv.layer`` become native ``torch.nn`` layers
(``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.Linear``, ...); every other node is one torch
statement (``templates``) with its source scope in a trailing comment.

State-dict naming rule: a native layer lives at its source scope and a raw weight at its
initializer name, both split on ``.`` / ``/`` into a module path (``layer1.0.conv1`` becomes
``self.layer1[0].conv1``, intermediate levels are ``Scope`` containers). So an IR imported
from torch reproduces the original state_dict keys. A path part that is not an identifier or
a non-negative integer, that shadows an ``nn.Module`` member, or that collides with another
entry, makes the whole name fall back to one flat sanitised attribute. Kernels in other
layouts (Flax/Keras ``IO``, ``HWIO``) are transposed to torch's ``OI`` / ``OIHW``. Constants
too large to inline are persistent buffers ``const_*`` on the top-level module.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import re
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import (
    LayerBody,
    Namespace,
    parse_attrs,
    scalar_literal,
    type_subgraph,
    with_subgraph_nodes,
)
from xconv.converters.expressions import SUB_BYTE
from xconv.converters.module_tree import LINE_LENGTH, inline_chains, wrap_lines
from xconv.converters.torch.source import tree as source_tree
from xconv.converters.torch.source.fuse import fuse_activations
from xconv.converters.torch.source.plan import TORCH_NAMES, plan_layers
from xconv.converters.torch.source.templates import (
    FLOAT4_AS_IS,
    FLOAT4_VALUES,
    WIDE_UNSIGNED,
    OpCall,
    dtype_expr,
    registry,
    tensor_literal,
    widened,
)
from xconv.errors import ConversionError
from xconv.ir.metadata import LAYOUT, MODULE, ROLE, get_scope
from xconv.ir.naming import split_path
from xconv.ir.passes import DeadNodeRemovalPass, canonicalize
from xconv.ir.passes._utils import constant_of, is_annotated
from xconv.ir.passes.attention import fold_causal_masks, fold_repeated_kv
from xconv.ir.passes.layout import sink_transposes
from xconv.ir.scoped_sizes import localize_sizes

#: float4e2m1 in numpy (ml_dtypes), as the IR holds its constants.
_FLOAT4 = np.dtype(ir.DataType.FLOAT4E2M1.numpy())

#: The names ``tree.rename_locals`` gives ``forward``'s locals (by role).
_ROLE_NAME = re.compile(r"(h|x|attn|q|k|v|scores|mask)\d*")

#: Constants up to this many elements are written inline; larger ones are buffers.
INLINE_LIMIT = 64

_RESERVED = frozenset(
    {"torch", "nn", "F", "np", "math", "Path", "self", "Model", "Scope", "load"}
    | set(dir(builtins))
    | set(keyword.kwlist)
)


def _module_members() -> frozenset[str]:
    import torch

    return frozenset(n for n in dir(torch.nn.Module) if not n.startswith("_"))


def _pack_qkv(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Flax's ``(E, H, D)`` q/k/v and ``(H, D, E)`` out kernels -> torch's packed weights."""
    e = w["q_kernel"].shape[0]
    packed = {
        "in_proj_kernel": np.concatenate(
            [w[f"{r}_kernel"].reshape(e, -1).T for r in ("q", "k", "v")], axis=0
        ),
        "out_proj_kernel": np.ascontiguousarray(w["out_proj_kernel"].reshape(-1, e).T),
    }
    if "q_bias" in w:
        packed["in_proj_bias"] = np.concatenate([w[f"{r}_bias"].reshape(-1) for r in "qkv"])
        packed["out_proj_bias"] = w["out_proj_bias"]
    return packed


def _kernel_to_torch(arr: np.ndarray, layout: str | None, target: str) -> np.ndarray:
    """Transpose a kernel from its recorded layout (``HWIO``, ``IO``) to ``target``."""
    if not layout or layout == target or sorted(layout) != sorted(target):
        return arr
    return np.ascontiguousarray(np.transpose(arr, [layout.index(ch) for ch in target]))


class _Emitter:
    def __init__(self, model: ir.Model) -> None:
        self.graph = model.graph
        self.opsets = model.opset_imports
        self.annotated = is_annotated(self.graph)
        self.plans = plan_layers(self.graph, self.annotated)
        self.ns = Namespace(_RESERVED)
        self.members = _module_members() | {"Scope"}
        self.top = Namespace(_RESERVED | self.members)  # flat top-level attribute names
        self.tree: dict[tuple[str, ...], str] = {}  # module path -> "scope" | "leaf"
        self.init: list[str] = []
        self.init_paths: list[tuple[str, ...]] = []  # module path each init line assigns
        self.body: list[str] = []
        self.body_meta: list[tuple[tuple[str, ...], list[str], list[str]]] = []
        self.state: dict[str, np.ndarray] = {}
        self.env: dict[ir.Value, str] = {}
        self.raw: dict[ir.Value, str] = {}
        self.uses_scope = False
        self.uses_f = False
        self.helpers: set[str] = set()  # generated helper classes (BatchNorm2d, ...)
        self.functions: set[str] = set()  # generated helper functions (registry.helpers)
        self.nested = 0  # depth of the nested function (If branch, loop body) being written
        self.modules = source_tree.node_classes(self.graph)
        self.modules.update(source_tree.user_classes(model.metadata_props.get("xconv.modules")))

    # ------------------------------------------------------------ checks

    def check_supported(self) -> None:
        nodes = with_subgraph_nodes(n for n in self.graph if n not in self.plans)
        registry.check_nodes(nodes, self.opsets)

    # ------------------------------------------------------------ module tree

    def _path_ok(self, parts: tuple[str, ...]) -> bool:
        for i, part in enumerate(parts):
            if not (part.isidentifier() or part.isdigit()) or keyword.iskeyword(part):
                return False
            if part in self.members or (i == 0 and (part in _RESERVED or part.isdigit())):
                return False
            if part.startswith("_"):
                return False
        for i in range(1, len(parts)):
            if self.tree.get(parts[:i], "scope") != "scope":
                return False
        return parts not in self.tree

    @staticmethod
    def _access(parts: tuple[str, ...]) -> str:
        out = "self"
        for p in parts:
            out += f"[{p}]" if p.isdigit() else f".{p}"
        return out

    def place(self, name: str) -> tuple[str, str, tuple[str, ...]]:
        """Claim a module path for ``name``; returns (owner expr, attribute, full path)."""
        parts = split_path(name)
        if not self._path_ok(parts) or (len(parts) == 1 and not self.top.take(parts[0])):
            parts = (self.top.new(name),)
        for i in range(1, len(parts)):
            pre = parts[:i]
            if pre not in self.tree:
                self.tree[pre] = "scope"
                self.uses_scope = True
                self._init(self._assign(pre, "Scope()"), pre)
                if i == 1:
                    self.top.take(pre[0])
        self.tree[parts] = "leaf"
        return self._access(parts[:-1]), parts[-1], parts

    def _assign(self, parts: tuple[str, ...], expr: str) -> str:
        owner, attr = self._access(parts[:-1]), parts[-1]
        if attr.isdigit():
            return f'{owner}.add_module("{attr}", {expr})'
        return f"{owner}.{attr} = {expr}"

    def _init(self, line: str, path: tuple[str, ...]) -> None:
        self.init.append(line)
        self.init_paths.append(path)

    def _stmt(self, line: str, owner: tuple[str, ...], defs: list[str], uses: list[str]) -> None:
        self.body.append(line)
        self.body_meta.append((owner, defs, uses))

    # ------------------------------------------------------------ values

    def weight(self, value: ir.Value) -> str:
        if value in self.raw:
            return self.raw[value]
        arr = byte_type(value.const_value.numpy())
        owner, attr, parts = self.place(value.name)
        dt = dtype_expr(ir.DataType.from_numpy(arr.dtype))
        empty = f"torch.empty({_shape(arr.shape)}, dtype={dt})"
        role = value.metadata_props.get(ROLE)
        buffer = role in ("mean", "var", "num_batches") or not np.issubdtype(arr.dtype, np.floating)
        if buffer:
            self._init(f'{owner}.register_buffer("{attr}", {empty})', parts)
        elif attr.isdigit():
            self._init(f'{owner}.register_parameter("{attr}", nn.Parameter({empty}))', parts)
        else:
            self._init(f"{owner}.{attr} = nn.Parameter({empty})", parts)
        self.state[".".join(parts)] = arr
        self.raw[value] = self._access(parts)
        return self.raw[value]

    def constant(self, value: ir.Value, arr: np.ndarray, bare: bool) -> str:
        arr = byte_type(arr)
        float4 = arr.dtype == _FLOAT4
        if arr.size <= INLINE_LIMIT and float4:
            # torch builds no float4 tensor from numbers: float32 ones (exact) rounded to it
            self.functions.add("to_float4")
            return f"_to_float4({tensor_literal(arr.astype(np.float32))})"
        if arr.size <= INLINE_LIMIT:
            return tensor_literal(arr, bare_scalar=bare)
        expr = None if float4 else structured_constant(arr)
        if expr is not None:
            return expr
        if value not in self.raw:
            attr = self.top.new(f"const_{value.name or 'value'}")
            dt = dtype_expr(ir.DataType.from_numpy(arr.dtype))
            self._init(
                f'self.register_buffer("{attr}", torch.empty({_shape(arr.shape)}, dtype={dt}))',
                (attr,),
            )
            self.state[attr] = arr
            self.tree[(attr,)] = "leaf"
            self.raw[value] = f"self.{attr}"
        return self.raw[value]

    # ------------------------------------------------------------ emission

    def emit(self) -> tuple[list[str], list[str]]:
        inputs = []
        for v in self.graph.inputs:
            if v.is_initializer():
                continue
            name = self.ns.new(v.name)
            inputs.append(name)
            self.env[v] = name
        for node in self.graph:
            plan = self.plans.get(node)
            if plan is not None:
                if node is plan.last:
                    self.emit_layer(plan)
                continue
            if node.op_type == "Constant":
                continue
            self.emit_node(node)
        outputs = []
        for v in self.graph.outputs:
            c = constant_of(v, self.annotated)
            if c is not None:
                outputs.append(self.constant(v, c, False))
            elif v.is_initializer():
                outputs.append(self.weight(v))
            else:
                outputs.append(self.env[v])
        return inputs, outputs

    def emit_layer(self, p: LayerBody) -> None:
        c = constant_of(p.inputs[0], self.annotated)
        x = self.env[p.inputs[0]] if c is None else self.constant(p.inputs[0], c, False)
        owner, attr, parts = self.place(p.scope or p.anchor.name or p.kind)
        w = {r: v.const_value.numpy() for r, v in p.weights.items()}
        dt = ""
        main = p.weights.get("kernel") or p.weights.get("scale") or p.weights.get("embedding")
        if main is not None and main.dtype not in (ir.DataType.FLOAT, None):
            dt = f", dtype={dtype_expr(main.dtype)}"
        access = self._access(parts)
        layer, w, call = _LAYER_WRITERS[p.kind](self, p, p.hyper, w, dt, x, access)
        call = call or f"{access}({x})"
        self._init(self._assign(parts, layer), parts)
        prefix = ".".join(parts)
        for role, arr in w.items():
            self.state[f"{prefix}.{TORCH_NAMES[p.kind][role]}"] = arr
        out = self.ns.new(p.outputs[0].name)
        self._stmt(f"{out} = {call}", parts[:-1], [out], [x] if c is None else [])
        self.env[p.outputs[0]] = out

    def subgraph_function(self, node: ir.Node, key: str, graph: ir.Graph) -> str:
        """Write ``graph`` (an If branch, a Loop or Scan body) as a function nested in
        ``forward``: its parameters are the graph's inputs, its body the graph's statements
        (reading the enclosing values by closure), and it returns the tuple of its outputs.
        Returns the function's name."""
        type_subgraph(graph, self.opsets)
        name = self.ns.new(key if key != "body" else f"{node.op_type.lower()}_body")
        body, meta, env = self.body, self.body_meta, dict(self.env)
        self.body, self.body_meta = [], []
        self.nested += 1
        try:
            params = [self.local_name(v.name or "x") for v in graph.inputs]
            self.env.update(zip(graph.inputs, params, strict=True))
            for inner in graph:
                if inner.op_type != "Constant":
                    self.emit_node(inner)
            outs = []
            for v in graph.outputs:
                c = constant_of(v, self.annotated)
                if c is not None:
                    outs.append(self.constant(v, c, False))
                elif v.is_initializer() and v.const_value is not None:
                    outs.append(self.weight(v))
                else:
                    outs.append(self.env[v])
            lines, inner_meta = self.body, self.body_meta
        finally:
            self.nested -= 1
            self.body, self.body_meta = body, meta
        # names bound inside the function are its locals: unknown after it
        self.env = env
        local = set(params) | {d for _, defs, _ in inner_meta for d in defs}
        owner = split_path(get_scope(node)) if get_scope(node) else ()
        outer = [u for _, _, uses in inner_meta for u in uses if u not in local]
        self._stmt(f"def {name}({', '.join(params)}):", owner, [name], outer)
        for line in lines:
            self._stmt(f"    {line}", owner, [], [])
        ret = f"({outs[0]},)" if len(outs) == 1 else ", ".join(outs)
        self._stmt(f"    return {ret}", owner, [], [])
        return name

    def local_name(self, hint: str | None) -> str:
        """A new local. Inside a nested function, never a name the role renaming of
        ``forward`` hands out (``h``, ``x2``, ``attn``): that renaming leaves a nested
        function's locals as they are, and one of them must not shadow an enclosing value.
        A name from an inlined ONNX function (``LinearAttention_<graph>_function_q_t``) keeps
        the function's own part (``q_t``): the prefix is the same on every local."""
        if self.nested and hint and "_function_" in hint:
            hint = hint.rsplit("_function_", 1)[1] or hint
        name = self.ns.new(hint)
        while self.nested and _ROLE_NAME.fullmatch(name):
            name = self.ns.new(f"{name}_")
        return name

    def emit_node(self, node: ir.Node) -> None:
        tpl = registry.find(node, self.opsets)
        attrs = parse_attrs(node, tpl.attrs, "PyTorch source")
        for key, graph in [(k, g) for k, g in attrs.items() if isinstance(g, ir.Graph)]:
            attrs[key] = self.subgraph_function(node, key, graph)  # its nested def's name
        args: list[str | None] = []
        consts: list[np.ndarray | None] = [
            None if v is None or not v.name else constant_of(v, self.annotated) for v in node.inputs
        ]
        # float4e2m1 codes moved as uint8 (templates.FLOAT4_VALUES): torch has no kernels for
        # the type beyond views and copies
        codes = node.op_type not in FLOAT4_VALUES | FLOAT4_AS_IS and any(
            v is not None and v.dtype == ir.DataType.FLOAT4E2M1
            for v in (*node.inputs, *node.outputs)
        )
        if codes and len(node.outputs) > 1:
            raise ConversionError(
                "the PyTorch source emitter moves float4e2m1 through single-output ops only",
                op=node.op_type,
                node=node.name,
            )
        same = _identity_input(node, consts)
        if same is not None and same in self.env:
            self.env[node.outputs[0]] = self.env[same]  # ``x / 1.0``, ``x + 0``: no statement
            return
        for v, c in zip(node.inputs, consts, strict=True):
            if v is None or not v.name:
                args.append(None)
            elif c is not None:
                args.append(self.constant(v, c, tpl.bare))
            elif v.is_initializer() and v.const_value is not None:
                args.append(self.weight(v))
            else:
                args.append(self.env[v])
            if codes and args[-1] is not None and v.dtype == ir.DataType.FLOAT4E2M1:
                args[-1] = f"{args[-1]}.view(torch.uint8)"
        if codes:
            consts = [_float4_codes(c) for c in consts]
            attrs = {k: _float4_codes(a) for k, a in attrs.items()}
        shapes = [
            None
            if v is None or v.shape is None
            else tuple(d if isinstance(d, int) else None for d in v.shape)
            for v in node.inputs
        ]
        wide = widened(node)
        if wide:  # uint16/32/64 operands computed in int64 (see templates.WIDENED_OPS)
            args = [a if a is None or re.fullmatch(r"-?\d+", a) else f"{a}.to(torch.int64)"
                    for a in args]  # fmt: skip
        call = OpCall(node, args, consts, shapes, attrs, float4_codes=codes)
        expr = tpl.fn(call)
        self.functions |= call.helpers
        if wide and node.outputs[0].dtype in WIDE_UNSIGNED:
            expr = f"({expr}).to({dtype_expr(node.outputs[0].dtype)})"
        if codes and node.outputs[0].dtype == ir.DataType.FLOAT4E2M1:
            expr = f"{_primary(expr)}.view({dtype_expr(ir.DataType.FLOAT4E2M1)})"
        outs = []
        for o in node.outputs:
            if o.name and (o.uses() or o.is_graph_output()):
                outs.append(self.local_name(o.name))
            else:
                outs.append("_")
        scope = get_scope(node)
        # (no comment inside a nested function: the role renaming reads a line up to one)
        comment = f"  # {scope}" if scope and not self.nested else ""
        used = [
            self.env[v]
            for v, c in zip(node.inputs, consts, strict=True)
            if v is not None and v.name and c is None and v in self.env
        ]
        owner = split_path(scope) if scope else ()
        self._stmt(
            f"{', '.join(outs)} = {expr}{comment}", owner, [o for o in outs if o != "_"], used
        )
        for o, name in zip(node.outputs, outs, strict=True):
            if name != "_":
                self.env[o] = name


#: ``op: (neutral constant, positions it may take)``: the op returns its other operand.
_NEUTRAL = {
    "Add": (0.0, (0, 1)),
    "Sub": (0.0, (1,)),
    "Mul": (1.0, (0, 1)),
    "Div": (1.0, (1,)),
    "Max": (-np.inf, (0, 1)),
    "Min": (np.inf, (0, 1)),
}


def _identity_input(node: ir.Node, consts: list[np.ndarray | None]) -> ir.Value | None:
    """The input a node passes through unchanged (a traced ``x / 1.0``, ``x + zeros``, an
    all-true ``Where``), when it has the node's shape and dtype; else None."""
    if len(node.outputs) != 1 or node.outputs[0].is_graph_output():
        return None
    out = node.outputs[0]
    if node.op_type == "Where" and len(node.inputs) == 3:
        cond, keep = consts[0], node.inputs[1]
        ok = cond is not None and cond.dtype == np.bool_ and bool(np.all(cond))
        candidates = [(keep, ok and consts[1] is None)]
    elif node.op_type in _NEUTRAL and len(node.inputs) == 2:
        value, positions = _NEUTRAL[node.op_type]
        candidates = []
        for pos in positions:
            c, other = consts[pos], node.inputs[1 - pos]
            ok = c is not None and c.dtype.kind == "f" and bool(np.all(c == value))
            candidates.append((other, ok and consts[1 - pos] is None))
    else:
        return None
    for v, ok in candidates:
        if (
            ok
            and v is not None
            and v.shape is not None
            and out.shape is not None
            and [str(d) for d in v.shape] == [str(d) for d in out.shape]
            and all(isinstance(d, int) or d.value is not None for d in v.shape)
            and v.dtype == out.dtype
        ):
            return v
    return None


def _float4_codes(a: Any) -> Any:
    """A float4e2m1 array as its codes (uint8, one a byte); anything else as it is."""
    return a.view(np.uint8) if isinstance(a, np.ndarray) and a.dtype == _FLOAT4 else a


def _primary(expr: str) -> str:
    """``expr`` as an operand of ``.``: parenthesised unless a name, call, attribute or
    subscript."""
    try:
        body = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return f"({expr})"
    return (
        expr
        if isinstance(body, ast.Name | ast.Call | ast.Attribute | ast.Subscript)
        else f"({expr})"
    )


def _broadcast_base(arr: np.ndarray) -> np.ndarray:
    """The smallest array that ``arr`` is a broadcast of (size-1 where all slices agree)."""
    base = arr
    for axis in range(arr.ndim):
        first = np.take(base, [0], axis=axis)
        if base.shape[axis] > 1 and np.array_equal(np.broadcast_to(first, base.shape), base):
            base = first
    return base


def byte_type(arr: np.ndarray) -> np.ndarray:
    """A sub-byte integer array (int4, uint4, int2, uint2: torch names those types but neither
    copies nor computes with them) as int8 / uint8 of the same values; others as they are."""
    signed = _SUB_BYTE_SIGNED.get(arr.dtype)
    if signed is None:
        return arr
    return arr.astype(np.int8 if signed else np.uint8)


#: The sub-byte numpy (ml_dtypes) types and whether each is signed.
_SUB_BYTE_SIGNED = {
    np.dtype(t.numpy()): t in (ir.DataType.INT4, ir.DataType.INT2) for t in SUB_BYTE
}


def structured_constant(arr: np.ndarray) -> str | None:
    """A short torch expression for a large constant that has one: a splat (``torch.full``),
    a broadcast of a small tensor, or of a ``tril``/``triu`` mask (``.expand``). Such
    constants come from tracing (a causal mask built with ``jnp.tril``, an ``-inf`` fill):
    writing them as code keeps them out of the state_dict."""
    dt = dtype_expr(ir.DataType.from_numpy(arr.dtype))
    shape = _shape(arr.shape)
    flat = arr.reshape(-1)
    if np.all(flat == flat[0]) or (arr.dtype.kind == "f" and np.all(np.isnan(flat))):
        return f"torch.full({shape}, {scalar_literal(flat[0])}, dtype={dt})"
    base = _broadcast_base(arr)
    expand = "" if base.shape == arr.shape else f".expand({shape})"
    if base.size <= INLINE_LIMIT:
        return tensor_literal(base) + expand
    core = base.reshape([d for d in base.shape if d != 1] or [1])
    if core.ndim != 2 or not np.all((core == 0) | (core == 1)):
        return None
    n, m = core.shape
    ones = np.ones((n, m), dtype=arr.dtype)
    row, col = core[0].astype(bool), core[:, 0].astype(bool)
    # tril(k) / triu(k) are fixed by the first row and column: try just those diagonals.
    ks = {int(row.sum()) - 1, -int(np.argmax(col)), int(np.argmax(row)), 1 - int(col.sum())}
    for k in sorted(ks):
        for fn in ("tril", "triu"):
            if np.array_equal(getattr(np, fn)(ones, k), core):
                diag = f"diagonal={k}" if k else ""
                mask = f"torch.ones(({n}, {m}), dtype={dt}).{fn}({diag})"
                return mask + (f".reshape({_shape(base.shape)})" if base.ndim != 2 else "") + expand
    return None


#: torch's default epsilon of its norm layers, as ``scalar_literal`` writes it.
_EPS = "1e-05"


def _non_default(*args: tuple[str, str, str]) -> list[str]:
    """``name=value`` for the ``(name, value, default)`` whose value is not torch's default."""
    return [f"{name}={value}" for name, value, default in args if value != default]


def _dense_layout(p: LayerBody) -> str:
    if p.anchor.op_type == "Gemm":
        tb = p.anchor.attributes.get("transB")
        return "OI" if tb is not None and tb.value else "IO"
    return "IO"


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _tup(values: Any) -> str:
    items = [int(v) for v in (values if isinstance(values, list | tuple) else [values])]
    if len(set(items)) == 1 and len(items) > 1:
        return str(items[0])
    return _shape(tuple(items)) if len(items) > 1 else str(items[0])


def _indent(lines: list[str], n: int) -> list[str]:
    return [(" " * n + line) if line else "" for line in lines]


_SCOPE_CLASS = '''class Scope(nn.Module):
    """One level of the source model's module path; ``scope[0]`` reads child ``"0"``."""

    def __getitem__(self, key):
        return getattr(self, str(key))'''

_BIASED_BATCH_NORM = '''class BiasedVarBatchNorm{n}d(nn.BatchNorm{n}d):
    """``nn.BatchNorm{n}d`` that updates ``running_var`` with the biased batch variance.

    torch uses the unbiased one (``n / (n - 1)`` larger); the source model (Flax, Keras or
    ONNX) uses the biased one. Normalisation and the state_dict are those of the base class.
    """

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        with torch.no_grad():
            var, mean = torch.var_mean(x, dim=dims, unbiased=False)
            self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
            self.running_var.lerp_(var.to(self.running_var.dtype), self.momentum)
            self.num_batches_tracked += 1
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)'''

_LOAD = '''def load(out_dir=None):
    """Return the model in eval mode with its weights loaded from ``out_dir``."""
    path = Path(out_dir or Path(__file__).parent)
    model = Model()
    try:
        from safetensors.torch import load_file
    except ImportError:
        state = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
    else:
        state = load_file(str(path / "weights.safetensors"))
    model.load_state_dict(state)
    return model.eval()'''


def render(em: _Emitter, inputs: list[str], outputs: list[str], name: str) -> str:
    tree = source_tree.Tree(
        list(zip(em.init, em.init_paths, strict=True)),
        [source_tree.Stmt(t, *m) for t, m in zip(em.body, em.body_meta, strict=True)],
        list(outputs),
    )
    source_tree.build(tree, em.modules)
    em.init = [line for line, _ in tree.init]
    ret = outputs[0] if len(outputs) == 1 else ", ".join(outputs)
    params = [p if not re.fullmatch(r"input(_\d+)?", p) else "" for p in inputs]
    lines = [s.text for s in tree.body] + [f"return {ret}"]
    blocks = {source_tree.access(p) for p in tree.kinds}
    lines, params = source_tree.rename_locals(lines, inputs, params, blocks)
    kinds = {source_tree.access(p)[len("self.") :]: k for p, k in tree.kinds.items()}
    body = inline_chains([*source_tree.loop_chains(lines[:-1], kinds), lines[-1]], LINE_LENGTH - 8)
    em.body = body[:-1]
    ret = body[-1][len("return ") :]
    inputs = params
    cls = [
        "class Model(nn.Module):",
        '    """The converted model; see ``load``."""',
        "",
        "    def __init__(self):",
        "        super().__init__()",
        *_indent(em.init, 8),
        "",
        f"    def forward(self, {', '.join(inputs)}):",
        *_indent([*em.body, f"return {ret}"], 8),
    ]
    em.uses_scope = any(
        "Scope()" in line or "(Scope):" in line for line in [*em.init, *tree.classes]
    )
    helpers = [registry.helpers[name].strip() for name in sorted(em.functions)]
    helpers += [_BIASED_BATCH_NORM.replace("{n}", name[-2]) for name in sorted(em.helpers)]
    # as ruff formats them: a call that passes the line length, its arguments on their own lines
    classes = [wrap_lines(text, full=True) for text in [*tree.classes, "\n".join(cls)]]
    parts = ([_SCOPE_CLASS] if em.uses_scope else []) + helpers + classes + [_LOAD]
    text = "\n\n\n".join(parts)
    uses = {name: bool(re.search(rf"(?<![\w.]){name}\.", text)) for name in ("math", "np", "F")}
    uses["re"] = bool(re.search(r"(?<![\w.])re\.compile\(", text))
    imports = ["import math"] * uses["math"] + ["import re"] * uses["re"]
    imports += ["from pathlib import Path", ""]
    imports += ["import numpy as np"] * uses["np"] + ["import torch"]
    imports += ["import torch.nn.functional as F"] * uses["F"] + ["from torch import nn"]
    doc = f'"""PyTorch model generated by xconv from {name!r}. Regenerate, do not edit."""'
    if len(doc) > LINE_LENGTH:  # a long model name: on a line of its own
        doc = (
            f'"""PyTorch model generated by xconv. Regenerate, do not edit.\n\nFrom {name!r}.\n"""'
        )
    return doc + "\n\n" + "\n".join(imports) + "\n\n\n" + text + "\n"


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def generate(model: ir.Model) -> tuple[str, dict[str, np.ndarray]]:
    """Return ``(model.py source, state_dict as numpy arrays)`` without writing anything."""
    model = _copy(model)
    # A causal mask built from the input's sizes is the attention's is_causal (the source's).
    fold_causal_masks(model)
    # Each layer computes the symbolic sizes it reads (a standard layer's body reads only its
    # own inputs: nn.MultiheadAttention), on this copy: see xconv.ir.scoped_sizes.
    localize_sizes(model.graph)
    model = canonicalize(model)
    fold_repeated_kv(model)  # keys and values repeated per query head: the grouped ones
    if model.metadata_props.get("xconv.source") != "torch":
        # A channels-last source: compute channels-first between layers (see layout.py).
        sink_transposes(model)
        # A traced softmax / tanh GELU as the one call a person writes (``fuse``);
        # the constants the fused chains read are dropped with them.
        if fuse_activations(model):
            DeadNodeRemovalPass()(model)
    em = _Emitter(model)
    em.check_supported()
    inputs, outputs = em.emit()
    if not outputs:
        raise ConversionError("the model has no outputs")
    return render(em, inputs, outputs, model.graph.name or "model"), em.state


def to_torch_source(model: ir.Model) -> tuple[str, dict[str, Any]]:
    """Readable ``nn.Module`` source for ``model`` and the state_dict that fills it.

    Args:
        model: The IR model (not modified; canonicalised on a copy).

    Returns:
        ``(source, state_dict)``: ``source`` defines ``class Model(nn.Module)`` and
        ``load(out_dir)``; ``Model().load_state_dict(state_dict)`` loads it (tensors).

    Raises:
        UnsupportedOpError: ops without a template, all listed at once.
    """
    source, arrays = generate(model)
    state = {k: state_tensor(np.array(v)) for k, v in arrays.items()}
    return source, state


def state_tensor(arr: np.ndarray) -> Any:
    """A state_dict entry: numpy as torch; an ml_dtypes array torch has a type for (float8,
    float8e8m0, float4e2m1: one code a byte, as the torch runtime holds it) by its bits."""
    import torch

    try:
        return torch.from_numpy(arr)
    except TypeError:
        dtype = getattr(torch, dtype_expr(ir.DataType.from_numpy(arr.dtype)).split(".")[1])
        bits = arr.view(np.uint8 if arr.itemsize == 1 else np.int16)
        return torch.from_numpy(bits).view(dtype)


# ------------------------------------------------------------------ layers by kind
# Each writer: (emitter, layer body, hyper-parameters, weights by role, dtype argument, input
# expression, attribute access) -> (the nn.Module expression, the weights in torch's layout, the
# call when it is not ``access(x)``). Keyed by the layer kinds of ``xconv/ir/layers.py``.


def _dense(em, p, h, w, dt, x, access):
    lay = p.weights["kernel"].metadata_props.get(LAYOUT) or _dense_layout(p)
    w["kernel"] = _kernel_to_torch(w["kernel"], lay, "OI")
    bias = "" if h["use_bias"] else ", bias=False"
    return f"nn.Linear({h['in_features']}, {h['out_features']}{bias}{dt})", w, None


def _conv(em, p, h, w, dt, x, access):
    kind, n = p.kind, h["ndim"]
    target = ("OI" if kind == "conv" else "IO") + "DHW"[-n:]
    w["kernel"] = _kernel_to_torch(
        w["kernel"], p.weights["kernel"].metadata_props.get(LAYOUT), target
    )
    cls = f"nn.Conv{n}d" if kind == "conv" else f"nn.ConvTranspose{n}d"
    pad = tuple(min(int(lo), int(hi)) for lo, hi in h["padding"])
    extra = [(int(lo) - m, int(hi) - m) for (lo, hi), m in zip(h["padding"], pad, strict=True)]
    call = None
    if any(lo or hi for lo, hi in extra):
        em.uses_f = True  # F.pad lists the last dimension first
        flat = ", ".join(f"{lo}, {hi}" for lo, hi in reversed(extra))
        call = f"{access}(F.pad({x}, ({flat})))"
    args = [str(h["in_channels"]), str(h["out_channels"]), _tup(h["kernel_size"])]
    args += _non_default(
        ("stride", _tup(h["strides"]), "1"),
        ("padding", _tup(pad), "0"),
        ("output_padding", _tup(h.get("output_padding") or 0), "0"),
        ("dilation", _tup(h["dilations"]), "1"),
        ("groups", str(h["groups"]), "1"),
        ("bias", str(bool(h["use_bias"])), "True"),
    )
    mode = h.get("padding_mode") or "zeros"
    if mode != "zeros":
        args.append(f'padding_mode="{mode}"')
    return f"{cls}({', '.join(args)}{dt})", w, call


def _batch_norm(em, p, h, w, dt, x, access):
    nd = {2: 1, 3: 1, 4: 2, 5: 3}[len(p.inputs[0].shape)]
    mom = h["momentum"]
    cls = f"nn.BatchNorm{nd}d"
    if h["track_running_stats"] and not p.anchor.metadata_props.get(MODULE, "").startswith(
        "torch."
    ):
        # Flax, Keras and ONNX update running_var with the biased batch variance.
        cls = f"BiasedVarBatchNorm{nd}d"
        em.helpers.add(cls)
    args = [str(h["num_features"])]
    args += _non_default(
        ("eps", scalar_literal(h["epsilon"]), _EPS),
        ("momentum", "None" if mom is None else scalar_literal(mom), "0.1"),
        ("affine", str(bool(h["affine"])), "True"),
        ("track_running_stats", str(bool(h["track_running_stats"])), "True"),
    )
    if h["track_running_stats"] and "num_batches" not in w:
        w["num_batches"] = np.asarray(0, dtype=np.int64)
    return f"{cls}({', '.join(args)}{dt})", w, None


def _layer_norm(em, p, h, w, dt, x, access):
    aff = bool(h["elementwise_affine"])
    bias = "" if not aff or h["use_bias"] else ", bias=False"
    args = [_tup(h["normalized_shape"])]
    args += _non_default(
        ("eps", scalar_literal(h["epsilon"]), _EPS),
        ("elementwise_affine", str(aff), "True"),
    )
    return f"nn.LayerNorm({', '.join(args)}{bias}{dt})", w, None


def _group_norm(em, p, h, w, dt, x, access):
    args = [str(h["num_groups"]), str(h["num_channels"])]
    args += _non_default(
        ("eps", scalar_literal(h["epsilon"]), _EPS),
        ("affine", str(bool(h["affine"])), "True"),
    )
    return f"nn.GroupNorm({', '.join(args)}{dt})", w, None


def _rms_norm(em, p, h, w, dt, x, access):
    eps = "None" if h["epsilon"] is None else scalar_literal(h["epsilon"])
    args = [_tup(h["normalized_shape"])]
    args += _non_default(
        ("eps", eps, "None"),
        ("elementwise_affine", str(bool(h["elementwise_affine"])), "True"),
    )
    return f"nn.RMSNorm({', '.join(args)}{dt})", w, None


def _embedding(em, p, h, w, dt, x, access):
    pad = h.get("padding_idx")
    pad_s = "" if pad is None else f", padding_idx={pad}"
    return f"nn.Embedding({h['num_embeddings']}, {h['features']}{pad_s}{dt})", w, None


def _attention(em, p, h, w, dt, x, access):
    if "q_kernel" in w:
        w = _pack_qkv(w)
    extra = ""
    for key in ("kdim", "vdim"):
        if h.get(key) not in (None, h["embed_dim"]):
            extra += f", {key}={h[key]}"
    args = [str(h["embed_dim"]), str(h["num_heads"])]
    args += _non_default(
        ("dropout", scalar_literal(h.get("dropout") or 0.0), "0.0"),
        ("bias", str(bool(h["use_bias"])), "True"),
    )
    args += _non_default(("batch_first", str(bool(h["batch_first"])), "False"))
    layer = f"nn.MultiheadAttention({', '.join(args)}{extra}{dt})"
    return layer, w, f"{access}({x}, {x}, {x}, need_weights=False)[0]"


def _dropout(em, p, h, w, dt, x, access):
    return f"nn.Dropout({scalar_literal(h['rate'])})", w, None


_LAYER_WRITERS = {
    "dense": _dense,
    "conv": _conv,
    "conv_transpose": _conv,
    "batch_norm": _batch_norm,
    "layer_norm": _layer_norm,
    "group_norm": _group_norm,
    "rms_norm": _rms_norm,
    "embedding": _embedding,
    "attention": _attention,
    "dropout": _dropout,
}
