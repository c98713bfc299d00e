"""One-shot empirical privacy estimation (Andrew, Kairouz, Oh, Oprea, McMahan &
Suriyakumar, ICLR 2024, "One-shot Empirical Privacy Estimation for Federated Learning").

The auditor's statistic per canary is how far the released model moved along the
canary's direction (the cosine between the model delta and a random canary direction;
for a Dirac canary, its coordinate). Andrew et al. fit a Gaussian to the inserted
canaries' statistics and one to the never-inserted (held-out) canaries', **each with its
own variance**, and report the epsilon at the target delta of that pair of Gaussians:
exact for the Gaussian mechanism (the variances then agree), and close for mechanisms
whose view is not Gaussian, such as the Poisson-subsampled sum of DP-SGD steps (a
Binomial mixture of shifted Gaussians, :mod:`.audit_view`), where the inserted
canaries' spread is wider and the equal-variance (GDP) fit misses most of the epsilon.

The pair's privacy curve is computed exactly here: log(p1 / p0) is a quadratic in x, so
the set where it exceeds epsilon is an interval or the complement of one, and
delta(eps) = P1[S] - e^eps P0[S] (and the same with the roles swapped: add and remove,
the worse) is a sum of normal tails.

Besides the point estimate (the paper's), :func:`one_shot_estimate` gives:

- ``mu_equal_variance`` / ``epsilon_equal_variance``: GDP with mu = (mean1 - mean0) / s
  (pooled s), for comparison;
- ``epsilon_lower_bound``: the least epsilon of any Gaussian pair in a joint confidence
  box of its parameters (Welch's interval for the difference of the means, chi-square
  intervals for the two standard deviations, Bonferroni over the three). It is a lower
  bound at ``confidence`` **if the statistics are Gaussian** (Andrew et al.'s asymptotic
  result for random canaries in high dimension under the Gaussian mechanism), unlike the
  one-run bounds of :mod:`.audit` and :mod:`.audit_fdp`, which hold for any mechanism.
  The confidence is needed: with equal true variances the fitted ones differ by chance,
  and the point estimate's tails then overstate epsilon (1.05x on average at q = 1 with
  10,000 canaries, up to 1.5x with 3,000).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import ndtr
from scipy.stats import chi2
from scipy.stats import t as student_t

from .audit_gdp import gdp_epsilon


def _mass(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """P[lo < Z < hi] for standard normal Z, accurate in both tails."""
    upper = lo > 0  # both in the upper tail: difference of survival functions
    return np.where(upper, ndtr(-lo) - ndtr(-hi), ndtr(hi) - ndtr(lo))


def _one_way(eps: np.ndarray, m1: np.ndarray, s1: np.ndarray, m0: np.ndarray,
             s0: np.ndarray) -> np.ndarray:
    """sup_S P1[S] - e^eps P0[S] for P1 = N(m1, s1^2), P0 = N(m0, s0^2) (arrays)."""
    a = 0.5 / s0 ** 2 - 0.5 / s1 ** 2  # S = {a x^2 + b x + c > 0}
    b = m1 / s1 ** 2 - m0 / s0 ** 2
    c = np.log(s0 / s1) - m1 ** 2 / (2 * s1 ** 2) + m0 ** 2 / (2 * s0 ** 2) - eps
    inf = np.inf
    linear = a == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        # linear (equal variances): S = {b x + c > 0}, a half-line (or all, or nothing)
        root = -c / np.where(b != 0, b, 1.0)
        lin_lo = np.where(b > 0, root, -inf)
        lin_hi = np.where(b < 0, root, np.where((b > 0) | (c > 0), inf, -inf))
        # quadratic: roots by the stable formula (no cancellation when a is tiny)
        disc = b * b - 4 * a * c
        qq = -0.5 * (b + np.where(b >= 0, 1.0, -1.0) * np.sqrt(np.maximum(disc, 0.0)))
        r1 = qq / np.where(linear, 1.0, a)
        r2 = np.where(qq != 0, c / qq, 0.0)
        x1, x2 = np.minimum(r1, r2), np.maximum(r1, r2)

    def prob(m: np.ndarray, s: np.ndarray) -> np.ndarray:
        lin = _mass((lin_lo - m) / s, (lin_hi - m) / s)
        inside = _mass((x1 - m) / s, (x2 - m) / s)
        outside = ndtr((x1 - m) / s) + ndtr(-(x2 - m) / s)
        # a > 0: S is outside [x1, x2], or everything when disc <= 0;
        # a < 0: S is inside (x1, x2), or nothing when disc <= 0
        quad = np.where(a > 0, np.where(disc > 0, outside, 1.0),
                        np.where(disc > 0, inside, 0.0))
        return np.where(linear, lin, quad)

    out = prob(m1, s1) - np.exp(eps) * prob(m0, s0)
    return np.maximum(out, 0.0)


def gaussian_pair_delta(epsilon: Any, m1: Any, s1: Any, m0: Any = 0.0,
                        s0: Any = 1.0) -> np.ndarray:
    """delta(epsilon) of N(m1, s1^2) against N(m0, s0^2), both directions (the worse)."""
    e, m1, s1, m0, s0 = np.broadcast_arrays(*(np.asarray(v, float) for v in
                                              (epsilon, m1, s1, m0, s0)))
    return np.maximum(_one_way(e, m1, s1, m0, s0), _one_way(e, m0, s0, m1, s1))


EPS_MAX = 200.0  # where the search for epsilon stops


def gaussian_pair_epsilon(delta: float, m1: Any, s1: Any, m0: Any = 0.0, s0: Any = 1.0,
                          eps_max: float = EPS_MAX) -> np.ndarray:
    """The smallest epsilon with delta(epsilon) <= ``delta`` for each Gaussian pair
    (vectorized bisection; capped at ``eps_max``)."""
    m1, s1, m0, s0 = np.broadcast_arrays(*(np.asarray(v, float) for v in (m1, s1, m0, s0)))
    lo, hi = np.zeros(m1.shape), np.ones(m1.shape)
    over = gaussian_pair_delta(hi, m1, s1, m0, s0) > delta
    while over.any() and hi.max() < eps_max:
        lo = np.where(over, hi, lo)
        hi = np.where(over, 2 * hi, hi)
        over = gaussian_pair_delta(hi, m1, s1, m0, s0) > delta
    hi = np.minimum(hi, eps_max)
    zero = gaussian_pair_delta(np.zeros(m1.shape), m1, s1, m0, s0) <= delta
    for _ in range(60):
        mid = (lo + hi) / 2
        above = gaussian_pair_delta(mid, m1, s1, m0, s0) > delta
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    return np.where(zero, 0.0, hi)


@dataclass(frozen=True)
class OneShotEstimate:
    """Andrew et al.'s estimate from inserted (``in``) and held-out (``out``) statistics."""

    n_in: int
    n_out: int
    mean_in: float
    std_in: float
    mean_out: float
    std_out: float
    epsilon_estimate: float  # the paper's: unequal-variance Gaussians
    mu_equal_variance: float  # GDP mu with the pooled std, for comparison
    epsilon_lower_bound: float  # at ``confidence``, if the statistics are Gaussian
    delta: float
    confidence: float

    @property
    def epsilon_equal_variance(self) -> float:
        return gdp_epsilon(self.mu_equal_variance, self.delta)

    def record(self) -> dict[str, Any]:
        """The JSON keys of an audit line."""
        return {"epsilon-estimate-oneshot": self.epsilon_estimate,
                "epsilon-lower-bound-oneshot": self.epsilon_lower_bound,
                "mu-equal-variance": self.mu_equal_variance,
                "epsilon-equal-variance": self.epsilon_equal_variance,
                "inserted-mean": self.mean_in, "inserted-std": self.std_in,
                "held-out-mean": self.mean_out, "held-out-std": self.std_out,
                "oneshot-confidence": self.confidence}


