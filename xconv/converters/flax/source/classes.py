"""Generated block classes with constructor fields: one class per source class and structure.

Instances of a source block class (a torch ``BasicBlock``) whose generated classes differ only
in the channel counts of their layers become one class with fields (``features: int``), each
instance built with its own values (``BasicBlock(8)``, ``BasicBlock(16)``). Instances that
differ in structure stay separate classes, named after the source class plus what the variant
adds. One difference is folded into fields instead: a variant that only adds an optional
branch (a ``downsample``: its own submodules and one line computing the residual from them)
and strides becomes the same class with ``strides: int = 1`` and ``downsample: bool = False``
fields, the branch built and called under ``if self.downsample:`` (see :func:`merge_optional`).

While the tree is emitted, a parent refers to a child instance by a placeholder
(``{inst:<group>:<values>}``); :func:`resolve` writes the final constructor calls once every
group's instances, hence its fields, are known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from xconv.converters.module_tree import (
    LINE_LENGTH,
    fold_optional,
    split_args,
    variant_name,  # noqa: F401 (re-export)
)
from xconv.converters.module_tree import class_attrs as _attrs  # noqa: F401 (re-export)

#: Leading positional ints of a layer constructor: its feature counts.
_CTOR = re.compile(
    r"(?P<ctor>nnx?\.(?:Conv|Dense|ConvTranspose|Linear|BatchNorm|LayerNorm|GroupNorm|RMSNorm))"
    r"\((?P<a>\d+)(?:, (?P<b>\d+))?(?=[,)])"
)
#: A boolean argument of an activation that instances may differ in (torch's
#: ``nn.GELU(approximate=...)`` per layer): a ``bool`` field.
_FLAG = re.compile(r"(?<=\bjax\.nn\.gelu\()(?P<x>[^\n]*?), approximate=(?P<flag>True|False)\)")
_BOOL_ROLES = frozenset({"approximate", "downsample", "shortcut"})
#: Fields with a default (``strides: int = 1``): passed by keyword, omitted when default.
_DEFAULTS = {"strides": 1, "downsample": 0, "shortcut": 0}
_LOOP_LINE = re.compile(r"\s*(for block in self\.\w+:|\w+ = block\()")
_TOKEN = re.compile(r"\{inst:(\d+):([\d,]*)\}")
_SLOT = "\x00"


@dataclass
class Group:
    """The instances of one source class with one structure."""

    name: str
    skeleton: str  # class text, feature counts replaced by slots
    slots: list[str]  # the slot's field role per position: "features" or "in_features"
    base: str = ""  # the source class name
    instances: list[tuple[int, ...]] = field(default_factory=list)
    alias: int | None = None  # merged into this group (see :func:`merge_optional`)
    convert: object = None  # a token's values -> the values of the (merged) group


def _roles(ctor: str, api: str, two: bool) -> list[str]:
    if api == "nnx" and two:
        return ["in_features", "features"]
    return ["features"]


def abstract(text: str, api: str) -> tuple[str, list[str], tuple[int, ...]]:
    """``(skeleton, slot roles, values)``: ``text`` with its layer feature counts lifted out."""
    roles: list[str] = []
    values: list[int] = []

    found: list[tuple[int, int, str, list[str], list[int]]] = []
    for m in _CTOR.finditer(text):
        two = m.group("b") is not None
        nums = [int(m.group("a"))] + ([int(m.group("b"))] if two else [])
        rep = f"{m.group('ctor')}(" + ", ".join(_SLOT for _ in nums)
        found.append((m.start(), m.end(), rep, _roles(m.group("ctor"), api, two), nums))
    for m in _FLAG.finditer(text):
        rep = f"{m.group('x')}, approximate={_SLOT})"
        found.append((m.start(), m.end(), rep, ["approximate"], [int(m.group("flag") == "True")]))
    out, last = [], 0
    for start, end, rep, rs, nums in sorted(found):  # slots in the order of the text
        out += [text[last:start], rep]
        roles.extend(rs)
        values.extend(nums)
        last = end
    return "".join([*out, text[last:]]), roles, tuple(values)


def _literal(role: str, value: int) -> str:
    return str(bool(value)) if role in _BOOL_ROLES else str(value)


def _type(name: str) -> str:
    return "bool" if _base(name) in _BOOL_ROLES else "int"


def _fields(group: Group) -> tuple[list[str], dict[int, str]]:
    """Field names and ``{slot position: field}`` for the positions that vary."""
    roles: dict[tuple[int, ...], set[str]] = {}
    cols: dict[int, tuple[int, ...]] = {}
    for pos, role in enumerate(group.slots):
        column = tuple(inst[pos] for inst in group.instances)
        if len(set(column)) > 1:
            cols[pos] = column
            roles.setdefault(column, set()).add(role)
    columns: dict[tuple[int, ...], str] = {}
    names: list[str] = []
    for column, rs in roles.items():  # a count used as both in and out is the features
        role = "features" if "features" in rs else sorted(rs)[0]
        name = role if role not in names else f"{role}_{len(names) + 1}"
        columns[column] = name
        names.append(name)
    order = list(_DEFAULTS)
    names.sort(key=lambda n: order.index(_base(n)) + 1 if _base(n) in _DEFAULTS else 0)
    return names, {pos: columns[c] for pos, c in cols.items()}


def _base(name: str) -> str:
    return name.rstrip("_0123456789")


def _decl(name: str) -> str:
    default = _DEFAULTS.get(_base(name))
    tail = "" if default is None else f" = {_literal(_base(name), default)}"
    return f"{name}: {_type(name)}{tail}"


def _plain(name: str) -> str:
    """``strides=1``: a defaulted parameter without its annotation."""
    return f"{name}={_literal(_base(name), _DEFAULTS[_base(name)])}"


def render_group(group: Group, api: str) -> str:
    """The class text, varying feature counts as fields."""
    names, by_pos = _fields(group)
    first = group.instances[0]
    parts = group.skeleton.split(_SLOT)
    out = [parts[0]]
    for pos, rest in enumerate(parts[1:]):
        f = by_pos.get(pos)
        here = _literal(group.slots[pos], first[pos])
        # nnx reads a flag in __call__: an attribute (set first thing in __init__)
        flag = api == "nnx" and group.slots[pos] in _BOOL_ROLES
        out.append((f if api == "nnx" and not flag else f"self.{f}") if f else here)
        out.append(rest)
    text = "".join(out).replace("{cls}", group.name)
    if not names:
        return text
    if api == "linen":
        doc_end = text.index('"""', text.index('"""') + 3) + 3
        lines = "".join(f"\n    {_decl(n)}" for n in names)
        return text[:doc_end] + "\n" + lines + text[doc_end:]
    args = ", ".join(_decl(n) for n in names)
    head = f"def __init__(self, {args}, *, rngs: nnx.Rngs):"
    if len(head) + 4 > 100:  # a field with a default says its type by the default
        args = ", ".join(_decl(n) if _DEFAULTS.get(_base(n)) is None else _plain(n) for n in names)
        head = f"def __init__(self, {args}, *, rngs: nnx.Rngs):"
    if len(head) + 4 > 100:  # then plain names rather than one parameter a line
        args = ", ".join(n if _DEFAULTS.get(_base(n)) is None else _plain(n) for n in names)
        head = f"def __init__(self, {args}, *, rngs: nnx.Rngs):"
    if len(head) + 4 > 100:  # as ruff formats it: one parameter a line
        params = ["self", *(_decl(n) for n in names), "*", "rngs: nnx.Rngs"]
        head = "def __init__(\n" + "".join(f"        {a},\n" for a in params) + "    ):"
    keep = "".join(f"\n        self.{n} = {n}" for n in names if _type(n) == "bool")
    return text.replace("def __init__(self, *, rngs: nnx.Rngs):", head + keep, 1)


def resolve(text: str, groups: list[Group], api: str) -> str:
    """Placeholders -> constructor calls (``BasicBlock(16)``, ``...(16, rngs=rngs)``)."""

    def sub(m: re.Match) -> str:
        group = groups[int(m.group(1))]
        values = tuple(int(v) for v in m.group(2).split(",") if v)
        if group.convert is not None:
            values = group.convert(values)
        if group.alias is not None:
            group = groups[group.alias]
        names, by_pos = _fields(group)
        args = []
        for name in names:
            pos = min(p for p, f in by_pos.items() if f == name)
            default = _DEFAULTS.get(_base(name))
            if default is None:
                args.append(_literal(group.slots[pos], values[pos]))
            elif values[pos] != default:
                args.append(f"{name}={_literal(group.slots[pos], values[pos])}")
        if api == "nnx":
            args.append("rngs=rngs")
        return f"{group.name}({', '.join(args)})"

    return _TOKEN.sub(sub, text)


def token(index: int, values: tuple[int, ...]) -> str:
    return f"{{inst:{index}:{','.join(map(str, values))}}}"


_SETUP = re.compile(r"^self\.(?P<p>\w+?)_(?P<i>\d+) = (?P<ctor>.+)$")
_CALL = re.compile(
    r"^(?P<v>\w+) = self\.(?P<p>\w+?)_(?P<i>\d+)\((?P=v)(?P<rest>(?:, train=train)?)\)"
)


def loop_lists(
    setup: list[str], body: list[str], api: str = "linen"
) -> tuple[list[str], list[str]]:
    """Children ``p_0 .. p_{n-1}`` (a torch ``Sequential`` of blocks) called one after the
    other on one value become a list attribute ``self.p`` called in a loop. linen names a
    list's elements ``p_0``, ``p_1``, so the variables are the same as the attributes'; nnx
    keeps an ``nnx.List`` under ``p/0``, ``p/1`` (see :func:`nnx_list_path`)."""
    tried: set[str] = set()
    while True:
        runs: dict[str, list[int]] = {}
        for i, line in enumerate(setup):
            m = _SETUP.match(line)
            if m and m.group("ctor").startswith("{inst:") and m.group("p") not in tried:
                runs.setdefault(m.group("p"), []).append(i)
        if not runs:
            return setup, body
        prefix, rows = next(iter(runs.items()))
        tried.add(prefix)
        done = _loop(prefix, rows, setup, body, api)
        if done is not None:
            setup, body = done


def _loop(prefix: str, rows: list[int], setup: list[str], body: list[str], api: str):
    text = "\n".join([*setup, *body])
    n = len(rows)
    indexes = [int(_SETUP.match(setup[r]).group("i")) for r in rows]
    if n < 2 or indexes != list(range(n)) or rows != list(range(rows[0], rows[0] + n)):
        return None
    if re.search(rf"self\.{prefix}\b", text):
        return None  # the name is taken
    calls = [i for i, line in enumerate(body) if re.search(rf"self\.{prefix}_\d+\(", line)]
    if len(calls) != n or calls != list(range(calls[0], calls[0] + n)):
        return None
    matches = [_CALL.match(body[c]) for c in calls]
    if not all(matches) or len({(m.group("v"), m.group("rest")) for m in matches}) != 1:
        return None
    if [int(m.group("i")) for m in matches] != list(range(n)):
        return None
    ctors = [_SETUP.match(setup[r]).group("ctor") for r in rows]
    same = len(set(ctors)) == 1
    items = f"[{ctors[0]} for _ in range({n})]" if same else f"[{', '.join(ctors)}]"
    if api == "nnx":
        items = f"nnx.List({items})"
    # ``block`` is free unless something other than an earlier loop of this kind uses it.
    others = [ln for ln in text.splitlines() if not _LOOP_LINE.match(ln)]
    loop_var = "block" if not any(re.search(r"\bblock\b", ln) for ln in others) else "block_"
    v, rest = matches[0].group("v"), matches[0].group("rest")
    setup = [*setup[: rows[0]], f"self.{prefix} = {items}", *setup[rows[0] + n :]]
    body = [
        *body[: calls[0]],
        f"for {loop_var} in self.{prefix}:",
        f"    {v} = {loop_var}({v}{rest})",
        *body[calls[0] + n :],
    ]
    return setup, body


_NNX_LIST = re.compile(r"^self\.(?P<p>\w+) = nnx\.List\(")


def nnx_list_path(path: tuple[str, ...], lists: set[str]) -> tuple[str, ...]:
    """``("layer1_0", "conv1", "kernel")`` -> ``("layer1", "0", "conv1", "kernel")`` when
    ``layer1`` became an ``nnx.List``."""
    if path:
        head, _, index = path[0].rpartition("_")
        if head in lists and index.isdigit():
            return (head, index, *path[1:])
    return path


def nnx_lists(setup: list[str], body: list[str]) -> tuple[list[str], list[str], set[str]]:
    """The root's loops for nnx: ``(setup, body, list attribute names)``."""
    setup, body = loop_lists(setup, body, "nnx")
    return setup, body, {m.group("p") for ln in setup if (m := _NNX_LIST.match(ln))}


