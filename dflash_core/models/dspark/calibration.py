"""How well DSpark's confidence head predicts acceptance, and what a verifier that uses it would
gain (docs/algorithm.md, DSpark): pure functions over what exact decoding recorded per round,
the drafts' confidences and how many of them were accepted.

The head's c_j estimates P(draft j accepted | drafts < j accepted), so per slot it is compared
with the acceptance observed among the rounds that REACHED slot j (all earlier drafts accepted).
The chance of getting past slot j is the survival a_j = c_0 * ... * c_j.

An adaptive verifier verifies fewer drafts than it has. At a budget of k drafts per round:
- ``fixed``: the first k drafts of every round;
- ``adaptive``: the rounds taken as one batch of requests, k x rounds (round, slot) pairs in
  descending survival (the confidence-ordered admission of the paper's scheduler and of vLLM's
  adaptive verification under a budget). Survival falls along a round, so each round verifies a
  prefix; a confident round verifies more, a doubtful one less.
Either way a round gains min(accepted, verified) + 1 tokens; the figure is their mean (tau at
that budget). At k = B both verify everything: exact tau.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

BUDGETS = (2, 4)  # and B, the block's drafts: what the evaluation reports
BINS = 10  # equal-width confidence bins of the ECE


def _ragged(confidences: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """[R, J] confidences (0 where absent) and the mask of drafted slots."""
    R = len(confidences)
    J = max((len(c) for c in confidences), default=0)
    conf = np.zeros((R, J), dtype=np.float64)
    valid = np.zeros((R, J), dtype=bool)
    for r, c in enumerate(confidences):
        conf[r, : len(c)] = np.asarray(c, dtype=np.float64)
        valid[r, : len(c)] = True
    return conf, valid


def ece(confidence: np.ndarray, outcome: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error: sum over equal-width confidence bins of (share of samples) x
    |mean confidence - observed rate|. 0.0 without samples."""
    c = np.asarray(confidence, dtype=np.float64).ravel()
    o = np.asarray(outcome, dtype=np.float64).ravel()
    if not len(c):
        return 0.0
    idx = np.minimum((np.clip(c, 0.0, 1.0) * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.sum() / len(c) * abs(c[sel].mean() - o[sel].mean())
    return float(total)


@dataclass
class Budget:
    drafts: int  # k: drafts verified per round on average
    fixed: float  # tau verifying the first k of every round
    adaptive: float  # tau verifying the k x rounds most likely to survive


@dataclass
class Calibration:
    rounds: int
    reached: list[int] = field(default_factory=list)  # per slot: rounds that reached it
    expected: list[float] = field(default_factory=list)  # mean c_j where slot j was reached
    observed: list[float] = field(default_factory=list)  # share accepted where reached
    ece_slot: list[float] = field(default_factory=list)
    ece: float = 0.0  # over every reached (round, slot)
    # per slot, over every round that drafted it: mean survival a_j vs share that got past j
    survival_expected: list[float] = field(default_factory=list)
    survival_observed: list[float] = field(default_factory=list)
    tau: float = 0.0  # every draft verified (= exact tau of these rounds)
    budgets: list[Budget] = field(default_factory=list)

    def as_dict(self) -> dict:
        """Plain JSON values (an event's field, events.EvalResult.calibration)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Calibration | None":
        """A Calibration from ``as_dict``'s output; None for {} or None (no confidence head,
        or an event written before calibrations were recorded)."""
        if not d:
            return None
        known = {f for f in cls.__dataclass_fields__ if f != "budgets"}
        out = cls(**{k: v for k, v in d.items() if k in known})
        out.budgets = [Budget(int(b["drafts"]), float(b["fixed"]), float(b["adaptive"]))
                       for b in d.get("budgets") or []]
        return out


def _budget_tau(surv: np.ndarray, valid: np.ndarray, accepted: np.ndarray, k: int
                ) -> tuple[float, float]:
    R, J = valid.shape
    fixed = float(np.mean(np.minimum(accepted, k) + 1))
    K = min(int(k) * R, int(valid.sum()))
    r_idx, j_idx = np.nonzero(valid)
    # descending survival; ties by slot so each round's share stays a prefix
    order = np.lexsort((j_idx, -surv[r_idx, j_idx]))[:K]
    verified = np.bincount(r_idx[order], minlength=R)
    adaptive = float(np.mean(np.minimum(accepted, verified) + 1))
    return fixed, adaptive


def calibrate(confidences: Sequence[Sequence[float]], accepted: Sequence[int],
              budgets: Sequence[int] | None = None, bins: int = BINS) -> Calibration:
    """Calibration of recorded rounds: ``confidences[r]`` the head's c_j for the drafts of
    round r (as many as it drafted), ``accepted[r]`` how many of them were accepted. Budgets:
    default those of BUDGETS below the most drafts any round had (B), and B."""
    acc = np.asarray(accepted, dtype=np.int64)
    if len(acc) != len(confidences):
        raise ValueError(f"{len(confidences)} rounds of confidences but {len(acc)} acceptances")
    conf, valid = _ragged(confidences)
    R, J = conf.shape
    out = Calibration(rounds=R)
    if R == 0 or J == 0:
        return out
    if np.any(acc < 0) or np.any(acc > valid.sum(1)):
        raise ValueError("an acceptance is negative or larger than the round's drafts")
    slot = np.arange(J)[None, :]
    reached = valid & (acc[:, None] >= slot)
    passed = acc[:, None] > slot
    surv = np.cumprod(np.where(valid, conf, 1.0), axis=1)
    for j in range(J):
        m = reached[:, j]
        out.reached.append(int(m.sum()))
        out.expected.append(float(conf[m, j].mean()) if m.any() else 0.0)
        out.observed.append(float(passed[m, j].mean()) if m.any() else 0.0)
        out.ece_slot.append(ece(conf[m, j], passed[m, j], bins))
        d = valid[:, j]
        out.survival_expected.append(float(surv[d, j].mean()) if d.any() else 0.0)
        out.survival_observed.append(float(passed[d, j].mean()) if d.any() else 0.0)
    out.ece = ece(conf[reached], passed[reached], bins)
    out.tau = float(np.mean(acc + 1))
    ks = list(budgets) if budgets is not None else [k for k in BUDGETS if k < J] + [J]
    for k in dict.fromkeys(ks):
        fixed, adaptive = _budget_tau(surv, valid, acc, int(k))
        out.budgets.append(Budget(int(k), fixed, adaptive))
    return out
