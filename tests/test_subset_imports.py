"""Each framework's directions work with the other framework absent (simulated here).

A subprocess marks the other framework's modules as missing (``sys.modules[name] = None``,
what Python does for a module that is not installed as far as ``import`` and
``importlib.util.find_spec`` are concerned) and runs that subset's tests
(``tests/subsets``). ``.ci/run`` runs the same tests in real torch-only and JAX-only venvs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: subset -> top-level modules that subset's install does not have.
ABSENT = {
    "torch": ("jax", "jaxlib", "flax", "optax", "orbax", "chex"),
    "jax": ("torch", "torchvision", "onnxscript", "torch_geometric"),
}

_RUN = """
import sys
for name in {absent!r}:
    sys.modules[name] = None
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "tests/subsets"]))
"""


@pytest.mark.parametrize("subset", sorted(ABSENT))
def test_subset_runs_without_the_other_framework(subset):
    pytest.importorskip(subset)  # this subset's own framework is optional
    env = {
        **os.environ,
        "XCONV_SUBSET": subset,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, "-c", _RUN.format(absent=ABSENT[subset])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:]
