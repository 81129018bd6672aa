"""IR -> Flax source: a self-contained ``model.py`` (linen or nnx) and its variables.

Node groups whose anchor carries ``xconv.layer`` become native Flax layers (``nn.Conv``,
``nn.BatchNorm``, ...); every other node is one jnp / lax statement (``templates``) with its
source scope in a trailing comment. Activations stay channels-last through runs of
conv / pool / norm / elementwise ops (``layout.py``); the model keeps the source's interface.
"""

from __future__ import annotations

import builtins
import json
import keyword
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from xconv.converters.codegen import (
    Namespace,
    drop_noop_attention_masks,
    fold_reduce_reshapes,
    subgraphs,
    with_subgraph_nodes,
    write_dir_atomic,
)
from xconv.converters.flax.source import classes as flax_classes
from xconv.converters.flax.source import templates_resize as flax_ops_resize  # noqa: F401  (registers templates)
from xconv.converters.flax.source.attention import fold_head_transposes, packed_self_attention
from xconv.converters.flax.source.layers import layer_ctor
from xconv.converters.flax.source.nodes import _Nodes
from xconv.converters.flax.source.planning import LayerPlan, _Planning
from xconv.converters.flax.source.render import (
    _class_doc,
    _class_name,
    render,
    render_class,
    variables_tree,
)
from xconv.converters.flax.source.sizes import Size, _Sizes
from xconv.converters.flax.source.templates import (
    UnsupportedTemplateError,
    dtype_expr,
    registry,
)
from xconv.converters.flax.source.values import _Values, _Var
from xconv.converters.ops import layout, precision
from xconv.errors import ConversionError
from xconv.ir.metadata import LAYOUT, MODULE, get_scope
from xconv.ir.passes import canonicalize
from xconv.ir.passes._utils import constant_of, is_annotated, is_weight
from xconv.ir.passes.attention import fold_causal_masks, fold_repeated_kv
from xconv.ir.scoped_sizes import localize_sizes
from xconv.weights.flax_msgpack import write_msgpack
from xconv.weights.flax_names import (
    DROPPED_ROLES,
    FLAX_VARIABLES,
    flax_kernel_layout,
    kernel_permutation,
    module_name,
    raw_param_name,
)

_RESERVED = frozenset(
    {
        "jnp",
        "np",
        "nn",
        "nnx",
        "jax",
        "lax",
        "math",
        "serialization",
        "Path",
        "self",
        "train",
        "rngs",
        "Model",
        "Constant",
        "load",
        "_SAVED",
    }
    | set(dir(builtins))
    | set(keyword.kwlist)
)


#: Names a submodule or variable attribute must not take: linen / nnx Module members.
_MODULE_MEMBERS = frozenset(
    {
        "apply",
        "bind",
        "clone",
        "copy",
        "eval",
        "get_variable",
        "has_rng",
        "has_variable",
        "init",
        "init_with_output",
        "is_initializing",
        "is_mutable_collection",
        "iter_children",
        "iter_modules",
        "lazy_init",
        "make_rng",
        "module_paths",
        "name",
        "param",
        "parent",
        "path",
        "perturb",
        "put_variable",
        "scope",
        "set_attributes",
        "setup",
        "sow",
        "tabulate",
        "train",
        "unbind",
        "variable",
        "variables",
        "rngs",
    }
)


def _namespace(reserved: frozenset[str] = _RESERVED) -> Namespace:
    """Unique, readable identifiers that never shadow builtins or a generated helper."""
    return Namespace(
        reserved, avoid=lambda name: name.startswith("_") and name[1:] in registry.helpers
    )


@dataclass(frozen=True)
class FlaxOptions:
    """Choices for the generated Flax source.

    Attributes:
        native_conv_transpose: Write group-1 transposed convolutions as ``nn.ConvTranspose``
            (``transpose_kernel=True``, kernel ``(*k, out, in)``) instead of a generated class
            holding torch's ``(in, out, *k)`` kernel.
        share_blocks: Rebuild the source's module tree (the default): each instance of a
            source block class (a torch ``BasicBlock``, ``BertLayer``) becomes a generated
            class, one class for identical instances, blocks nested as the source nests
            them, variables nested per block (DESIGN rule 10). False: one flat class.

    ``native_conv_transpose`` is off by default until ``xconv.weights.mapping`` predicts its
    kernel layout; the mapping reads the block tree off the emitter's own output.
    """

    native_conv_transpose: bool = False
    share_blocks: bool = True
    #: Compute dtype: ``None`` / ``"float32"`` (default) or ``"bfloat16"``: layers get
    #: ``dtype=jnp.bfloat16`` (params stay float32), other statements cast float32 params
    #: and constants where they meet bfloat16 activations, norms and softmax run in float32
    #: (:mod:`xconv.converters.ops.precision`).
    dtype: str | None = None


