"""Framework-free helpers shared by the source emitters that rebuild the source module tree
(the Flax emitter's ``flax_classes`` and the PyTorch emitter's ``source_tree``)."""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

#: The project's line length (ruff); generated statements stay within it when they fold.
LINE_LENGTH = 100


def class_attrs(text: str) -> list[str]:
    """Attributes a generated class's ``__init__``/``setup`` assigns (``self.name = ...``)."""
    return re.findall(r"^ {8}self\.(\w+) =", text, flags=re.M)


def variant_name(base: str, skeleton: str, others: list[Any]) -> str:
    """``BasicBlock`` + what this structure adds over the first group of the class.

    ``others`` are the groups already made (objects with ``name`` and ``skeleton``)."""
    if not others:
        return base
    others = [g for g in others if g.name == base] or others
    extra = [a for a in class_attrs(skeleton) if a not in set(class_attrs(others[0].skeleton))]
    stem = extra[0].split("_")[0] if extra else ""
    return base + stem[:1].upper() + stem[1:] if stem.isidentifier() else base


def optional_merge_pairs(groups: list[Any]):
    """``(plain index, plain, variant)`` candidate pairs for the emitters' ``merge_optional``:
    each group not yet merged (``alias`` / ``convert`` unset) against every other unmerged
    group of the same source class. A variant merged into one plain (its ``alias`` set by the
    caller) is offered no further plain."""
    for vi, var in enumerate(groups):
        for pi, plain in enumerate(groups):
            if var.alias is not None or var.convert is not None:
                break
            if pi == vi or plain.base != var.base or plain.alias is not None:
                continue
            if plain.convert is None:
                yield pi, plain, var


def fold_optional(groups: list[Any], merge: Any, slots: str) -> list[tuple[Any, Any]]:
    """The emitters' ``merge_optional`` loop: for each candidate pair that ``merge(plain,
    variant)`` folds into ``(skeleton, slot records, from_plain, from_variant)``, the plain
    group takes both groups' instances (converted), the skeleton and the records (its field
    ``slots``), and the variant points at it (``alias``). Returns the folded pairs."""
    folded = []
    for pi, plain, var in optional_merge_pairs(groups):
        merged = merge(plain, var)
        if merged is None:
            continue
        skeleton, records, from_plain, from_var = merged
        plain.instances = [from_plain(v) for v in plain.instances] + [
            from_var(v) for v in var.instances
        ]
        plain.skeleton = skeleton
        setattr(plain, slots, records)
        plain.convert, var.convert, var.alias = from_plain, from_var, pi
        folded.append((plain, var))
    return folded


_ASSIGN = re.compile(r"^(?P<v>[A-Za-z_]\w*) = (?P<rhs>[^#]*)$")
_GENERIC = re.compile(r"(h|x)\d*")
_CALL = re.compile(r"(?<![\w.])self\.[\w.\[\]]+\(")


def _uses(name: str, text: str) -> int:
    return len(re.findall(rf"(?<![\w.'\"]){re.escape(name)}(?![\w'\"])", text))


def _calls_done(text: str) -> bool:
    """Whether ``text`` holds a module call that completes (runs) within it."""
    for m in _CALL.finditer(text):
        depth = 0
        for ch in text[m.end() - 1 :]:
            depth += ch in "([{"
            depth -= ch in ")]}"
            if depth == 0:
                return True
    return False


def _primary(expr: str) -> bool:
    """A call or attribute chain (``f(x)``, ``self.fc(h)``): no operator outside brackets."""
    if not re.match(r"^[A-Za-z_][\w.]*[(\[]", expr) or not expr.endswith((")", "]")):
        return False
    depth = 0
    for ch in expr:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and ch in " +-*/@%<>=!&|~^":
            return False
    return True


