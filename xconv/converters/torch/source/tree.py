"""The source module tree in generated PyTorch: one class per source module class.

The emitter writes one flat ``Model.forward`` whose statements know their source module path
(``owner``) and the locals they define and read. From the model's ``xconv.modules`` (module
path -> source class, recorded by the Flax importer), each path of a user-defined class whose
statements are one contiguous run becomes a generated ``nn.Module`` class: its layers move
into the class's ``__init__`` (attribute names unchanged, so the state_dict keys are those of
the flat model), the run becomes its ``forward``, and the parent calls it
(``x = self.Block_0(x)``). Deepest paths first, so blocks nest. Instances whose class text
is identical share one class; consecutive instances chained on one value are called in a loop.
Locals are renamed by role (``x`` for a block's or residual's value, ``attn``, ``h``), a name
reused once its value is dead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from xconv.converters.module_tree import (
    LINE_LENGTH,
    fold_optional,
    inline_chains,
    variant_name,
)
from xconv.ir.metadata import MODULE, SCOPE
from xconv.ir.naming import split_path

#: Module-class prefixes of library layers (not generated as classes).
_LIBRARY = ("flax.", "torch.", "jax.", "keras.", "tensorflow.")
_COMMENT = re.compile(r"  # (?P<scope>\S+)$")


@dataclass
class Stmt:
    text: str
    owner: tuple[str, ...]
    defs: list[str]
    uses: list[str]


@dataclass
class Tree:
    """Emitted statements plus what the class extraction needs."""

    init: list[tuple[str, tuple[str, ...]]]  # (line, module path it assigns)
    body: list[Stmt]
    returns: list[str]
    classes: list[str] = field(default_factory=list)  # rendered class texts
    kinds: dict[tuple[str, ...], str] = field(default_factory=dict)  # path -> generated class


def user_classes(modules_json: str | None) -> dict[tuple[str, ...], str]:
    """``{module path: source class name}`` for user-defined classes (not library layers)."""
    if not modules_json:
        return {}
    try:
        modules = json.loads(modules_json)
    except ValueError:
        return {}
    out = {}
    for path, qual in modules.items():
        if path and isinstance(qual, str) and not qual.startswith(_LIBRARY):
            name = qual.rsplit(".", 1)[-1]
            if name.isidentifier():
                out[split_path(path)] = name
    return out


def node_classes(graph: Any) -> dict[tuple[str, ...], str]:
    """``{module path: class}`` from the nodes' own ``xconv.scope`` / ``xconv.module`` (a Flax
    module xconv generated records its source's scopes and classes there, not in
    ``xconv.modules``); user-defined classes only."""
    out: dict[tuple[str, ...], str] = {}
    for node in graph:
        scope, qual = node.metadata_props.get(SCOPE), node.metadata_props.get(MODULE)
        if scope and qual and not qual.startswith(_LIBRARY):
            name = qual.rsplit(".", 1)[-1]
            if name.isidentifier():
                out.setdefault(split_path(scope), name)
    return out


def access(parts: tuple[str, ...]) -> str:
    out = "self"
    for p in parts:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def _rebase(line: str, prefix: str) -> tuple[str, bool]:
    """``line`` with ``prefix`` (``self.Block_0``) replaced by ``self``; False when the line
    also reads ``self`` members outside the prefix."""
    pat = re.compile(re.escape(prefix) + r"(?=[.\[(])")
    new, n = pat.subn("self", line)
    total = len(re.findall(r"(?<![\w.])self(?=[.\[(])", line))
    return new, n == total


def _relative_comment(line: str, path: tuple[str, ...]) -> str:
    m = _COMMENT.search(line)
    if not m:
        return line
    parts = split_path(m.group("scope"))
    if parts[: len(path)] != path:
        return line
    rest = "/".join(parts[len(path) :])
    return line[: m.start()] + (f"  # {rest}" if rest else "")


def _extract(tree: Tree, path: tuple[str, ...]) -> tuple[list[str], list[str]] | None:
    n = len(path)
    rows = [i for i, s in enumerate(tree.body) if s.owner[:n] == path]
    if not rows or rows != list(range(rows[0], rows[-1] + 1)):
        return None
    scope_rows = [i for i, (_, p) in enumerate(tree.init) if p == path]
    init_rows = [i for i, (_, p) in enumerate(tree.init) if p[:n] == path and len(p) > n]
    if len(scope_rows) != 1 or not init_rows:
        return None
    prefix = access(path)
    init, body = [], []
    for i in init_rows:
        line, ok = _rebase(tree.init[i][0], prefix)
        if not ok:
            return None
        init.append(line)
    for i in rows:
        line, ok = _rebase(tree.body[i].text, prefix)
        if not ok:
            return None
        body.append(_relative_comment(line, path))
    run = [tree.body[i] for i in rows]
    defined = {d for s in run for d in s.defs}
    ins: list[str] = []
    for s in run:
        ins += [u for u in s.uses if u not in defined and u not in ins]
    later = {u for s in tree.body[rows[-1] + 1 :] for u in s.uses} | set(tree.returns)
    outs = [d for s in run for d in s.defs if d in later]
    if not outs:
        return None
    ret = ", ".join(outs)
    blocks = {access(q[n:]) for q in tree.kinds if q[:n] == path}
    kinds = {access(q[n:])[len("self.") :]: k for q, k in tree.kinds.items() if q[:n] == path}
    text = [
        "    def __init__(self):",
        "        super().__init__()",
        *["        " + ln for ln in init],
        "",
        f"    def forward(self, {', '.join(rename_locals([], ins)[1])}):",
        *["        " + ln for ln in _forward(body + [f"return {ret}"], ins, blocks, kinds)],
    ]
    call = Stmt(f"{ret} = {prefix}({', '.join(ins)})", path[:-1], outs, ins)
    tree.body[rows[0] : rows[-1] + 1] = [call]
    keep = [row for i, row in enumerate(tree.init) if i not in set(init_rows)]
    tree.init = keep
    return text, [ins[0] if ins else ""]


def _forward(lines: list[str], ins: list[str], blocks: set[str], kinds: dict[str, str]):
    lines = rename_locals(lines, ins, None, blocks)[0]
    return inline_chains([*loop_chains(lines[:-1], kinds), lines[-1]], LINE_LENGTH - 8)


#: Leading positional ints of a torch layer constructor: its channel / feature counts.
_CTOR = re.compile(
    r"(?<![\w.])(?P<ctor>nn\.(?:Conv|ConvTranspose)[123]d|nn\.Linear|nn\.BatchNorm[123]d"
    r"|BiasedVarBatchNorm[123]d|nn\.LayerNorm|nn\.GroupNorm|nn\.Embedding)"
    r"\((?P<a>\d+)(?:, (?P<b>\d+))?(?=[,)])"
)
#: A raw parameter's or buffer's shape: ``torch.empty((64, 32), ...)``.
_EMPTY = re.compile(r"(?<=torch\.empty\(\()(?P<dims>\d+(?:, \d+)*,?)(?=\))")
_SLOT = "\x00"
_TOKEN = re.compile(r"\{inst:(\d+):([\w\x00,]*)\}")


def _slot_roles(ctor: str, two: bool) -> list[str]:
    if "Conv" in ctor:
        return ["in_channels", "out_channels"][: 1 + two]
    if "Linear" in ctor:
        return ["in_features", "out_features"][: 1 + two]
    if "BatchNorm" in ctor:
        return ["channels"]
    return ["features", "features"][: 1 + two]


@dataclass
class _Group:
    name: str
    base: str
    skeleton: str
    roles: list[str]
    instances: list[tuple[int, ...]] = field(default_factory=list)
    alias: int | None = None  # merged into this group (see :func:`merge_optional`)
    convert: Any = None  # a token's values -> the values of the (merged) group


def _abstract(text: str, groups: list[_Group]) -> tuple[str, list[str], tuple[int, ...]]:
    """``text`` with its channel / feature counts as slots: layer constructor ints, raw
    parameter shapes, and the values a nested generated class's instance is made with."""
    found: list[tuple[int, str, list[str], list[int]]] = []  # (start, replacement, roles, ints)

    def layer(m: re.Match) -> None:
        two = m.group("b") is not None
        nums = [int(m.group("a"))] + ([int(m.group("b"))] if two else [])
        rep = f"{m.group('ctor')}(" + ", ".join(_SLOT for _ in nums)
        found.append((m.start(), m.end(), rep, _slot_roles(m.group("ctor"), two), nums))

    def shape(m: re.Match) -> None:
        nums = [int(d) for d in m.group("dims").replace(",", " ").split()]
        rep = ", ".join(_SLOT for _ in nums) + ("," if len(nums) == 1 else "")
        found.append((m.start(), m.end(), rep, ["features"] * len(nums), nums))

    def token(m: re.Match) -> None:
        g = groups[int(m.group(1))]
        nums = [int(v) for v in m.group(2).split(",") if v]
        rep = f"{{inst:{m.group(1)}:" + ",".join(_SLOT for _ in nums) + "}"
        found.append((m.start(), m.end(), rep, list(g.roles), nums))

    for pat, fn in ((_CTOR, layer), (_EMPTY, shape), (_TOKEN, token)):
        for m in pat.finditer(text):
            fn(m)
    found.sort()
    out, roles, values, at = [], [], [], 0
    for start, end, rep, r, nums in found:
        out += [text[at:start], rep]
        roles += r
        values += nums
        at = end
    out.append(text[at:])
    return "".join(out), roles, tuple(values)