_LIST_LINE = re.compile(r"^(?P<ind> *)self\.(?P<p>\w+) = nnx\.List\(\[(?P<items>.*)\]\)$")


def split_nnx_lists(text: str, width: int = LINE_LENGTH) -> str:
    """An ``nnx.List`` of differing blocks too long for one line, built a run at a time.

    ``self.layer2 = nnx.List([BasicBlock(8, 16, strides=2, ...), BasicBlock(16, 16, ...)])``
    becomes ``self.layer2 = nnx.List([BasicBlock(8, 16, strides=2, ...)])`` and
    ``self.layer2.append(BasicBlock(16, 16, ...))`` (``.extend(... for _ in range(n))`` for a
    run of identical blocks): one line per distinct block rather than ruff's six-line
    nesting of a list inside a call. The elements and their order are the same."""
    out = []
    for line in text.split("\n"):
        m = _LIST_LINE.match(line)
        items = split_args(m.group("items")) if m and len(line) > width else []
        if len(items) < 2 or any(" for _ in range(" in a for a in items):
            out.append(line)
            continue
        runs: list[list[str]] = []
        for item in items:
            if runs and runs[-1][0] == item:
                runs[-1].append(item)
            else:
                runs.append([item])
        ind, attr = m.group("ind"), f"self.{m.group('p')}"
        for i, run in enumerate(runs):
            many = f"{run[0]} for _ in range({len(run)})" if len(run) > 1 else run[0]
            if i == 0:
                out.append(f"{ind}{attr} = nnx.List([{many}])")
            else:
                out.append(f"{ind}{attr}.{'extend' if len(run) > 1 else 'append'}({many})")
    return "\n".join(out)


