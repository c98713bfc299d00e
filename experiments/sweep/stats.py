"""Means over repeated runs with a 95% confidence interval, as papers report them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def t_half_width(sem: float, n: int, level: float = 0.95) -> float:
    """Half the width of Student's t interval for a mean of ``n`` draws with standard
    error ``sem``: ``scipy.stats.t.interval``'s, from the quantile it uses (scipy.special's
    ``stdtrit``; scipy.stats itself is a second's import, at the end of every sweep)."""
    if sem == 0:  # every draw the same (t.interval would give nan)
        return 0.0
    from scipy.special import stdtrit  # lazy: only repeated runs need it

    return float(stdtrit(n - 1, (1 + level) / 2)) * sem


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of Student's t interval for the mean of independent runs
    (each seed one draw); the half-width is nan with fewer than two values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return math.nan, math.nan
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan
    return mean, t_half_width(statistics.stdev(xs) / math.sqrt(len(xs)), len(xs), level)


def fmt_ci(values: Sequence[float], digits: int = 4) -> str:
    """'0.8123 ± 0.0101 (n=3)', or '' with no values."""
    mean, half = mean_ci(values)
    if math.isnan(mean):
        return ""
    n = sum(v is not None and math.isfinite(float(v)) for v in values)
    return (f"{mean:.{digits}f}" if math.isnan(half)
            else f"{mean:.{digits}f} ± {half:.{digits}f}") + f" (n={n})"
