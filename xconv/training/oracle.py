"""The float64 oracle of a training run, and the element-wise bound each tensor is judged by.

A float32 training run is only defined up to rounding, and rounding is not small everywhere:
a parameter whose true gradient is zero (a convolution's bias before a BatchNorm, the key bias
of attention) sees only rounding noise as its gradient, its momentum buffer is that noise
summed, and Adam normalises it into full-size steps. Comparing such a tensor with torch's by
relative difference fails a right conversion; widening a global tolerance lets a wrong one
through. So the check keeps a third run, the torch module and its optimizer in float64
(:class:`Float64Twin`), stepped in lockstep on the same batches, and judges every parameter,
optimizer slot and running statistic after every step with the parity oracle policy
(:mod:`xconv.parity.policies`, :func:`xconv.parity.metrics.compare`)::

    |cand_i - oracle_i| <= (k * c + floor_ulps * eps) * (|oracle_i| + s)

with ``c = max_j |torch_j - oracle_j| / (|oracle_j| + s)`` the float32 torch run's own error
per unit of magnitude in that tensor (its largest over the steps so far: two float32 runs
wander from the float64 one independently, and the reference may pass close to it at one
step), and ``s`` the tensor's RMS magnitude. The bound follows the tensor's magnitude and,
through ``c``, everything the float32 reference has accumulated by that step: the size of its
updates, the noise a zero gradient turns into steps, the drift of many steps. Over the 100
steps of the ResNet fixture's SGD run, the candidate's error is at most 0.8 of this bound
with ``k = 4`` (1.5 with ``c`` of the step alone). A conversion may be ``k`` times less exact
than torch, never more: a wrong
learning rate, momentum, weight decay or BatchNorm momentum moves a tensor by a fraction of
its update, which float32 torch does not (tests/training/test_check_bounds.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from xconv.parity.metrics import Metrics, compare
from xconv.parity.policies import Policy, eps


class Float64Twin:
    """A float64 copy of the torch module with its optimizer and scheduler (slots cast)."""

    def __init__(self, module, opt, sched, loss_fn) -> None:
        import torch

        self.module, self.opt, self.sched = copy.deepcopy((module, opt, sched))
        # In place: the optimizer's parameter objects stay the module's.
        self.module.double()
        for st in self.opt.state.values():
            for k, v in list(st.items()):
                if torch.is_tensor(v) and v.is_floating_point() and k != "step":
                    st[k] = v.double()
        self.loss_fn = copy.deepcopy(loss_fn)
        if isinstance(self.loss_fn, torch.nn.Module):
            self.loss_fn.double()

    @staticmethod
    def cast(x):
        return x.double() if x.is_floating_point() else x


def float64_blocker(module) -> str | None:
    """Why the module gets no float64 oracle (it already computes in float64), or None."""
    dtypes = {str(p.dtype).removeprefix("torch.") for p in module.parameters()}
    if "float64" in dtypes:
        return "the module computes in float64: its run is its own oracle"
    return None


@dataclass
class Judge:
    """How tensors are judged: the oracle policy, or ``state_tol`` relative per tensor."""

    policy: Policy | None  # None: explicit (state_tol * max|ref|)
    state_tol: float
    #: Largest error / bound of each tensor over all steps (> 1 failed).
    excess: dict[str, float] = field(default_factory=dict)
    #: Largest ``c`` (float32 torch's error per unit magnitude) of each tensor so far.
    ref_error: dict[str, float] = field(default_factory=dict)
    #: Steps each tensor has been judged at: a value carried over n training steps (a
    #: parameter, an optimizer's state) holds up to n steps of float32 rounding.
    steps: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        if self.policy is not None:
            return (
                f"float64 oracle: |candidate - float64 torch| <= (k*c + floor) * (|oracle| + "
                f"rms) per element, k={self.policy.k:g} times float32 torch's own error per "
                f"unit magnitude (c, its largest so far), floor {self.policy.floor_ulps:g} ulp "
                f"per step the value has been carried"
            )
        return f"explicit: |candidate - torch| <= {self.state_tol:g} * max|torch| per tensor"

    def judge(self, name: str, cand, ref, oracle=None) -> Metrics:
        cand, ref = np.asarray(cand), np.asarray(ref)
        if self.policy is not None and oracle is not None:
            oracle = np.asarray(oracle)
            m = compare(name, cand, ref, self._policy(name, ref, oracle), oracle, logits=False,
                        check_dtype=False)  # fmt: skip
        else:
            scale = float(np.max(np.abs(ref.astype(np.float64)), initial=0.0))
            policy = Policy(rtol=0.0, atol=self.state_tol * scale)
            m = compare(name, cand, ref, policy, logits=False, check_dtype=False)
        ex = m.excess if m.excess is not None else (0.0 if m.passed else float("inf"))
        self.excess[name] = max(self.excess.get(name, 0.0), ex)
        return m

    def _policy(self, name: str, ref: np.ndarray, oracle: np.ndarray) -> Policy:
        """The oracle policy with ``c`` at its largest so far: compare takes ``c`` of this
        step, so the difference goes into the floor (``k * (c_max - c) / eps`` more ulp). The
        floor is per step: at its n-th step a value carries n steps of float32 rounding of
        its own (two float32 runs of one chaotic training drift apart, and torch's own run may
        happen to stay close to float64 where the candidate's does not)."""
        n = self.steps[name] = self.steps.get(name, 0) + 1
        floor = self.policy.floor_ulps * n
        o = oracle.astype(np.float64)
        r = ref.astype(np.float64)
        ok = np.isfinite(o) & np.isfinite(r)
        if not ok.any() or not np.issubdtype(ref.dtype, np.floating):
            return replace(self.policy, floor_ulps=floor)
        s = max(float(np.sqrt(np.mean(o[ok] ** 2))), float(np.finfo(np.float64).tiny))
        c = float(np.max(np.abs(r[ok] - o[ok]) / (np.abs(o[ok]) + s)))
        # torch's own error level is that of its whole run, not of one tensor: a tensor torch
        # happens to keep close to float64 (8 elements of a bias's momentum) says nothing of
        # the rounding the step holds. The largest over the tensors of this kind (the state
        # name after "/", e.g. momentum_buffer; parameters and statistics together) so far.
        kind = name.rsplit("/", 1)[1] if "/" in name else ""
        c_max = max(self.ref_error.get(kind, 0.0), c)
        self.ref_error[kind] = self.ref_error[name] = c_max
        extra = self.policy.k * (c_max - c) / eps(ref.dtype) if c_max > c else 0.0
        return replace(self.policy, floor_ulps=floor + extra)

    def why(self, m: Metrics) -> str:
        """The failing element of ``m``: where, the three values, the error and its bound."""
        if m.error:
            return m.error
        if not m.worst:
            return f"{m.mismatches} element(s) differ"
        w = m.worst[0]
        at = f"{m.name}[{', '.join(map(str, w['index']))}]" if w["index"] else m.name
        values = f"candidate {w['cand']:.7g}, torch {w['ref']:.7g}"
        if w.get("oracle") is not None:
            values += f", float64 torch {w['oracle']:.7g}"
            rule = (
                f"|candidate - float64 torch| = {w['err']:.3g} > bound {w['bound']:.3g} "
                f"({self.policy.k:g} x float32 torch's own error per unit magnitude in this "
                f"tensor, {self.ref_error.get(m.name, 0.0):.3g} at most so far; here torch is "
                f"{m.ref_err:.3g} from float64 at most), plus {self.policy.floor_ulps:g} ulp per step carried, at this element's "
                "magnitude)"
            )
        else:
            rule = f"|candidate - torch| = {w['err']:.3g} > bound {w['bound']:.3g} (state_tol)"
        return f"{at}: {values}; {rule}; {m.mismatches} of {int(np.prod(m.shape))} elements out"

    def element(self, m: Metrics) -> dict[str, Any]:
        return dict(m.worst[0]) if m.worst else {}


__all__ = ["Float64Twin", "Judge", "float64_blocker"]
