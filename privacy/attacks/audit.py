"""Empirical DP auditing in one training run (Steinke, Nasr & Jagielski, NeurIPS 2023).

The auditor crafts m canaries (:mod:`.canaries`: records with a Dirac gradient at a
coordinate of their own); each is inserted into the client's training data independently
with probability 1/2. After the round it scores every canary from what the server holds —
how far the observed update moved against the canary's gradient at its coordinate —
guesses "included" for the highest scores and "excluded" for the lowest, abstaining on
the rest, and counts its correct guesses v out of r. If the training were (epsilon, delta)-DP, v
could exceed a Binomial(r, e^eps / (1 + e^eps)) count only with a probability bounded in
the paper's Theorem 3.1 (the delta term: 2 m delta times the largest of
P[v > Binomial >= v - i] / i); the audit reports the largest epsilon that this rejects at
the stated confidence: a lower bound on the epsilon the run really has. On a DP run it
must stay below the accountant's epsilon; without DP it is clearly positive.

It is judged against two references: the accountant's claim, which guards against an
adversary who sees every step, and the exact epsilon of what the auditor sees
(:mod:`.audit_view`, Steinke et al. 2025: with Poisson batches the server sees only the
sum of a round's steps, whose epsilon is well below the claim). :class:`AuditResult`
carries both when the caller knows them, and the bound as a fraction of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom


def guesses(scores: np.ndarray, fraction: float) -> np.ndarray:
    """+1 (included) for the top fraction/2 of scores, -1 for the bottom, 0 otherwise."""
    k = int(len(scores) * fraction / 2)
    order = np.argsort(-np.asarray(scores), kind="stable")
    out = np.zeros(len(scores), dtype=int)
    out[order[:k]] = 1
    out[order[len(scores) - k:]] = -1
    return out


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[at least v of r guesses correct] if the training were (eps, delta)-DP (Thm 3.1)."""
    q = 1 / (1 + math.exp(-eps))
    beta = binom.sf(v - 1, r, q)  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(1.0, beta)
    i = np.arange(1, v + 1)  # alpha = max_i P[v > Binomial(r, q) >= v - i] / i
    alpha = float(np.max(np.cumsum(binom.pmf(v - i, r, q)) / i))
    return min(1.0, beta + 2 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """The largest epsilon rejected at ``confidence`` by v correct guesses out of r."""
    if r == 0 or p_value(m, r, v, 0.0, delta) >= 1 - confidence:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < 1 - confidence:
        lo, hi = hi, 2 * hi
    for _ in range(50):  # bisection: p_value grows with eps
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) < 1 - confidence else (lo, mid)
    return lo


@dataclass(frozen=True)
class AuditResult:
    canaries: int  # m
    guesses: int  # r
    correct: int  # v
    epsilon_lower_bound: float
    confidence: float
    delta: float
    epsilon_claimed: float | None = None  # the accountant's
    epsilon_view: float | None = None  # exact, of what the auditor sees (.audit_view)

    @property
    def fraction_of_claim(self) -> float | None:
        """The bound over the accountant's epsilon (None when unknown or 0)."""
        return self.epsilon_lower_bound / self.epsilon_claimed if self.epsilon_claimed \
            else None

    @property
    def fraction_of_view(self) -> float | None:
        """The bound over the view's exact epsilon: how much of what it could show."""
        return self.epsilon_lower_bound / self.epsilon_view if self.epsilon_view else None


def audit(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float = 0.95,
          guess_fraction: float = 0.5, epsilon_claimed: float | None = None,
          epsilon_view: float | None = None) -> AuditResult:
    """Score the auditor's guesses against which canaries really were included
    (``epsilon_claimed`` / ``epsilon_view``: the references it is reported against)."""
    g = guesses(scores, guess_fraction)
    truth = np.where(included, 1, -1)
    r = int((g != 0).sum())
    v = int(((g == truth) & (g != 0)).sum())
    return AuditResult(len(scores), r, v, epsilon_lower_bound(len(scores), r, v, delta,
                                                              confidence), confidence, delta,
                       epsilon_claimed, epsilon_view)