_STRIDES = re.compile(r"strides=(\d+)")
_BODY_LINE = re.compile(r"^ {8}(?:(?P<v>\w+) = |return )(?P<rhs>.*)$")


def merge_optional(groups: list[Group], api: str) -> None:
    """Fold a variant that only adds an optional branch into its plain class, in place.

    ``BasicBlockDownsample`` (``self.downsample_0``, ``self.downsample_1``, ``residual =
    <branch>(x)``, ``strides=2``) and ``BasicBlock`` (the same layers, the block input as the
    residual) become one ``BasicBlock`` with ``strides: int = 1`` and ``downsample: bool =
    False`` fields. The variant's group then points at the merged one (``alias``); placeholders
    of either are converted to the merged group's values when resolved."""
    for plain, var in fold_optional(groups, lambda p, v: _merge(p, v, api), "slots"):
        if var.name == var.base:
            plain.name = var.name


def _ssa(lines: list[str], env: dict[str, str]) -> list[str] | None:
    """Body lines with their locals renamed by definition (``v0``, ``v1``...)."""
    out: list[str] = []
    for line in filter(None, lines):
        m = _BODY_LINE.match(line)
        if m is None:
            return None
        rhs = re.sub(
            r"(?<![\w.])[A-Za-z_]\w*\b(?!\s*=[^=])",
            lambda t: env.get(t.group(0), t.group(0)),
            m.group("rhs"),
        )
        if m.group("v"):
            env[m.group("v")] = f"v{len(out) + 1}"
            out.append(f"{env[m.group('v')]} = {rhs}")
        else:
            out.append(f"return {rhs}")
    return out


