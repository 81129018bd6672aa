"""Tolerance policies: when does a candidate output count as equal to the reference?

Every policy judges each element on its own, after a position check: NaN and ±inf must sit
at exactly the same places in the candidate and the reference (same sign for inf), or the
output fails. Bounds are always finite.

- ``oracle`` (default): the reference is also run in float64 as ground truth. Element ``i``
  of the candidate passes when::

      |cand_i - oracle_i| <= (k * c + floor_ulps * eps(dtype)) * (|oracle_i| + s)

  where ``c = max_j |ref_j - oracle_j| / (|oracle_j| + s)`` is the reference's own rounding
  error per unit of magnitude (so every element's bound is at least ``k`` times the
  reference's error at that element), ``s`` is the tensor's RMS magnitude (the absolute
  floor for elements near zero, whose rounding error comes from the larger values they are
  computed from) and ``floor_ulps * eps * |oracle_i|`` is a floor in ULPs at the element's
  own magnitude. A small element cannot hide behind a large one: its bound scales with it.
- ``dtype``: elementwise ``|cand - ref| <= atol + rtol * |ref|`` with per-dtype defaults as
  ``torch.testing.assert_close``.
- explicit: ``Policy(rtol=..., atol=...)`` (or ``rtol=``/``atol=`` keyword arguments).
- ``noise``: used only when the reference has no float64 twin at all but the candidate has.
  The candidate's float64 run stands in for the oracle, but the candidate must never widen
  its own bound (a precision bug makes ``cand`` and ``cand64`` differ), so an element passes
  only when it is within both the oracle-style bound (with ``2 k``) and the dtype policy's.

dtype: the candidate's dtype must equal the reference's, unless ``allow_dtype`` names the
promotion (``{"float32": "bfloat16"}``: a deliberate bfloat16 conversion of a float32 model,
judged at bfloat16 precision). A float candidate of an integer reference always fails. A
candidate that computes in a coarser dtype than it returns (``compute_dtype``: a bfloat16
model that casts its logits to float32) is judged at the compute dtype's precision.

bfloat16 compute (:func:`bf16_policy`, what ``dtype="bfloat16"`` conversions are checked
with): the oracle policy with the floor derived from bfloat16's unit roundoff ``u = 2**-8``
and the model's depth ``L`` (matmul / convolution stages on its longest path), each stage
rounding its operands and result to bfloat16, errors adding like a random walk::

    |cand_i - oracle_i| <= (k * c + 4 * u * sqrt(L)) * (|oracle_i| + s)

The factor 4 leaves room over the measured error (0.3-2.5 ``u * sqrt(L)`` at the worst
element of the ``fixtures/torch_models.py`` models, every input set) while a weight off by
25 % still fails (``tests/parity/test_bf16.py``).

Reduced-precision dots (:meth:`Policy.at_precision`, set per row by the checker from the
device and the matmul-precision settings, :mod:`xconv.parity.precision`): a float32 model
whose dots and convolutions round their inputs to TF32 (``u = 2**-11``), one bfloat16 pass
(``u = 2**-8``) or three (``u = 2**-16``) and accumulate in float32. Each element's floor
grows by that rounding::

    |cand_i - oracle_i| <= (k * c + floor_ulps * eps + 8 * u * sqrt(L)) * (|oracle_i| + s)

``L`` is the dot / conv stages on the candidate's longest path. Why ``sqrt(L)`` and not the
contraction length ``K``: one dot ``y = sum_j a_j b_j`` with rounded inputs errs by
``sum_j a_j b_j (d_j + e_j)``, ``|d|, |e| <= u``: at most ``2 u sum_j |a_j b_j|`` (the worst
case, ``K`` times an element's share), but the roundings are independent and unbiased, so the
error is ``~ u sqrt(sum_j (a_j b_j)^2)``, of the order of ``u`` times the output's RMS
magnitude ``s`` whatever ``K``; the ``K`` bound would be 768 u (0.37 at TF32) for a BERT
projection and pass a wrong model. Each of the ``L`` chained stages adds such an error, and
independent errors add as a random walk: ``sqrt(L)``. The factor 8: the worst element of the
parity suites' right models (``tests/parity/test_precision.py``, rounding simulated on the CPU,
every input set) measured 0.3-4.0 ``u * sqrt(L)`` (4.0: attention on the 4x ``large`` inputs,
where 16x larger logits amplify their rounding through the softmax), and a GPU that truncates
to TF32 rather than rounding errs up to twice as much. At float32 the added term is 0: nothing
judged at float32 loosens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from xconv.errors import ParityConfigError

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
        floor_ulps: Oracle policy: floor in ULPs at each element's magnitude (and of the
            tensor's RMS magnitude for elements near zero).
        allow_dtype: Reference dtype -> candidate dtype(s) allowed to differ from it, e.g.
            ``{"float32": "bfloat16"}``; the pair is judged at the less precise dtype.
        allow_constant: Accept a reference output that is constant on every input set
            (otherwise such a check compares nothing and fails as vacuous).
    """

    kind: str = "oracle"
    rtol: float | None = None
    atol: float | None = None
    k: float = 4.0
    floor_ulps: float = 8.0
    allow_dtype: Any = None
    allow_constant: bool = False
    #: The dtype the candidate computes in, where coarser than the dtype it returns (a
    #: bfloat16 model that hands back float32 logits): outputs are judged at the less precise
    #: of the two, so the floor's ULP and the dtype tolerances are those of the computation
    #: (:func:`bf16_policy` sets ``"bfloat16"``). None: judged at the outputs' dtype.
    compute_dtype: str | None = None
    #: What the floor was derived from (:func:`bf16_policy`), stated in :meth:`describe`.
    bound: str | None = None
    #: The precision the judged row's float32 dots ran at (:data:`DOT_UNIT_ROUNDOFF`), and
    #: the dot / conv stages on its longest path: set per row by :meth:`at_precision`.
    precision: str = "float32"
    dot_depth: int = 1

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ParityConfigError(
                f"unknown parity policy {self.kind!r}; use one of {list(_KINDS)}"
            )
        if (self.rtol is not None or self.atol is not None) and self.kind == "oracle":
            object.__setattr__(self, "kind", "explicit")
        for name in ("k", "floor_ulps", "rtol", "atol"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and np.isfinite(v)):
                raise ParityConfigError(f"Policy.{name} must be a finite number, not {v!r}")
        if self.k <= 0 or self.floor_ulps < 0:
            raise ParityConfigError("Policy.k must be > 0 and Policy.floor_ulps >= 0")
        if (self.rtol is not None and self.rtol < 0) or (self.atol is not None and self.atol < 0):
            raise ParityConfigError("Policy.rtol and Policy.atol must be >= 0")
        object.__setattr__(self, "allow_dtype", _dtype_pairs(self.allow_dtype))
        if self.precision not in DOT_UNIT_ROUNDOFF:
            raise ParityConfigError(
                f"Policy.precision must be one of {list(DOT_UNIT_ROUNDOFF)}, not {self.precision!r}"
            )
        if self.compute_dtype is not None:
            try:
                eps(self.compute_dtype)
            except (TypeError, ValueError):
                raise ParityConfigError(
                    f"Policy.compute_dtype must name a float dtype, not {self.compute_dtype!r}"
                ) from None
            object.__setattr__(self, "compute_dtype", dtype_name(self.compute_dtype))

    def allows(self, ref_dtype: Any, cand_dtype: Any) -> bool:
        """Whether a candidate of ``cand_dtype`` may stand for a reference of ``ref_dtype``."""
        r, c = dtype_name(ref_dtype), dtype_name(cand_dtype)
        return r == c or (r, c) in self.allow_dtype

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

    def judged_at(self, dtype: Any) -> Any:
        """The dtype an output of ``dtype`` is judged at: ``compute_dtype`` where coarser."""
        if self.compute_dtype is not None and eps(self.compute_dtype) > eps(dtype):
            return self.compute_dtype
        return dtype

    @property
    def dot_rel(self) -> float:
        """The relative floor reduced-precision dots add (0 at float32)."""
        u = DOT_UNIT_ROUNDOFF[self.precision]
        return DOT_FACTOR * u * float(np.sqrt(max(self.dot_depth, 1))) if u else 0.0

    def at_precision(self, precision: str, depth: int = 1) -> Policy:
        """This policy for a row whose float32 dots ran at ``precision`` through ``depth``
        chained dot / conv stages (see the module docstring)."""
        return replace(self, precision=precision, dot_depth=max(int(depth), 1))

    def describe_precision(self) -> str:
        """The added floor, in words (empty at float32)."""
        if not self.dot_rel:
            return ""
        u = DOT_UNIT_ROUNDOFF[self.precision]
        return (
            f"dots at {self.precision}: floor + {DOT_FACTOR:g} * 2^{int(np.log2(u))} * sqrt(L), "
            f"L = {self.dot_depth} dot/conv stages: +{self.dot_rel:.3g} relative"
        )

    def describe(self) -> str:
        extra = ""
        if self.allow_dtype:
            extra += ", allow_dtype " + ", ".join(f"{r}->{c}" for r, c in self.allow_dtype)
        if self.allow_constant:
            extra += ", allow_constant"
        if self.compute_dtype is not None:
            extra += f", computed in {self.compute_dtype}"
        if self.bound:
            extra += f"; {self.bound}"
        if self.kind == "oracle":
            return f"oracle (float64 reference; k={self.k:g}, floor={self.floor_ulps:g} ulp{extra})"
        if self.kind == "noise":
            return (
                "noise (NO float64 reference: error estimated from the candidate's float64 "
                f"run, capped by the dtype policy; k={self.k:g}, floor={self.floor_ulps:g} ulp"
                f"{extra})"
            )
        if self.kind == "dtype":
            return f"dtype (per-dtype rtol/atol as torch.testing.assert_close{extra})"
        return f"explicit (rtol={self.rtol}, atol={self.atol}{extra})"

    def as_dtype_policy(self) -> Policy:
        """The fallback when no float64 oracle can be built."""
        return replace(self, kind="dtype")

    def as_noise_policy(self) -> Policy:
        """The fallback when only the candidate has a float64 twin (a reference that pins
        float32 inside, e.g. Flax layers built with ``dtype="float32"``)."""
        return replace(self, kind="noise")


