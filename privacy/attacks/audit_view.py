"""The exact epsilon of what the auditor sees: the last iterate of Poisson DP-SGD with an
input-independent canary (Steinke, Nasr, Ganesh, Balle, Choquette-Choo, Jagielski, Hayes,
Thakurta, Smith & Terzis, ICLR 2025, "The Last Iterate Advantage: Empirical Auditing and
Principled Heuristic Analysis of Differentially Private SGD").

The accountant guards against an adversary who sees every noisy step. An auditor who
holds only the released update (one per round) sees less: for a canary whose clipped
gradient is a fixed vector of norm C (a Dirac canary, or a random direction: its
gradient does not depend on the model), only the update's component along the canary
matters, and over T steps at Poisson rate q with noise multiplier sigma it is (in units
of C, up to the learning rate)

    with the canary:    K + N(0, T sigma^2),  K ~ Binomial(T, q),
    without it:         N(0, T sigma^2),

a Binomial mixture of shifted Gaussians against a centred Gaussian. Its likelihood ratio
L(x) = sum_k w_k exp((k x - k^2 / 2) / (T sigma^2)) increases with x, so each direction
of the hockey-stick divergence is a single tail:

- remove (mixture P against Gaussian Q): delta(eps) = P[X > x1] - e^eps Q[X > x1] at
  L(x1) = e^eps;
- add (Q against P): delta(eps) = Q[X < x2] - e^eps P[X < x2] at L(x2) = e^-eps (none
  when e^-eps <= w_0 = (1 - q)^T, the floor of L).

:func:`view_delta` is the larger of the two (add or remove one record), and
:func:`view_epsilon` the smallest epsilon whose delta is at most the target. An audit
that scores the canary by that component (the Dirac canary's coordinate, the cosine of a
random direction) cannot exceed this epsilon, whatever the accountant claims: it is the
target an audit of the released update should be judged against. With q = 1 the view is
the Gaussian mechanism with mu = sqrt(T) / sigma, the claim's own composition.

Several observed rounds are several releases: their view is the composition of each
round's mixture (:func:`view_epsilon` with ``rounds``, through dp-accounting's privacy
loss distributions), which is at least the epsilon of their sum (:func:`view_epsilon`
with ``steps`` = every step of the run: what an audit that adds the rounds' scores sees).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, logsumexp
from scipy.stats import binom

if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution


@dataclass(frozen=True)
class CanaryView:
    """Sum over ``steps`` Poisson steps (rate ``sample_rate``, ``noise_multiplier``) of a
    fixed-gradient canary's component, in units of the clipping norm."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if self.noise_multiplier <= 0 or not 0 < self.sample_rate <= 1 or self.steps < 1:
            raise ValueError("the view needs noise multiplier > 0, 0 < q <= 1 and steps >= 1")

    @property
    def std(self) -> float:
        return self.noise_multiplier * math.sqrt(self.steps)

    @functools.cached_property
    def shifts(self) -> tuple[np.ndarray, np.ndarray]:
        """k = 0..T with log P[K = k] (the terms below 1e-300 are dropped)."""
        k = np.arange(self.steps + 1)
        logw = binom.logpmf(k, self.steps, self.sample_rate)
        keep = logw > -690
        return k[keep].astype(float), logw[keep]

    def log_ratio(self, x: float) -> float:
        """log L(x): log of the mixture's density over the centred Gaussian's at x."""
        k, logw = self.shifts
        return float(logsumexp(logw + (k * x - k * k / 2) / self.std ** 2))

    def _solve(self, level: float) -> float:
        """x with log L(x) = level (log L increases with x)."""
        s = self.std
        lo, hi = -s, s
        while self.log_ratio(lo) > level:
            lo = 2 * lo - s
        while self.log_ratio(hi) < level:
            hi = 2 * hi + s
        return float(brentq(lambda x: self.log_ratio(x) - level, lo, hi, xtol=1e-12,
                            rtol=1e-14))

    def _tail(self, x: float, upper: bool) -> tuple[float, float]:
        """log P[X > x] and log Q[X > x] (``upper``), or of X < x."""
        k, logw = self.shifts
        s, sign = self.std, (-1 if upper else 1)
        return (float(logsumexp(logw + log_ndtr(sign * (x - k) / s))),
                float(log_ndtr(sign * x / s)))

    def delta_remove(self, epsilon: float) -> float:
        """sup_S P[S] - e^eps Q[S]: the record is in the run's view P, out of Q."""
        x1 = self._solve(epsilon)
        p, q = self._tail(x1, upper=True)
        return max(0.0, math.exp(p) * -math.expm1(min(0.0, epsilon + q - p)))

    def delta_add(self, epsilon: float) -> float:
        """sup_S Q[S] - e^eps P[S]."""
        k, logw = self.shifts
        if -epsilon <= logw[0] and k[0] == 0:  # L never falls below e^-eps
            return 0.0
        x2 = self._solve(-epsilon)
        p, q = self._tail(x2, upper=False)
        return max(0.0, math.exp(q) * -math.expm1(min(0.0, epsilon + p - q)))

    def delta(self, epsilon: float) -> float:
        return max(self.delta_remove(epsilon), self.delta_add(epsilon))

    def epsilon(self, delta: float) -> float:
        """The smallest epsilon with delta(epsilon) <= ``delta``."""
        if self.delta(0.0) <= delta:
            return 0.0
        hi = 1.0
        while self.delta(hi) > delta:
            hi *= 2
        return float(brentq(lambda e: self.delta(e) - delta, hi / 2 if hi > 1 else 0.0, hi,
                            xtol=1e-9))

    def moments(self) -> tuple[float, float, float, float]:
        """(mean, std) of the view with the canary, then without it (units of C)."""
        t, q = self.steps, self.sample_rate
        return t * q, math.sqrt(t * q * (1 - q) + self.std ** 2), 0.0, self.std

    def moment_fit_epsilon(self, delta: float) -> float:
        """The epsilon at ``delta`` of the two Gaussians with the view's moments: what
        Andrew et al.'s unequal-variance fit (:mod:`.audit_oneshot`) tends to with many
        canaries. Below :meth:`epsilon` at the settings DP-SGD is run with (0.92x at
        q = 0.1, 30 steps, claimed epsilon 8; 0.98x at 2), above it for large q and few
        steps, where the mixture is far from Gaussian."""
        from .audit_oneshot import gaussian_pair_epsilon

        return float(gaussian_pair_epsilon(delta, *self.moments()))

    def sample(self, rng: np.random.Generator, n: int, included: bool) -> np.ndarray:
        """n draws of the view with (``included``) or without the canary (Monte Carlo)."""
        shift = rng.binomial(self.steps, self.sample_rate, n) if included else 0
        return shift + rng.normal(0.0, self.std, n)


