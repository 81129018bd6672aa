"""Tolerance policies: when does a candidate output count as equal to the reference?

Three policies:

- ``oracle`` (default): the reference is also run in float64 as ground truth. The candidate
  passes when its error against the oracle is at most ``k`` times the reference's own
  low-precision error against the oracle, plus a floor::

      max|cand - oracle| <= k * max|ref - oracle| + floor_ulps * eps(dtype) * max|oracle|

  The floor (8 ULP of the output's largest magnitude by default; fp32: ~9.5e-7 relative to
  the output scale) covers outputs the reference happens to compute almost exactly. This
  separates a conversion bug (an error far above rounding noise) from the rounding noise
  a deep network accumulates, without hand-tuned tolerances.
- ``dtype``: elementwise ``|cand - ref| <= atol + rtol * |ref|`` with per-dtype defaults as
  ``torch.testing.assert_close``.
- explicit: ``Policy(rtol=..., atol=...)`` (or ``rtol=``/``atol=`` keyword arguments).
- ``noise``: the oracle policy's fallback when the reference has no float64 twin but the
  candidate has: ``max|cand - ref| <= k * 2 * max|cand - cand64| + floor``. The candidate's
  own rounding error (against its float64 run) stands for the reference's, both computing
  the same function at the same precision; a conversion bug is in both ``cand`` and
  ``cand64``, so it does not widen the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

#: Per-dtype (rtol, atol), as torch.testing.assert_close.
DTYPE_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
}

_KINDS = ("oracle", "dtype", "explicit", "noise")


@dataclass(frozen=True)
class Policy:
    """A tolerance policy.

    Attributes:
        kind: ``"oracle"``, ``"dtype"`` or ``"explicit"`` (set automatically when ``rtol`` or
            ``atol`` is given).
        rtol: Relative tolerance (explicit policy; overrides the per-dtype default).
        atol: Absolute tolerance (explicit policy; overrides the per-dtype default).
        k: Oracle policy: allowed ratio of the candidate's error to the reference's.
        floor_ulps: Oracle policy: floor in ULPs of the output's largest magnitude.
    """

    kind: str = "oracle"
    rtol: float | None = None
    atol: float | None = None
    k: float = 4.0
    floor_ulps: float = 8.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown parity policy {self.kind!r}; use one of {list(_KINDS)}")
        if (self.rtol is not None or self.atol is not None) and self.kind == "oracle":
            object.__setattr__(self, "kind", "explicit")
        if self.k <= 0 or self.floor_ulps < 0:
            raise ValueError("Policy.k must be > 0 and Policy.floor_ulps >= 0")

    @property
    def uses_oracle(self) -> bool:
        return self.kind == "oracle"

    def tolerances(self, dtype: Any) -> tuple[float, float]:
        """(rtol, atol) for an elementwise comparison at ``dtype`` (explicit values win)."""
        rtol, atol = DTYPE_TOLERANCES.get(dtype_name(dtype), (0.0, 0.0))
        return (
            self.rtol if self.rtol is not None else rtol,
            self.atol if self.atol is not None else atol,
        )

    def floor(self, dtype: Any, scale: float) -> float:
        """Oracle policy floor: ``floor_ulps * eps(dtype) * scale``."""
        return self.floor_ulps * eps(dtype) * max(scale, np.finfo(np.float64).tiny)

    def describe(self) -> str:
        if self.kind == "oracle":
            return f"oracle (float64 reference; k={self.k:g}, floor={self.floor_ulps:g} ulp)"
        if self.kind == "noise":
            return (
                f"noise (reference error estimated from the candidate's float64 run; "
                f"k={self.k:g}, floor={self.floor_ulps:g} ulp)"
            )
        if self.kind == "dtype":
            return "dtype (per-dtype rtol/atol as torch.testing.assert_close)"
        return f"explicit (rtol={self.rtol}, atol={self.atol})"

    def as_dtype_policy(self) -> Policy:
        """The fallback when no float64 oracle can be built."""
        return replace(self, kind="dtype")

    def as_noise_policy(self) -> Policy:
        """The fallback when only the candidate has a float64 twin (a reference that pins
        float32 inside, e.g. Flax layers built with ``dtype="float32"``)."""
        return replace(self, kind="noise")


def resolve_policy(policy: str | Policy | None, **overrides: Any) -> Policy:
    """Build a Policy from a name, a Policy, or None, with optional ``rtol``/``atol``/``k``."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if policy is None:
        policy = "oracle"
    if isinstance(policy, str):
        if policy not in ("oracle", "dtype"):
            raise ValueError(f"unknown parity policy {policy!r}; use 'oracle', 'dtype' or Policy")
        base = Policy(kind=policy)
    elif isinstance(policy, Policy):
        base = policy
    else:
        raise TypeError(f"policy must be a str or Policy, not {type(policy).__name__}")
    if not overrides:
        return base
    kind = "explicit" if ("rtol" in overrides or "atol" in overrides) else base.kind
    return replace(base, kind=kind, **overrides)


def dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def eps(dtype: Any) -> float:
    """Machine epsilon of a float dtype (bfloat16 and float8 through ml_dtypes)."""
    try:
        return float(np.finfo(dtype).eps)
    except (TypeError, ValueError):
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)