#: Unit roundoff of the inputs of a float32 dot / convolution at each matmul precision (the
#: operands rounded to that many mantissa bits, products accumulated in float32); float32's
#: own rounding is in the policy's ULP floor already, so it adds nothing.
DOT_UNIT_ROUNDOFF: dict[str, float] = {
    "float32": 0.0,
    "bf16_3x": 2.0**-16,  # a float32 as the sum of two bfloat16 (16 bits), the lo*lo term dropped
    "tf32": 2.0**-11,  # 10 stored mantissa bits
    "bf16": 2.0**-8,  # 7 stored mantissa bits
}
#: Allowed error of reduced-precision dots per ``sqrt(depth)``, in unit roundoffs.
DOT_FACTOR = 8.0

#: The differential check (generated source against the IR's runtime, which run the same graph
#: in the same framework): they may differ by float reassociation, never by more. An output
#: passes within ``DIFFERENTIAL_ATOL * max(1, max|want|) + DIFFERENTIAL_RTOL * |want|`` per
#: element; beyond it, a float32 output still passes within that bound widened by
#: :data:`DIFFERENTIAL_NOISE` times the runtime's own largest error against its float64 run
#: (deep networks: float32 reassociation alone reaches ~1e-5 of the output's scale).
DIFFERENTIAL_RTOL, DIFFERENTIAL_ATOL = 1e-4, 1e-5
DIFFERENTIAL_NOISE = 4.0


