"""Test helper: ruff's findings on a file xconv generated (a written model must lint clean)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def ruff_findings(path: Path, line_length: int | None = None) -> str:
    """ruff's findings (pycodestyle, pyflakes, isort, bugbear, pyupgrade) on ``path``; empty
    when clean. Long lines (long constant literals) count only with a ``line_length``."""
    width = ["--line-length", str(line_length)] if line_length else ["--ignore", "E501"]
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache", "--select",
         "E,F,W,I,B,UP", *width, str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    return "" if res.returncode == 0 else res.stdout + res.stderr
