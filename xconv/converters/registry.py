"""Op-handler registries shared by every backend.

A handler is a small pure function registered under an ONNX op type (and domain and opset
range). It declares the attributes it understands with their defaults; the registry parses
a node's attributes once into plain Python values and rejects any attribute the handler did
not declare, so nothing is silently ignored. User registrations win over built-in ones.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from xconv.errors import MissingOp, UnsupportedAttributeError, UnsupportedOpError
from xconv.ir.metadata import SOURCE_LINE, get_scope


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: Marks an attribute that has no default: the node must carry it.
REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Handler:
    """A registered handler: ``fn(ctx, *inputs, **attrs) -> output | tuple of outputs``."""

    op_type: str
    domain: str
    since: int
    until: int | None
    fn: Callable[..., Any]
    attrs: Mapping[str, Any]
    user: bool = False

    def covers(self, version: int) -> bool:
        return self.since <= version and (self.until is None or version <= self.until)

    def parse_attributes(self, node: ir.Node) -> dict[str, Any]:
        """Return the node's attributes as Python values, defaults filled in.

        Raises:
            UnsupportedAttributeError: an attribute the handler does not declare, or a
                required one missing.
        """
        out = {}
        unknown = [name for name in node.attributes if name not in self.attrs]
        if unknown:
            raise UnsupportedAttributeError(
                f"attribute(s) {sorted(unknown)} not supported; this handler understands "
                f"{sorted(self.attrs) or 'no attributes'}",
                op=node.op_type,
                node=node.name,
                scope=get_scope(node),
            )
        for name, default in self.attrs.items():
            attr = node.attributes.get(name)
            if attr is None:
                if default is REQUIRED:
                    raise UnsupportedAttributeError(
                        f"required attribute {name!r} is missing",
                        op=node.op_type,
                        node=node.name,
                        scope=get_scope(node),
                    )
                out[name] = default
            else:
                out[name] = attribute_value(attr)
        return out


def attribute_value(attr: ir.Attr) -> Any:
    """Convert an ``ir.Attr`` to a plain value: int, float, str, tuple, ndarray, ir.Graph."""
    t = attr.type
    value = attr.value
    if attr.is_ref():
        raise UnsupportedAttributeError(
            f"reference attribute {attr.name!r} is only valid inside a function body"
        )
    if t in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
        return tuple(value)
    if t == ir.AttributeType.TENSOR:
        return value.numpy()
    if t == ir.AttributeType.TENSORS:
        return tuple(v.numpy() for v in value)
    if t == ir.AttributeType.GRAPHS:
        return tuple(value)
    return value


@dataclass
class Registry:
    """Handlers for one backend, keyed by (domain, op type), each with an opset range.

    The same design serves runtime op handlers, source-emitter templates and the Flax
    frontend's primitive handlers: ``handler_class`` (a :class:`Handler` subclass) carries
    what one kind of registry needs beyond the op, domain, opset range and attributes
    (e.g. a template's layout), passed to :meth:`register` as keyword options.
    """

    backend: str
    #: Import path of the module whose ``register`` users call (for error messages).
    module: str | None = None
    handler_class: type[Handler] = Handler
    #: Characters besides letters and digits an op type may have (jax primitives: ``-``).
    name_chars: str = "_"
    _handlers: dict[tuple[str, str], list[Handler]] = field(default_factory=dict)

    def register(
        self,
        op_type: str,
        *,
        domain: str = "",
        since: int = 1,
        until: int | None = None,
        attrs: Mapping[str, Any] | None = None,
        user: bool = True,
        **options: Any,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering ``fn(ctx, *inputs, **attrs)`` for an op.

        Args:
            op_type: ONNX op type, e.g. ``"Conv"``.
            domain: Op domain; ``""`` is the ONNX default domain.
            since: First opset version the handler implements.
            until: Last opset version it implements (None: all later ones).
            attrs: Attribute names the handler understands, with defaults (``REQUIRED`` for
                none). Any other attribute on a node is an error.
            user: True for user registrations, which take precedence over built-ins.
            options: Extra fields of ``handler_class`` (e.g. a template's ``layout``).
        """
        if not op_type or not all(ch.isalnum() or ch in self.name_chars for ch in op_type):
            raise ValueError(f"invalid op type {op_type!r}")
        if domain == "ai.onnx":
            domain = ""

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            handler = self.handler_class(
                op_type, domain, since, until, fn, dict(attrs or {}), user, **options
            )
            bucket = self._handlers.setdefault((domain, op_type), [])
            bucket.append(handler)
            # User handlers first, then newest `since` first.
            bucket.sort(key=lambda h: (not h.user, -h.since))
            return fn

        return decorator

    def builtin(self, op_type: str, **kwargs: Any):
        """Register a built-in handler (users' registrations win over it)."""
        return self.register(op_type, user=False, **kwargs)

    def lookup(self, domain: str, op_type: str, version: int) -> tuple[Handler | None, str]:
        """Return ``(handler, "")`` or ``(None, reason)``."""
        if domain == "ai.onnx":
            domain = ""
        candidates = self._handlers.get((domain, op_type))
        if not candidates:
            return None, f"no handler registered for {domain + '::' if domain else ''}{op_type}"
        for h in candidates:
            if h.covers(version):
                return h, ""
        ranges = ", ".join(f"[{h.since}, {h.until or 'latest'}]" for h in candidates)
        return None, f"{op_type} handlers cover opsets {ranges}, not {version}"

    def unregister(self, op_type: str, *, domain: str = "", user: bool = True) -> None:
        """Remove the user registrations for an op (its built-in handler, if any, applies
        again), or with ``user=False`` its built-in ones (before replacing them)."""
        key = ("" if domain == "ai.onnx" else domain, op_type)
        bucket = [h for h in self._handlers.get(key, []) if h.user != user]
        if bucket:
            self._handlers[key] = bucket
        else:
            self._handlers.pop(key, None)

    def find(self, node: ir.Node, opsets: Mapping[str, int] | None = None) -> Handler | None:
        """The handler for ``node`` (its own version, else the graph's opset, else any), or None."""
        domain = "" if node.domain == "ai.onnx" else node.domain
        version = node.version if node.version is not None else (opsets or {}).get(domain)
        if version is None:
            candidates = self._handlers.get((domain, node.op_type))
            return candidates[0] if candidates else None
        return self.lookup(domain, node.op_type, version)[0]

    def __getitem__(self, op_type: str) -> Handler:
        """The preferred handler of a default-domain op (any opset); KeyError if none."""
        candidates = self._handlers.get(("", op_type))
        if not candidates:
            raise KeyError(op_type)
        return candidates[0]

    def op_types(self, domain: str = "") -> list[str]:
        return sorted(op for (d, op) in self._handlers if d == domain)

    def __contains__(self, key: str | tuple[str, str]) -> bool:
        if isinstance(key, str):
            key = ("", key)
        return key in self._handlers

    def missing_ops(self, graph: ir.Graph, opsets: Mapping[str, int]) -> list[MissingOp]:
        """Every op (in all subgraphs too) this registry cannot handle, with counts."""
        return self.missing_in(iter_nodes(graph), opsets)

    def missing_in(self, nodes: Iterable[ir.Node], opsets: Mapping[str, int]) -> list[MissingOp]:
        """Every op of ``nodes`` this registry cannot handle, with counts and first node."""
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        first: dict[tuple[str, str], ir.Node] = {}
        for node in nodes:
            domain = "" if node.domain == "ai.onnx" else node.domain
            version = node.version if node.version is not None else opsets.get(domain, 1)
            handler, _ = self.lookup(domain, node.op_type, version)
            if handler is None:
                key = (domain, node.op_type)
                counts[key] += 1
                first.setdefault(key, node)
        return [
            MissingOp(
                op_type=op,
                domain=domain,
                count=n,
                first_node=first[(domain, op)].name,
                first_scope=get_scope(first[(domain, op)]),
                source_line=first[(domain, op)].metadata_props.get(SOURCE_LINE),
            )
            for (domain, op), n in sorted(counts.items())
        ]

    def check_supported(self, model: ir.Model) -> None:
        """Scan first, fail once: raise one UnsupportedOpError naming every missing op."""
        missing = self.missing_ops(model.graph, model.opset_imports)
        if missing:
            raise UnsupportedOpError(self.backend, missing, self.module)


@dataclass
class TemplateRegistry(Registry):
    """A source emitter's templates, plus the module-level helper functions they may call.

    ``helpers`` maps a helper name to its source (a function ``_<name>``); a template that
    calls one adds the name to ``call.helpers`` and the emitter writes the source once.
    """

    helpers: dict[str, str] = field(default_factory=dict)

    def missing_templates(
        self, nodes: Iterable[ir.Node], opsets: Mapping[str, int]
    ) -> list[MissingOp]:
        """:meth:`missing_in` less Constant nodes (an emitter writes them as literals)."""
        todo = (n for n in nodes if not (n.op_type == "Constant" and n.domain in ("", "ai.onnx")))
        return self.missing_in(todo, opsets)

    def check_nodes(
        self,
        nodes: Iterable[ir.Node],
        opsets: Mapping[str, int],
        error: Callable[[list[MissingOp]], Exception] | None = None,
    ) -> None:
        """Scan first, fail once over ``nodes``."""
        missing = self.missing_templates(nodes, opsets)
        if missing:
            if error is not None:
                raise error(missing)
            raise UnsupportedOpError(self.backend, missing, self.module)


def iter_nodes(graph: ir.Graph) -> Iterator[ir.Node]:
    """All nodes of a graph, recursing into subgraph attributes (If/Loop/Scan bodies)."""
    for node in graph:
        yield node
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.GRAPH:
                yield from iter_nodes(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for g in attr.value:
                    yield from iter_nodes(g)


def elementwise_table(
    registry: Registry, table: Mapping[str, Callable[..., Any]], *, since: int = 1
) -> None:
    """Register trivial one-to-one ops (no attributes) from a table ``{op: fn(*inputs)}``."""
    for op_type, impl in table.items():

        def handler(ctx, *inputs, _impl=impl):
            return _impl(*inputs)

        handler.__name__ = f"{op_type}_handler"
        registry.builtin(op_type, since=since)(handler)


def as_tuple(outputs: Any) -> tuple[Any, ...]:
    """Normalise a handler's return to a tuple of outputs.

    Only a tuple means several outputs; a list is one output holding an ONNX sequence.
    """
    if isinstance(outputs, tuple):
        return outputs
    return (outputs,)


def dedupe(names: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for n in names:
        seen.setdefault(n, None)
    return list(seen)


def import_handler_modules(package: str, names: Iterable[str]) -> None:
    """Import ``package.<name>`` for each name; importing a handler module registers its
    handlers. A module that does not exist is skipped; any other import error propagates."""
    import importlib

    for name in names:
        try:
            importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
