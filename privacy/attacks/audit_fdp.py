"""One-run auditing of f-differential privacy (Mahloujifar, Melis & Chaudhuri 2024,
"Auditing f-Differential Privacy in One Run", arXiv:2410.22235).

The game is the one of Steinke, Nasr & Jagielski (:mod:`.audit`): m canaries, each
included independently with probability 1/2, k guesses of which c are right. Where
Steinke et al. bound the number of right guesses through (epsilon, delta), Mahloujifar
et al. use the mechanism's whole trade-off function f (the least type-II error of any
test at each type-I error): their recursion over the right guesses (the bound "with a
cap" of section 4) computes how much probability c right guesses out of k need if the
mechanism were f-DP; when that exceeds what k guesses out of m can carry, f-DP is
rejected at level alpha. With f the Gaussian trade-off G_mu (Dong, Roth & Su 2019) the
audit reports the largest mu it rejects: a **lower bound on mu at the stated
confidence** that holds for any mechanism, with no independence assumption: a
mechanism that is mu'-GDP for a mu' below it would produce this many right guesses
with probability at most 1 - confidence. Its epsilon at delta (the epsilon of that
Gaussian mechanism) is what the paper reports; it bounds the run's epsilon when the
claimed mechanism is itself Gaussian-shaped (Gaussian mechanisms composed, no
subsampling), which is when :mod:`.audit_suite` compares it with the claim.
"""

from __future__ import annotations

from collections.abc import Callable

from scipy.stats import norm


def gaussian_blow_down(mu: float) -> Callable[[float], float]:
    """x -> f(1 - x) for the Gaussian trade-off f = G_mu: the least probability an event
    can have under one neighbour if it has probability x under the other."""
    return lambda x: float(norm.cdf(norm.ppf(x) - mu))


def fdp_rejected(m: int, k: int, c: int, blow_down: Callable[[float], float],
                 alpha: float) -> bool:
    """Whether c right guesses out of k (of m canaries) reject the f-DP claim whose
    trade-off gives ``blow_down`` at level ``alpha`` (Mahloujifar et al.'s recursion)."""
    if k == 0 or c == 0:
        return False
    right, wrong = alpha * c / m, alpha * (k - c) / m
    for i in reversed(range(c)):
        needed = max(wrong, blow_down(right))
        if needed == wrong:  # the constraint no longer binds: nothing changes below
            break
        right = min(1.0, right + i / (k - i) * (needed - wrong))
        wrong = needed
    return right + wrong > k / m


def mu_lower_bound(m: int, k: int, c: int, confidence: float, mu_max: float = 50.0) -> float:
    """The largest mu such that mu-GDP is rejected by c right guesses out of k."""
    alpha = 1 - confidence
    if not fdp_rejected(m, k, c, gaussian_blow_down(0.0), alpha):
        return 0.0
    lo, hi = 0.0, 1.0
    while fdp_rejected(m, k, c, gaussian_blow_down(hi), alpha):
        lo, hi = hi, 2 * hi
        if hi > mu_max:
            return mu_max
    for _ in range(40):  # bisection: rejection gets harder as mu grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fdp_rejected(m, k, c, gaussian_blow_down(mid), alpha) \
            else (lo, mid)
    return lo
