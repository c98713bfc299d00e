"""Gaussian differential privacy: the (epsilon, delta) curve of mu-GDP, and an estimate
of mu from canary scores in the spirit of Nasr et al. (2023, "Tight Auditing of
Differentially Private Machine Learning", USENIX Security).

**mu <-> epsilon.** A mechanism is mu-GDP (Dong, Roth & Su 2019, "Gaussian Differential
Privacy", JRSS-B 2022) when telling neighbours apart is no easier than telling N(0, 1)
from N(mu, 1). It is then (epsilon, delta(epsilon))-DP for every epsilon with
``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`` (their Corollary 2.13),
and this curve is exact for the Gaussian mechanism (sensitivity / noise std = mu) and
for compositions of Gaussian mechanisms (mu adds in quadrature).

**mu from scores.** The included canaries' scores and the excluded ones' are two
samples; for a threshold t, "score >= t means included" has a false-positive rate FPR
and a false-negative rate FNR. Under mu-GDP every test has
``FNR >= Phi(Phi^-1(1 - FPR) - mu)``, so ``mu >= Phi^-1(1 - FPR) - Phi^-1(FNR)``. The
thresholds are the excluded scores' k-th largest values for k = 1, 2, 4, 8, ... (a grid
fixed before looking at the scores): at the k-th largest of n excluded scores the true
FPR is exactly Beta(k, n - k + 1) distributed, and the included scores, independent of
it, give a Clopper-Pearson bound on the FNR. Both upper bounds at every grid threshold
hold jointly at ``confidence`` (Bonferroni over 2 x the grid), so the largest mu over
the grid is:

- a **lower bound on mu at the stated confidence**, provided the canaries' scores are
  independent draws of the same two distributions (what Dirac canaries on disjoint
  coordinates with independent per-coordinate noise make true up to the data's own
  gradients at those coordinates; Nasr et al. make the same assumption). Unlike the
  one-run bounds (:mod:`.audit`, :mod:`.audit_fdp`) it does not hold for any mechanism
  without that assumption;
- its epsilon at the run's delta (:func:`gdp_epsilon`) is an **estimate** of the run's
  epsilon: exact when the mechanism's privacy curve is Gaussian (Gaussian mechanisms
  composed, no subsampling), otherwise the epsilon of the Gaussian curve through the
  measured point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.stats import beta, norm


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of mu-GDP (Dong, Roth & Su, Corollary 2.13), in the log domain."""
    if mu <= 0:
        return 0.0
    a = norm.logcdf(-epsilon / mu + mu / 2)
    b = epsilon + norm.logcdf(-epsilon / mu - mu / 2)
    return float(math.exp(a) * -math.expm1(b - a)) if b < a else 0.0


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest epsilon with delta(epsilon) <= delta for mu-GDP (0 when mu is 0)."""
    if mu <= 0 or gdp_delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(mu, hi) > delta:
        hi *= 2
    return float(brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, hi, xtol=1e-9))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu of the Gaussian mechanism that is exactly (epsilon, delta)-DP."""
    if epsilon <= 0 and delta <= 0:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, epsilon) < delta:
        hi *= 2
    return float(brentq(lambda m: gdp_delta(m, epsilon) - delta, 1e-12, hi, xtol=1e-12))


@dataclass(frozen=True)
class GdpEstimate:
    mu_lower_bound: float  # at the confidence, if the canaries' scores are independent
    fpr_upper: float  # the bounds at the threshold that gave it
    fnr_upper: float
    thresholds: int  # how many thresholds were tested (the Bonferroni family)


def threshold_grid(n_out: int) -> list[int]:
    """k = 1, 2, 4, ... <= n_out: which largest excluded scores serve as thresholds."""
    return [2 ** i for i in range(int(math.log2(n_out)) + 1)] if n_out else []


def gdp_mu_lower_bound(in_scores: np.ndarray, out_scores: np.ndarray,
                       confidence: float) -> GdpEstimate:
    """The largest mu the scores show at ``confidence`` (see the module's docstring)."""
    ins, outs = np.asarray(in_scores, float), np.sort(np.asarray(out_scores, float))[::-1]
    grid = threshold_grid(len(outs))
    if not len(ins) or not grid:
        return GdpEstimate(0.0, 1.0, 1.0, len(grid))
    alpha = (1 - confidence) / (2 * len(grid))
    best = GdpEstimate(0.0, 1.0, 1.0, len(grid))
    for k in grid:
        fpr_hi = float(beta.ppf(1 - alpha, k, len(outs) - k + 1))
        # "included" when a score is strictly above the threshold: an included score tied
        # with it counts as missed (ties, e.g. scores that never moved, would otherwise
        # look like perfect detection; with continuous scores nothing changes)
        fn = int((ins <= outs[k - 1]).sum())
        fnr_hi = float(beta.ppf(1 - alpha, fn + 1, len(ins) - fn)) if fn < len(ins) else 1.0
        mu = float(norm.isf(fpr_hi) - norm.ppf(fnr_hi))
        if mu > best.mu_lower_bound:
            best = GdpEstimate(mu, fpr_hi, fnr_hi, len(grid))
    return best
