"""Per-output metrics and the pass/fail decision under a tolerance policy."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from xconv.parity.policies import Policy, dtype_name


@dataclass
class Metrics:
    """How a candidate array compares with the reference (and the float64 oracle).

    Attributes:
        name: Output (or scope, or gradient) name.
        passed: Whether it is within the policy.
        shape: Candidate shape; ``ref_shape`` when they differ.
        dtype: Candidate dtype.
        max_abs: ``max |cand - ref|``.
        max_rel: ``max |cand - ref| / |ref|`` over elements where ``ref != 0``.
        mean_abs: ``mean |cand - ref|``.
        ulp_p99: 99th percentile of the ULP distance at the candidate's dtype.
        cosine: Cosine similarity of the flattened arrays.
        argmax_agree: Fraction of rows (last axis) whose argmax agrees (logits-like outputs).
        topk_agree: Fraction of rows whose top-k index sets agree (k = ``topk``).
        mismatches: Elements outside the tolerance; ``first_mismatch`` is the first one's index.
        cand_err: Oracle policy: ``max |cand - oracle|``.
        ref_err: Oracle policy: ``max |ref - oracle|``.
        bound: Oracle policy: the allowed ``max |cand - oracle|``; dtype policy: None.
        rtol / atol: The elementwise tolerances used (dtype / explicit policies).
        error: Why the arrays are not comparable (shape or dtype-kind mismatch), if so.
    """

    name: str
    passed: bool
    shape: tuple[int, ...]
    dtype: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    ulp_p99: float = 0.0
    cosine: float | None = None
    argmax_agree: float | None = None
    topk_agree: float | None = None
    topk: int | None = None
    mismatches: int = 0
    first_mismatch: tuple[int, ...] | None = None
    cand_err: float | None = None
    ref_err: float | None = None
    bound: float | None = None
    rtol: float | None = None
    atol: float | None = None
    ref_shape: tuple[int, ...] | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Oracle policy: candidate error over the reference's (inf when the ref is exact)."""
        if self.cand_err is None or self.ref_err is None:
            return None
        if self.ref_err == 0:
            return 0.0 if self.cand_err == 0 else float("inf")
        return self.cand_err / self.ref_err

    @property
    def severity(self) -> float:
        """A scalar for plots: error relative to the allowed error (>1 fails)."""
        if self.error:
            return float("inf")
        if self.bound is not None and self.cand_err is not None:
            return self.cand_err / self.bound if self.bound > 0 else float(self.cand_err > 0)
        if self.atol is not None and self.rtol is not None:
            return self.max_abs / max(self.atol + self.rtol * 1.0, 1e-300)
        return float(not self.passed)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = self.ratio
        return {k: _json_number(v) for k, v in out.items()}


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    if isinstance(v, tuple):
        return list(v)
    return v


def compare(
    name: str,
    cand: np.ndarray,
    ref: np.ndarray,
    policy: Policy,
    oracle: np.ndarray | None = None,
    *,
    logits: bool = True,
) -> Metrics:
    """Compare one candidate array with the reference under ``policy``.

    With the oracle policy and an ``oracle`` array the decision is
    ``max|cand - oracle| <= k * max|ref - oracle| + floor``; elements above that bound are
    the mismatches. With the noise policy ``oracle`` is the candidate's float64 run and the
    decision is ``|cand - ref| <= k * 2 * max|cand - oracle| + floor``. Otherwise it is
    elementwise ``|cand - ref| <= atol + rtol * |ref|``.
    Non-float outputs must match exactly.
    """
    cand = np.asarray(cand)
    ref = np.asarray(ref)
    m = Metrics(name=name, passed=False, shape=tuple(cand.shape), dtype=dtype_name(cand.dtype))
    if cand.shape != ref.shape:
        m.ref_shape = tuple(ref.shape)
        m.error = f"shape {tuple(cand.shape)} != reference shape {tuple(ref.shape)}"
        return m
    floating = _is_float(cand) or _is_float(ref)
    if not floating:
        if cand.dtype.kind == "b" or ref.dtype.kind == "b" or cand.dtype.kind in "OSU":
            bad = cand != ref
        else:
            bad = cand.astype(np.int64) != ref.astype(np.int64)
        diff = np.abs(cand.astype(np.float64) - ref.astype(np.float64)) if cand.size else bad
        _fill_diff_stats(m, diff, ref.astype(np.float64), cand, ref)
        _fill_mismatches(m, bad)
        m.passed = m.mismatches == 0
        return m

    c64 = cand.astype(np.float64)
    r64 = ref.astype(np.float64)
    diff = np.abs(c64 - r64)
    both_nan = np.isnan(c64) & np.isnan(r64)
    diff = np.where(both_nan, 0.0, diff)
    _fill_diff_stats(m, diff, r64, cand, ref)
    if logits and c64.ndim >= 2 and c64.shape[-1] >= 2 and c64.size:
        _fill_logit_agreement(m, c64, r64)

    if oracle is not None and (policy.kind == "noise" or policy.uses_oracle):
        o64 = np.asarray(oracle).astype(np.float64)
        if o64.shape != c64.shape:
            m.error = f"oracle shape {o64.shape} != {c64.shape}"
            return m
        finite = np.isfinite(o64)
        scale = float(np.max(np.abs(o64[finite]))) if finite.any() else 0.0
        floor = policy.floor(_less_precise(cand.dtype, ref.dtype), scale)
        if policy.kind == "noise":
            # ``oracle`` is the candidate's own float64 run: its distance to ``cand``
            # estimates the rounding error of either float32 side.
            noise = _nan_aware_abs(c64, o64)
            m.ref_err = float(np.max(noise)) if noise.size else 0.0
            m.cand_err = float(np.max(diff)) if diff.size else 0.0
            m.bound = policy.k * 2.0 * m.ref_err + floor
            _fill_mismatches(m, ~((diff <= m.bound) | both_nan))
        else:
            cerr = _nan_aware_abs(c64, o64)
            rerr = _nan_aware_abs(r64, o64)
            m.ref_err = float(np.max(rerr)) if rerr.size else 0.0
            m.cand_err = float(np.max(cerr)) if cerr.size else 0.0
            m.bound = policy.k * m.ref_err + floor
            _fill_mismatches(m, ~(cerr <= m.bound))
    else:
        rtol, atol = policy.tolerances(_less_precise(cand.dtype, ref.dtype))
        m.rtol, m.atol = rtol, atol
        ok = (diff <= atol + rtol * np.abs(r64)) | both_nan
        # inf == inf of the same sign counts as equal.
        ok |= np.isinf(c64) & (c64 == r64)
        _fill_mismatches(m, ~ok)
    m.passed = m.mismatches == 0
    return m


