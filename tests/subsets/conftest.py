"""The subset tests run only where a subset is installed (or simulated): ``XCONV_SUBSET``.

``XCONV_SUBSET=torch`` (what ``pip install "xconv[torch]"`` installs: no jax) or
``XCONV_SUBSET=jax`` (``xconv[jax]``: no torch) selects the module for that subset.
``.ci/run`` builds one venv per subset and runs them; ``tests/test_subset_imports.py`` runs them
in the default suite with every module the extra does not install blocked from import.
"""

from __future__ import annotations

import os

_SUBSET = os.environ.get("XCONV_SUBSET", "")
collect_ignore = [
    f for f in ("test_torch_only.py", "test_jax_only.py") if f != f"test_{_SUBSET}_only.py"
]