def _merge_setup(plain: Group, var: Group):
    """``(stem, plain lines, variant lines, call line, branch lines, rest lines)`` or None.

    The variant adds attributes of one boolean role (``stem``); its setup less those lines
    equals the plain setup (but for strides), and both ``__call__`` signatures are equal."""
    extra = [a for a in _attrs(var.skeleton) if a not in set(_attrs(plain.skeleton))]
    stems = {a.split("_")[0] for a in extra}
    if not extra or len(stems) != 1 or set(_attrs(plain.skeleton)) - set(_attrs(var.skeleton)):
        return None
    stem = stems.pop()
    if stem not in _BOOL_ROLES or stem in _attrs(var.skeleton) or "strides" in plain.skeleton:
        return None
    pl, vl = plain.skeleton.split("\n"), var.skeleton.split("\n")
    call_p = next((i for i, ln in enumerate(pl) if ln.startswith("    def __call__(")), None)
    call_v = next((i for i, ln in enumerate(vl) if ln.startswith("    def __call__(")), None)
    if call_p is None or call_v is None or pl[call_p] != vl[call_v]:
        return None
    if _SLOT in "".join(pl[call_p:] + vl[call_v:]):
        return None
    own = re.compile(rf"self\.{stem}_\w+\b")
    # the setup: the variant's lines less its branch equal the plain lines (but for strides)
    branch = [i for i, ln in enumerate(vl[:call_v]) if own.search(ln)]
    if any(not re.match(rf"^ {{8}}self\.{stem}_\w+ = ", vl[i]) for i in branch):
        return None
    rest = [i for i in range(call_v) if i not in branch]
    if [_STRIDES.sub("", vl[i]).replace(", ,", ",") for i in rest] != [
        _STRIDES.sub("", ln).replace(", ,", ",") for ln in pl[:call_p]
    ]:
        return None
    return stem, pl, vl, call_p, call_v, branch, rest