def inline_chains(lines: list[str], width: int, max_depth: int = 3) -> list[str]:
    """Straight-line ``lines`` (no indentation; the last one ``return ...``) with each
    ``h = f(x)`` whose value only the next statement reads folded into that statement as a
    call argument (``h = relu(bn(conv(x)))``), as a person writes a chain of layers. Only
    generic names (``h``, ``x2``) fold, never into a line that calls a module before the
    argument (the call order stays), and a line stays under ``width`` characters and
    ``max_depth`` folded calls."""
    out = list(lines)
    depth = [1] * len(out)
    i = 0
    while i < len(out) - 1:
        m = _ASSIGN.match(out[i])
        nxt = out[i + 1]
        target = _ASSIGN.match(nxt)
        rhs_next = target.group("rhs") if target else nxt.removeprefix("return ")
        if (
            m is None
            or not (
                _GENERIC.fullmatch(m.group("v")) or (target and target.group("v") == m.group("v"))
            )
            or "  # " in nxt
            or not (target or nxt.startswith("return "))
            or _uses(m.group("v"), rhs_next) != 1
            or depth[i] + depth[i + 1] > max_depth
        ):
            i += 1
            continue
        v, expr = m.group("v"), m.group("rhs").strip()
        # still read after the next statement (before being assigned again)?
        later = False
        if not (target and target.group("v") == v):
            for ln in out[i + 2 :]:
                a = _ASSIGN.match(ln)
                body = a.group("rhs") if a else ln
                if _uses(v, body):
                    later = True
                    break
                if a and a.group("v") == v:
                    break
        use = re.search(rf"(?<![\w.'\"]){re.escape(v)}(?![\w'\"])", rhs_next)
        before, after = rhs_next[: use.start()], rhs_next[use.end() :]
        whole = not before.strip() and not after.strip()
        as_arg = whole or (re.search(r"[(,] ?$", before) and re.match(r"^ ?[,)]", after))
        # ``h.reshape(...)`` of a call's value: ``f(x).reshape(...)``
        as_arg = as_arg or (
            re.search(r"(^|[(,] ?)$", before) and after.startswith(".") and _primary(expr)
        )
        new_rhs = before + expr + after
        head = nxt[: len(nxt) - len(rhs_next)]
        new = head + new_rhs
        if later or not as_arg or _calls_done(before) or len(new) > width:
            i += 1
            continue
        out[i + 1] = new
        depth[i + 1] += depth[i]
        del out[i], depth[i]
        i = max(i - 1, 0)
    # ``v = expr`` then ``return v``: ``return expr`` (no deeper nesting, one name less)
    m = _ASSIGN.match(out[-2]) if len(out) >= 2 else None
    if (
        m
        and out[-1] == f"return {m.group('v')}"
        and "  # " not in out[-2]
        and len(f"return {m.group('rhs').strip()}") <= width
    ):
        out[-2:] = [f"return {m.group('rhs').strip()}"]
    return out


def _outside_strings(text: str, start: int = 0):
    """``(index, char, depth)`` for each character of ``text`` from ``start`` that lies outside
    string literals; ``depth`` counts the open brackets after that character (an opening
    bracket counts itself, a closing one does not)."""
    depth, quote = 0, ""
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        else:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
            yield i, ch, depth


def split_args(text: str) -> list[str]:
    """``text`` split at its top-level commas (outside brackets and string literals)."""
    parts, start = [], 0
    for i, ch, depth in _outside_strings(text):
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    last = text[start:].strip()
    return [*parts, last] if last else parts


def _closing(text: str, start: int) -> int | None:
    """Index of the bracket closing the one at ``start`` (string literals skipped)."""
    for i, ch, depth in _outside_strings(text, start):
        if ch in ")]}" and depth == 0:
            return i
    return None


#: What may follow the bracket a wrapped line splits: attributes and subscripts
#: (``).value``, ``)[:4]``, ``).dtype``) and, on an argument's own line, its comma.
_TAIL = re.compile(r"(\.\w+|\[[^\[\]()]*\])*,?")
_DEF = re.compile(r"(?P<ind>\s*)def \w+\(")
_RETURN = re.compile(r"(?P<ind>\s*)return (?P<e>.+)")


