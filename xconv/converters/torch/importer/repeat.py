"""Trace a model of repeated blocks once per block pattern, not once per block.

A decoder of 32 identical layers costs 32 times one layer in ``torch.export``, in
torch.onnx's decompositions and translation, though every layer is the same graph on other
weights. Here the largest ``nn.ModuleList`` whose entries are interchangeable (one class,
equal parameter names, shapes and dtypes, equal buffers, equal plain attributes except one
equal to the entry's own index, such as ``layer_idx``) is cut to its first two entries, the
module is traced and translated, and the second entry's part of both graphs (the decomposed
``ExportedProgram`` the layerwise parity splits, and the IR) is copied for every entry left
out: weights renamed to that entry's state_dict keys (``model.layers.7.mlp.up_proj.weight``),
node scopes to its module path, values to fresh names, its chained inputs (the hidden state)
read from the copy before it, the values it shares with every layer (rotary tables, the mask)
read as they are.

The trace is checked before anything is copied, and :func:`trace_repeated` returns ``None``
(the caller traces the whole module) with the reason when a precondition does not hold: no
such list, entries that differ, a forward that does not run the two entries one after the
other as two blocks of the same graph (same ops, same arguments, the same shared inputs,
the second reading the first's outputs in the places the first read the glue's), later code
reading an entry other than the last, or subgraph attributes. Names of the values after the
copied entries differ from a full trace (torch numbers them by op); the graph, its scopes,
weights and module tree are those of the full trace.
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir
import torch
from torch import fx, nn

logger = logging.getLogger(__name__)

_NAME_SCOPES = "pkg.torch.onnx.name_scopes"
KEEP = 2  # entries traced: the first reads the glue, the second is the pattern of the rest


@dataclass(frozen=True)
class RepeatedList:
    """A list of interchangeable blocks: ``module.get_submodule(path)``, ``length`` entries."""

    path: str
    length: int


def find_repeated(module: nn.Module) -> tuple[RepeatedList | None, str]:
    """The largest ``nn.ModuleList`` (by parameter count) of more than ``KEEP`` entries whose
    entries are interchangeable, and why none when there is none."""
    found: list[tuple[int, str, int]] = []
    reasons = []
    for path, mod in module.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) <= KEEP:
            continue
        why = _differ(list(mod))
        if why:
            reasons.append(f"{path}: {why}")
            continue
        count = sum(p.numel() for p in mod.parameters())
        found.append((count, path, len(mod)))
    if not found:
        return None, "; ".join(reasons) or "no nn.ModuleList of more than 2 entries"
    _, path, length = max(found)
    return RepeatedList(path, length), ""


def _differ(entries: list[nn.Module]) -> str:
    """Why the entries are not interchangeable ('' when they are)."""
    first = entries[0]
    tensors0 = _tensors(first)
    attrs = [_attributes(e) for e in entries]
    for i, e in enumerate(entries[1:], start=1):
        if type(e) is not type(first):
            return f"entry {i} is {type(e).__name__}, entry 0 {type(first).__name__}"
        if _tensors(e) != tensors0:
            return f"entry {i} has other parameters/buffers than entry 0"
        if set(attrs[i]) != set(attrs[0]):
            return f"entry {i} has other submodules/attributes than entry 0"
        for name, b in e.named_buffers():
            ref = first.get_buffer(name)
            if not _is_fake(b) and not _is_fake(ref) and not torch.equal(b, ref):
                return f"entry {i} buffer {name} differs from entry 0"
    for key in attrs[0]:
        values = [a[key] for a in attrs]
        if all(v == values[0] and type(v) is type(values[0]) for v in values):
            continue
        if all(type(v) is int and v == i for i, v in enumerate(values)):
            continue  # the entry's own index (layer_idx)
        where = ".".join(p for p in key if p)
        return f"{where} differs between entries: {values[:4]}"
    return ""


def _tensors(entry: nn.Module) -> list:
    return [
        (n, tuple(t.shape), t.dtype, isinstance(t, nn.Parameter))
        for n, t in [*entry.named_parameters(), *entry.named_buffers()]
    ]


def _attributes(entry: nn.Module) -> dict[tuple[str, str], Any]:
    """Plain attributes (numbers, strings, tuples of them) of the entry and its submodules."""
    attrs: dict[tuple[str, str], Any] = {}
    for sub_path, sub in entry.named_modules():
        attrs[(sub_path, "<class>")] = type(sub).__qualname__
        for key, value in vars(sub).items():
            if not key.startswith("_") and _plain(value):
                attrs[(sub_path, key)] = value
    return attrs


def _plain(value: Any) -> bool:
    if isinstance(value, bool | int | float | str | type(None)):
        return True
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return False


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor" or t.device.type == "meta"


# --------------------------------------------------------------------------- the route


@dataclass
class Repeated:
    """What :func:`trace_repeated` made: the IR (not yet annotated) and the decomposed program,
    both as a full trace would have them, and what it did."""

    model: ir.Model
    program: Any
    note: str


def trace_repeated(
    module: nn.Module,
    trace: Callable[[nn.Module], tuple[ir.Model, Any]],
) -> tuple[Repeated | None, str]:
    """Trace ``module`` with its repeated list cut to ``KEEP`` entries and copy the last one.

    Args:
        module: The (weightless) module; its list is put back before returning.
        trace: ``module -> (raw torch.onnx IR, decomposed ExportedProgram)``.

    Returns:
        ``(Repeated, "")``, or ``(None, reason)`` when the full module must be traced.
    """
    found, why = find_repeated(module)
    if found is None:
        return None, why
    parent_path, _, attr = found.path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    full = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList(list(full)[:KEEP]))
    try:
        model, program = trace(module)
    except Exception as e:  # a forward that needs every entry: trace the whole list
        return None, f"the shortened {found.path} does not trace: {str(e).splitlines()[:1]}"
    finally:
        setattr(parent, attr, full)
    try:
        plan = _plan(program, model, found)
    except _Fallback as e:
        return None, str(e)
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    try:
        program = _replicate_program(program, plan, tensors)
        _replicate_ir(model, plan, tensors)
    except Exception as e:  # a case the checks above missed: the full trace is always right
        logger.warning("copying %s failed, tracing it in full: %s", found.path, e)
        return None, f"copying {found.path} failed: {str(e).splitlines()[:1]}"
    note = (
        f"traced {found.path} with {KEEP} of {found.length} entries; "
        f"entries {KEEP}..{found.length - 1} copied from entry {KEEP - 1}"
    )
    return Repeated(model, program, note), ""


class _Fallback(Exception):
    pass


@dataclass
class _Plan:
    container: str
    length: int
    template: Any  # parity Block of the last traced entry
    chain: dict[int, int]  # template input position -> template output position
    ir_nodes: list[ir.Node]
    weights: dict[str, str]  # template weight placeholder name -> state_dict key
    names: tuple[dict[int, dict[str, str]], dict[str, str]]  # wanted copy / later names
    fx_names: dict[int, dict[str, str]] = field(default_factory=dict)  # k -> {tpl: copy}
    after: dict[str, str] = field(default_factory=dict)  # names after the list, renamed
    ir_meta: list[tuple] = field(default_factory=list)  # per IR node: fx name, scopes, props


_COUNTED = re.compile(r"^(.*?)(?:_(\d+))?$")


def _count(name: str) -> tuple[str, int]:
    base, n = _COUNTED.match(name).groups()
    return base, int(n or 0)


def _numbered(base: str, n: int) -> str:
    return f"{base}_{n}" if n else base


def _fx_names(
    first: tuple[str, ...], template: tuple[str, ...], later: list[str], length: int
) -> tuple[dict[int, dict[str, str]], dict[str, str]]:
    """The names torch gives the nodes of a full trace: one counter per op name, advancing by
    the same step in every entry (measured between the two traced entries)."""
    step: dict[str, int] = {}
    pairs = []
    for a, b in zip(first, template, strict=True):
        (base_a, n_a), (base_b, n_b) = _count(a), _count(b)
        if base_a != base_b or step.get(base_b, n_b - n_a) != n_b - n_a:
            return {}, {}  # no counting pattern: copies get suffixed names
        step[base_b] = n_b - n_a
        pairs.append((b, base_b, n_b))
    copies = {
        k: {b: _numbered(base, n + (k - KEEP + 1) * step[base]) for b, base, n in pairs}
        for k in range(KEEP, length)
    }
    after = {}
    for name in later:
        base, n = _count(name)
        if step.get(base):
            after[name] = _numbered(base, n + (length - KEEP) * step[base])
    return copies, after


def _prefix(container: str, i: int) -> str:
    return f"{container}.{i}"


def _plan(program: Any, model: ir.Model, found: RepeatedList) -> _Plan:
    from xconv.parity.layerwise import _weight_placeholders, split_program

    blocks = split_program(program)
    names = [b.name for b in blocks]
    wanted = [_prefix(found.path, i) for i in range(KEEP)]
    at = [names.index(w) if w in names else -1 for w in wanted]
    if -1 in at or at != list(range(at[0], at[0] + KEEP)):
        raise _Fallback(f"the trace does not run {' then '.join(wanted)} as consecutive blocks")
    first, template = blocks[at[0]], blocks[at[-1]]
    if _structure(program, first) != _structure(program, template):
        raise _Fallback(f"{wanted[0]} and {wanted[-1]} trace to different graphs")
    if len(first.outputs) != len(template.outputs) or len(first.inputs) != len(template.inputs):
        raise _Fallback("entries differ in their inputs/outputs")
    chain = {}
    pos = {n: i for i, n in enumerate(first.nodes)}
    tpos = {n: i for i, n in enumerate(template.nodes)}
    out_pos = [pos[o] for o in first.outputs]
    if out_pos != [tpos[o] for o in template.outputs]:
        raise _Fallback("entries make their outputs at different places")
    for i, (a, b) in enumerate(zip(first.inputs, template.inputs, strict=True)):
        if b in first.outputs:
            chain[i] = first.outputs.index(b)
        elif a != b:
            raise _Fallback(f"{wanted[-1]} reads {b} where {wanted[0]} reads {a}")
    later = blocks[at[-1] + 1 :]
    if any(x in first.outputs for b in later for x in b.inputs):
        raise _Fallback(f"code after the list reads {wanted[0]}'s outputs")
    if not chain:
        raise _Fallback(f"{wanted[-1]} does not read {wanted[0]}'s outputs")
    weight_of = _weight_placeholders(program)
    place_of = {t: p for p, t in weight_of.items()}
    prefix = _prefix(found.path, KEEP - 1) + "."
    kinds = {s.arg.name: s.kind.name for s in program.graph_signature.input_specs}
    order = {s.arg.name: i for i, s in enumerate(program.graph_signature.input_specs)}
    own = sorted((place_of[w] for w in template.weights if w.startswith(prefix)), key=order.get)
    weights = {p: weight_of[p] for p in own}  # in the signature's (state_dict) order
    if any(kinds.get(p) not in ("PARAMETER", "BUFFER") for p in weights):
        raise _Fallback("an entry reads a lifted constant of its own")
    ir_nodes = _ir_nodes(model, template)
    ir_first = _ir_nodes(model, first)
    # torch.onnx makes a constant once and reuses it: the first entry may hold a few more.
    if _ir_keys(ir_first) != _ir_keys(ir_nodes):
        raise _Fallback("the entries translate to different IR")
    _check_ir_links(ir_first, ir_nodes, template, {template.inputs[i] for i in chain})
    later_nodes = [n for b in later for n in b.nodes]
    return _Plan(
        found.path,
        found.length,
        template,
        chain,
        ir_nodes,
        weights,
        _fx_names(first.nodes, template.nodes, later_nodes, found.length),
    )


def _check_ir_links(
    first: list[ir.Node], nodes: list[ir.Node], template: Any, chained: set
) -> None:
    """The IR of the template reads the previous entry only through the chained values (by
    their FX names) or its shared constants, and makes its outputs under their FX names."""
    made = {id(v) for n in nodes for v in n.outputs}
    in_first = {id(v): n for n in first for v in n.outputs}
    read = set()
    for n in nodes:
        for v in n.inputs:
            if v is None or id(v) in made:
                continue
            read.add(v.name)
            src = in_first.get(id(v))
            if (
                src is not None
                and v.name not in chained
                and (src.inputs or src.op_type != "Constant")
            ):
                raise _Fallback(f"the IR of {template.name} reads {v.name} of the entry before it")
    if not chained <= read:
        raise _Fallback(f"the IR of {template.name} does not read {sorted(chained - read)}")
    names = {v.name for n in nodes for v in n.outputs}
    if not set(template.outputs) <= names:
        raise _Fallback(f"the IR of {template.name} names its outputs otherwise")


def _structure(program: Any, block: Any) -> list:
    from xconv.parity.layerwise import _weight_placeholders

    weight_of = _weight_placeholders(program)
    by_name = {n.name: n for n in program.graph.nodes}
    local = {n: i for i, n in enumerate(block.nodes)}
    inputs = {n: i for i, n in enumerate(block.inputs)}
    prefix = block.name + "."

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a.name in local:
                return ("node", local[a.name])
            if a.name in weight_of:
                return ("weight", weight_of[a.name].removeprefix(prefix))
            return ("input", inputs[a.name])
        return a

    out = []
    for name in block.nodes:
        node = by_name[name]
        args = fx.node.map_aggregate(node.args, ref)
        kwargs = fx.node.map_aggregate(node.kwargs, ref)
        out.append((node.op, str(node.target), repr(args), repr(sorted(kwargs.items()))))
    return out


def _fx_name(node: ir.Node) -> str | None:
    raw = node.metadata_props.get(_NAME_SCOPES)
    if not raw:
        return None
    try:
        scopes = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    return scopes[-1] if scopes else None


def _ir_nodes(model: ir.Model, block: Any) -> list[ir.Node]:
    names = set(block.nodes)
    nodes = [n for n in model.graph if _fx_name(n) in names]
    for n in nodes:
        for a in n.attributes.values():
            if a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                raise _Fallback(f"{block.name} holds a subgraph ({n.op_type})")
    graph_nodes = list(model.graph)
    first = graph_nodes.index(nodes[0]) if nodes else 0
    if graph_nodes[first : first + len(nodes)] != nodes:
        raise _Fallback(f"the IR of {block.name} is not one run of nodes")
    return nodes


def _ir_keys(nodes: list[ir.Node]) -> list[tuple]:
    return [_ir_key(n) for n in nodes if n.op_type != "Constant" or n.inputs]


def _ir_key(node: ir.Node) -> tuple:
    attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
    return (node.domain, node.op_type, len(node.inputs), len(node.outputs), attrs)


def _path_re(container: str) -> re.Pattern:
    """``container.<KEEP-1>`` as a module path (not ``.10``) or an FX/torch key."""
    dotted = re.escape(_prefix(container, KEEP - 1))
    under = re.escape(_prefix(container, KEEP - 1).replace(".", "_"))
    return re.compile(rf"(?:{dotted}|{under})(?![0-9])")


def _renamer(container: str, k: int) -> Callable[[str], str]:
    pattern = _path_re(container)
    dotted = _prefix(container, k)

    def rename(text: str) -> str:
        return pattern.sub(
            lambda m: dotted if "." in m.group(0) else dotted.replace(".", "_"), text
        )

    return rename


# ------------------------------------------------------------------------ the program copy


def _replicate_program(program: Any, plan: _Plan, tensors: Mapping[str, torch.Tensor]) -> Any:
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    old = program.graph
    by_name = {n.name: n for n in old.nodes}
    tpl = plan.template
    tpl_nodes = [by_name[n] for n in tpl.nodes]
    tpl_set = set(tpl_nodes)
    last_node = tpl_nodes[-1]
    last_weight = max((i for i, n in enumerate(old.nodes) if n.name in plan.weights), default=None)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs = list(program.graph_signature.input_specs)
    spec_of = {s.arg.name: s for s in specs}
    new_specs: dict[str, list[InputSpec]] = {}  # after which placeholder
    state = dict(program.state_dict)
    copies: dict[int, dict[str, fx.Node]] = {}  # k -> {template placeholder: new placeholder}
    renamed: dict[int, dict[str, str]] = {}  # k -> {template fx name: copy's name}

    def add_placeholders() -> None:
        added = []
        for k in range(KEEP, plan.length):
            rename = _renamer(plan.container, k)
            copies[k] = {}
            for p, target in plan.weights.items():
                src = by_name[p]
                new_target = rename(target)
                node = g.placeholder(rename(p))
                node.meta = dict(src.meta)
                copies[k][p] = node
                spec = spec_of[p]
                added.append(
                    InputSpec(spec.kind, TensorArgument(node.name), new_target, spec.persistent)
                )
                if spec.kind == InputKind.PARAMETER or spec.persistent:
                    state[new_target] = tensors[new_target]
        new_specs[last_placeholder] = added

    last_placeholder = ""
    wanted_after = plan.names[1]
    for i, node in enumerate(old.nodes):
        if node.name in wanted_after:
            new = g.create_node(
                node.op,
                node.target,
                fx.node.map_arg(node.args, lambda a: env[a]),
                fx.node.map_arg(node.kwargs, lambda a: env[a]),
                name=wanted_after[node.name],
                type_expr=node.type,
            )
            new.meta = dict(node.meta)
            plan.after[node.name] = new.name
            env[node] = new
        else:
            env[node] = g.node_copy(node, lambda a: env[a])
        if node.op == "placeholder" and i == last_weight:
            last_placeholder = node.name
            add_placeholders()
        if node is last_node:
            outs = [by_name[o] for o in tpl.outputs]
            prev = [env[o] for o in outs]
            for k in range(KEEP, plan.length):
                prev = _copy_block(g, env, plan, k, tpl_nodes, tpl_set, copies[k], prev, renamed)
            for o, new in zip(outs, prev, strict=True):
                env[o] = new  # code after the list reads the last copy
    return _program_of(program, g, env, new_specs, state)


def _program_of(
    program: Any,
    g: fx.Graph,
    env: Mapping[fx.Node, fx.Node],
    new_specs: Mapping[str, list[Any]],
    state: dict[str, Any],
) -> Any:
    """The ``ExportedProgram`` of the copied graph ``g``: ``program``'s input specs with the
    copies' placeholders (``new_specs``, after the placeholder they follow), its outputs
    renamed through ``env``, ``state`` as its state dict."""
    from torch.export.exported_program import ExportedProgram
    from torch.export.graph_signature import ExportGraphSignature, OutputSpec, TensorArgument

    by_name = {n.name: n for n in program.graph.nodes}
    specs_out = []
    for s in program.graph_signature.input_specs:
        specs_out.append(s)
        specs_out.extend(new_specs.get(s.arg.name, []))
    outputs = []
    for spec in program.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in by_name:
            spec = OutputSpec(
                spec.kind, TensorArgument(env[by_name[spec.arg.name]].name), spec.target
            )
        outputs.append(spec)
    signature = ExportGraphSignature(specs_out, outputs)
    gm = fx.GraphModule(program.graph_module, g)
    try:
        return ExportedProgram(
            root=gm,
            graph=g,
            graph_signature=signature,
            state_dict=state,
            range_constraints=program.range_constraints,
            module_call_graph=list(program.module_call_graph),
            example_inputs=program.example_inputs,
            constants=program.constants,
        )
    except Exception as e:
        raise RuntimeError(f"the copied program does not verify: {e}") from e


def _copy_block(
    g: fx.Graph,
    env: dict[fx.Node, fx.Node],
    plan: _Plan,
    k: int,
    tpl_nodes: list[fx.Node],
    tpl_set: set[fx.Node],
    weights: Mapping[str, fx.Node],
    prev_outputs: list[fx.Node],
    renamed: dict[int, dict[str, str]],
) -> list[fx.Node]:
    rename = _renamer(plan.container, k)
    tpl = plan.template
    chained = {tpl.inputs[i]: prev_outputs[j] for i, j in plan.chain.items()}
    local: dict[fx.Node, fx.Node] = {}
    renamed[k] = {}

    def arg(a: fx.Node) -> fx.Node:
        if a in local:
            return local[a]
        if a.name in weights:
            return weights[a.name]
        if a.name in chained:
            return chained[a.name]
        return env[a]  # shared with every entry (rotary tables, mask)

    for node in tpl_nodes:
        want = plan.names[0].get(k, {}).get(node.name, f"{node.name}_{k}")
        new = g.create_node(
            node.op,
            node.target,
            fx.node.map_arg(node.args, arg),
            fx.node.map_arg(node.kwargs, arg),
            name=want,
            type_expr=node.type,
        )
        meta = dict(node.meta)
        stack = meta.get("nn_module_stack")
        if stack:
            meta["nn_module_stack"] = {
                rename(key): (rename(v[0]), *v[1:]) if isinstance(v, tuple) and v else v
                for key, v in stack.items()
            }
        new.meta = meta
        local[node] = new
        renamed[k][node.name] = new.name
    plan.fx_names[k] = renamed[k]
    by_name = {n.name: n for n in tpl_nodes}
    return [local[by_name[o]] for o in tpl.outputs]


# ----------------------------------------------------------------------------- the IR copy


def _replicate_ir(model: ir.Model, plan: _Plan, tensors: Mapping[str, torch.Tensor]) -> None:
    graph = model.graph
    tpl = plan.template
    nodes = plan.ir_nodes
    by_name = {v.name: v for n in nodes for v in n.outputs}
    for v in graph.inputs:
        by_name.setdefault(v.name, v)
    outs = [by_name[o] for o in tpl.outputs]
    readers_after = {id(o): [(u, i) for u, i in o.uses() if u not in set(nodes)] for o in outs}
    graph_outputs = {id(o): [i for i, v in enumerate(graph.outputs) if v is o] for o in outs}
    _rename_after(graph, nodes[-1], plan.after)
    plan.ir_meta = [_ir_meta(n) for n in nodes]
    prev = outs
    anchor = nodes[-1]
    new_inits: list[ir.Value] = []
    for k in range(KEEP, plan.length):
        made, inits, prev = _copy_ir(nodes, plan, k, outs, prev, tensors)
        graph.insert_after(anchor, made)
        anchor = made[-1]
        new_inits.extend(inits)
    for o, new in zip(outs, prev, strict=True):
        for user, i in readers_after[id(o)]:
            user.replace_input_with(i, new)
        for i in graph_outputs[id(o)]:
            graph.outputs[i] = new
    _add_initializers(graph, new_inits, list(tensors))


def _copy_ir(
    nodes: list[ir.Node],
    plan: _Plan,
    k: int,
    outs: list[ir.Value],
    prev: list[ir.Value],
    tensors: Mapping[str, torch.Tensor],
) -> tuple[list[ir.Node], list[ir.Value], list[ir.Value]]:
    """Entry ``k`` of the list: ``(its IR nodes, its new initializers, its outputs)``."""
    tpl = plan.template
    prefix = _prefix(plan.container, KEEP - 1) + "."
    rename = _renamer(plan.container, k)
    fx_names = plan.fx_names[k]
    chained = {tpl.inputs[i]: prev[j] for i, j in plan.chain.items()}
    local: dict[int, ir.Value] = {}
    inits: dict[str, ir.Value] = {}

    def value(v: ir.Value | None) -> ir.Value | None:
        if v is None:
            return None
        if id(v) in local:
            return local[id(v)]
        if v.name in chained:
            return chained[v.name]
        if v.is_initializer() and v.name.startswith(prefix):
            name = rename(v.name)
            if name not in inits:
                const = v.const_value
                inits[name] = ir.Value(
                    name=name,
                    type=v.type,
                    shape=v.shape,
                    const_value=None if const is None else type(const)(tensors[name], name=name),
                )
            return inits[name]
        return v  # shared with every entry

    made = []
    for node, (fx_name, scopes, kept) in zip(nodes, plan.ir_meta, strict=True):
        attrs = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        props = dict(kept)
        if scopes is not None:
            props[_NAME_SCOPES] = repr(
                [rename(p) for p in scopes[:-1]] + [fx_names.get(scopes[-1], scopes[-1])]
            )
        new = ir.Node(
            node.domain,
            node.op_type,
            [value(v) for v in node.inputs],
            attributes=attrs,
            overload=node.overload,
            num_outputs=len(node.outputs),
            version=node.version,
            name=_node_name(node.name, fx_name, fx_names, k),
            metadata_props=props,
        )
        for o, n in zip(node.outputs, new.outputs, strict=True):
            n.name = fx_names.get(o.name, f"{o.name}_{k}")
            n.type = o.type
            n.shape = o.shape
            n.metadata_props.update(o.metadata_props)
            local[id(o)] = n
        made.append(new)
    return made, list(inits.values()), [local[id(o)] for o in outs]


_KEPT = (_NAME_SCOPES, "pkg.torch.onnx.class_hierarchy", "pkg.torch.onnx.stack_trace")


def _ir_meta(node: ir.Node) -> tuple[str | None, list | None, dict[str, str]]:
    """What a copy of ``node`` needs: its FX name, its scopes, and the metadata the importer
    reads (the rest of torch.onnx's metadata, dropped by ``annotate``, is not copied)."""
    props = {
        k: v
        for k, v in node.metadata_props.items()
        if k in _KEPT or not (k.startswith("pkg.torch.") or k == "namespace")
    }
    raw = props.get(_NAME_SCOPES)
    scopes = None
    if raw:
        try:
            scopes = ast.literal_eval(raw) or None
        except (ValueError, SyntaxError):
            scopes = None
    return (scopes[-1] if scopes else None), scopes, props


def _node_name(name: str | None, fx_name: str | None, fx_names: Mapping[str, str], k: int):
    if not name:
        return None
    if fx_name in fx_names and name == f"node_{fx_name}":
        return f"node_{fx_names[fx_name]}"
    return f"{name}_{k}"


def _rename_after(graph: ir.Graph, last: ir.Node, after: Mapping[str, str]) -> None:
    """The nodes after the list take the names a full trace gives them (``plan.after``)."""
    nodes = list(graph)
    for node in nodes[nodes.index(last) + 1 :]:
        fx_name = _fx_name(node)
        if fx_name not in after:
            continue
        new = after[fx_name]
        scopes = ast.literal_eval(node.metadata_props[_NAME_SCOPES])
        scopes[-1] = new
        node.metadata_props[_NAME_SCOPES] = repr(scopes)
        if node.name == f"node_{fx_name}":
            node.name = f"node_{new}"
        for o in node.outputs:
            if o.name == fx_name:
                o.name = new


def _add_initializers(graph: ir.Graph, new: list[ir.Value], order: list[str]) -> None:
    """Register ``new`` and order the initializers as the state_dict (as a full trace does)."""
    for v in new:
        graph.register_initializer(v)
    rank = {name: i for i, name in enumerate(order)}
    items = list(graph.initializers.items())
    keyed = sorted(range(len(items)), key=lambda i: (rank.get(items[i][0], len(rank) + i), i))
    if keyed == list(range(len(items))):
        return
    graph.initializers.clear()
    for i in keyed:
        graph.initializers[items[i][0]] = items[i][1]


__all__ = ["KEEP", "Repeated", "RepeatedList", "find_repeated", "trace_repeated"]
