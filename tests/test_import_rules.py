"""The import rules of docs/design.md ("Layers and the import rules"), read off the source.

Every ``import`` statement is counted, the lazy ones inside functions too (a lazy import is
still an arrow: it runs when the function does), and a module's parent packages with it
(importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``). ``tests/test_subset_imports.py``
checks the framework split at run time; this checks the layers statically, so an arrow that no
test happens to execute is caught too.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "xconv"

#: The framework folders under xconv/converters (each a converter).
FRAMEWORKS = ("flax", "jax", "onnx", "tf", "torch")
#: The lower layers: framework-free, importing no converter, directly or through another module.
LOWER = ("xconv.errors", "xconv.inputs", "xconv.ir", "xconv.weights", "xconv.converters.ops")
#: Framework folders that may import one another (a converter reading .onnx files).
ALLOWED_ACROSS = {("tf", "onnx"), ("torch", "onnx")}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The xconv module an imported name lives in (``a.b.f`` -> ``a.b``), or None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES]


@cache
def direct_imports(module: str) -> frozenset[str]:
    """The xconv modules ``module`` imports anywhere in its body (parents included), except
    under ``if TYPE_CHECKING:``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }  # never run: annotations only
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the submodule when there is one
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] != "xconv":
                continue
            found = _resolve(name)
            if found is not None and found != module:
                out.update(_with_parents(found))
    return frozenset(out - {module})


def reachable(module: str) -> dict[str, str]:
    """Every xconv module ``module`` can end up importing -> the module that imports it."""
    seen: dict[str, str] = {}
    todo = [module]
    while todo:
        cur = todo.pop()
        for dep in direct_imports(cur):
            if dep not in seen and dep != module:
                seen[dep] = cur
                todo.append(dep)
    return seen


def _chain(module: str, target: str, via: dict[str, str]) -> str:
    """``target <- ... <- module``: the path by which ``module`` reaches ``target``."""
    out = [target]
    while out[-1] != module:
        out.append(via[out[-1]])
    return " <- ".join(out)


def _framework(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "converters" and parts[2] in FRAMEWORKS:
        return parts[2]
    return None


def _in(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def test_the_scan_sees_the_known_arrows():
    """The scanner itself: a lazy import inside a function and a parent package are found."""
    assert "xconv.converters.flax.source.emitter" in direct_imports("xconv.weight_template")
    assert "xconv.converters.flax" in direct_imports("xconv.weight_template")
    assert "xconv.converters.torch.importer.trace" in direct_imports("xconv.weight_template")
    assert "xconv.converters.jax.interpreter" in reachable("xconv.pipeline")


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_import_no_converter(layer):
    bad = []
    for module in (m for m in MODULES if _in(m, layer)):
        via = reachable(module)
        bad += [_chain(module, dep, via) for dep in sorted(via) if _framework(dep)]
    assert not bad, "a lower layer reaches a converter:\n" + "\n".join(bad)


def test_ir_imports_only_errors_and_itself():
    bad = [
        f"{m} -> {dep}"
        for m in MODULES
        if _in(m, "xconv.ir")
        for dep in direct_imports(m)
        if not (_in(dep, "xconv.ir") or dep in ("xconv", "xconv.errors"))
    ]
    assert not bad, "\n".join(bad)


def test_no_framework_folder_imports_another():
    bad = [
        f"{m} -> {dep}"
        for m in MODULES
        if (src := _framework(m))
        for dep in direct_imports(m)
        if (dst := _framework(dep)) and dst != src and (src, dst) not in ALLOWED_ACROSS
    ]
    assert not bad, "\n".join(bad)