def wrap_line(line: str, width: int = LINE_LENGTH, *, full: bool = False) -> list[str]:
    """A statement longer than ``width`` ending in a call, laid out as ruff's formatter does:
    the arguments on one indented line, or one per line when they do not fit. Anything else
    (a comment, a string, no such call) stays as it is.

    ``full``: more of ruff's layout. A line that still does not fit is split again (an
    argument that is a call, a list: its items); a ``def``'s parameters are split like a
    call's arguments; a list or tuple literal and a returned tuple go one a line with a
    trailing comma; a call followed by a subscript (``f(...)[:4]``) is split at the call
    (ruff would split the subscript's brackets: ``[\n    :4\n]``)."""
    if len(line) <= width or "#" in line or '"""' in line:
        return [line]
    indent = len(line) - len(line.lstrip())
    pad = " " * (indent + 4)
    if full:
        m = _DEF.match(line)
        if m and _closing(line, m.end() - 1) == len(line) - 2 and line.endswith("):"):
            params = split_args(line[m.end() : -2])
            joined = ", ".join(params)
            rows = [pad + joined] if len(pad + joined) <= width else _rows(params, pad, width)
            return [line[: m.end()], *rows, m.group("ind") + "):"]
        m = _RETURN.fullmatch(line)
        if m and len(split_args(m.group("e"))) > 1:
            rows = _rows(split_args(m.group("e")), pad, width)
            return [f"{m.group('ind')}return (", *rows, m.group("ind") + ")"]
    tail = _TAIL if full else re.compile(r"(\.\w+)*")
    # the first call whose closing bracket ends the line (``.value`` may follow it)
    opened = close = None
    for i, ch in enumerate(line):
        j = _closing(line, i) if ch == "(" or (full and ch == "[") else None
        if j is not None and tail.fullmatch(line[j + 1 :]):
            opened, close = i, j
            break
    if opened is not None and opened + 1 > width:
        # the head does not fit (``x = f(...) + b.reshape(``): split the first top-level
        # call whose closing bracket leaves a tail that fits (``) + b.reshape((-1, 1, 1))``)
        opened = close = None
        depth = 0
        for i, ch in enumerate(line):
            if ch == "(" and depth == 0 and re.search(r"[\w\]]$", line[:i]):
                j = _closing(line, i)
                if j is not None and indent + len(line) - j <= width and "#" not in line[j:]:
                    opened, close = i, j
                break
            depth += ch in "([{"
            depth -= ch in ")]}"
    # a list or tuple literal, not a call's or a subscript's brackets
    literal = full and opened is not None and not re.search(r"[\w)\]]$", line[:opened])
    if opened is None or not (literal or line[indent:opened].strip()):
        return [line]
    args = split_args(line[opened + 1 : close])
    if not args:
        return [line]
    head, end = line[: opened + 1], " " * indent + line[close:]
    joined = ", ".join(args)
    # a trailing comma (``(x,)``, a one-item tuple) keeps its items one a line, as in ruff
    magic = line[opened + 1 : close].rstrip().endswith(",")
    if len(pad) + len(joined) <= width and not magic and not (literal and len(args) > 1):
        return [head, pad + joined, end]
    one = args[0]
    if len(args) == 1 and one[:1] == "[" and _closing(one, 0) == len(one) - 1 and not literal:
        items = split_args(one[1:-1])  # a sole list argument: its items one per line
        rows = _rows(items, pad + "    ", width) if full else [pad + f"    {a}," for a in items]
        return [head, pad + "[", *rows, pad + "]", end]
    if line[opened] == "[" and not literal and len(args) == 1:
        # one index on its own line(s), without a trailing comma: x[a,] indexes by (a,)
        return [head, *wrap_line(pad + one, width, full=True), end]
    return [head, *(_rows(args, pad, width) if full else [pad + a + "," for a in args]), end]


def _rows(items: list[str], pad: str, width: int) -> list[str]:
    """``items`` one a line with a trailing comma, each split again where it does not fit."""
    return [out for a in items for out in wrap_line(pad + a + ",", width, full=True)]


def wrap_lines(text: str, width: int = LINE_LENGTH, *, full: bool = False) -> str:
    """:func:`wrap_line` over every line of ``text``; a statement whose wrapped form would
    parse to other code (a layout rule's slip) is kept on its line."""
    out: list[str] = []
    for line in text.split("\n"):
        wrapped = wrap_line(line, width, full=full)
        out += wrapped if len(wrapped) == 1 or _same_code(line, wrapped) else [line]
    return "\n".join(out)


def _same_code(line: str, wrapped: list[str]) -> bool:
    """Whether ``wrapped`` parses to the statement ``line`` does (True where ``line`` is not a
    statement on its own, a block's head or part of a longer one)."""

    def tree(text: str) -> str | None:
        text = textwrap.dedent(text)
        text += "\n    pass" if text.rstrip().endswith(":") else ""
        try:
            return ast.dump(ast.parse(text))
        except SyntaxError:
            return None

    before = tree(line)
    return before is None or before == tree("\n".join(wrapped))


_RESHAPE = re.compile(r"^(?P<v>\w+) = (?P<xp>j?np)\.reshape\((?P<e>.+), (?P<s>\([^()]*\))\)$")
_SHAPE_READ = r"(?P<star>\*?)(?<![\w.]){v}\.shape\[(?P<colon>:?)(?P<n>\d+)\]"


def _tuple_dims(shape: str) -> list[str]:
    """``"(*h.shape[:2], 4, 8)"`` -> ``["h.shape[0]", "h.shape[1]", "4", "8"]``."""
    dims = []
    for part in split_args(shape[1:-1]):
        m = re.fullmatch(r"\*(\w+)\.shape\[:(\d+)\]", part)
        dims += [f"{m.group(1)}.shape[{j}]" for j in range(int(m.group(2)))] if m else [part]
    return dims