def _fields(g: _Group) -> tuple[list[str], dict[int, str]]:
    """Field names and ``{slot: field}`` for the slots whose value differs between instances;
    slots that always hold the same values as each other share one field."""
    by_column: dict[tuple[int, ...], list[str]] = {}
    slot_column: dict[int, tuple[int, ...]] = {}
    for pos, role in enumerate(g.roles):
        column = tuple(inst[pos] for inst in g.instances)
        if len(set(column)) > 1:
            by_column.setdefault(column, []).append(role)
            slot_column[pos] = column
    names: list[str] = []
    column_name: dict[tuple[int, ...], str] = {}
    for column, roles in by_column.items():
        kinds = {r.split("_")[-1] for r in roles}
        if len(set(roles)) == 1:
            role = roles[0]
        elif kinds <= {"channels", "features"}:
            role = "channels" if "channels" in kinds else "features"
        else:
            role = roles[0]
        name, k = role, 1
        while name in names:
            k += 1
            name = f"{role}{k}"
        names.append(name)
        column_name[column] = name
    return names, {pos: column_name[c] for pos, c in slot_column.items()}


#: Fields with a default: declared last, passed by keyword only when not the default.
_DEFAULTS = {"stride": 1, "downsample": 0}


def _literal(role: str, value: int | str) -> str:
    """A slot's value as written: ``True`` for a flag, a field's name as is."""
    if role == "downsample" and str(value) in ("0", "1"):
        return str(value == 1 or value == "1")
    return str(value)


