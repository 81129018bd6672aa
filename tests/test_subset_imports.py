"""Each framework's directions work with the other framework absent (simulated here).

A subprocess marks the other framework's modules as missing (``sys.modules[name] = None``,
what Python does for a module that is not installed as far as ``import`` and
``importlib.util.find_spec`` are concerned) and runs that subset's tests
(``tests/subsets``). ``.ci/run`` runs the same tests in real torch-only and JAX-only venvs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Distribution named in pyproject's extras -> the top-level modules it installs (with the
#: optional ones it pulls in).
MODULES = {
    "torch": ("torch",),
    "onnxscript": ("onnxscript",),
    "onnxruntime": ("onnxruntime",),
    "jax": ("jax", "jaxlib"),
    "flax": ("flax",),
    "msgpack": ("msgpack",),
    "orbax-checkpoint": ("orbax",),
    "optax": ("optax", "chex"),
    "tensorflow-cpu": ("tensorflow", "keras"),
    "tf2onnx": ("tf2onnx",),
    "safetensors": ("safetensors",),
    "pillow": ("PIL",),
}
#: Installed in the development venv by neither extra (the tests' own extras).
_DEV_ONLY = ("torchvision", "torch_geometric")


def _extras() -> dict[str, list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = data["project"]["optional-dependencies"]
    names = {
        key: [re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in reqs]
        for key, reqs in extras.items()
        if key not in ("all", "dev")
    }
    return names


def absent_modules(subset: str) -> tuple[str, ...]:
    """The modules that ``pip install "xconv[SUBSET]"`` does not install: those of every other
    extra's distributions (read from pyproject.toml, so the simulated install is the real one)."""
    extras = _extras()
    have = {m for dist in extras[subset] for m in MODULES[dist]}
    every = {m for dists in extras.values() for dist in dists for m in MODULES[dist]}
    return tuple(sorted((every - have) | set(_DEV_ONLY)))


#: subset -> top-level modules that subset's install does not have.
ABSENT = {subset: absent_modules(subset) for subset in ("torch", "jax")}

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


_EACH_ALONE = """
import importlib, sys
failed = []
for name in {modules!r}:
    for mod in [m for m in sys.modules if m == "xconv" or m.startswith("xconv.")]:
        del sys.modules[mod]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{{name}}: {{type(e).__name__}}: {{e}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.parametrize(
    ("framework", "package"),
    [("jax", "xconv.converters.jax"), ("torch", "xconv.converters.torch.runtime")],
)
def test_each_handler_module_imports_on_its_own(framework, package):
    """Importing one runtime handler module first (e.g. ``xconv.converters.jax.attention``)
    works: no cycle through the kernel or between handler modules."""
    pytest.importorskip(framework)
    from xconv.converters.ops import RUNTIME_FAMILIES

    names = [
        f"{package}.{m}" for m in (*RUNTIME_FAMILIES, "kernel" if framework == "jax" else "xp")
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, "-c", _EACH_ALONE.format(modules=names)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
