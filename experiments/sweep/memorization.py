"""A sweep's memorization: each cell's final canary exposure (the Secret Sharer, Carlini et
al. 2019) in its table, and exposure against the epsilon each cell spent, one line per
repetition count, means over seeds with their 95% intervals (Thakkar et al. 2020 plot
exposure against user-level epsilon the same way)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from tasks.results.exposure import headline, read_exposure
from tasks.results.ledger import headline_epsilon
from tasks.results.plots import place_legend, wrap_title

from .outcome import named, trouble
from .stats import mean_ci


def exposure_text(cell: Any) -> str:
    """The cell's last-round mean exposure per repetition count, e.g. '1x=1.3 100x=14.2'."""
    if not cell.run_dir:
        return ""
    return " ".join(f"{reps}x={value:.1f}"
                    for reps, value in headline(read_exposure(cell.run_dir)).items())


def exposure_plots(title: str, cells: Sequence[Any]) -> dict[str, Figure]:
    """exposure_privacy.png: final exposure against epsilon spent (log axis; cells without
    DP at the right edge), one point per cell (the mean over its seeds, its 95% interval
    shaded), one line per repetition count; cells that failed or diverged named in the
    legend, not drawn. Empty when no cell planted canaries."""
    runs = [(c, read_exposure(c.run_dir)) for c in cells if c.run_dir]
    runs = [(c, rows) for c, rows in runs if rows]
    if not runs:
        return {}
    space = float(runs[0][1][0]["space"])
    sound = [(c, rows) for c, rows in runs if trouble(c) is None]
    eps = {c.label: headline_epsilon(c.result.get("privacy")) for c, _ in sound}
    finite = [e for e in eps.values() if e is not None]
    right = max(finite) * 4 if finite else 1.0  # where the no-DP cells are drawn
    fig = Figure(figsize=(6.8, 4.2))
    ax = fig.subplots()
    groups: dict[str, list[Any]] = {}  # a cell over its seeds: one point
    for c, rows in sound:
        groups.setdefault(c.group, []).append((c, rows))
    for reps in sorted({r["repetitions"] for _, rows in runs for r in rows}):
        points = []
        for members in groups.values():
            values = [v for _, rows in members if (v := headline(rows).get(reps)) is not None]
            xs = [eps[c.label] for c, _ in members if eps[c.label] is not None]
            if values:
                points.append((sum(xs) / len(xs) if xs else right, *mean_ci(values)))
        points.sort()
        half = [h if math.isfinite(h) else 0.0 for _, _, h in points]
        line, = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=4,
                        label=f"{reps} repetition{'s' * (reps > 1)}")
        pairs = list(zip(points, half, strict=True))
        ax.fill_between([p[0] for p in points], [p[1] - h for p, h in pairs],
                        [p[1] + h for p, h in pairs], color=line.get_color(), alpha=0.2)
    for c, _ in runs:
        if (why := trouble(c)) is not None:
            ax.plot([], [], ls="none", marker="x", color="tab:red",
                    label=named(c.label, f"{why}; not drawn"))
    ax.axhline(math.log2(space), color="grey", ls="--", lw=1, label="maximum: log2 |R|")
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="chance (about 1 bit)")
    ax.set_xscale("log")
    ticks = sorted(set(finite)) + ([right] if any(e is None for e in eps.values()) else [])
    ax.set_xticks(ticks, [f"{t:.3g}" if t != right or right in finite else "no DP"
                          for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("epsilon spent (user level: central; record level: local)")
    ax.set_ylabel("canary exposure, last round (bits)")
    ax.set_title("memorization against privacy\n" + wrap_title(title), fontsize=10)
    ax.grid(alpha=0.3)
    place_legend(ax, fontsize=7)
    return {"exposure_privacy.png": fig}

