"""Means over repeated runs with a 95% confidence interval, as papers report them."""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width) of Student's t interval for the mean of independent runs
    (each seed one draw); the half-width is nan with fewer than two values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return math.nan, math.nan
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, math.nan
    from scipy.stats import t  # lazy: only sweeps over seeds need it

    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return mean, float(t.ppf(0.5 + level / 2, len(xs) - 1)) * sd / math.sqrt(len(xs))


def fmt_ci(values: Sequence[float], digits: int = 4) -> str:
    """'0.8123 ± 0.0101 (n=3)', or '' with no values."""
    mean, half = mean_ci(values)
    if math.isnan(mean):
        return ""
    n = sum(v is not None and math.isfinite(float(v)) for v in values)
    return (f"{mean:.{digits}f}" if math.isnan(half)
            else f"{mean:.{digits}f} ± {half:.{digits}f}") + f" (n={n})"