def _decl(name: str) -> str:
    role = name.rstrip("0123456789")
    if role not in _DEFAULTS:
        return f"{name}: int"
    kind = "bool" if role == "downsample" else "int"
    return f"{name}: {kind} = {_literal(role, _DEFAULTS[role])}"


def _ordered(names: list[str]) -> list[str]:
    """Fields without a default first, then ``stride``, ``downsample``."""
    order = list(_DEFAULTS)

    def key(name: str) -> int:
        role = name.rstrip("0123456789")
        return order.index(role) + 1 if role in order else 0

    return sorted(names, key=key)


def _render(g: _Group) -> str:
    names, by_pos = _fields(g)
    parts = g.skeleton.split(_SLOT)
    out = [parts[0]]
    for pos, rest in enumerate(parts[1:]):
        if g.roles[pos] == "stride" and not by_pos.get(pos) and g.instances[0][pos] == 1:
            out[-1] = out[-1].removesuffix(", stride=")  # a merged stride slot at its default
            out.append(rest)
            continue
        out += [by_pos.get(pos) or _literal(g.roles[pos], g.instances[0][pos]), rest]
    text = "".join(out)
    if names:
        args = ", ".join(_decl(n) for n in _ordered(names))
        head = f"    def __init__(self, {args}):"
        if len(head) > LINE_LENGTH:  # as ruff formats it: one parameter a line
            params = ["self", *(_decl(n) for n in _ordered(names))]
            head = "    def __init__(\n" + "".join(f"        {a},\n" for a in params) + "    ):"
        text = text.replace("    def __init__(self):", head, 1)
    doc = f'    """``{g.base}`` of the source model."""'
    # A class whose children are numbered (a Flax layer collection) reads them as self[0].
    base = "Scope" if re.search(r"\bself\[", text) else "nn.Module"
    return "\n".join([f"class {g.name}({base}):", doc, "", text])