def _std_interval(x: np.ndarray, alpha: float) -> tuple[float, float]:
    """Two-sided chi-square interval for x's standard deviation, missing w.p. ``alpha``."""
    n, var = len(x), float(x.var(ddof=1))
    return (float(np.sqrt((n - 1) * var / chi2.ppf(1 - alpha / 2, n - 1))),
            float(np.sqrt((n - 1) * var / chi2.ppf(alpha / 2, n - 1))))


def _difference_interval(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[float, float]:
    """Welch's two-sided interval for mean(x) - mean(y), missing w.p. ``alpha``."""
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    dof = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    half = float(student_t.ppf(1 - alpha / 2, dof) * np.sqrt(vx + vy))
    d = float(x.mean() - y.mean())
    return d - half, d + half


def one_shot_estimate(in_scores: np.ndarray, out_scores: np.ndarray, delta: float,
                      confidence: float = 0.95, grid: int = 9) -> OneShotEstimate:
    """Fit N(mean, std^2) to each set of statistics and report the epsilon of the pair at
    ``delta`` (Andrew et al. 2024), the equal-variance GDP mu, and the least epsilon over
    the joint ``confidence`` box of the pair's parameters (``grid`` points a side)."""
    ins, outs = np.asarray(in_scores, float), np.asarray(out_scores, float)
    if len(ins) < 3 or len(outs) < 3:
        raise ValueError("the one-shot estimate needs at least 3 inserted and 3 held-out "
                         "canaries")
    m1, s1, m0, s0 = ins.mean(), ins.std(ddof=1), outs.mean(), outs.std(ddof=1)
    if min(s1, s0) <= 0 or not np.isfinite([m1, s1, m0, s0]).all():
        # a side without spread (e.g. an update that never moved): no Gaussian to fit
        eps = 0.0 if m1 == m0 else EPS_MAX
        return OneShotEstimate(len(ins), len(outs), float(m1), float(s1), float(m0),
                               float(s0), eps, 0.0 if m1 == m0 else float("inf"), eps,
                               delta, confidence)
    estimate = float(gaussian_pair_epsilon(delta, m1, s1, m0, s0))
    pooled = np.sqrt(((len(ins) - 1) * s1 ** 2 + (len(outs) - 1) * s0 ** 2)
                     / (len(ins) + len(outs) - 2))
    mu = float(abs(m1 - m0) / pooled) if pooled > 0 else float("inf")
    # the pair's epsilon depends on the means through their difference only: a box of
    # three intervals (Bonferroni), the least epsilon over a grid on it with its corners
    alpha = (1 - confidence) / 3
    lo, hi = _difference_interval(ins, outs, alpha)
    c1, d1 = _std_interval(ins, alpha)
    c0, d0 = _std_interval(outs, alpha)
    diffs = np.linspace(lo, hi, grid)
    if lo < 0 < hi:
        diffs = np.append(diffs, 0.0)
    d, u, v = np.meshgrid(diffs, np.linspace(c1, d1, grid), np.linspace(c0, d0, grid),
                          indexing="ij")
    lower = float(gaussian_pair_epsilon(delta, d, u, 0.0, v).min())
    return OneShotEstimate(len(ins), len(outs), float(m1), float(s1), float(m0), float(s0),
                           estimate, mu, min(lower, estimate), delta, confidence)
