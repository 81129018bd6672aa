"""Numeric parity: run a reference and a candidate side by side on every device, judge
them against a float64 oracle, and name the first module scope where they part.

Imports no framework; each adapter imports its framework when it wraps a model.
"""

from __future__ import annotations

from xconv.parity.checker import InputSpec, check_files, check_parity, make_inputs
from xconv.parity.metrics import Metrics, compare
from xconv.parity.policies import DTYPE_TOLERANCES, Policy, resolve_policy
from xconv.parity.report import DeviceRun, ParityReport

__all__ = [
    "DTYPE_TOLERANCES",
    "DeviceRun",
    "InputSpec",
    "Metrics",
    "ParityReport",
    "Policy",
    "check_files",
    "check_parity",
    "compare",
    "make_inputs",
    "resolve_policy",
]