def _resolve(text: str, groups: list[_Group]) -> str:
    def sub(m: re.Match) -> str:
        g = groups[int(m.group(1))]
        values = tuple(v for v in m.group(2).split(",") if v)
        if g.convert is not None:  # values or, inside a class, its field names
            values = tuple(map(str, g.convert(values)))
        if g.alias is not None:
            g = groups[g.alias]
        names, by_pos = _fields(g)
        args = []
        for n in _ordered(names):
            pos = min(p for p, f in by_pos.items() if f == n)
            default = _DEFAULTS.get(n.rstrip("0123456789"))
            if default is None:
                args.append(_literal(g.roles[pos], values[pos]))
            elif values[pos] != str(default):
                args.append(f"{n}={_literal(g.roles[pos], values[pos])}")
        return f"{g.name}({', '.join(args)})"

    return _TOKEN.sub(sub, text)


def build(tree: Tree, classes: dict[tuple[str, ...], str]) -> None:
    """Extract a generated class per user-class path (deepest first). Instances of one source
    class with one structure share a class, differing channel / feature counts becoming
    constructor fields; other structures are variants (``BasicBlockDownsample``)."""
    _hoist_layout(tree)
    groups: list[_Group] = []
    taken: set[str] = {"Model", "Scope"}
    for path in sorted(classes, key=lambda p: (-len(p), p)):
        done = _extract(tree, path)
        if done is None:
            continue
        skeleton, roles, values = _abstract("\n".join(done[0]), groups)
        base = classes[path]
        gid = next(
            (i for i, g in enumerate(groups) if g.base == base and g.skeleton == skeleton), None
        )
        if gid is None:
            same = [g for g in groups if g.base == base]
            name = variant_name(base, skeleton, same)
            k = 1
            while name in taken:
                k += 1
                name = f"{base}{k}"
            taken.add(name)
            groups.append(_Group(name, base, skeleton, roles))
            gid = len(groups) - 1
        groups[gid].instances.append(values)
        tree.kinds[path] = groups[gid].name
        tok = f"{{inst:{gid}:{','.join(map(str, values))}}}"
        tree.init = [(_instantiate(ln, tok) if p == path else ln, p) for ln, p in tree.init]
    merge_optional(groups)
    renamed = {g.name: groups[g.alias].name for g in groups if g.alias is not None}
    renamed.update({g.name: g.name for g in groups if g.alias is None})
    tree.kinds = {p: renamed.get(k, k) for p, k in tree.kinds.items()}
    tree.classes = [_resolve(_render(g), groups) for g in groups if g.alias is None]
    tree.init = [(_resolve(ln, groups), p) for ln, p in tree.init]


_PERMUTE = re.compile(r"^\w+ = \w+\.permute\([\d, ]+\)(  # .*)?$")


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _hoist_layout(tree: Tree) -> None:
    """A layout transpose (NHWC <-> NCHW) that opens or closes a module's run belongs to the
    caller: the block itself reads and writes the layout of its neighbours."""
    body = tree.body
    for i, s in enumerate(body):
        if not s.owner or not _PERMUTE.match(s.text):
            continue
        after = body[i + 1].owner if i + 1 < len(body) else ()
        before = body[i - 1].owner if i else ()
        if after[: len(s.owner)] != s.owner:
            s.owner = _common(s.owner, after)
        elif before[: len(s.owner)] != s.owner:
            s.owner = _common(s.owner, before)


def _instantiate(line: str, tok: str) -> str:
    if line.endswith(" = Scope()"):
        return line[: -len("Scope()")] + tok
    return line.replace('", Scope())', f'", {tok})')


# ------------------------------------------------------------------ locals by role