def _merge_call(pl: list[str], vl: list[str], call_p: int, call_v: int, stem: str):
    """``(variant line of the branch, input name, branch value name)`` or None.

    One line of the variant's call computes the branch's value from the input; without it
    (the value being the input) the variant's body is the plain body."""
    own = re.compile(rf"self\.{stem}_\w+\b")
    arg = re.match(r"    def __call__\(self, (\w+)", pl[call_p])
    uses = [i for i in range(call_v + 1, len(vl)) if own.search(vl[i])]
    if arg is None or len(uses) != 1:
        return None
    head = _BODY_LINE.match(vl[uses[0]])
    if head is None or not head.group("v") or head.group("v") == arg.group(1):
        return None
    x, res = arg.group(1), head.group("v")
    want = _ssa(pl[call_p + 1 :], {x: "v0"})
    got = _ssa(
        [ln for i, ln in enumerate(vl[call_v + 1 :], call_v + 1) if i != uses[0]],
        {x: "v0", res: "v0"},
    )
    if want is None or want != got or any(re.search(rf"\b{res}\b", ln) for ln in vl[: uses[0]]):
        return None
    return uses[0], x, res


def _merge_text(var: Group, vl: list[str], call_v: int, branch: list[int], use: int, names):
    """The merged text, from the variant's: ``(lines, slot roles, slot sources)``.

    Each slot's source is ``("v", variant slot)``, ``("flag",)`` or ``("strides", value)``;
    ``names`` is ``(stem, input name, branch value name)``."""
    stem, x, res = names
    slot_of = _slot_offsets(vl)
    out: list[str] = []
    slots: list[str] = []
    srcs: list[tuple] = []

    def emit(line: str, i: int, indent: str = "") -> None:
        pieces = re.split(rf"({_SLOT}|strides=\d+)", line)
        k = 0
        text = []
        for piece in pieces:
            if piece == _SLOT:
                slots.append(var.slots[slot_of[i] + k])
                srcs.append(("v", slot_of[i] + k))
                k += 1
                text.append(_SLOT)
            elif piece.startswith("strides="):
                slots.append("strides")
                srcs.append(("strides", int(piece[8:])))
                text.append(f"strides={_SLOT}")
            else:
                text.append(piece)
        out.append(indent + "".join(text))

    def flag(indent: str) -> None:
        slots.append(stem)
        srcs.append(("flag",))
        out.append(f"{indent}if {_SLOT}:")

    for i in range(call_v):
        if i == branch[0]:
            flag(" " * 8)
        emit(vl[i], i, "    " if i in branch else "")
    out.append(vl[call_v])
    for i in range(call_v + 1, len(vl)):
        if i == use:
            out.append(f"        {res} = {x}")
            flag(" " * 8)
            emit(vl[i], i, "    ")
        else:
            emit(vl[i], i)
    return out, slots, srcs


