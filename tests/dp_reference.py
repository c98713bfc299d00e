"""Independent references for privacy numbers: closed forms and Monte Carlo.

Nothing here uses fedpriv's accountants. The tests measure a mechanism's parameters
(noise std, how far one client moves the output, how often a client is sampled) from
the code actually run, then compute epsilon here and compare it with what fedpriv
reports.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of a mu-GDP mechanism (Dong, Roth & Su 2019, Corollary 2.13).

    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2). T Gaussian mechanisms
    with ratios r_t compose exactly to mu = sqrt(sum r_t^2).
    """
    def gap(eps: float) -> float:
        a = norm.cdf(-eps / mu + mu / 2)
        b = math.exp(eps + norm.logcdf(-eps / mu - mu / 2))
        return a - b - delta

    if gap(0.0) <= 0:
        return 0.0
    return float(brentq(gap, 0.0, 10 * mu * mu + 10 * mu + 50, xtol=1e-10))


def mixture_loss_samples(q: float, mu: float, rounds: int, samples: int,
                         rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Composed privacy losses of the sampled Gaussian, both directions.

    One round: Q = N(0, 1) (the client absent) and P = (1 - q) N(0, 1) + q N(mu, 1) (the
    client present with probability q). L = log(p/q)(o) = log(1 - q + q exp(mu o -
    mu^2/2)). "remove": o ~ P, loss L; "add": o ~ Q, loss -L. Returned: the sum of
    ``rounds`` independent losses, ``samples`` times, per direction.
    """
    out = {}
    for direction in ("remove", "add"):
        o = rng.standard_normal((samples, rounds))
        if direction == "remove":
            o += mu * (rng.random((samples, rounds)) < q)
        loss = np.log1p(q * np.expm1(mu * o - mu * mu / 2))
        out[direction] = (loss if direction == "remove" else -loss).sum(axis=1)
    return out


def hockey_stick(losses: np.ndarray, eps: float) -> float:
    """delta(eps) = E[(1 - e^(eps - L))_+] over privacy-loss samples L."""
    return float(np.mean(np.clip(-np.expm1(eps - losses), 0.0, None)))


def monte_carlo_epsilon(q: float, mu: float, rounds: int, delta: float,
                        samples: int = 1_000_000, seed: int = 0) -> float:
    """epsilon at ``delta`` of ``rounds`` sampled Gaussians, by Monte Carlo of the loss."""
    losses = mixture_loss_samples(q, mu, rounds, samples, np.random.default_rng(seed))
    worst = 0.0
    for sample in losses.values():
        if hockey_stick(sample, 0.0) <= delta:
            continue
        lo, hi = 0.0, float(sample.max())
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if hockey_stick(sample, mid) > delta else (lo, mid)
        worst = max(worst, hi)
    return worst


def pld_epsilon(q: float, noise_multiplier: float, rounds: int, delta: float) -> float:
    """The same with dp-accounting's PLD accountant (numerically tight, not RDP)."""
    from dp_accounting import GaussianDpEvent, NeighboringRelation, PoissonSampledDpEvent
    from dp_accounting.pld import PLDAccountant

    acc = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE,
                        value_discretization_interval=1e-4)
    event = GaussianDpEvent(noise_multiplier)
    acc.compose(PoissonSampledDpEvent(q, event) if q < 1 else event, rounds)
    return float(acc.get_epsilon(delta))