# (an indented line is a nested function's: its locals are not renamed)
_ASSIGN = re.compile(r"^(?P<lhs>\w[\w, ]*?) = (?P<rhs>.*)$")
_IDENT = re.compile(r"(?<![\w.\"'])[A-Za-z_]\w*(?![\w\"'])")


_LAYER_NAME = re.compile(
    r"(Dense|Conv|LayerNorm|BatchNorm|GroupNorm|RMSNorm|Embed|Dropout|Linear|Norm)"
)


def _layer_like(callee: str) -> bool:
    """A generated class named like a layer (a user's ``BatchNorm``): its value is ``h``."""
    last = re.split(r"[.\[\]]", callee.rstrip("]"))[-1]
    return bool(_LAYER_NAME.match(last)) and not last.startswith("Embed")


#: Projection layer names (``query``, ``q_proj``, ``wq``) -> the role of their value.
_QKV = {"q": "q", "query": "q", "k": "k", "key": "k", "v": "v", "value": "v"}


def _role(rhs: str, blocks: set[str]) -> str:
    m = re.match(r"self(?:\.\w+|\[\d+\])+\((?P<args>.*)\)(?P<tail>.*)$", rhs)
    if m:
        callee = rhs.split("(", 1)[0]
        if callee in blocks:
            return "h" if _layer_like(callee) else "x"
        last = re.split(r"[.\[\]]", callee.rstrip("]"))[-1]
        if "need_weights" in rhs or ("attention" in last.lower() and "norm" not in last.lower()):
            return "attn"
        proj = last.lower().removesuffix("_proj").removeprefix("w")
        if proj in _QKV:
            return _QKV[proj]
        if last.startswith("Embed"):
            return "x"
        return (
            "x"
            if last[:1].isupper()
            and not re.match(
                r"(Dense|Conv|LayerNorm|BatchNorm|GroupNorm|RMSNorm|Embed|Dropout|Linear)", last
            )
            else "h"
        )
    if "scaled_dot_product_attention" in rhs or "softmax" in rhs:
        return "attn"
    if re.fullmatch(r"\w+ \+ \w+", rhs):
        return "x"
    return "h"


def _calls_block(line: str, blocks: set[str]) -> bool:
    m = _ASSIGN.match(line)
    callee = m.group("rhs").split("(", 1)[0] if m else ""
    return callee in blocks and not _layer_like(callee)


def rename_locals(
    lines: list[str],
    params: list[str],
    keep: list[str] | None = None,
    blocks: set[str] = frozenset(),
) -> tuple[list[str], list[str]]:
    """``(lines, new param names)``: straight-line ``lines`` (last one ``return ...``) with
    locals named by role, a name reused once the value it held is dead; ``params`` become
    ``x``, ``x2``... except where ``keep`` gives a non-empty name to keep."""
    defs: list[list[str]] = []
    uses: list[set[str]] = []
    local = set(params)
    for ln in lines:
        m = _ASSIGN.match(ln)
        d = [t.strip() for t in m.group("lhs").split(",")] if m else []
        d = [t for t in d if t != "_" and t.isidentifier()]
        rhs = m.group("rhs") if m else ln
        uses.append({t for t in _IDENT.findall(rhs.split("  # ")[0]) if t in local})
        local |= set(d)
        defs.append(d)
    last: dict[str, int] = {}
    for i, u in enumerate(uses):
        for t in u:
            last[t] = i
    new: dict[str, str] = {}
    held: dict[str, str] = {}  # new name -> old name holding it
    free_x = iter(["x", *(f"x{k}" for k in range(2, 99))])
    for k, p in enumerate(params):
        kept = keep[k] if keep else ""
        new[p] = kept or next(n for n in free_x if n not in set(params) | set(held))
        held[new[p]] = p
    for i, d in enumerate(defs):
        line_new: set[str] = set()
        rhs = _ASSIGN.match(lines[i]).group("rhs") if d else ""
        role = _role(rhs.split("  # ")[0], blocks) if d else ""
        if role == "h" and d:
            role = _carried_role(rhs.split("  # ")[0], new) or role
        for old in d:
            first = next((j for j in range(i + 1, len(lines)) if old in uses[j]), None)
            if len(d) == 1 and first is not None and _calls_block(lines[first], blocks):
                role = "x"  # the value a block takes: the model's running value
            k = 1
            while True:
                cand = role if k == 1 else f"{role}{k}"
                owner = held.get(cand)
                free = owner is None or last.get(owner, -1) <= i
                if free and cand not in line_new:
                    break
                k += 1
            new[old] = cand
            held[cand] = old
            line_new.add(cand)
            last.setdefault(old, len(lines))
    if not new:
        return lines, [new.get(p, p) for p in params]
    pat = re.compile(
        r"(?<![\w.\"'])("
        + "|".join(map(re.escape, sorted(new, key=len, reverse=True)))
        + r")(?![\w\"'])"
    )
    return [
        pat.sub(lambda m: new[m.group(1)], ln.split("  # ")[0])
        + ("  # " + ln.split("  # ", 1)[1] if "  # " in ln else "")
        for ln in lines
    ], [new[p] for p in params]