def _join_dims(dims: list[str]) -> str:
    """Dimension texts joined, a leading ``e.shape[0], e.shape[1]`` as ``*e.shape[:2]``."""
    m = re.fullmatch(r"(\w+)\.shape\[0\]", dims[0]) if dims else None
    k = 1
    while m and k < len(dims) and dims[k] == f"{m.group(1)}.shape[{k}]":
        k += 1
    head = [f"*{m.group(1)}.shape[:{k}]"] if m and k > 1 else dims[:k]
    return ", ".join(head + dims[k:])


def _read_through(v: str, shape: str, line: str) -> str | None:
    """``line`` with its reads of ``v.shape`` (``v.shape[0]``, ``*v.shape[:2]``) written from
    ``shape``, the tuple ``v`` was reshaped to; None when one reads an inferred (-1) one."""
    dims = _tuple_dims(shape)
    bad = False

    def sub(m: re.Match) -> str:
        nonlocal bad
        n = int(m.group("n"))
        if not m.group("colon"):
            if n >= len(dims) or dims[n] == "-1":
                bad = True
            return m.group("star") + (dims[n] if n < len(dims) else "")
        if n > len(dims) or "-1" in dims[:n]:
            bad = True
        joined = _join_dims(dims[:n])
        if m.group("star"):
            return joined
        if joined.startswith("*") and "," not in joined:
            return joined[1:]  # ``v.shape[:2]`` -> ``e.shape[:2]``
        return f"({joined}{',' if n == 1 else ''})"

    out = re.sub(_SHAPE_READ.format(v=re.escape(v)), sub, line)
    return None if bad else out


def fold_reshapes(lines: list[str]) -> list[str]:
    """``t = jnp.reshape(e, s1)`` read only by the next statement's ``jnp.reshape(t, s2)``
    becomes ``jnp.reshape(e, s2)`` (a reshape of a reshape is one reshape): the layout
    bookkeeping's unit-axis reshape before a flatten disappears. ``s2``'s reads of
    ``t.shape`` are written from ``s1``."""
    out = list(lines)
    i = 0
    while i < len(out) - 1:
        m = _RESHAPE.match(out[i])
        if m is None:
            i += 1
            continue
        v, xp = m.group("v"), m.group("xp")
        use = f"{xp}.reshape({v}, "
        nxt = out[i + 1]
        if use in nxt and ".shape[" in nxt:
            nxt = _read_through(v, m.group("s"), nxt) or nxt
        rest = "\n".join([nxt, *out[i + 2 :]])
        if use not in nxt or _uses(v, rest) != 1:
            i += 1
            continue
        out[i + 1] = nxt.replace(use, f"{xp}.reshape({m.group('e')}, ", 1)
        del out[i]
    return out


_SPLIT_LIST = re.compile(
    r"^(?P<v>\w+) = list\((?P<e>(?:jnp|np)\.split\(.+, \[(?P<i>[\d, ]*)\].*\))\)$"
)


def unpack_splits(lines: list[str]) -> list[str]:
    """``v = list(jnp.split(e, [32, 64], axis=-1))`` whose parts are then read once each into
    locals (``a = v[0]``, ``b = v[1]``, ``c = v[2]``) becomes ``a, b, c = jnp.split(...)``, as
    the source's ``q, k, v = x.split(d, dim=-1)``."""
    out = list(lines)
    i = 0
    while i < len(out):
        m = _SPLIT_LIST.match(out[i])
        if m is None:
            i += 1
            continue
        v, n = m.group("v"), len([p for p in m.group("i").split(",") if p.strip()]) + 1
        reads = out[i + 1 : i + 1 + n]
        names = []
        for k, line in enumerate(reads):
            r = re.fullmatch(rf"(\w+) = {v}\[{k}\]", line)
            if r is None:
                break
            names.append(r.group(1))
        later = "\n".join(out[i + 1 + n :])
        free = v in names or _uses(v, later) == 0
        if len(names) != n or len(set(names)) != n or not free:
            i += 1
            continue
        if any(_uses(a, "\n".join(out[i : i + 1 + k])) for k, a in enumerate(names) if a != v):
            i += 1  # a target read by an earlier line of the group
            continue
        out[i : i + 1 + n] = [f"{', '.join(names)} = {m.group('e')}"]
        i += 1
    return out
