"""Classic DP mechanisms with their epsilon/delta bookkeeping, and a k-anonymity check.

- Laplace mechanism: adds Laplace(0, sensitivity / epsilon) noise; pure epsilon-DP
  for an L1 sensitivity (Dwork, McSherry, Nissim, Smith 2006).
- Gaussian mechanism: adds N(0, sigma^2) noise for an L2 sensitivity. ``classic``
  uses sigma = sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon, valid for epsilon < 1
  (Dwork & Roth 2014, Thm A.1); ``analytic`` finds the smallest sigma that satisfies
  the exact condition of Balle & Wang (2018, Thm 8), valid for every epsilon > 0.
- Randomized response: the two-coin survey (Warner 1965; Dwork & Roth 2014, 3.2):
  answer truthfully with probability ``p_truth``, otherwise answer by a fair coin.
  It is ln((1 + p) / (1 - p))-DP, and the share of true "yes" answers has an unbiased
  estimate from the noisy answers.
- k-anonymity (Sweeney 2002): every combination of quasi-identifier values that
  occurs must occur at least k times.

Each mechanism returns a :class:`Release` holding the noisy value and the privacy it
cost; a :class:`Budget` adds releases up under basic sequential composition.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.special import ndtr


class BudgetExceeded(RuntimeError):
    """A release would spend more epsilon or delta than the budget allows."""


@dataclass(frozen=True)
class Release:
    """A noisy answer and what it cost."""

    value: Any
    epsilon: float
    delta: float
    mechanism: str
    scale: float  # Laplace b, Gaussian sigma, or randomized response's p_truth


@dataclass
class Budget:
    """An (epsilon, delta) budget spent under basic sequential composition."""

    epsilon: float
    delta: float = 0.0
    spent_epsilon: float = 0.0
    spent_delta: float = 0.0
    releases: list[Release] = field(default_factory=list)

    def charge(self, release: Release) -> Release:
        """Record a release, or raise :class:`BudgetExceeded` (recording nothing)."""
        eps = self.spent_epsilon + release.epsilon
        dlt = self.spent_delta + release.delta
        if eps > self.epsilon * (1 + 1e-12) or dlt > self.delta * (1 + 1e-12):
            raise BudgetExceeded(
                f"{release.mechanism} release costs ({release.epsilon:g}, {release.delta:g}); "
                f"spent ({self.spent_epsilon:g}, {self.spent_delta:g}) of "
                f"({self.epsilon:g}, {self.delta:g}).")
        self.spent_epsilon, self.spent_delta = eps, dlt
        self.releases.append(release)
        return release

    @property
    def remaining(self) -> tuple[float, float]:
        return self.epsilon - self.spent_epsilon, self.delta - self.spent_delta


def _check(name: str, value: float, low: float = 0.0, high: float | None = None,
           open_high: bool = True) -> None:
    if not math.isfinite(value) or value <= low or (
            high is not None and (value >= high if open_high else value > high)):
        bound = f" and {'<' if open_high else '<='} {high}" if high is not None else ""
        raise ValueError(f"{name} must be > {low}{bound}, got {value}")


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def laplace_mechanism(value: float | np.ndarray, sensitivity: float, epsilon: float,
                      rng: np.random.Generator | int | None = None) -> Release:
    """Add Laplace(0, sensitivity/epsilon) noise: epsilon-DP for an L1 ``sensitivity``."""
    _check("sensitivity", sensitivity)
    _check("epsilon", epsilon)
    b = sensitivity / epsilon
    arr = np.asarray(value, dtype=float)
    noisy = arr + _rng(rng).laplace(0.0, b, size=arr.shape)
    return Release(noisy if arr.ndim else float(noisy), epsilon, 0.0, "laplace", b)


def _analytic_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """delta achieved by N(0, sigma^2) at epsilon (Balle & Wang 2018, Theorem 8)."""
    a = sensitivity / (2 * sigma)
    b = epsilon * sigma / sensitivity
    return float(ndtr(a - b) - math.exp(epsilon) * ndtr(-a - b))


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0,
                   method: str = "analytic") -> float:
    """Noise standard deviation of the Gaussian mechanism for (epsilon, delta)-DP."""
    _check("epsilon", epsilon)
    _check("delta", delta, 0.0, 1.0)
    _check("sensitivity", sensitivity)
    if method == "classic":
        if epsilon >= 1:
            raise ValueError("the classic Gaussian bound needs epsilon < 1; use "
                             "method='analytic'")
        return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon
    if method != "analytic":
        raise ValueError(f"method must be 'analytic' or 'classic', got {method!r}")
    lo, hi = 1e-6 * sensitivity, sensitivity
    while _analytic_delta(hi, epsilon, sensitivity) > delta:
        hi *= 2
    for _ in range(200):  # bisection on the monotone delta(sigma)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _analytic_delta(mid, epsilon, sensitivity) > delta else (lo, mid)
    return hi


def gaussian_mechanism(value: float | np.ndarray, sensitivity: float, epsilon: float,
                       delta: float, rng: np.random.Generator | int | None = None,
                       method: str = "analytic") -> Release:
    """Add N(0, sigma^2) noise calibrated to an L2 ``sensitivity``: (epsilon, delta)-DP."""
    sigma = gaussian_sigma(epsilon, delta, sensitivity, method)
    arr = np.asarray(value, dtype=float)
    noisy = arr + _rng(rng).normal(0.0, sigma, size=arr.shape)
    return Release(noisy if arr.ndim else float(noisy), epsilon, delta, f"gaussian-{method}",
                   sigma)


def randomized_response_epsilon(p_truth: float) -> float:
    """Epsilon of two-coin randomized response that tells the truth with prob. ``p_truth``."""
    _check("p_truth", p_truth, 0.0, 1.0)
    return math.log((1 + p_truth) / (1 - p_truth))


def randomized_response(answers: Sequence[bool] | np.ndarray, p_truth: float = 0.5,
                        rng: np.random.Generator | int | None = None) -> Release:
    """Each respondent flips a coin: heads (``p_truth``) -> the truth; tails -> a fair coin."""
    truth = np.asarray(answers, dtype=bool)
    gen = _rng(rng)
    honest = gen.random(truth.shape) < p_truth
    coin = gen.random(truth.shape) < 0.5
    noisy = np.where(honest, truth, coin)
    return Release(noisy, randomized_response_epsilon(p_truth), 0.0, "randomized-response",
                   p_truth)


def estimate_yes_share(noisy_answers: Sequence[bool] | np.ndarray, p_truth: float) -> float:
    """Unbiased estimate of the true share of "yes" from randomized-response answers.

    E[observed yes share] = p * pi + (1 - p) / 2, so pi_hat = (yes_share - (1 - p)/2) / p.
    """
    _check("p_truth", p_truth, 0.0, 1.0)
    observed = float(np.mean(np.asarray(noisy_answers, dtype=float)))
    return (observed - (1 - p_truth) / 2) / p_truth


@dataclass(frozen=True)
class KAnonymity:
    """The k-anonymity level of a table over its quasi-identifiers."""

    k: int  # the smallest group size (0 for an empty table)
    groups: int
    smallest: tuple  # the quasi-identifier values of (one of) the smallest groups

    def satisfies(self, k: int) -> bool:
        return self.k >= k


def k_anonymity(records: Iterable[Mapping[str, Any]] | Mapping[str, Sequence[Any]],
                quasi_identifiers: Sequence[str] | None = None) -> KAnonymity:
    """Group records by their quasi-identifier values; k is the smallest group size.

    ``records`` is a list of row mappings or a mapping of columns. All columns are
    quasi-identifiers unless ``quasi_identifiers`` names a subset.
    """
    if isinstance(records, Mapping):
        columns = list(records)
        n = len(next(iter(records.values()))) if records else 0
        rows: list[Mapping[str, Any]] = [{c: records[c][i] for c in columns} for i in range(n)]
    else:
        rows = list(records)
    if not rows:
        return KAnonymity(0, 0, ())
    qi = list(quasi_identifiers) if quasi_identifiers is not None else list(rows[0])
    missing = [q for q in qi if q not in rows[0]]
    if missing:
        raise KeyError(f"quasi-identifiers {missing} are not columns of the records")
    counts = Counter(tuple(row[q] for q in qi) for row in rows)
    smallest, k = min(counts.items(), key=lambda kv: kv[1])
    return KAnonymity(k, len(counts), smallest)
