"""A black-box neighbouring-datasets tester: a statistical lower bound on a mechanism's epsilon.

A DP mechanism M claims that for neighbouring datasets D and D' and every set S of
outputs, P[M(D) in S] <= e^eps P[M(D') in S] + delta (and with D, D' swapped). The
tester runs M many times on each side and looks for an S that breaks the claim, in the
spirit of DP-Auditorium (Kong et al., IEEE S&P 2024: mechanism testers built from
divergence estimates of samples on D and D') and Delta-Siege (Lokna et al. 2023:
threshold tests over cheap scalar features of the output):

1. every release (named arrays and scalars) is reduced to scalar **statistics**: for
   an array its L2 norm, per-coordinate std, mean, mean and max absolute value, and its
   projection on the direction in which D' differs from D and its coordinate that moves
   most (both learned on the training half only); every scalar the release carries
   (steps, sampling rate, epsilon...) as is;
2. the runs are split in halves. On the **training** half, each statistic gets the
   threshold test (threshold and orientation) that best separates D from D';
3. on the **held-out** half, that test's false-positive and false-negative rates get
   Clopper-Pearson upper bounds (Clopper & Pearson 1934), Bonferroni-corrected over
   every statistic so that all bounds hold together at the stated confidence. A test
   with FPR <= a and FNR <= b implies, for any (eps, delta)-DP mechanism,
   eps >= max(log((1 - delta - b) / a), log((1 - delta - a) / b)) (Kairouz et al. 2015;
   the auditing bound of Jagielski et al. 2020 and Nasr et al. 2021), clamped at 0.

The largest bound over the statistics is a lower bound on the mechanism's true epsilon
with the stated confidence: a bound above the mechanism's claim refutes the claim. A
bound below it proves nothing (a black-box test can find leaks, never certify).

Plain numpy and scipy: a mechanism is any callable ``run(which, seed) -> release``, so
researchers can test their own (:func:`test_mechanism`); fedpriv's own mechanisms, as
the product runs them, are in :mod:`experiments.neighbour_mechanisms`.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

D, D_PRIME = "D", "D'"
SIDES = (D, D_PRIME)
Release = Mapping[str, Any]  # name -> np.ndarray | float
Mechanism = Callable[[str, int], Release]

# Reductions of one array release to a scalar (each one statistic per array).
ARRAY_STATISTICS: dict[str, Callable[[np.ndarray], float]] = {
    "l2": lambda a: float(np.linalg.norm(a)),
    "std": lambda a: float(np.std(a)),
    "mean": lambda a: float(np.mean(a)),
    "mean-abs": lambda a: float(np.mean(np.abs(a))),
    "max-abs": lambda a: float(np.max(np.abs(a))) if a.size else 0.0,
}
PROJECTION = "projection"  # the learned one: <a, mean_D' - mean_D> on the training half
TOP_COORDINATE = "top-coordinate"  # learned too: the coordinate that moves most (training)
MAX_PROJECTED = 1 << 15  # coordinates kept per array for the learned statistics


@dataclass(frozen=True)
class Claim:
    """What a mechanism claims: (epsilon, delta)-DP under a neighbouring relation."""

    epsilon: float
    delta: float
    relation: str
    source: str = ""  # where the figure comes from (e.g. "the client's ledger")


@dataclass(frozen=True)
class StatisticBound:
    """One statistic's threshold test and the epsilon lower bound its held-out half gives.

    The test guesses ``guess_above`` when the statistic is above ``threshold``;
    ``fpr``/``fnr`` are its held-out error rates (a false positive: guessing D' on a run
    of D), ``fpr_upper``/``fnr_upper`` their Clopper-Pearson upper bounds."""

    name: str
    epsilon: float
    threshold: float
    guess_above: str
    fpr: float
    fnr: float
    fpr_upper: float
    fnr_upper: float
    mean: tuple[float, float]  # the statistic's mean on D, on D' (held-out runs)
    std: tuple[float, float]  # its standard deviation on D, on D' (held-out runs)


@dataclass
class NeighbourReport:
    """The tester's result: every statistic's bound, the best one, and the claim."""

    statistics: list[StatisticBound]
    runs: int  # per side
    confidence: float
    delta: float  # the delta the bounds are computed at
    claim: Claim | None = None
    mechanism: str = "mechanism"
    neighbours: str = ""  # how D' differs from D, in words
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> StatisticBound:
        """The statistic with the largest bound (the first one on a tie)."""
        return max(self.statistics, key=lambda s: s.epsilon)

    @property
    def epsilon(self) -> float:
        """The lower bound on epsilon, at ``confidence``, jointly over every statistic."""
        return self.best.epsilon

    @property
    def passed(self) -> bool | None:
        """True when the bound stays at or under the claim (None without a claim)."""
        if self.claim is None:
            return None
        return self.epsilon <= self.claim.epsilon * (1 + 1e-9)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per statistic, largest bound first (for tables and JSON)."""
        out = []
        for s in sorted(self.statistics, key=lambda s: -s.epsilon):
            out.append({"statistic": s.name, "eps-lower-bound": s.epsilon,
                        "mean D": s.mean[0], "mean D'": s.mean[1],
                        "std D": s.std[0], "std D'": s.std[1],
                        "test": f"> {s.threshold:.6g} => {s.guess_above}",
                        "FPR": s.fpr, "FNR": s.fnr,
                        "FPR upper": s.fpr_upper, "FNR upper": s.fnr_upper})
        return out

    def table(self) -> str:
        """The per-statistic table as plain text (largest bound first)."""
        head = " ".join(["statistic".ljust(28), "eps >=".rjust(7), "mean D".rjust(11),
                         "mean D'".rjust(11), "std D".rjust(10), "std D'".rjust(10),
                         "FPR/FNR held-out".rjust(17), "upper bounds".rjust(13)])
        lines = [head, "-" * len(head)]
        for s in sorted(self.statistics, key=lambda s: -s.epsilon):
            lines.append(
                f"{s.name[:28]:<28} {s.epsilon:>7.3f} {s.mean[0]:>11.5g} {s.mean[1]:>11.5g} "
                f"{s.std[0]:>10.4g} {s.std[1]:>10.4g} {s.fpr:>8.2f}/{s.fnr:<8.2f} "
                f"{s.fpr_upper:>6.3f}/{s.fnr_upper:<6.3f}")
        return "\n".join(lines)

    def describe(self) -> str:
        """One paragraph: what was run, the bound, and the verdict against the claim."""
        b = self.best
        half = self.runs - self.runs // 2
        held = self.runs // 2
        conf = f"{100 * self.confidence:g}%"
        what = (f"{self.mechanism}: {self.runs} runs on D and {self.runs} on D'"
                + (f" ({self.neighbours})" if self.neighbours else "") +
                f", {len(self.statistics)} statistics of each release, thresholds chosen on "
                f"{half} runs a side and scored on the other {held}")
        if b.epsilon > 0:
            found = (f"The strongest, '{b.name}' (mean {b.mean[0]:.5g} on D vs "
                     f"{b.mean[1]:.5g} on D'), misclassified {b.fpr:.0%} of D's held-out runs "
                     f"and {b.fnr:.0%} of D''s (upper bounds {b.fpr_upper:.3g} and "
                     f"{b.fnr_upper:.3g}, Clopper-Pearson, Bonferroni over all statistics), "
                     f"so epsilon >= {b.epsilon:.3f} at delta {self.delta:.3g} with {conf} "
                     "confidence")
            if b.fpr == 0 and b.fnr == 0:
                found += (" (it separated D from D' perfectly: that is the largest bound "
                          f"{self.runs} runs a side can give, and more runs would raise it)")
        else:
            found = (f"No statistic separated D from D' well enough to bound epsilon above 0 "
                     f"at delta {self.delta:.3g} ({conf} confidence)")
        if self.claim is None:
            verdict = "No claim was given to compare with."
        elif self.passed:
            verdict = (f"The mechanism claims epsilon {self.claim.epsilon:.4g} at delta "
                       f"{self.claim.delta:.3g} ({self.claim.relation}"
                       + (f"; {self.claim.source}" if self.claim.source else "") +
                       f"): PASS, the {conf} lower bound stays under the claim. This does not "
                       "prove the claim: a black-box test finds leaks, it cannot certify their "
                       "absence.")
        else:
            verdict = (f"The mechanism claims epsilon {self.claim.epsilon:.4g} at delta "
                       f"{self.claim.delta:.3g} ({self.claim.relation}"
                       + (f"; {self.claim.source}" if self.claim.source else "") +
                       f"): FAIL, the claim is refuted at {conf} confidence (the bound is "
                       f"{b.epsilon / max(self.claim.epsilon, 1e-12):.3g}x the claim).")
        notes = (" " + " ".join(self.notes)) if self.notes else ""
        return f"{what}. {found}. {verdict}{notes} ({self.seconds:.1f} s)"


