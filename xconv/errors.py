"""The xconv error tree.

Every error names what went wrong, where (op, node, scope, source line when known) and what
to do next. The CLI maps each class to its own exit code (``EXIT_CODES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ConversionError(Exception):
    """Base of every error xconv raises on purpose.

    Args:
        message: What went wrong and what to do next.
        op: The op type involved, if any.
        node: The node name involved, if any.
        scope: The source module scope (``xconv.scope``), if known.
        source_line: The user's source line, if the framework recorded one.
    """

    exit_code = 10

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        node: str | None = None,
        scope: str | None = None,
        source_line: str | None = None,
    ) -> None:
        self.message = message
        self.op = op
        self.node = node
        self.scope = scope
        self.source_line = source_line
        super().__init__(str(self))

    def __str__(self) -> str:
        where = []
        if self.op:
            where.append(f"op {self.op}")
        if self.node:
            where.append(f"node {self.node!r}")
        if self.scope:
            where.append(f"scope {self.scope!r}")
        if self.source_line:
            where.append(f"at {self.source_line}")
        prefix = f"[{', '.join(where)}] " if where else ""
        return prefix + self.message


class InvalidModelError(ConversionError):
    """The input file or object is not a valid model (corrupt, truncated, wrong kind)."""

    exit_code = 3


class UnsupportedAttributeError(ConversionError):
    """A node carries an attribute, or attribute value, the handler does not implement."""

    exit_code = 5


class StaticValueError(ConversionError):
    """A value that must be known at trace time (a shape, an axis list) is data-dependent."""

    exit_code = 5


class WeightsError(ConversionError):
    """Weights do not match the model: missing, unexpected or mis-shaped keys."""

    exit_code = 6


class MissingFrameworkError(ConversionError):
    """An optional framework needed for this conversion is not installed."""

    exit_code = 7


class ParityError(ConversionError):
    """Source and converted model disagree beyond the tolerance policy."""

    exit_code = 1


class ParityConfigError(ConversionError, ValueError):
    """A parity check was asked for something it cannot do: a device no framework sees, an
    unknown or invalid policy, inputs that cannot be read or that the reference cannot run."""

    exit_code = 2


class UsageError(ConversionError, ValueError):
    """The command needs more from the user before it can run: flags that are missing (all
    named at once, each with the flag that supplies it), a file that needs ``--trust-pickle``
    or ``--trust-code``, a path of the wrong kind.

    Args:
        message: What is missing and why.
        missing: ``(flag, why)`` pairs, one per missing thing; each is listed on its own line
            after the message.
    """

    exit_code = 2

    def __init__(self, message: str, *, missing: Sequence[tuple[str, str]] = (), **kw) -> None:
        self.missing = tuple(missing)
        super().__init__(message, **kw)

    def __str__(self) -> str:
        lines = [super().__str__()]
        lines += [f"  {flag}: {why}" for flag, why in self.missing]
        return "\n".join(lines)


@dataclass(frozen=True)
class MissingOp:
    """One op type a backend lacks, as found by a whole-graph scan."""

    op_type: str
    domain: str
    count: int
    first_node: str | None = None
    first_scope: str | None = None
    source_line: str | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.domain}::{self.op_type}" if self.domain else self.op_type


class UnsupportedOpError(ConversionError):
    """The graph uses ops the target backend has no handler for; lists all of them at once."""

    exit_code = 4

    def __init__(
        self,
        backend: str,
        missing: Sequence[MissingOp],
        registry_module: str | None = None,
        *,
        headline: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.backend = backend
        self.missing = tuple(missing)
        n = len(self.missing)
        lines = [headline or f"the {backend} backend has no handler for {n} op type(s):"]
        for m in self.missing:
            where = f", first at node {m.first_node!r}" if m.first_node else ""
            if m.first_scope:
                where += f" (scope {m.first_scope!r})"
            if m.source_line:
                where += f" [{m.source_line}]"
            lines.append(f"  - {m.qualified_name} x{m.count}{where}")
        where = registry_module or f"xconv.converters.{backend}.registry"
        lines.append(
            hint
            or f"Register a handler for each with {where}.register(op_type, domain=...) "
            "before converting."
        )
        super().__init__("\n".join(lines))


def require(module: str, extra: str):
    """Import an optional framework module or raise MissingFrameworkError naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingFrameworkError(
            f"{module} is not installed; install it with: pip install 'xconv[{extra}]' ({e})"
        ) from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else "")[:300]


def _known_fix(e: BaseException) -> str | None:
    """What to do about an exception xconv did not expect, when the kind alone says it."""
    import errno

    if isinstance(e, MemoryError):
        return "the machine ran out of memory; free memory or convert on a larger machine"
    if isinstance(e, RecursionError):
        return "the model nests too deeply for Python's recursion limit"
    if isinstance(e, PermissionError):
        return "check the permissions of the files and folders named"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return "the disk is full; free space or write the output elsewhere (-o)"
    if isinstance(e, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return "check the paths given"
    return None


def unexpected(e: BaseException, *, what: str, files: Sequence[str] = ()) -> ConversionError:
    """A one-paragraph ``ConversionError`` (exit code 10) for an exception no xconv code
    turned into an error of the tree: what failed, on which files, and the fix when known.

    Args:
        e: The exception that escaped.
        what: What was being done (``"xconv torch-to-flax"``).
        files: The files the command was given.
    """
    on = f" on {', '.join(files)}" if files else ""
    where = ""
    if e.__traceback__ is not None:
        import traceback

        frames = traceback.extract_tb(e.__traceback__)
        if frames:
            last = frames[-1]
            where = f" (raised at {last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
    detail = _first_line(e)
    fix = _known_fix(e)
    message = f"{what} failed{on}: {type(e).__name__}{': ' + detail if detail else ''}{where}. " + (
        f"{fix[0].upper()}{fix[1:]}."
        if fix
        else "xconv did not expect this error: check the input files, re-run with --debug "
        "for the full traceback, and report it if the inputs are valid."
    )
    err = ConversionError(message)
    err.__cause__ = e
    return err


#: Top-level module of an optional framework -> the extra that installs it.
FRAMEWORK_EXTRAS = {
    "torch": "torch",
    "onnxscript": "torch",
    "jax": "jax",
    "jaxlib": "jax",
    "flax": "jax",
    "optax": "jax",
    "orbax": "jax",
    "msgpack": "jax",
    "tensorflow": "tf",
    "tf2onnx": "tf",
    "keras": "tf",
    "onnxruntime": "onnxruntime",
    "safetensors": "safetensors",
}


def missing_framework(error: ImportError) -> MissingFrameworkError | None:
    """The clean "not installed" error for an import of an optional framework, else None."""
    name = getattr(error, "name", None) or ""
    extra = FRAMEWORK_EXTRAS.get(name.partition(".")[0])
    if extra is None:
        return None
    return MissingFrameworkError(
        f"{name} is not installed; install it with: pip install 'xconv[{extra}]'"
    )


EXIT_CODES: dict[type[ConversionError], int] = {
    cls: cls.exit_code
    for cls in (
        ConversionError,
        InvalidModelError,
        UnsupportedOpError,
        UnsupportedAttributeError,
        StaticValueError,
        WeightsError,
        MissingFrameworkError,
        ParityError,
        ParityConfigError,
        UsageError,
    )
}
