"""The audit's three estimators side by side, and the check of a claimed epsilon.

From one set of canary scores (the whole run's, :mod:`experiments.leakage.audit_run`, or
one observation's) and which canaries were really included (read only here, by the
scorer):

- ``epsilon-lower-bound``: Steinke, Nasr & Jagielski (2023) one-run bound
  (:mod:`.audit`): a lower bound on epsilon at the confidence for any mechanism;
- ``mu-lower-bound-fdp`` / ``epsilon-lower-bound-fdp``: Mahloujifar, Melis & Chaudhuri
  (2024) one-run f-DP bound (:mod:`.audit_fdp`) from the same guesses: a lower bound on
  mu for any mechanism, and its epsilon at delta;
- ``mu-lower-bound-gdp`` / ``epsilon-estimate-gdp``: Gaussian-DP estimation after Nasr
  et al. (2023) (:mod:`.audit_gdp`): a lower bound on mu if the canaries' scores are
  independent draws, and its epsilon at delta (an estimate).

The three hold jointly at ``confidence`` (each is computed at 1 - (1 - confidence) / 3,
Bonferroni). The claim check: ``claim-consistent`` is False when a bound exceeds what the
accountant claims. Steinke's epsilon is compared with the claimed epsilon always; the
two mu bounds are compared with the mu of the Gaussian mechanism that has the claimed
(epsilon, delta) only when the claimed mechanism is Gaussian-shaped (``gaussian_claim``:
Gaussian mechanisms composed without subsampling, whose privacy curve is exactly
mu-GDP); for a subsampled mechanism a mu-GDP bound says nothing about its (epsilon,
delta) claim, and only Steinke's bound is compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .audit import epsilon_lower_bound, guesses
from .audit_fdp import mu_lower_bound
from .audit_gdp import gdp_epsilon, gdp_mu, gdp_mu_lower_bound

ESTIMATORS = 3


@dataclass(frozen=True)
class AuditBounds:
    canaries: int  # m
    guesses: int  # k
    correct: int  # c
    epsilon_lower_bound: float  # Steinke et al.
    mu_lower_bound_fdp: float  # Mahloujifar et al.
    mu_lower_bound_gdp: float  # Nasr et al.'s GDP estimation (independence assumed)
    delta: float
    confidence: float  # joint, over the three

    @property
    def epsilon_lower_bound_fdp(self) -> float:
        return gdp_epsilon(self.mu_lower_bound_fdp, self.delta)

    @property
    def epsilon_estimate_gdp(self) -> float:
        return gdp_epsilon(self.mu_lower_bound_gdp, self.delta)

    def record(self) -> dict[str, Any]:
        """The JSON keys of leakage.jsonl / leakage.json."""
        return {"canaries": self.canaries, "guesses": self.guesses, "correct": self.correct,
                "epsilon-lower-bound": self.epsilon_lower_bound,
                "mu-lower-bound-fdp": self.mu_lower_bound_fdp,
                "epsilon-lower-bound-fdp": self.epsilon_lower_bound_fdp,
                "mu-lower-bound-gdp": self.mu_lower_bound_gdp,
                "epsilon-estimate-gdp": self.epsilon_estimate_gdp,
                "delta": self.delta, "per-bound-confidence": self.per_bound_confidence}

    @property
    def per_bound_confidence(self) -> float:
        return 1 - (1 - self.confidence) / ESTIMATORS


def audit_all(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float,
              guess_fraction: float) -> AuditBounds:
    """All three estimators on the canaries' ``scores`` (higher: more likely included)."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    each = 1 - (1 - confidence) / ESTIMATORS
    g = guesses(scores, guess_fraction)
    truth = np.where(included, 1, -1)
    k = int((g != 0).sum())
    c = int(((g == truth) & (g != 0)).sum())
    m = len(scores)
    gdp = gdp_mu_lower_bound(scores[included], scores[~included], each)
    return AuditBounds(m, k, c, epsilon_lower_bound(m, k, c, delta, each),
                       mu_lower_bound(m, k, c, each), gdp.mu_lower_bound, delta, confidence)


def claim_check(bounds: AuditBounds, claimed_epsilon: float | None,
                gaussian_claim: bool) -> dict[str, Any]:
    """Whether the bounds are consistent with the accountant's epsilon (None: no claim,
    e.g. a run without DP: then there is nothing to compare)."""
    if claimed_epsilon is None:
        return {"claim-consistent": None, "claim-checked-by": "no claim"}
    checked = {"steinke": bounds.epsilon_lower_bound > claimed_epsilon}
    out: dict[str, Any] = {}
    if gaussian_claim:
        mu = gdp_mu(claimed_epsilon, bounds.delta)
        out["mu-claimed"] = mu
        checked["fdp"] = bounds.mu_lower_bound_fdp > mu
        checked["gdp"] = bounds.mu_lower_bound_gdp > mu
    return {**out, "claim-consistent": not any(checked.values()),
            "claim-checked-by": ", ".join(checked),
            "claim-rejected-by": [name for name, over in checked.items() if over]}