def differential_policy(
    dtype: Any, scale: float, bf16: float | None = None, noise: float | None = None
) -> Policy:
    """The explicit policy the differential check judges one output with.

    Args:
        dtype: The runtime output's dtype: half-precision outputs get at least 4 ULPs of their
            own dtype (reassociation in float16 moves the last bit at any magnitude).
        scale: The runtime output's largest finite magnitude.
        bf16: A bfloat16-compute pair: ``bf16 * (|want| + scale)`` per element instead
            (``xconv.pipeline.source.bf16_differential_bound``).
        noise: The runtime's largest error against its float64 run: the bound widens by
            :data:`DIFFERENTIAL_NOISE` times it.
    """
    if bf16 is not None:
        return Policy(kind="explicit", rtol=bf16, atol=bf16 * scale, bound="bfloat16 compute")
    try:
        tiny = 4 * eps(dtype)
    except (TypeError, ValueError):  # an integer output: judged exactly, the bound unused
        tiny = 0.0
    rtol, atol = max(DIFFERENTIAL_RTOL, tiny), max(DIFFERENTIAL_ATOL, tiny) * max(1.0, scale)
    if noise is None:
        return Policy(kind="explicit", rtol=rtol, atol=atol)
    bound = f"{DIFFERENTIAL_NOISE:g} x the runtime's float32 error {noise:.3g} added"
    return Policy(kind="explicit", rtol=rtol, atol=atol + DIFFERENTIAL_NOISE * noise, bound=bound)