def _slot_offsets(lines: list[str]) -> list[int]:
    """Line index -> index of its first slot."""
    slot_of: list[int] = []
    n = 0
    for ln in lines:
        slot_of.append(n)
        n += ln.count(_SLOT)
    return slot_of


def _merge(plain: Group, var: Group, api: str):
    """``(skeleton, slots, plain values -> merged, variant values -> merged)`` or None."""
    setup = _merge_setup(plain, var)
    if setup is None:
        return None
    stem, pl, vl, call_p, call_v, branch, rest = setup
    call = _merge_call(pl, vl, call_p, call_v, stem)
    if call is None:
        return None
    use, x, res = call
    slot_of = _slot_offsets(vl)
    rest_slots = [slot_of[i] + k for i in rest for k in range(vl[i].count(_SLOT))]
    out, slots, srcs = _merge_text(var, vl, call_v, branch, use, (stem, x, res))

    # a branch slot takes, for the plain instances, the value of a rest slot with its role
    # and the variant's value (the branch's in/out features are the block's)
    first = var.instances[0]
    fill: dict[int, int] = {}
    for s in (slot_of[i] + k for i in branch for k in range(vl[i].count(_SLOT))):
        same = [r for r in rest_slots if var.slots[r] == var.slots[s] and first[r] == first[s]]
        if not same or any([inst[r] for r in same[:1]] != [inst[s]] for inst in var.instances):
            return None
        fill[s] = rest_slots.index(same[0])

    def from_var(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(values[s[1]] if s[0] == "v" else (1 if s[0] == "flag" else s[1]) for s in srcs)

    def from_plain(values: tuple[int, ...]) -> tuple[int, ...]:
        got = []
        for s in srcs:
            if s[0] == "v":
                got.append(values[fill[s[1]] if s[1] in fill else rest_slots.index(s[1])])
            else:
                got.append(0 if s[0] == "flag" else 1)
        return tuple(got)

    return "\n".join(out), slots, from_plain, from_var


_FOR = re.compile(r"^for (?P<b>\w+) in (?P<seq>self\.\w+):$")


def merge_loops(body: list[str]) -> list[str]:
    """Consecutive loops with one body (``for block in self.layer1: x = block(x)`` then the
    same over ``self.layer2``) as one loop over both lists: ``for block in (*self.layer1,
    *self.layer2):``, as a person writes the stages of a ResNet."""

    def single(k: int) -> re.Match | None:  # a one-statement loop at ``k``
        m = _FOR.match(body[k]) if k + 1 < len(body) else None
        if not m or not body[k + 1].startswith("    ") or body[k + 1].startswith("     "):
            return None
        return m if k + 2 >= len(body) or not body[k + 2].startswith("    ") else None

    out: list[str] = []
    i = 0
    while i < len(body):
        m = single(i)
        if m is None:
            out.append(body[i])
            i += 1
            continue
        seqs, j = [m.group("seq")], i + 2
        while (n := single(j) if j < len(body) else None) and body[j + 1] == body[i + 1]:
            if n.group("b") != m.group("b"):
                break
            seqs.append(n.group("seq"))
            j += 2
        head = seqs[0] if len(seqs) == 1 else "(" + ", ".join(f"*{q}" for q in seqs) + ")"
        out += [f"for {m.group('b')} in {head}:", body[i + 1]]
        i = j
    return out
