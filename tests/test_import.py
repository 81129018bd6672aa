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


def test_subpackages_are_attributes_after_import_xconv():
    """``import xconv`` then ``xconv.training.check_training`` works, as for any package whose
    subpackages a user reaches by attribute; no framework is loaded until one is used."""
    code = (
        "import sys, xconv; "
        "assert 'training' in dir(xconv) and 'sharding' in dir(xconv); "
        "print(xconv.training.check_training.__name__, xconv.sharding.__name__, "
        "xconv.testing.assert_parity.__name__, xconv.parity.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [
        "check_training",
        "xconv.sharding",
        "assert_parity",
        "xconv.parity",
    ]