_RESHAPE = re.compile(r"^(?P<v>\w+)\.(?:reshape|view|permute|transpose|contiguous)\(")


def _carried_role(rhs: str, new: dict[str, str]) -> str | None:
    """A role that a value keeps through a reshape (``q = q.reshape(...)``), or ``scores``
    for the product of a ``q`` and a ``k``."""

    def role_of(name: str) -> str:
        return re.sub(r"\d+$", "", new.get(name, ""))

    m = _RESHAPE.match(rhs)
    if m and role_of(m.group("v")) in ("q", "k", "v"):
        return role_of(m.group("v"))
    used = {role_of(t) for t in _IDENT.findall(rhs)}
    if {"q", "k"} <= used and ("einsum" in rhs or "@" in rhs or "matmul" in rhs):
        return "scores"
    return None


_CHAIN = re.compile(
    r"^(?P<ind> *)(?P<v>\w+) = self\.(?P<p>\w+?)(?P<sep>_|\[)(?P<i>\d+)\]?\((?P=v)\)$"
)


def _item(m: re.Match, k: int = 0) -> str:
    i = int(m.group("i")) + k
    return f"{m.group('p')}_{i}" if m.group("sep") == "_" else f"{m.group('p')}[{i}]"


def loop_chains(lines: list[str], kinds: dict[str, str]) -> list[str]:
    """``x = self.Block_0(x)``, ``x = self.Block_1(x)``... of one generated class become
    ``for block in (self.Block_0, self.Block_1): x = block(x)``."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _CHAIN.match(lines[i])
        j = i + 1
        if m:
            kind = kinds.get(_item(m))
            while j < len(lines):
                n = _CHAIN.match(lines[j])
                if not (
                    n
                    and n.group("v") == m.group("v")
                    and n.group("p") == m.group("p")
                    and n.group("sep") == m.group("sep")
                    and int(n.group("i")) == int(m.group("i")) + j - i
                    and kinds.get(_item(n)) == kind
                    and kind
                ):
                    break
                j += 1
        if m and j - i >= 2:
            ind, v = m.group("ind"), m.group("v")
            names = [f"self.{_item(m, k)}" for k in range(j - i)]
            head = f"{ind}for block in ({', '.join(names)}):"
            if len(head) > LINE_LENGTH - 8:  # as ruff formats it: one item a line
                out += [f"{ind}for block in (", *(f"{ind}    {n}," for n in names), f"{ind}):"]
            else:
                out.append(head)
            out.append(f"{ind}    {v} = block({v})")
            i = j
        else:
            out.append(lines[i])
            i += 1
    return out


# ------------------------------------------------------------------ optional branches

_ATTR = re.compile(r'^ {8}self\.(?P<a>\w+) = |^ {8}self\.register_buffer\("(?P<b>\w+)"')
_STRIDE_ARG = re.compile(r", stride=(\d+)")
_FWD_LINE = re.compile(r"^ {8}(?:(?P<v>\w+) = |return )(?P<rhs>.*)$")
_HEAD = ["    def __init__(self):", "        super().__init__()"]


def merge_optional(groups: list[_Group]) -> None:
    """Fold a variant that only adds an optional branch into its plain class, in place (the
    Flax emitter's rule of the same name, see ``xconv/converters/flax/source/classes.py``).

    ``BasicBlockConv`` (``self.Conv_2`` and ``self.BatchNorm_2`` more, ``h2 = <branch>(x)``
    added to the residual, ``stride=2``) and ``BasicBlock`` (the same layers, the block input
    as the residual) become one ``BasicBlock`` with ``stride: int = 1`` and ``downsample: bool
    = False`` fields; the branch is built and called under ``if self.downsample``. Attribute
    names are unchanged, so are the state_dict keys. The variant's group then points at the
    merged one (``alias``); placeholders of either are converted when resolved."""
    fold_optional(groups, _merge, "roles")


def _split(skeleton: str):
    lines = skeleton.split("\n")
    fwd = next((i for i, ln in enumerate(lines) if ln.startswith("    def forward(")), None)
    if fwd is None or lines[:2] != _HEAD or _SLOT in "".join(lines[fwd:]):
        return None
    init = [ln for ln in lines[2:fwd] if ln]
    body = lines[fwd + 1 :]
    if not all(_FWD_LINE.match(ln) for ln in body):
        return None
    attrs = []
    for ln in init:
        m = _ATTR.match(ln)
        if m is None:
            return None
        attrs.append(m.group("a") or m.group("b"))
    return init, attrs, lines[fwd], body


def _offsets(lines: list[str]) -> list[int]:
    out, n = [], 0
    for ln in lines:
        out.append(n)
        n += ln.count(_SLOT)
    return out


def _merge_forward(vattrs: list[str], extra: list[int], vsig: str, vbody: list[str], pbody):
    """``(branch line, its value, its expression, the value it reads)`` or None.

    One line of the variant's forward computes the branch's value from one value ``y``; with
    ``y`` in its place (and without the line) the variant's forward is the plain one."""
    own = re.compile(r"self\.(?:" + "|".join(vattrs[i] for i in extra) + r")\b")
    uses = [i for i, ln in enumerate(vbody) if own.search(ln)]
    if len(uses) != 1:
        return None
    u = uses[0]
    head = _FWD_LINE.match(vbody[u])
    if not head.group("v"):
        return None
    r, rhs = head.group("v"), head.group("rhs")
    params = re.findall(r"\w+", vsig.split("(", 1)[1])[1:]
    known = set(params) | {_FWD_LINE.match(ln).group("v") for ln in vbody[:u]} - {None}
    reads = {t for t in _IDENT.findall(rhs) if t in known}
    if len(reads) != 1:
        return None
    y = reads.pop()
    defs = [_FWD_LINE.match(ln).group("v") for ln in vbody]
    if defs.count(r) != 1 or y in defs[u:]:
        return None
    word = re.compile(rf"(?<![\w.]){re.escape(r)}(?!\w)")
    without = [word.sub(y, ln) for i, ln in enumerate(vbody) if i != u]
    if without != pbody:
        return None
    return u, r, rhs, y


def _merge_body(vbody: list[str], u: int, r: str, rhs: str, y: str) -> list[str]:
    """The variant's forward body with its branch line under ``self.downsample``."""
    name = "residual" if not any(re.search(r"\bresidual\b", ln) for ln in vbody) else r
    line = f"        {name} = {rhs} if self.downsample else {y}"
    if len(line) <= LINE_LENGTH:
        branch = [line]
    else:
        branch = [
            f"        {name} = {y}",
            "        if self.downsample:",
            f"            {name} = {rhs}",
        ]
    rename = re.compile(rf"(?<![\w.]){re.escape(r)}(?!\w)")
    return [*vbody[:u], *branch, *(rename.sub(name, ln) for ln in vbody[u + 1 :])]


def _merge_init(var: _Group, pinit: list[str], vinit: list[str], extra: list[int], rest):
    """The merged constructor: ``(lines, roles, sources, branch slots)`` or None.

    Slots are in the order of the merged text, each with its ``(plain, variant)`` source: a
    slot index, ``("const", value)``, ``("stride", value)`` or a function of the values; the
    branch slots' plain sources (None) are filled by :func:`_merge_fill`."""
    voff, poff = _offsets(vinit), _offsets(pinit)
    pline = {i: k for k, i in enumerate(rest)}
    roles: list[str] = ["downsample"]
    srcs: list[tuple[Any, Any]] = [(lambda p: 0, lambda v: 1)]
    init = [*_HEAD, f"        self.downsample = {_SLOT}"]
    fills: list[int] = []  # merged slots of the branch: plain values filled from a like slot
    for i, ln in enumerate(vinit):
        if i == extra[0]:
            init.append("        if self.downsample:")
        j = pline.get(i)
        pstr = [int(s) for s in _STRIDE_ARG.findall(pinit[j])] if j is not None else []
        vstr = [int(s) for s in _STRIDE_ARG.findall(ln)]
        if j is not None and pstr and len(pstr) != len(vstr):
            return None
        k = s = 0
        text = []
        for piece in re.split(rf"({_SLOT}|, stride=\d+)", ln):
            if piece == _SLOT:
                vpos = voff[i] + k
                ppos = poff[j] + k if j is not None else None
                roles.append(var.roles[vpos])
                srcs.append((ppos, vpos))
                k += 1
                text.append(_SLOT)
            elif piece.startswith(", stride="):
                roles.append("stride")
                pv = (pstr[s] if pstr else 1) if j is not None else None
                srcs.append((("const", pv), ("stride", vstr[s])))
                s += 1
                text.append(f", stride={_SLOT}")
            else:
                text.append(piece)
            if j is None and piece and (piece == _SLOT or piece.startswith(", stride=")):
                fills.append(len(srcs) - 1)
        line = "".join(text)
        init.append(("    " + line) if j is None else line)
        if len(init[-1]) > LINE_LENGTH:
            return None
    return init, roles, srcs, fills


def _src_value(src, inst):
    if isinstance(src, int):
        return inst[src]
    return src[1]


def _merge_fill(var: _Group, roles: list[str], srcs: list, fills: list[int]) -> bool:
    """Give each branch slot, for the plain instances, a like slot's value (in place)."""

    def vcol(m: int) -> tuple[int, ...]:
        return tuple(_src_value(srcs[m][1], inst) for inst in var.instances)

    for m in fills:
        like = [
            n
            for n in range(1, len(srcs))
            if n not in fills and vcol(n) == vcol(m) and srcs[n][0] is not None
        ]
        like.sort(key=lambda n: roles[n] != roles[m])
        if like:
            srcs[m] = (srcs[like[0]][0], srcs[m][1])
        elif roles[m] == "stride":
            srcs[m] = (("const", 1), srcs[m][1])
        else:
            return False
    return True


def _merge(plain: _Group, var: _Group):
    """``(skeleton, roles, plain values -> merged, variant values -> merged)`` or None."""
    ps, vs = _split(plain.skeleton), _split(var.skeleton)
    if ps is None or vs is None:
        return None
    pinit, pattrs, psig, pbody = ps
    vinit, vattrs, vsig, vbody = vs
    extra = [i for i, a in enumerate(vattrs) if a not in set(pattrs)]
    if not extra or extra != list(range(extra[0], extra[-1] + 1)) or psig != vsig:
        return None
    if set(pattrs) - set(vattrs) or "downsample" in vattrs or "downsample" in vsig:
        return None
    rest = [i for i in range(len(vinit)) if i not in extra]
    if [_STRIDE_ARG.sub("", vinit[i]) for i in rest] != [_STRIDE_ARG.sub("", ln) for ln in pinit]:
        return None
    fwd = _merge_forward(vattrs, extra, vsig, vbody, pbody)
    if fwd is None:
        return None
    body = _merge_body(vbody, *fwd)
    ctor = _merge_init(var, pinit, vinit, extra, rest)
    if ctor is None:
        return None
    init, roles, srcs, fills = ctor
    if not _merge_fill(var, roles, srcs, fills):
        return None

    def from_plain(vals: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(_src_value(p, vals) if not callable(p) else p(vals) for p, _ in srcs)

    def from_var(vals: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(_src_value(v, vals) if not callable(v) else v(vals) for _, v in srcs)

    sig = [vsig, *body]
    return "\n".join([*init, "", *sig]), roles, from_plain, from_var
