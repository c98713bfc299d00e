"""ROC curves on log axes (matplotlib only: the sweep draws them without torch).

The axes go down only as far as the sample can measure: with n non-members the lowest
false-positive rate other than 0 is 1/n, with m members the lowest true-positive rate is
1/m. Drawn lower (as 1e-4 from 8 members), a staircase of a few points looks like a
low-FPR result it is not."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from matplotlib.ticker import NullFormatter

PAD = 1.06  # the axes reach this factor beyond the lowest measurable rate and 1


class RocCurve(NamedTuple):
    """One attack's ROC and the sample it was measured on."""

    label: str
    fpr: Sequence[float]
    tpr: Sequence[float]
    members: int
    nonmembers: int


def measurable(fpr: Sequence[float], tpr: Sequence[float], members: int, nonmembers: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The points of a curve at rates the sample can resolve: FPR >= 1/nonmembers and
    TPR >= 1/members (a point below either is 0 on that axis: not drawable on a log
    scale and not a measurement of a low rate)."""
    x, y = np.asarray(fpr, dtype=float), np.asarray(tpr, dtype=float)
    keep = (x >= 1 / max(nonmembers, 1) - 1e-12) & (y >= 1 / max(members, 1) - 1e-12)
    return x[keep], y[keep]


def roc_limits(curves: Sequence[RocCurve]) -> tuple[float, float]:
    """The lowest FPR and TPR any of ``curves`` can measure (the largest sample's)."""
    return (1 / max(max(c.nonmembers for c in curves), 1),
            1 / max(max(c.members for c in curves), 1))


def log_ticks(lo: float) -> list[float]:
    """Ticks from ``lo`` to 1 on a log axis: 1, 2 and 5 per decade over a short range,
    decades alone over a long one (matplotlib labels a short range's minor ticks in a
    clutter of overlapping powers of ten)."""
    k0 = math.floor(math.log10(lo) + 1e-9)
    ticks = [m * 10.0 ** k for k in range(k0, 1) for m in (1, 2, 5)
             if lo - 1e-12 <= m * 10.0 ** k <= 1 + 1e-12]
    return ticks if len(ticks) <= 7 else [t for t in ticks if math.isclose(
        10 ** round(math.log10(t)), t)]


def draw_roc(ax: Any, curves: Sequence[RocCurve], colors: Any = None) -> tuple[float, float]:
    """(label, fpr, tpr, members, nonmembers) curves and chance on log axes limited to the
    lowest rates the samples measure, each curve drawn only where its own sample measures;
    the axis labels say where they stop. Returns the (FPR, TPR) floors."""
    x0, y0 = roc_limits(curves)
    for i, c in enumerate(curves):
        x, y = measurable(c.fpr, c.tpr, c.members, c.nonmembers)
        ax.plot(x, y, label=c.label, lw=1,
                color=None if colors is None else colors(i % 20))
    grid = np.logspace(np.log10(max(x0, y0)), 0, 50)
    ax.plot(grid, grid, ls="--", color="gray", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    # a hair of room (PAD) so that points on the floor or at 1 are not hidden by the frame
    ax.set_xlim(x0 / PAD, PAD)
    ax.set_ylim(y0 / PAD, PAD)
    for axis, lo in ((ax.xaxis, x0), (ax.yaxis, y0)):
        ticks = log_ticks(lo)
        labels = [f"{t:g}" for t in ticks]
        if all(t / lo > 1.3 for t in ticks):  # the floor itself, as the fraction it is
            ticks, labels = [lo, *ticks], [f"1/{round(1 / lo):,}", *labels]
        axis.set_ticks(ticks, labels)
        axis.set_minor_formatter(NullFormatter())
    own = "" if len({(c.members, c.nonmembers) for c in curves}) == 1 else \
        "; each curve to its own sample"
    ax.set_xlabel(f"false positive rate\n(lowest measurable: 1/{round(1 / x0):,} "
                  f"non-members{own})")
    ax.set_ylabel(f"true positive rate\n(lowest measurable: 1/{round(1 / y0):,} members)")
    ax.grid(alpha=0.3, which="both")
    return x0, y0
