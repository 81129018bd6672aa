"""Testing helpers and the xconv pytest plugin (entry point ``pytest11: xconv``).

``assert_parity(reference, candidate, ...)`` raises AssertionError with a readable summary
(per-output metrics, first divergent scope). The plugin adds the ``xconv_parity`` fixture
and a ``--xconv-devices`` option (``all``, ``cpu``, or a comma list such as ``cpu,cuda:0``).

This module imports no framework (nor the parity machinery) at import time, so loading
the plugin costs nothing for test suites that do not use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from xconv.parity.report import ParityReport


def assert_parity(
    reference: Any, candidate: Any, inputs: Any = None, **kwargs: Any
) -> ParityReport:
    """Check parity and raise AssertionError (with the report summary) when it fails.

    Takes the arguments of :func:`xconv.check_parity`; returns the report when it passes.
    """
    from xconv.parity.checker import check_parity

    report = check_parity(reference, candidate, inputs, **kwargs)
    if not report.passed:
        raise AssertionError("xconv parity check failed\n" + report.summary())
    return report


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("xconv")
    group.addoption(
        "--xconv-devices",
        action="store",
        default="all",
        help="devices the xconv_parity fixture checks on: all (default), cpu, or a comma "
        "list such as cpu,cuda:0",
    )


def parse_devices(value: str | None) -> str | list[str]:
    if not value or value.strip() == "all":
        return "all"
    return [d.strip() for d in value.split(",") if d.strip()]


@pytest.fixture
def xconv_parity(request: pytest.FixtureRequest) -> Callable[..., ParityReport]:
    """``xconv_parity(reference, candidate, inputs=None, **kwargs)``: ``assert_parity`` on
    the devices chosen with ``--xconv-devices`` (a ``devices=`` argument still wins)."""
    devices = parse_devices(request.config.getoption("--xconv-devices", default="all"))

    def check(reference: Any, candidate: Any, inputs: Any = None, **kwargs: Any) -> ParityReport:
        kwargs.setdefault("devices", devices)
        return assert_parity(reference, candidate, inputs, **kwargs)

    return check
