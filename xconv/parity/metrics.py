"""Per-output metrics and the pass/fail decision under a tolerance policy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from xconv.parity.policies import Policy, dtype_name, eps


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
        error: Why the arrays are not comparable (shape or dtype mismatch), if so.
        excess: ``max_i err_i / bound_i`` (> 1 fails; inf for a NaN/inf out of place).
        worst: The elements furthest outside their bound: index, cand, ref, oracle, err,
            bound. ``bound`` is the bound at the worst element.
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
    excess: float | None = None
    worst: list[dict[str, Any]] = field(default_factory=list)

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
        if self.excess is not None:
            return self.excess
        if self.bound is not None and self.cand_err is not None:
            return self.cand_err / self.bound if self.bound > 0 else float(self.cand_err > 0)
        if self.atol is not None and self.rtol is not None and self.max_abs is not None:
            return self.max_abs / max(self.atol + self.rtol * 1.0, 1e-300)
        return float(not self.passed)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = self.ratio
        return {k: _json_number(v) for k, v in out.items()}


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    if isinstance(v, tuple | list):
        return [_json_number(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_number(x) for k, x in v.items()}
    return v


def compare(
    name: str,
    cand: np.ndarray,
    ref: np.ndarray,
    policy: Policy,
    oracle: np.ndarray | None = None,
    *,
    logits: bool = True,
    check_dtype: bool = True,
) -> Metrics:
    """Compare one candidate array with the reference under ``policy``, element by element.

    NaN and ±inf must sit at the same positions in ``cand`` and ``ref``. Finite elements are
    judged by the policy (see :mod:`xconv.parity.policies`): with the oracle policy and an
    ``oracle`` array, ``|cand_i - oracle_i|`` against a per-element bound; with the noise
    policy ``oracle`` is the candidate's own float64 run and the bound is capped by the dtype
    policy's; otherwise ``|cand_i - ref_i| <= atol + rtol * |ref_i|``. Non-float outputs must
    match exactly. The dtypes must match unless ``policy.allow_dtype`` names the pair
    (``check_dtype=False`` skips that, for scope localisation). ``worst`` lists the elements
    furthest outside their bound, with indices.
    """
    cand = np.asarray(cand)
    ref = np.asarray(ref)
    m = Metrics(name=name, passed=False, shape=tuple(cand.shape), dtype=dtype_name(cand.dtype))
    m.error = _incomparable(cand, ref, policy, check_dtype)
    if m.error is not None:
        if cand.shape != ref.shape:
            m.ref_shape = tuple(ref.shape)
        return m
    # A 0-d output (a symbolic size, an optimizer's step count) is judged as one element.
    cand, ref = np.atleast_1d(cand), np.atleast_1d(ref)
    if oracle is not None:
        oracle = np.atleast_1d(np.asarray(oracle))
    if cand.dtype.kind == "c" or ref.dtype.kind == "c":
        # Complex: the real and imaginary parts side by side on a last axis of 2, each judged
        # as a float (a cast to float would drop the imaginary part unseen).
        cand, ref = _parts(cand), _parts(ref)
        oracle = None if oracle is None else _parts(oracle)
    if not is_float(cand):
        return _compare_exact(m, cand, ref)

    c64 = cand.astype(np.float64)
    r64 = ref.astype(np.float64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(c64 - r64)
    # Non-finite values are judged by position: NaN where the reference has NaN, ±inf where
    # it has the same inf. Anything else non-finite, on either side, is a mismatch.
    same_special = (np.isnan(c64) & np.isnan(r64)) | (np.isinf(c64) & np.isinf(r64) & (c64 == r64))
    finite = np.isfinite(c64) & np.isfinite(r64)
    special_bad = ~finite & ~same_special
    diff = np.where(same_special, 0.0, diff)
    _fill_diff_stats(m, diff, r64, cand, ref)
    if logits and c64.ndim >= 2 and c64.shape[-1] >= 2 and c64.size:
        _fill_logit_agreement(m, c64, r64)

    dt = policy.judged_at(_less_precise(cand.dtype, ref.dtype))
    rtol, atol = policy.tolerances(dt)
    r_abs = np.abs(np.where(finite, r64, 0.0))
    if policy.dot_rel and policy.kind in ("dtype", "noise"):
        # Reduced-precision dots: the dtype policy's rtol grows by the same relative floor as
        # the oracle's, and its atol by that floor at the tensor's RMS magnitude.
        rms = float(np.sqrt(np.mean(r_abs**2))) if r_abs.size else 0.0
        rtol, atol = rtol + policy.dot_rel, atol + policy.dot_rel * rms
    dtype_bound = atol + rtol * r_abs
    del r_abs
    if oracle is not None and (policy.kind == "noise" or policy.uses_oracle):
        if np.shape(oracle) != c64.shape:
            m.error = f"oracle shape {np.shape(oracle)} != {c64.shape}"
            return m
        err, bound = _oracle_bound(m, c64, r64, oracle, diff, finite, policy, dt, dtype_bound)
    else:
        m.rtol, m.atol = rtol, atol
        err = np.where(finite, diff, 0.0)
        bound = dtype_bound
    bad = ~(finite & (err <= bound)) & ~same_special
    _fill_mismatches(m, bad)
    _fill_worst(m, err, bound, special_bad, c64, r64, oracle)
    m.passed = m.mismatches == 0
    return m


def _parts(x: np.ndarray) -> np.ndarray:
    """``(..., 2)``: the real and imaginary parts of ``x`` at their own float dtype."""
    x = np.asarray(x)
    return np.stack([x.real, x.imag if x.dtype.kind == "c" else np.zeros_like(x)], axis=-1)


def _incomparable(cand: np.ndarray, ref: np.ndarray, policy: Policy, check_dtype: bool):
    """Why ``cand`` cannot be compared with ``ref`` element by element (shape, float against
    non-float, a dtype change the policy does not allow), or None."""
    if cand.shape != ref.shape:
        return f"shape {tuple(cand.shape)} != reference shape {tuple(ref.shape)}"
    if is_float(cand) != is_float(ref):
        return (
            f"dtype {dtype_name(cand.dtype)} != reference dtype {dtype_name(ref.dtype)} "
            "(a float and a non-float output are never equal)"
        )
    if check_dtype and not policy.allows(ref.dtype, cand.dtype):
        r, c = dtype_name(ref.dtype), dtype_name(cand.dtype)
        return (
            f"dtype {c} != reference dtype {r}; if the change is deliberate, pass "
            f'Policy(allow_dtype={{"{r}": "{c}"}})'
        )
    return None


def _compare_exact(m: Metrics, cand: np.ndarray, ref: np.ndarray) -> Metrics:
    """Non-float outputs: equal element by element."""
    if cand.dtype.kind == "b" or ref.dtype.kind == "b" or cand.dtype.kind in "OSU":
        bad = cand != ref
    else:
        bad = cand.astype(np.int64) != ref.astype(np.int64)
    if cand.dtype.kind not in "OSU":  # strings have no distance, only their mismatches
        diff = np.abs(cand.astype(np.float64) - ref.astype(np.float64)) if cand.size else bad
        _fill_diff_stats(m, diff, ref.astype(np.float64), cand, ref)
    _fill_mismatches(m, bad)
    m.passed = m.mismatches == 0
    return m


def _oracle_bound(m, c64, r64, oracle, diff, finite, policy: Policy, dt, dtype_bound):
    """The error judged and its per-element bound under the oracle or noise policy (see
    :func:`compare`); sets ``m.ref_err`` and ``m.cand_err``."""
    o64 = np.asarray(oracle).astype(np.float64)
    judged = finite & np.isfinite(o64)
    o0 = np.where(judged, o64, 0.0)
    del o64  # full-size float64 temporaries go as soon as they are used: peak memory
    o_abs = np.abs(o0)
    s = float(np.sqrt(np.mean(o_abs[judged] ** 2))) if judged.any() else 0.0
    s = max(s, float(np.finfo(np.float64).tiny))
    if policy.kind == "noise":
        # ``oracle`` is the candidate's float64 run: its distance to ``cand`` estimates
        # the rounding error of either float32 side; the error judged is cand vs ref.
        own = np.where(judged, np.abs(np.where(finite, c64, 0.0) - o0), 0.0)
        err = np.where(finite, diff, 0.0)
        k = 2.0 * policy.k
    else:
        own = np.where(judged, np.abs(np.where(finite, r64, 0.0) - o0), 0.0)
        err = np.where(judged, np.abs(np.where(finite, c64, 0.0) - o0), 0.0)
        k = policy.k
    # The reference's own error per unit of magnitude: every element's bound is at
    # least k times the reference's error there, and scales with the element.
    per_unit = float(np.max(own / (o_abs + s))) if judged.any() else 0.0
    m.ref_err = float(np.max(own)) if own.size else 0.0
    del own, o0
    bound = (k * per_unit + policy.floor_ulps * eps(dt) + policy.dot_rel) * (o_abs + s)
    if policy.kind == "noise":
        bound = np.minimum(bound, dtype_bound)
    # Elements the oracle cannot judge (it is non-finite there) fall back to the dtype
    # policy against the reference.
    unjudged = finite & ~judged
    err = np.where(unjudged, diff, err)
    bound = np.where(unjudged, dtype_bound, bound)
    m.cand_err = float(np.max(err)) if err.size else 0.0
    return err, bound


def _fill_worst(m, err, bound, special_bad, c64, r64, oracle, n: int = 5) -> None:
    """The ``n`` elements with the largest error over bound (misplaced NaN/inf first)."""
    if err.size == 0:
        return
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(
            bound > 0, err / np.where(bound > 0, bound, 1.0), np.where(err > 0, np.inf, 0.0)
        )
    excess = np.where(special_bad, np.inf, excess).reshape(-1)
    m.excess = float(np.max(excess))
    order = _largest(excess, n)
    flat_b, flat_e = bound.reshape(-1), err.reshape(-1)
    m.bound = float(flat_b[int(order[0])])
    o = None if oracle is None else np.asarray(oracle, dtype=np.float64).reshape(-1)
    for i in (int(j) for j in order):
        if excess[i] == 0 and m.worst:
            break
        m.worst.append(
            {
                "index": [int(j) for j in np.unravel_index(i, err.shape)],
                "cand": float(c64.reshape(-1)[i]),
                "ref": float(r64.reshape(-1)[i]),
                "oracle": None if o is None else float(o[i]),
                "err": float(flat_e[i]),
                "bound": float(flat_b[i]),
            }
        )


def _fill_diff_stats(m: Metrics, diff: np.ndarray, r64: np.ndarray, cand, ref) -> None:
    if diff.size == 0:
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.where(np.isnan(diff), np.inf, diff).astype(np.float64, copy=False)
        m.max_abs = float(np.max(d))
        m.mean_abs = float(np.mean(d))
        nz = r64 != 0
        if nz.any():  # one scratch array, not three (outputs can be 32k-vocab logits)
            rel = np.abs(r64)
            np.divide(d, rel, out=rel, where=nz)
            rel[~nz] = -np.inf
            m.max_rel = float(np.max(rel))
        else:
            m.max_rel = 0.0
    m.ulp_p99 = ulp_p99(cand, ref)
    m.cosine = cosine(cand, ref)


def _largest(x: np.ndarray, n: int) -> np.ndarray:
    """Indices of the ``n`` largest of flat ``x``, largest first, ties (and NaNs, last) by
    index: ``np.argsort(-x, kind="stable")[:n]`` in O(size), not O(size log size) (a 32k-vocab
    logits output is millions of elements)."""
    k = min(n, x.size)
    if k == 0:
        return np.zeros(0, np.intp)
    neg = -x
    t = np.partition(neg, k - 1)[k - 1]  # the k-th largest of x, negated (NaN sorts last)
    if np.isnan(t):
        above = np.flatnonzero(~np.isnan(neg))
        tie = np.flatnonzero(np.isnan(neg))[: k - above.size]
    else:
        above = np.flatnonzero(neg < t)
        tie = np.flatnonzero(neg == t)[: k - above.size]
    idx = np.concatenate([above, tie])
    key = np.where(np.isnan(neg[idx]), np.inf, neg[idx])
    return idx[np.lexsort((idx, key))]


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
        return None  # undefined: two zero arrays agree on nothing
    if na == 0 or nb == 0:
        return 0.0
    return float(np.sum(a * b) / (na * nb))


_INT_OF = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def ulp_p99(cand: np.ndarray, ref: np.ndarray) -> float:
    """99th percentile of the ULP distance between ``cand`` and ``ref`` at cand's dtype."""
    cand = np.asarray(cand)
    if not is_float(cand) or cand.size == 0:
        return (
            float(np.percentile(np.abs(cand.astype(np.float64) - ref.astype(np.float64)), 99))
            if cand.size
            else 0.0
        )
    ref = np.asarray(ref).astype(cand.dtype)
    if cand.dtype.kind == "c":  # each part at its own float dtype
        cand, ref = _parts(cand), _parts(ref)
    ia = _ordered_ints(cand)
    ib = _ordered_ints(ref)
    d = np.abs(ia.astype(np.float64) - ib.astype(np.float64))
    with np.errstate(over="ignore"):  # exact in int64 where it fits (float64's ints do not)
        exact = np.abs(ia - ib).astype(np.float64)
    d = np.where(d < 2.0**62, exact, d)
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
    magnitude = np.int64(np.iinfo(itype).max)  # every bit but the sign
    # Negative floats: reflect the magnitude below zero; -0.0 and +0.0 both map to 0.
    return np.where(i < 0, -(i & magnitude), i)


def is_float(x: np.ndarray) -> bool:
    """numpy's float and complex arrays, and ml_dtypes' bfloat16 and float8 ones."""
    return (
        x.dtype.kind in "fc"
        or dtype_name(x.dtype) in ("bfloat16",)
        or "float8" in dtype_name(x.dtype)
    )


def _less_precise(a: np.dtype, b: np.dtype) -> np.dtype:
    try:
        return a if eps(a) >= eps(b) else b
    except (TypeError, ValueError):
        return a
