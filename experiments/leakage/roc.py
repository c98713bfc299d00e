"""ROC curves on log axes (matplotlib only: the sweep draws them without torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def draw_roc(ax: Any, curves: Sequence[tuple[str, Sequence[float], Sequence[float]]],
             floor: float = 1e-4, colors: Any = None) -> None:
    """(label, fpr, tpr) curves and chance on log axes, where the low false-positive rates
    that matter are visible."""
    for i, (label, fpr, tpr) in enumerate(curves):
        ax.plot(np.maximum(np.asarray(fpr), 1e-4), np.maximum(np.asarray(tpr), 1e-4),
                label=label, lw=1, color=None if colors is None else colors(i % 20))
    grid = np.logspace(-4, 0, 50)
    ax.plot(grid, grid, ls="--", color="gray", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(floor, 1)
    ax.set_ylim(floor, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.grid(alpha=0.3, which="both")