@dataclass
class Block:
    """One instance of a source block class: its scope, class and contiguous nodes."""

    scope: str
    module: str
    nodes: list[ir.Node]
    inputs: list[ir.Value]
    outputs: list[ir.Value]


@dataclass
class _Source:
    setup: list[tuple[str, str]] = field(default_factory=list)  # (linen line, nnx line)
    body: list[str] = field(default_factory=list)
    variables: list[_Var] = field(default_factory=list)
    helpers: set[str] = field(default_factory=set)
    # submodule path ("/"-joined) -> (source scope, source module class)
    scopes: dict[str, tuple[str, str]] = field(default_factory=dict)


def _kernel_view(array: np.ndarray, layout: str) -> np.ndarray:
    """The kernel in Flax's layout as a transposed view: the copy happens when it is written,
    one array at a time, not for the whole model at once."""
    return np.transpose(array, kernel_permutation(layout, flax_kernel_layout(layout)))


def _copy(model: ir.Model) -> ir.Model:
    # Nodes and values are new; weight tensors are shared with ``model`` (no copy).
    return model.clone()


class _Emitter(_Planning, _Values, _Nodes, _Sizes):
    def __init__(self, model: ir.Model, api: str, options: FlaxOptions | None = None) -> None:
        self.model = model
        self.api = api
        self.options = options or FlaxOptions()
        self.graph = model.graph
        self.annotated = is_annotated(self.graph)
        self.ns = _namespace()  # local variables of __call__
        self.attrs = _namespace(_RESERVED | _MODULE_MEMBERS)  # self.<attribute> names
        self.src = _Source()
        self.env: dict[ir.Value, dict[layout.Perm, str]] = {}
        self.native: dict[ir.Value, layout.Perm] = {}
        self.static: set[ir.Value] = set()
        self.sizes: dict[ir.Value, Size] = {}  # integer values known as Python expressions
        self.raw: dict[ir.Value, str] = {}
        self.plans: dict[ir.Node, LayerPlan] = {}
        self.has_constants = False
        self.weight_names: dict[ir.Value, str] = {}
        self.own_scope: str | None = None  # a generated submodule's scope (no comment needed)
        #: Name locals after their op, not the source's value names, so that identical layers
        #: generate identical classes (shared, like a torch block class used many times).
        self.canonical = False
        self.classes: dict[str, str] = {}  # generated submodule source -> class name
        self.groups: list[flax_classes.Group] = []  # block classes (shared with sub-emitters)
        self.class_ns = _namespace(_RESERVED | {"Model", "Constant"})
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        #: Instances of one source block class (a torch ``BasicBlock``): node -> its block.
        self.blocks: dict[ir.Node, Block] = {}
        self.prefix: str | None = None  # inside a generated block class: the block's scope
        self.done: set[ir.Node] = set()  # nodes already written (their reads are over)
        #: A generated class's nodes: a read outside them (the caller's) reads the caller's
        #: own local, so it never keeps a name of this class's body from being reused.
        self.body: set[ir.Node] | None = None
        self.nested = 0  # depth of the nested function (If branch, loop body) being written
        self.modules: dict[str, str] | None = None  # xconv.modules, parsed once
        #: bfloat16 compute (``options.dtype``): the values held in bfloat16.
        self.low_dtype = precision.resolve_dtype(self.options.dtype)
        self.low: set[ir.Value] = set()

    def plan_blocks(self, nodes: list[ir.Node] | None = None, outer: str | None = None) -> None:
        """Find instances of source block classes (DESIGN rule 10).

        A scope ``S`` whose own nodes carry a non-leaf source class (the ``Add`` of a torch
        ``BasicBlock`` at ``layer1.0``) and whose sub-scopes hold more nodes is a block when its
        nodes are contiguous and every layer inside lies wholly inside. Each block becomes a
        generated class (identical ones share a class); blocks inside it are planned when it
        is emitted (``outer``: its scope), so the classes nest as the source's modules do.
        """
        nodes = list(self.graph) if nodes is None else nodes
        classes: dict[str, str] = {}
        for node in nodes:
            scope, module = get_scope(node), node.metadata_props.get(MODULE)
            if scope and module and node.op_type != "Constant":
                classes.setdefault(scope, module)
        # Modules with no node of their own (a BertLayer only calls its children) are blocks
        # too; torch containers are not: their children are a list (``layer1_0``).
        for sc, module in self._modules().items():
            if (
                sc
                and sc not in classes
                and not module.startswith("torch.nn.modules.container.")
                and any(other.startswith(sc + ".") for other in list(classes))
            ):
                classes[sc] = module
        scopes = [
            sc
            for sc, module in classes.items()
            if any(other.startswith(sc + ".") for other in classes)
            and (outer is None or sc.startswith(outer + "."))
        ]
        taken: set[ir.Node] = set()
        for sc in sorted(scopes, key=lambda x: x.count(".")):  # outermost first
            if any(n in self.plans and self.plans[n].scope == sc for n in nodes):
                continue  # a recognised layer (attention): its plan writes it
            # Constants are inlined where they are used: they belong to no block.
            idx = [
                i
                for i, n in enumerate(nodes)
                if n.op_type != "Constant" and ((get_scope(n) or "") + ".").startswith(sc + ".")
            ]
            body = [n for n in nodes[idx[0] : idx[-1] + 1] if n.op_type != "Constant"]
            if any(subgraphs(n) for n in body):
                continue  # a subgraph reads values its node does not list: no block inputs
            inside = set(body)
            if any(
                n in taken or not ((get_scope(n) or "") + ".").startswith(sc + ".") for n in body
            ):
                continue
            if any(
                not {m for m in self.plans[n].body if m.op_type != "Constant"} <= inside
                for n in body
                if n in self.plans
            ):
                continue
            inputs, outputs = [], []
            for n in body:
                for v in n.inputs:
                    if v is None or not v.name or v.producer() in inside or v in inputs:
                        continue
                    if is_weight(v, self.annotated) or constant_of(v, self.annotated) is not None:
                        continue
                    inputs.append(v)
                for o in n.outputs:
                    if o.is_graph_output() or any(u.node not in inside for u in o.uses()):
                        outputs.append(o)
            if not inputs or not outputs:
                continue
            block = Block(sc, classes[sc], body, inputs, outputs)
            for n in body:
                self.blocks[n] = block
            taken |= inside

    def _modules(self) -> dict[str, str]:
        """``{scope: source module class}`` the importer recorded for the whole model."""
        if self.modules is None:
            raw = self.model.metadata_props.get("xconv.modules")
            try:
                self.modules = json.loads(raw) if raw else {}
            except ValueError:
                self.modules = {}
        return self.modules

    def emit_block(self, b: Block) -> None:
        """One instance of a source block class, as a (shared) generated class."""
        sub = _Emitter(self.model, self.api)
        sub.low_dtype, sub.low = self.low_dtype, {v for v in b.inputs if v in self.low}
        sub.plans = self.plans
        sub.prefix = sub.own_scope = b.scope
        sub.canonical = True
        sub.body = set(b.nodes)
        sub.classes, sub.class_ns, sub.groups = self.classes, self.class_ns, self.groups
        sub.options, sub.modules = self.options, self._modules()
        sub.plan_blocks(b.nodes, b.scope)
        sub.inputs = []
        for i, v in enumerate(b.inputs):
            role = "x" if i == 0 else sub.role(v)
            if v in self.static:
                role = "shape"  # a shape value (a dynamic batch's), never the residual
            elif role == "h" and len(b.inputs) == 2:
                role = "residual"
            name = sub.ns.new(role)
            sub.inputs.append(name)
            sub.bind(v, name, self.native[v], v in self.static)
        sub.emit_nodes(b.nodes)
        sub.outputs = [sub.env[v][sub.native[v]] for v in b.outputs]
        self.src.helpers |= sub.src.helpers
        self.has_constants |= sub.has_constants
        train = any(re.search(r"\btrain\b", line) for line in sub.src.body)
        doc = f"The source's {b.module} block."
        text = render_class(sub, "{cls}", doc, train=train)
        if train:  # the block takes train without a default: the caller always passes it
            text = text.replace("train: bool = False", "train: bool")
        ctor = self._block_class(text, b.module)
        attr = self.attrs.new(module_name(self._relative(b.scope)))
        self.src.setup.append((f"self.{attr} = {ctor}", f"self.{attr} = {ctor}"))
        self._adopt(attr, sub, b.scope, b.module)
        args = [self.env[v][self.native[v]] for v in b.inputs]
        if train:
            args.append("train=train")
        outs = [self.local(v, b.inputs if len(b.outputs) == 1 else (), b.scope) for v in b.outputs]
        self.src.body.append(
            f"{', '.join(outs)} = self.{attr}({', '.join(args)}){self._comment(b.nodes[-1], b.scope)}"
        )
        for v, name in zip(b.outputs, outs, strict=True):
            self.bind(v, name, sub.native[v], v in sub.static)
        self.low |= {v for v in b.outputs if v in sub.low}

    def _block_class(self, text: str, module: str) -> str:
        """The placeholder constructing this block: its class is shared by every instance
        of the source class with the same structure, feature counts becoming fields."""
        skeleton, roles, values = flax_classes.abstract(text, self.api)
        index = next((i for i, g in enumerate(self.groups) if g.skeleton == skeleton), None)
        if index is None:
            base = module.rsplit(".", 1)[-1]
            base = base if base.isidentifier() else "Block"
            same = [g for g in self.groups if g.base == base]
            name = self.class_ns.new(flax_classes.variant_name(base, skeleton, same))
            self.groups.append(flax_classes.Group(name, skeleton, roles, base=base))
            index = len(self.groups) - 1
        if values not in self.groups[index].instances:
            self.groups[index].instances.append(values)
        return flax_classes.token(index, values)

    def _adopt(self, attr: str, sub: _Emitter, scope: str | None, module: str) -> None:
        """Take a generated submodule's variables and source names under ``attr``."""
        for var in sub.src.variables:
            self.src.variables.append(
                _Var(
                    var.collection,
                    (attr, *var.path),
                    var.value,
                    var.source,
                    var.scope,
                    var.role,
                    var.kind,
                )
            )
        if scope:
            self.src.scopes[attr] = (scope, module)
        for path, origin in sub.src.scopes.items():
            self.src.scopes[f"{attr}/{path}"] = origin

    def _relative(self, name: str | None) -> str | None:
        """A scope or weight name relative to the block being generated."""
        if name and self.prefix and name.startswith(self.prefix + "."):
            return name[len(self.prefix) + 1 :]
        return name

    def check_supported(self) -> None:
        nodes = with_subgraph_nodes(n for n in self.graph if n not in self.plans)
        registry.check_nodes(nodes, self.model.opset_imports, UnsupportedTemplateError)

    # ------------------------------------------------------------ emission

    def emit(self) -> None:
        self.inputs = []
        for v in self.graph.inputs:
            if v.is_initializer():
                continue
            name = self.ns.new(v.name)
            self.inputs.append(name)
            self.bind(v, name, None)
            if self.low_dtype and v.dtype == ir.DataType.FLOAT:
                self.src.body.append(f"{name} = {name}.astype(jnp.bfloat16)")
                self.low.add(v)
        self.emit_nodes(list(self.graph))
        self.outputs = []
        for v in self.graph.outputs:
            c = constant_of(v, self.annotated)
            if c is not None:
                self.outputs.append(f"jnp.asarray({self.constant(v, c, None, None, False)})")
            elif v.is_initializer():
                self.outputs.append(self.weight(v))
            else:
                self.outputs.append(self.get(v, None))

    def emit_nodes(self, nodes: list[ir.Node]) -> None:
        for node in nodes:
            block = self.blocks.get(node)
            if block is not None:
                if node is block.nodes[0]:
                    self.done.update(block.nodes)
                    self.emit_block(block)
                continue
            plan = self.plans.get(node)
            if plan is not None:
                if node is plan.last:
                    self.done.update(plan.body)
                    if plan.native:
                        self.emit_layer(plan)
                    else:
                        self.emit_submodule(plan)
                continue
            if node.op_type == "Constant":
                continue
            self.done.add(node)
            self.emit_node(node)

    def _comment(self, node: ir.Node, scope: str | None = None) -> str:
        scope = scope or get_scope(node)
        if scope and self.prefix and scope.startswith(self.prefix + "."):
            scope = scope[len(self.prefix) + 1 :]
        tree = self.options.share_blocks
        parts = (scope or "").split(".")
        child = len(parts) == 1 or (len(parts) == 2 and parts[1].isdigit())  # layer1.0: a list
        if not scope or scope == self.own_scope or (tree and child):
            return ""  # a direct child of this class: its attribute says where it came from
        return f"  # {scope}"

    def emit_layer(self, p: LayerPlan) -> None:
        h, kind = p.hyper, p.kind
        rank = self.rank(p.input)
        if kind in ("conv", "conv_transpose", "group_norm") or (
            kind == "batch_norm" and rank is not None
        ):
            perm = layout.channels_last(rank) if rank is not None else None
        elif kind == "dropout":
            perm = self.native[p.input]
        else:
            perm = None
        x = self.get(p.input, perm)
        attr = self.attrs.new(module_name(self._relative(p.scope) or p.anchor.name or kind))
        w = {r: v.const_value.numpy() for r, v in p.weights.items() if r not in DROPPED_ROLES}
        pdt = ""
        if "kernel" in p.weights and p.weights["kernel"].dtype != ir.DataType.FLOAT:
            pdt = dtype_expr(p.weights["kernel"].dtype)
        call = f"self.{attr}({x})"
        if kind == "dense":
            lay = p.weights["kernel"].metadata_props.get(LAYOUT) or self._dense_layout(p)
            if lay == "OI" and self._tied_dense(p, x):
                return
            w["kernel"] = _kernel_view(w["kernel"], lay) if lay == "OI" else w["kernel"]
        elif kind == "conv":
            n = h["ndim"]
            lay = p.weights["kernel"].metadata_props.get(LAYOUT) or "OI" + "DHW"[-n:]
            w["kernel"] = _kernel_view(w["kernel"], lay)
        elif kind == "conv_transpose":
            n = h["ndim"]
            # torch's (in, out, *k) kernel is the kernel of the convolution this one is the
            # gradient of; Flax takes it as (*k, out, in) with transpose_kernel=True.
            w["kernel"] = np.transpose(w["kernel"], (*range(2, n + 2), 1, 0))
        elif kind == "batch_norm":
            call = f"self.{attr}({x}, use_running_average=not train)"
            if p.anchor.metadata_props.get(MODULE, "").startswith("torch."):
                self.src.helpers.add(f"torch_batch_norm_{self.api}")
                call = f"_torch_batch_norm(self.{attr}, {x}, train)"
        elif kind == "dropout":
            call = f"self.{attr}({x}, deterministic=not train)"
        if self.low_dtype and kind == "batch_norm" and self.api == "nnx":
            call = f"{call}.astype(jnp.bfloat16)"  # see flax_layers.layer_ctor
        linen, nnx_ = layer_ctor(kind, h, pdt, "jnp.bfloat16" if self.low_dtype else "")
        self.src.setup.append((f"self.{attr} = {linen}", f"self.{attr} = {nnx_}"))
        for role, arr in sorted(w.items()):
            collection, var = FLAX_VARIABLES[kind][role]
            self.src.variables.append(
                _Var(collection, (attr, var), arr, p.weights[role].name, p.scope, role, kind)
            )
        if p.scope:
            self.src.scopes[attr] = (p.scope, p.anchor.metadata_props.get(MODULE, ""))
        out = self.local(p.output, [p.input], p.scope)
        self.src.body.append(f"{out} = {call}{self._comment(p.anchor, p.scope)}")
        out_perm = perm if kind != "embedding" else None
        self.bind(p.output, out, out_perm)
        if (self.low_dtype and kind != "dropout") or p.input in self.low:
            self.low.add(p.output)  # layers compute in bfloat16; dropout keeps its input's

    def emit_submodule(self, p: LayerPlan) -> None:
        """A layer with no native Flax counterpart: its body as a generated submodule class."""
        sub = _Emitter(self.model, self.api)
        sub.low_dtype, sub.low = self.low_dtype, {v for v in p.inputs if v in self.low}
        sub.weight_names = {v: raw_param_name(r) for r, v in p.weights.items()}
        sub.own_scope = p.scope
        sub.canonical = True
        sub.body = set(p.body)
        sub.inputs = []
        for v in p.inputs:
            name = sub.ns.new("x" if len(p.inputs) == 1 else sub.role(v))
            sub.inputs.append(name)
            # A shape value stays numpy inside the class, so it folds under jit as it does here.
            sub.bind(v, name, None, v in self.static)
        for node in p.body:
            if node.op_type != "Constant":
                sub.done.add(node)
                sub.emit_node(node)
        sub.outputs = [sub.get(v, None) for v in p.outputs]
        if not sub.has_constants and packed_self_attention(p):
            # the same variables, the body one call (the source's ``self.attn(x, x, x)``)
            sub.src.body, sub.src.helpers = [], {"torch_mha"}
            low = ", dtype=jnp.bfloat16" if self.low_dtype else ""
            sub.outputs = [f"_torch_mha(self, {sub.inputs[0]}, heads={p.hyper['num_heads']}{low})"]
            if self.low_dtype:
                sub.low |= set(p.outputs)
        self.src.helpers |= sub.src.helpers
        text = render_class(sub, "{cls}", _class_doc(p))
        cls = self.classes.get(text)
        if cls is None:
            cls = self.class_ns.new(_class_name(p))
            self.classes[text] = cls
        attr = self.attrs.new(module_name(self._relative(p.scope)))
        self.src.setup.append((f"self.{attr} = {cls}()", f"self.{attr} = {cls}(rngs=rngs)"))
        self.has_constants |= sub.has_constants
        self._adopt(attr, sub, p.scope, p.anchor.metadata_props.get(MODULE, ""))
        args = ", ".join(self.get(v, None) for v in p.inputs)
        single = p.inputs if len(p.outputs) == 1 else ()
        outs = ", ".join(self.local(v, single, p.scope) for v in p.outputs)
        comment = self._comment(p.anchor, p.scope)
        self.src.body.append(f"{outs} = self.{attr}({args}){comment}")
        for v, name in zip(p.outputs, outs.split(", "), strict=True):
            self.bind(v, name, None, v in sub.static)
        self.low |= {v for v in p.outputs if v in sub.low}

    def _tied_dense(self, p: LayerPlan, x: str) -> bool:
        """A Linear whose ``(out, in)`` weight is already a raw parameter of this module (an LM
        head tied to the embedding the model gathers from): that parameter serves both uses,
        contracted on its ``in`` axis where it is, instead of an ``nn.Dense`` holding a
        transposed second copy of it (in variables.msgpack and in memory)."""
        body = set(p.body)
        kernel = p.weights["kernel"]
        if kernel not in self.raw or not any(u.node not in body for u in kernel.uses()):
            return False  # not tied, or its other use is a submodule's own variable
        if set(p.weights) - DROPPED_ROLES - {"kernel", "bias"}:
            return False
        w = self.weight(kernel)
        bias = self.weight(p.weights["bias"]) if p.hyper["use_bias"] and "bias" in p.weights else ""
        if self.low_dtype:  # Flax's Dense(dtype=jnp.bfloat16) casts all three
            x = x if p.input in self.low else f"{x}.astype(jnp.bfloat16)"
            w, bias = f"{w}.astype(jnp.bfloat16)", bias and f"{bias}.astype(jnp.bfloat16)"
            self.low.add(p.output)
        expr = f"jax.lax.dot_general({x}, {w}, ((({x}.ndim - 1,), (1,)), ((), ())))"
        if bias:
            expr += f" + {bias}"
        out = self.local(p.output, [p.input], p.scope)
        self.src.body.append(f"{out} = {expr}{self._comment(p.anchor, p.scope)}")
        self.bind(p.output, out, None)
        return True

    def _dense_layout(self, p: LayerPlan) -> str:
        if p.anchor.op_type == "Gemm":
            tb = p.anchor.attributes.get("transB")
            return "OI" if tb is not None and tb.value else "IO"
        return "IO"