def _nan_aware_abs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
    d = np.where(same, 0.0, d)
    return np.where(np.isnan(d), np.inf, d)


def _fill_diff_stats(m: Metrics, diff: np.ndarray, r64: np.ndarray, cand, ref) -> None:
    if diff.size == 0:
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.where(np.isnan(diff), np.inf, diff).astype(np.float64)
        m.max_abs = float(np.max(d))
        m.mean_abs = float(np.mean(d))
        nz = r64 != 0
        m.max_rel = float(np.max(d[nz] / np.abs(r64[nz]))) if nz.any() else 0.0
    m.ulp_p99 = ulp_p99(cand, ref)
    m.cosine = cosine(cand, ref)


def _fill_logit_agreement(m: Metrics, c64: np.ndarray, r64: np.ndarray) -> None:
    c2 = c64.reshape(-1, c64.shape[-1])
    r2 = r64.reshape(-1, r64.shape[-1])
    if not (np.isfinite(c2).all() and np.isfinite(r2).all()):
        return
    m.argmax_agree = float(np.mean(np.argmax(c2, -1) == np.argmax(r2, -1)))
    k = min(5, c2.shape[-1] - 1)
    if k >= 1:
        ct = np.sort(np.argpartition(-c2, k - 1, axis=-1)[:, :k], axis=-1)
        rt = np.sort(np.argpartition(-r2, k - 1, axis=-1)[:, :k], axis=-1)
        m.topk = k
        m.topk_agree = float(np.mean(np.all(ct == rt, axis=-1)))


def _fill_mismatches(m: Metrics, bad: np.ndarray) -> None:
    bad = np.asarray(bad)
    m.mismatches = int(np.count_nonzero(bad))
    if m.mismatches:
        flat = int(np.argmax(bad.reshape(-1)))
        m.first_mismatch = tuple(int(i) for i in np.unravel_index(flat, bad.shape))


def cosine(a: np.ndarray, b: np.ndarray) -> float | None:
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    b = np.asarray(b, dtype=np.float64).reshape(-1)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    # Plain reductions, not BLAS dot/norm: BLAS thread pools oversubscribe busy CPUs.
    na, nb = float(np.sqrt(np.sum(a * a))), float(np.sqrt(np.sum(b * b)))
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.sum(a * b) / (na * nb))


_INT_OF = {2: np.int16, 4: np.int32, 8: np.int64}


def ulp_p99(cand: np.ndarray, ref: np.ndarray) -> float:
    """99th percentile of the ULP distance between ``cand`` and ``ref`` at cand's dtype."""
    cand = np.asarray(cand)
    if not _is_float(cand) or cand.size == 0:
        return (
            float(np.percentile(np.abs(cand.astype(np.float64) - ref.astype(np.float64)), 99))
            if cand.size
            else 0.0
        )
    ref = np.asarray(ref).astype(cand.dtype)
    ia = _ordered_ints(cand)
    ib = _ordered_ints(ref)
    d = np.abs(ia.astype(np.float64) - ib.astype(np.float64))
    nan = np.isnan(cand.astype(np.float64)) | np.isnan(ref.astype(np.float64))
    d = np.where(
        nan,
        np.where(np.isnan(cand.astype(np.float64)) & np.isnan(ref.astype(np.float64)), 0, np.inf),
        d,
    )
    return float(np.percentile(d, 99))


def _ordered_ints(x: np.ndarray) -> np.ndarray:
    """Map floats to integers whose order and differences follow the float ordering."""
    itype = _INT_OF[x.dtype.itemsize]
    i = np.ascontiguousarray(x).view(itype).astype(np.int64)
    sign_mask = np.int64(1) << (8 * x.dtype.itemsize - 1)
    # Negative floats: reflect the magnitude below zero; -0.0 and +0.0 both map to 0.
    return np.where(i < 0, -(i & (sign_mask - 1)), i)


def _is_float(x: np.ndarray) -> bool:
    return (
        x.dtype.kind in "fc"
        or dtype_name(x.dtype) in ("bfloat16",)
        or "float8" in dtype_name(x.dtype)
    )


def _less_precise(a: np.dtype, b: np.dtype) -> np.dtype:
    from xconv.parity.policies import eps

    try:
        return a if eps(a) >= eps(b) else b
    except (TypeError, ValueError):
        return a