def view_delta(epsilon: float, noise_multiplier: float, sample_rate: float,
               steps: int) -> float:
    """delta(epsilon) of the released sum over ``steps`` steps (add or remove, the worse)."""
    return CanaryView(noise_multiplier, sample_rate, steps).delta(epsilon)


def view_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                 rounds: int = 1, discretization: float = 1e-3) -> float:
    """The exact epsilon at ``delta`` of what an auditor of the released updates sees:
    ``rounds`` releases, each the sum of ``steps`` Poisson steps (Steinke et al. 2025).

    One release is computed in closed form (:class:`CanaryView`); several are composed
    with dp-accounting's privacy loss distribution of the same mixture (pessimistic at
    ``discretization``: an upper bound, within about rounds x discretization).
    """
    view = CanaryView(noise_multiplier, sample_rate, steps)
    if rounds == 1:
        return view.epsilon(delta)
    return float(mixture_pld(view, discretization).self_compose(rounds)
                 .get_epsilon_for_delta(delta))


def mixture_pld(view: CanaryView, discretization: float = 1e-3) -> PrivacyLossDistribution:
    """dp-accounting's privacy loss distribution of one release (its mixture-of-Gaussians
    mechanism: the same view, computed independently)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    k, logw = view.shifts
    return pld.from_mixture_gaussian_mechanism(
        view.std, list(k), list(np.exp(logw) / np.exp(logw).sum()),
        value_discretization_interval=discretization)


def summed(views: Sequence[CanaryView]) -> CanaryView | None:
    """The view of the sum of several releases' scores (the whole-run audit adds the
    observed rounds'): one release of all their steps, when they share sigma and q
    (None otherwise: the sum is then not a Binomial mixture)."""
    if not views or len({(v.noise_multiplier, v.sample_rate) for v in views}) != 1:
        return None
    return CanaryView(views[0].noise_multiplier, views[0].sample_rate,
                      sum(v.steps for v in views))
