"""Generated block classes with constructor fields: one class per source class and structure.

Instances of a source block class (a torch ``BasicBlock``) whose generated classes differ only
in the channel counts of their layers become one class with fields (``features: int``), each
instance built with its own values (``BasicBlock(8)``, ``BasicBlock(16)``). Instances that
differ in structure (one has a ``downsample``) stay separate classes, named after the source
class plus what the variant adds (``BasicBlockDownsample``).

While the tree is emitted, a parent refers to a child instance by a placeholder
(``{inst:<group>:<values>}``); :func:`resolve` writes the final constructor calls once every
group's instances, hence its fields, are known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from xconv.converters.module_tree import class_attrs as _attrs  # noqa: F401 (re-export)
from xconv.converters.module_tree import variant_name  # noqa: F401 (re-export)

#: Leading positional ints of a layer constructor: its feature counts.
_CTOR = re.compile(
    r"(?P<ctor>nnx?\.(?:Conv|Dense|ConvTranspose|Linear|BatchNorm|LayerNorm|GroupNorm|RMSNorm))"
    r"\((?P<a>\d+)(?:, (?P<b>\d+))?(?=[,)])"
)
#: A boolean argument of an activation that instances may differ in (torch's
#: ``nn.GELU(approximate=...)`` per layer): a ``bool`` field.
_FLAG = re.compile(r"(?<=\bjax\.nn\.gelu\()(?P<x>[^\n]*?), approximate=(?P<flag>True|False)\)")
_BOOL_ROLES = frozenset({"approximate"})
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
    return "bool" if name.rstrip("_0123456789") in _BOOL_ROLES else "int"


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
    return names, {pos: columns[c] for pos, c in cols.items()}


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
        lines = "".join(f"\n    {n}: {_type(n)}" for n in names)
        return text[:doc_end] + "\n" + lines + text[doc_end:]
    args = ", ".join(f"{n}: {_type(n)}" for n in names)
    head = f"def __init__(self, {args}, *, rngs: nnx.Rngs):"
    keep = "".join(f"\n        self.{n} = {n}" for n in names if _type(n) == "bool")
    return text.replace("def __init__(self, *, rngs: nnx.Rngs):", head + keep, 1)


def resolve(text: str, groups: list[Group], api: str) -> str:
    """Placeholders -> constructor calls (``BasicBlock(16)``, ``...(16, rngs=rngs)``)."""

    def sub(m: re.Match) -> str:
        group = groups[int(m.group(1))]
        values = tuple(int(v) for v in m.group(2).split(",") if v)
        names, by_pos = _fields(group)
        args = []
        for name in names:
            pos = min(p for p, f in by_pos.items() if f == name)
            args.append(_literal(group.slots[pos], values[pos]))
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