# ---------------------------------------------------------------------- the statistics


def clopper_pearson_upper(errors: np.ndarray | int, trials: int, alpha: float) -> np.ndarray:
    """One-sided (1 - alpha) Clopper-Pearson upper bound on a binomial rate (vectorized)."""
    from scipy.stats import beta

    k = np.asarray(errors, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        upper = beta.ppf(1.0 - alpha, k + 1.0, np.maximum(trials - k, 1e-300))
    return np.where(k >= trials, 1.0, upper)


def epsilon_from_rates(fpr_upper: np.ndarray | float, fnr_upper: np.ndarray | float,
                       delta: float) -> np.ndarray:
    """max(log((1 - delta - FNR)/FPR), log((1 - delta - FPR)/FNR)), clamped at 0 (vectorized).

    Any test of an (eps, delta)-DP mechanism has 1 - FNR <= e^eps FPR + delta and
    1 - FPR <= e^eps FNR + delta (Kairouz et al. 2015), whence these two bounds."""
    a = np.maximum(np.asarray(fpr_upper, dtype=np.float64), 1e-300)
    b = np.maximum(np.asarray(fnr_upper, dtype=np.float64), 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        one = np.log(np.maximum(1.0 - delta - b, 0.0) / a)
        two = np.log(np.maximum(1.0 - delta - a, 0.0) / b)
    return np.maximum(np.nan_to_num(np.maximum(one, two), neginf=0.0), 0.0)


def _best_threshold(d: np.ndarray, dp: np.ndarray, delta: float, alpha: float
                    ) -> tuple[float, str]:
    """The threshold and orientation whose test best bounds epsilon on these samples
    (the bound computed as on the held-out half; the middle one of a tied range)."""
    values = np.unique(np.concatenate([d, dp]))
    if len(values) == 1:
        return float(values[0]), D_PRIME
    cuts = np.concatenate([[values[0] - 1.0], (values[:-1] + values[1:]) / 2,
                           [values[-1] + 1.0]])
    sd, sdp = np.sort(d), np.sort(dp)
    above_d = len(d) - np.searchsorted(sd, cuts, side="right")  # runs of D above each cut
    above_dp = len(dp) - np.searchsorted(sdp, cuts, side="right")
    best, choice = -math.inf, (float(cuts[0]), D_PRIME)
    # (guess when above, false positives = runs of D guessed D', false negatives = runs
    # of D' guessed D): guessing D' above the cut, or guessing D above it (D' below)
    for guess, fp, fn in ((D_PRIME, above_d, len(dp) - above_dp),
                          (D, len(d) - above_d, above_dp)):
        eps = epsilon_from_rates(clopper_pearson_upper(fp, len(d), alpha),
                                 clopper_pearson_upper(fn, len(dp), alpha), delta)
        score = eps - 1e-9 * (fp + fn)  # a lower empirical error breaks ties between bounds
        top = float(score.max())
        if top > best + 1e-12:
            tied = np.flatnonzero(score >= top - 1e-12)
            best, choice = top, (float(cuts[tied[len(tied) // 2]]), guess)
    return choice


def _score(d: np.ndarray, dp: np.ndarray, threshold: float, guess_above: str, delta: float,
           alpha: float) -> tuple[float, float, float, float, float]:
    """(eps bound, FPR, FNR, FPR upper, FNR upper) of one fixed test on held-out samples.

    FPR is always "guessed D' on a run of D" and FNR "guessed D on a run of D'"."""
    if guess_above == D_PRIME:
        fp, fn = int(np.sum(d > threshold)), int(np.sum(dp <= threshold))
    else:
        fp, fn = int(np.sum(d <= threshold)), int(np.sum(dp > threshold))
    a = float(clopper_pearson_upper(fp, len(d), alpha))
    b = float(clopper_pearson_upper(fn, len(dp), alpha))
    eps = float(epsilon_from_rates(a, b, delta))
    return eps, fp / len(d), fn / len(dp), a, b


# ---------------------------------------------------------------------- running the mechanism


def run_seeds(runs: int, seed: int) -> dict[str, list[int]]:
    """The seeds of each side's runs: distinct across every run, reproducible from ``seed``
    (D's run i has seed + 2i, D''s seed + 2i + 1)."""
    return {D: [seed + 2 * i for i in range(runs)],
            D_PRIME: [seed + 2 * i + 1 for i in range(runs)]}


@dataclass
class Reduced:
    """One run's release as the tester keeps it: its scalar statistics, and for each array
    a fixed subset of its coordinates (at most MAX_PROJECTED) for the learned statistics,
    so that memory does not grow with runs x model size."""

    values: dict[str, float]
    coordinates: dict[str, np.ndarray]
    shapes: dict[str, int]


@functools.lru_cache(maxsize=16)
def _kept(size: int, seed: int) -> np.ndarray | slice:
    if size <= MAX_PROJECTED:
        return slice(None)
    return np.sort(np.random.default_rng([seed, size, 0x9E0]).choice(size, MAX_PROJECTED,
                                                                     replace=False))


def reduce_release(value: Any, which: str, seed: int, subset_seed: int = 0) -> Reduced:
    """A release's statistics (:data:`ARRAY_STATISTICS` of each array, each scalar as is)
    and the coordinates kept for the learned ones."""
    if not isinstance(value, Mapping) or not value:
        raise TypeError(f"a mechanism must return a non-empty mapping of names to arrays or "
                        f"numbers; run({which!r}, {seed}) returned {type(value).__name__}")
    out = Reduced({}, {}, {})
    for name, v in value.items():
        arr = np.asarray(v, dtype=np.float64)
        key = str(name)
        if arr.ndim == 0:
            out.values[key] = float(arr)
            continue
        arr = arr.reshape(-1)
        for stat, fn in ARRAY_STATISTICS.items():
            out.values[f"{key}:{stat}"] = fn(arr)
        out.coordinates[key] = arr[_kept(arr.size, subset_seed)].copy()
        out.shapes[key] = arr.size
    return out


def collect(run: Mechanism, runs: int, seed: int = 0,
            progress: Callable[[int, int], None] | None = None
            ) -> dict[str, list[Reduced]]:
    """``runs`` releases of each side, reduced as they come (:func:`reduce_release`); D and
    D' take turns, so that anything that drifts during the test (caches, timings) falls
    on both sides alike."""
    seeds = run_seeds(runs, seed)
    out: dict[str, list[Reduced]] = {D: [], D_PRIME: []}
    for i in range(runs):
        for which in SIDES:
            s = seeds[which][i]
            out[which].append(reduce_release(run(which, s), which, s, seed))
        if progress is not None:
            progress(i + 1, runs)
    layouts = {(tuple(r.values), tuple(r.shapes.items())) for side in out.values()
               for r in side}
    if len(layouts) != 1:
        raise ValueError("the mechanism's releases do not all have the same names and sizes: "
                         f"{sorted(layouts)[:2]}")
    return out


def statistics_of(releases: dict[str, list[Reduced]], train: np.ndarray
                  ) -> dict[str, dict[str, np.ndarray]]:
    """Every statistic's value on every run of each side: name -> {side: values}.

    The projection's direction and the top coordinate are learned from the ``train`` runs
    only (a boolean mask over runs), so their held-out values are an honest test."""
    first = releases[D][0]
    out = {name: {w: np.array([r.values[name] for r in releases[w]]) for w in SIDES}
           for name in first.values}
    for key, size in first.shapes.items():
        mats = {w: np.stack([r.coordinates[key] for r in releases[w]]) for w in SIDES}
        direction = mats[D_PRIME][train].mean(0) - mats[D][train].mean(0)
        norm = float(np.linalg.norm(direction))
        if size > 1 and norm > 0:
            out[f"{key}:{PROJECTION}"] = {w: mats[w] @ (direction / norm) for w in SIDES}
            # the coordinate whose mean moves most, in units of its spread (Welch's t)
            spread = np.sqrt(mats[D][train].var(0) + mats[D_PRIME][train].var(0) + 1e-300)
            j = int(np.argmax(np.abs(direction) / spread))
            out[f"{key}:{TOP_COORDINATE}"] = {w: mats[w][:, j].copy() for w in SIDES}
    return out


def bound(values: dict[str, dict[str, np.ndarray]], train: np.ndarray, delta: float,
          confidence: float) -> list[StatisticBound]:
    """Each statistic's threshold test chosen on the ``train`` runs and scored on the others,
    all bounds holding together at ``confidence`` (Bonferroni over 2 rates a statistic)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = (1.0 - confidence) / (2 * max(len(values), 1))
    out = []
    for name, sides in values.items():
        d, dp = sides[D], sides[D_PRIME]
        finite = np.isfinite(d).all() and np.isfinite(dp).all()
        if not finite:  # a run released NaN or inf: its statistic cannot be thresholded
            d, dp = np.nan_to_num(d, posinf=1e300, neginf=-1e300), \
                np.nan_to_num(dp, posinf=1e300, neginf=-1e300)
        threshold, guess = _best_threshold(d[train], dp[train], delta, alpha)
        eps, fpr, fnr, a, b = _score(d[~train], dp[~train], threshold, guess, delta, alpha)
        held_d, held_dp = d[~train], dp[~train]
        out.append(StatisticBound(name, eps, threshold, guess, fpr, fnr, a, b,
                                  (float(np.mean(held_d)), float(np.mean(held_dp))),
                                  (float(np.std(held_d)), float(np.std(held_dp)))))
    return out


def test_mechanism(run: Mechanism, *, runs: int = 200, claim: Claim | None = None,
                   delta: float | None = None, confidence: float = 0.95, seed: int = 0,
                   name: str = "mechanism", neighbours: str = "",
                   progress: Callable[[int, int], None] | None = None) -> NeighbourReport:
    """Test a mechanism against its claim: ``run(which, seed)`` releases one output on
    ``which`` = "D" or "D'" (named arrays and numbers); ``runs`` per side.

    The bound is computed at ``delta``, by default the claim's. Returns a
    :class:`NeighbourReport` (``report.describe()``: one paragraph, ``report.passed``).
    A researcher's own mechanism plugs in as any such callable, e.g.::

        def run(which, seed):
            rng = np.random.default_rng(seed)
            x = 1.0 if which == "D'" else 0.0
            return {"out": x + rng.normal(0, 4.0, 1)}

        report = test_mechanism(run, runs=400, claim=Claim(1.0, 1e-5, "add-remove"))
    """
    if runs < 4:
        raise ValueError(f"runs must be at least 4 (two a side in each half), got {runs}")
    if delta is None:
        delta = claim.delta if claim is not None else 0.0
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    t0 = time.perf_counter()
    releases = collect(run, runs, seed, progress)
    train = np.arange(runs) < runs - runs // 2
    stats = statistics_of(releases, train)
    report = NeighbourReport(bound(stats, train, delta, confidence), runs, confidence, delta,
                             claim, name, neighbours)
    report.seconds = time.perf_counter() - t0
    return report


test_mechanism.__test__ = False  # type: ignore[attr-defined]  (pytest: not a test)


def max_detectable(runs: int, statistics: int, confidence: float = 0.95,
                   delta: float = 0.0) -> float:
    """The largest bound ``runs`` a side can give (perfect separation on the held-out half):
    how many runs a test needs to refute a claim of a given size."""
    alpha = (1.0 - confidence) / (2 * max(statistics, 1))
    a = float(clopper_pearson_upper(0, runs // 2, alpha))
    return float(epsilon_from_rates(a, a, delta))


def gaussian_epsilon(sensitivity_over_sigma: float, delta: float) -> float:
    """The exact epsilon of the Gaussian mechanism at ``delta`` (Balle & Wang 2018): the
    reference the synthetic tests compare with."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    mu = sensitivity_over_sigma

    def gap(eps: float) -> float:
        return (norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)
                - delta)

    if gap(0.0) <= 0:
        return 0.0
    return float(brentq(gap, 0.0, 10 * mu * mu + 50))


__all__: Sequence[str] = ["Claim", "Mechanism", "NeighbourReport", "Reduced", "StatisticBound",
                          "bound", "clopper_pearson_upper", "collect", "epsilon_from_rates",
                          "gaussian_epsilon", "max_detectable", "reduce_release", "run_seeds",
                          "statistics_of", "test_mechanism"]
