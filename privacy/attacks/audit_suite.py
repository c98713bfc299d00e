"""The audit's four estimators side by side, and the check of a claimed epsilon.

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
  independent draws, and its epsilon at delta (an estimate);
- ``epsilon-estimate-oneshot`` / ``epsilon-lower-bound-oneshot``: Andrew et al. (ICLR
  2024) one-shot estimate (:mod:`.audit_oneshot`): Gaussians with unequal variances
  fitted to the included and the excluded canaries' scores, the epsilon of that pair,
  and the least epsilon over a confidence box of the fit (a bound if the scores are
  Gaussian). With Poisson batches it is the only one that comes near what the released
  update can show.

The four hold jointly at ``confidence`` (each is computed at 1 - (1 - confidence) / 4,
Bonferroni). The claim check: ``claim-consistent`` is False when a bound exceeds what the
accountant claims. Steinke's epsilon is compared with the claimed epsilon always; the
two mu bounds are compared with the mu of the Gaussian mechanism that has the claimed
(epsilon, delta) only when the claimed mechanism is Gaussian-shaped (``gaussian_claim``:
Gaussian mechanisms composed without subsampling, whose privacy curve is exactly
mu-GDP); for a subsampled mechanism a mu-GDP bound says nothing about its (epsilon,
delta) claim. The one-shot bound is compared with a Gaussian claim, and with a
subsampled one when the claimed mechanism's view is given and its Gaussian fit
(:meth:`.audit_view.CanaryView.moment_fit_epsilon`, what the fit tends to on an honest
run) is within the claim.

**What the audit can see.** With the claimed mechanism's ``view`` (the sum of a
fixed-gradient canary's steps, :mod:`.audit_view`, Steinke et al. 2025) the check also
reports ``epsilon-view``, the exact epsilon of what the scores are computed from, and
each epsilon as a fraction of the claim and of the view: with Poisson batches the
server's view is far below the accountant's claim (5.1 against 8), and an audit is judged
by how much of the view it reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .audit import epsilon_lower_bound, guesses
from .audit_fdp import mu_lower_bound
from .audit_gdp import gdp_epsilon, gdp_mu, gdp_mu_lower_bound
from .audit_oneshot import OneShotEstimate, one_shot_estimate
from .audit_view import CanaryView

ESTIMATORS = 4
# the epsilons an audit line reports, in the order of the fractions
EPSILON_KEYS = ("epsilon-lower-bound", "epsilon-lower-bound-fdp", "epsilon-estimate-gdp",
                "epsilon-estimate-oneshot", "epsilon-lower-bound-oneshot")


@dataclass(frozen=True)
class AuditBounds:
    canaries: int  # m
    guesses: int  # k
    correct: int  # c
    epsilon_lower_bound: float  # Steinke et al.
    mu_lower_bound_fdp: float  # Mahloujifar et al.
    mu_lower_bound_gdp: float  # Nasr et al.'s GDP estimation (independence assumed)
    delta: float
    confidence: float  # joint, over the four
    oneshot: OneShotEstimate | None = None  # Andrew et al. (None: under 3 on a side)

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
                **(self.oneshot.record() if self.oneshot is not None else
                   {"epsilon-estimate-oneshot": 0.0, "epsilon-lower-bound-oneshot": 0.0}),
                "delta": self.delta, "per-bound-confidence": self.per_bound_confidence}

    @property
    def per_bound_confidence(self) -> float:
        return 1 - (1 - self.confidence) / ESTIMATORS


def audit_all(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float,
              guess_fraction: float) -> AuditBounds:
    """All four estimators on the canaries' ``scores`` (higher: more likely included)."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    each = 1 - (1 - confidence) / ESTIMATORS
    g = guesses(scores, guess_fraction)
    truth = np.where(included, 1, -1)
    k = int((g != 0).sum())
    c = int(((g == truth) & (g != 0)).sum())
    m = len(scores)
    ins, outs = scores[included], scores[~included]
    gdp = gdp_mu_lower_bound(ins, outs, each)
    oneshot = (one_shot_estimate(ins, outs, delta, each)
               if min(len(ins), len(outs)) >= 3 else None)
    return AuditBounds(m, k, c, epsilon_lower_bound(m, k, c, delta, each),
                       mu_lower_bound(m, k, c, each), gdp.mu_lower_bound, delta, confidence,
                       oneshot)


def oneshot_comparable(claimed_epsilon: float, delta: float, gaussian_claim: bool,
                       view: CanaryView | None) -> bool:
    """Whether the one-shot bound can be held against the claim: a Gaussian claim (the
    fit is then the right model), or a claimed view whose Gaussian fit stays within it."""
    if gaussian_claim:
        return True
    return view is not None and view.moment_fit_epsilon(delta) <= claimed_epsilon


def view_fractions(epsilons: dict[str, float], claimed_epsilon: float | None,
                   view_epsilon: float | None) -> dict[str, Any]:
    """Each reported epsilon as a fraction of the claim and of the view's exact epsilon
    (what the audit is judged against; absent when unknown or 0)."""
    out: dict[str, Any] = {}
    if view_epsilon is not None:
        out["epsilon-view"] = view_epsilon
    if claimed_epsilon:
        out["fraction-of-claim"] = {k: v / claimed_epsilon for k, v in epsilons.items()}
    if view_epsilon:
        out["fraction-of-view"] = {k: v / view_epsilon for k, v in epsilons.items()}
    return out


def claim_check(bounds: AuditBounds, claimed_epsilon: float | None,
                gaussian_claim: bool, view: CanaryView | None = None) -> dict[str, Any]:
    """Whether the bounds are consistent with the accountant's epsilon (None: no claim,
    e.g. a run without DP: then there is nothing to compare); with the claimed
    mechanism's ``view``, its exact epsilon and every bound as a fraction of it."""
    epsilons = {k: v for k, v in bounds.record().items() if k in EPSILON_KEYS}
    view_eps = view.epsilon(bounds.delta) if view is not None else None
    if claimed_epsilon is None:
        return {"claim-consistent": None, "claim-checked-by": "no claim",
                **view_fractions(epsilons, None, view_eps)}
    checked = {"steinke": bounds.epsilon_lower_bound > claimed_epsilon}
    out: dict[str, Any] = view_fractions(epsilons, claimed_epsilon, view_eps)
    if gaussian_claim:
        mu = gdp_mu(claimed_epsilon, bounds.delta)
        out["mu-claimed"] = mu
        checked["fdp"] = bounds.mu_lower_bound_fdp > mu
        checked["gdp"] = bounds.mu_lower_bound_gdp > mu
    if bounds.oneshot is not None and oneshot_comparable(claimed_epsilon, bounds.delta,
                                                         gaussian_claim, view):
        checked["oneshot"] = bounds.oneshot.epsilon_lower_bound > claimed_epsilon
    return {**out, "claim-consistent": not any(checked.values()),
            "claim-checked-by": ", ".join(checked),
            "claim-rejected-by": [name for name, over in checked.items() if over]}
