"""What a DP claim allows an attack: the highest TPR at each FPR (a trade-off curve).

Membership of one record is a hypothesis test between neighbouring datasets, so an
(epsilon, delta)-DP mechanism bounds every attack's ROC curve (Kairouz, Oh & Viswanath
2015; Dong, Roth & Su 2019, "Gaussian Differential Privacy"):

    TPR <= min(1, e^eps FPR + delta, 1 - e^-eps (1 - delta - FPR)).

A mechanism is (eps(delta), delta)-DP for every delta at once, so the tightest curve a
claim supports is the lower envelope of those lines over delta. Here eps(delta) comes
from the privacy-loss-distribution accountant of Google's dp-accounting (Koskela et al.
2020; Doroshenko et al. 2022) for the mechanism actually run — a Poisson-subsampled
Gaussian composed over DP-SGD's steps, or central DP's Gaussian releases — which is the
composed f-DP curve up to the grid of epsilons it is read at. For a plain Gaussian mechanism with
mu = sensitivity / noise the exact curve is the Gaussian trade-off Phi(Phi^-1(FPR) + mu)
(:func:`gaussian_curve`).

Neighbouring relation: add/remove one record (as the accountants use).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import beta, norm


def dp_curve(fpr: np.ndarray, epsilon: float, delta: float) -> np.ndarray:
    """The highest TPR an (epsilon, delta)-DP mechanism allows at each FPR."""
    f = np.asarray(fpr, dtype=float)
    return np.clip(np.minimum(np.exp(epsilon) * f + delta,
                              1 - np.exp(-epsilon) * (1 - delta - f)), 0, 1)


def gaussian_curve(fpr: np.ndarray, mu: float) -> np.ndarray:
    """The mu-GDP trade-off: TPR = Phi(Phi^-1(FPR) + mu) (Dong, Roth & Su 2019)."""
    return norm.cdf(norm.ppf(np.clip(np.asarray(fpr, dtype=float), 1e-300, 1)) + mu)


@dataclass(frozen=True)
class Claim:
    """A run's privacy claim for one record and the curve it implies."""

    epsilon: float
    delta: float
    by: str  # who claims it, in words
    profile: tuple[tuple[float, float], ...] = ()  # (epsilon(d), d) of the PLD, if known

    def curve(self, fpr: np.ndarray) -> np.ndarray:
        """The tightest TPR bound known: the PLD envelope, else the (eps, delta) line."""
        out = dp_curve(fpr, self.epsilon, self.delta)
        for eps, d in self.profile:
            out = np.minimum(out, dp_curve(fpr, eps, d))
        return out


def pld_profile(event: Any, points: int = 240) -> tuple[tuple[float, float], ...]:
    """(epsilon, delta(epsilon)) pairs of a dp-accounting event's privacy-loss
    distribution, for epsilon from 0 to its value at delta = 1e-12."""
    from dp_accounting.pld import PLDAccountant

    logging.getLogger("absl").setLevel(logging.ERROR)
    accountant = PLDAccountant()
    accountant.compose(event)
    top = float(accountant.get_epsilon(1e-12))
    return tuple((float(e), float(accountant.get_delta(e)))
                 for e in np.linspace(0.0, top, points))


def dpsgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> Any:
    """DP-SGD's steps as a dp-accounting event (Poisson-subsampled Gaussian)."""
    from dp_accounting import (
        GaussianDpEvent,
        PoissonSampledDpEvent,
        SelfComposedDpEvent,
    )

    step = GaussianDpEvent(noise_multiplier)
    if sample_rate < 1:
        step = PoissonSampledDpEvent(sample_rate, step)
    return SelfComposedDpEvent(step, int(steps))


def check_roc(members: np.ndarray, nonmembers: np.ndarray, claim: Claim,
              rates: tuple[float, ...] = (0.001, 0.01, 0.1), confidence: float = 0.95
              ) -> dict[str, Any]:
    """Is any operating point of the attack above the claim's curve, with confidence?

    At each FPR level with enough non-members, the threshold with at most that share of
    false positives gives (FP of N, TP of M); Clopper-Pearson bounds (Bonferroni over the
    levels) give FPR_hi and TPR_lo, and the point violates the claim when
    TPR_lo > curve(FPR_hi). Returns the levels checked, the worst margin, and whether
    the claim is consistent with what was measured.
    """
    m, n = np.asarray(members, float), np.asarray(nonmembers, float)
    levels = [r for r in rates if len(n) * r >= 1]
    alpha = (1 - confidence) / max(len(levels), 1)
    points = []
    for r in levels:
        k = int(np.floor(r * len(n) + 1e-9))
        threshold = -np.sort(-n)[k]
        fp, tp = int((n > threshold).sum()), int((m > threshold).sum())
        fpr_hi = 1.0 if fp == len(n) else float(beta.ppf(1 - alpha, fp + 1, len(n) - fp))
        tpr_lo = 0.0 if tp == 0 else float(beta.ppf(alpha, tp, len(m) - tp + 1))
        bound = float(claim.curve(np.array([fpr_hi]))[0])
        points.append({"fpr-level": r, "fpr": fp / len(n), "tpr": tp / len(m),
                       "fpr-upper": fpr_hi, "tpr-lower": tpr_lo, "bound": bound,
                       "violated": tpr_lo > bound})
    return {"epsilon": claim.epsilon, "delta": claim.delta, "claimed-by": claim.by,
            "confidence": confidence, "points": points,
            "consistent": not any(p["violated"] for p in points)}