@dataclass(frozen=True)
class EmittedVariable:
    """One variable of the generated module, with its origin.

    Attributes:
        path: Variable path, collection first for linen (``("params", "layer1_0", "conv1",
            "kernel")``), without it for nnx.
        source: The IR initializer (source weight) name, or None.
        scope: The source layer's scope (``layer1.0.conv1``), or None.
        role: The weight's role in that layer (``kernel``, ``bias``, ``mean``), or None.
        kind: The layer kind (``conv``, ``dense``, ...), ``raw`` for a weight the emitter
            keeps as a plain parameter, ``constant`` for a stored buffer.
        shape: The stored (Flax-layout) shape.
    """

    path: tuple[str, ...]
    source: str | None
    scope: str | None
    role: str | None
    kind: str
    shape: tuple[int, ...]


def _run(model: ir.Model, api: str, options: FlaxOptions | None) -> _Emitter:
    if api not in ("linen", "nnx"):
        raise ConversionError(f"api={api!r}; supported: 'linen', 'nnx'")
    low = precision.resolve_dtype((options or FlaxOptions()).dtype)
    model = _copy(model)
    # A causal mask built from the input's sizes is the attention's is_causal (the source's).
    fold_causal_masks(model)
    # Each layer computes the symbolic sizes it reads, on this copy (xconv.ir.scoped_sizes):
    # a layer body that took them as arguments could not be written as the layer it is.
    localize_sizes(model.graph)
    model = canonicalize(model)
    fold_repeated_kv(model)  # keys and values repeated per query head: the grouped ones
    model = fold_head_transposes(drop_noop_attention_masks(fold_reduce_reshapes(model)), low)
    em = _Emitter(model, api, options)
    em.plan_layers()
    em.check_supported()
    em.emit()
    if api == "nnx":
        _nnx_lists(em)
    return em


