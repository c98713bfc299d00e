"""Means over repeated runs with a 95% confidence interval, as papers report them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of Student's t interval for the mean of independent runs
    (each seed one draw; ``scipy.stats.t.interval``); the half-width is nan with fewer
    than two values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return math.nan, math.nan
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan
    from scipy import stats  # lazy: only sweeps over seeds need it

    sem = stats.sem(xs)
    if sem == 0:  # every seed gave the same value (t.interval would give nan)
        return mean, 0.0
    low, high = stats.t.interval(level, len(xs) - 1, loc=mean, scale=sem)
    return mean, float(high - low) / 2


def fmt_ci(values: Sequence[float], digits: int = 4) -> str:
    """'0.8123 ± 0.0101 (n=3)', or '' with no values."""
    mean, half = mean_ci(values)
    if math.isnan(mean):
        return ""
    n = sum(v is not None and math.isfinite(float(v)) for v in values)
    return (f"{mean:.{digits}f}" if math.isnan(half)
            else f"{mean:.{digits}f} ± {half:.{digits}f}") + f" (n={n})"
