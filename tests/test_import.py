"""``import xconv`` stays light: no framework, and little time over a bare interpreter."""

from __future__ import annotations

import subprocess
import sys
import time

FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "tensorflow", "keras", "onnxruntime")


def test_import_pulls_in_no_framework():
    code = (
        "import sys, xconv; "
        f"print(','.join(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cli_module_pulls_in_no_framework():
    code = (
        "import sys, xconv.cli; "
        f"print(','.join(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _best_of(code: str, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        best = min(best, time.perf_counter() - start)
    return best


def test_import_adds_under_300ms():
    bare = _best_of("pass")
    with_xconv = _best_of("import xconv")
    assert with_xconv - bare < 0.3, f"import xconv adds {with_xconv - bare:.3f}s"