#: bfloat16's unit roundoff (half its machine epsilon 2**-7).
BF16_UNIT_ROUNDOFF = 2.0**-8
#: Allowed error of a bfloat16-computed model per ``sqrt(depth)``, in unit roundoffs.
BF16_FACTOR = 4.0


def bf16_policy(depth: int, policy: str | Policy | None = "oracle") -> Policy:
    """The policy a bfloat16-compute conversion of a float32 model is checked with.

    Args:
        depth: Matmul / convolution stages on the model's longest path
            (:func:`xconv.converters.ops.precision.rounding_depth`).
        policy: The base policy: ``"oracle"`` (default) gets the floor
            ``BF16_FACTOR * 2**-8 * sqrt(depth)`` relative to ``|oracle_i| + rms``;
            ``"dtype"`` keeps torch's bfloat16 rtol / atol. Either allows float32 -> bfloat16.
    """
    depth = max(int(depth), 1)
    base = resolve_policy(policy)
    allow = {"float32": "bfloat16"}
    if not base.uses_oracle:
        bound = "bfloat16 compute, judged at torch's bfloat16 rtol/atol"
        return replace(base, allow_dtype=allow, compute_dtype="bfloat16", bound=bound)
    rel = BF16_FACTOR * BF16_UNIT_ROUNDOFF * float(np.sqrt(depth))
    bound = (
        f"bfloat16 compute: |cand - oracle| <= (k*c_ref + {BF16_FACTOR:g} * 2^-8 * sqrt(L)) * "
        f"(|oracle| + rms), L = {depth} matmul/conv stages: floor {rel:.3g} relative"
    )
    floor = rel / (2 * BF16_UNIT_ROUNDOFF)
    return replace(base, floor_ulps=floor, allow_dtype=allow, compute_dtype="bfloat16", bound=bound)


def resolve_policy(policy: str | Policy | None, **overrides: Any) -> Policy:
    """Build a Policy from a name, a Policy, or None, with optional ``rtol``/``atol``/``k``."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if policy is None:
        policy = "oracle"
    if isinstance(policy, str):
        if policy not in ("oracle", "dtype"):
            raise ParityConfigError(
                f"unknown parity policy {policy!r}; use 'oracle', 'dtype' or a Policy"
            )
        base = Policy(kind=policy)
    elif isinstance(policy, Policy):
        base = policy
    else:
        raise ParityConfigError(
            f"policy must be 'oracle', 'dtype' or a Policy, not {type(policy).__name__}"
        )
    if not overrides:
        return base
    kind = "explicit" if ("rtol" in overrides or "atol" in overrides) else base.kind
    return replace(base, kind=kind, **overrides)


def _dtype_pairs(allow: Any) -> tuple[tuple[str, str], ...]:
    """``{"float32": "bfloat16"}`` (values may be lists) as sorted (ref, cand) name pairs."""
    if not allow:
        return ()
    if isinstance(allow, Mapping):
        items = []
        for r, cs in allow.items():
            for c in [cs] if isinstance(cs, str) else list(cs):
                items.append((r, c))
    else:
        items = [tuple(p) for p in allow]
    try:
        pairs = {(dtype_name(r), dtype_name(c)) for r, c in items}
    except (TypeError, ValueError) as e:
        raise ParityConfigError(
            f"Policy.allow_dtype must map reference dtype names to candidate dtype names, "
            f'e.g. {{"float32": "bfloat16"}} ({e})'
        ) from e
    return tuple(sorted(pairs))


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