def _nnx_lists(em: _Emitter) -> None:
    """The root's repeated blocks as ``nnx.List`` attributes called in a loop; their variables
    and ``SOURCE_SCOPES`` entries move from ``layer1_0/...`` to ``layer1/0/...``."""
    from xconv.converters.flax.source import classes as flax_classes

    setup, body, lists = flax_classes.nnx_lists([b for _, b in em.src.setup], em.src.body)
    if not lists:
        return
    em.src.setup = [(line, line) for line in setup]
    em.src.body = body
    for v in em.src.variables:
        v.path = flax_classes.nnx_list_path(tuple(v.path), lists)
    em.src.scopes = {
        "/".join(flax_classes.nnx_list_path(tuple(k.split("/")), lists)): origin
        for k, origin in em.src.scopes.items()
    }


def _records(em: _Emitter) -> list[EmittedVariable]:
    return sorted(
        (
            EmittedVariable(
                (v.collection, *v.path) if em.api == "linen" else v.path,
                v.source,
                v.scope,
                v.role,
                v.kind,
                tuple(np.shape(v.value)),
            )
            for v in em.src.variables
        ),
        key=lambda r: r.path,
    )


def emitted_variables(
    model: ir.Model, *, api: str = "linen", options: FlaxOptions | None = None
) -> list[EmittedVariable]:
    """Every variable the generated module holds, sorted by path, with its origin."""
    return _records(_run(model, api, options))


def generate(
    model: ir.Model, *, api: str = "linen", options: FlaxOptions | None = None
) -> tuple[str, dict[str, Any]]:
    """Return ``(model.py source, variables tree)`` without writing anything."""
    em = _run(model, api, options)
    return render(em, em.model.graph.name or "model"), variables_tree(em)


def generate_with_records(
    model: ir.Model, *, api: str = "linen", options: FlaxOptions | None = None
) -> tuple[str, dict[str, Any], list[EmittedVariable]]:
    """:func:`generate` plus :func:`emitted_variables`, from one emission."""
    em = _run(model, api, options)
    return render(em, em.model.graph.name or "model"), variables_tree(em), _records(em)


def to_flax(
    model: ir.Model,
    out_dir: str | os.PathLike,
    *,
    api: str = "linen",
    options: FlaxOptions | None = None,
) -> Path:
    """Write a Flax module for ``model``: ``out_dir/model.py`` and ``variables.msgpack``.

    Args:
        model: The IR model (not modified; canonicalised on a copy).
        out_dir: Directory to create (replaced atomically when it exists).
        api: ``"linen"`` (``load`` returns ``(model, variables)``) or ``"nnx"`` (a ready model).
        options: :class:`FlaxOptions` (native ConvTranspose, shared block classes).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UnsupportedOpError: ops without a Flax template, all listed, before writing anything.
    """
    source, variables = generate(model, api=api, options=options)
    meta = json.dumps({"api": api, "format": 1}, sort_keys=True)
    return write_dir_atomic(
        out_dir,
        {
            "model.py": source.encode("utf-8"),
            "variables.msgpack": lambda f: write_msgpack(variables, f),  # streamed
            "xconv.json": meta.encode("utf-8"),
        },
    )
