"""A sweep's privacy-utility trade-off, one line per setting: cells that differ only in
their privacy level (target-epsilon or noise-multiplier) joined, each point the mean
epsilon spent and the mean final accuracy over seeds with its 95% interval."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from tasks.results.ledger import headline_epsilon
from tasks.results.plots import place_legend, wrap_title

from .outcome import trouble
from .stats import mean_ci

LEVEL_KEYS = ("target-epsilon", "noise-multiplier")


def setting_of(group: str) -> str:
    """'client-sampling=cyclic, target-epsilon=4.0' -> 'client-sampling=cyclic': the
    cell's label without its privacy level."""
    parts = [p for p in group.split(", ") if p.split("=", 1)[0] not in LEVEL_KEYS]
    return ", ".join(parts) or "(the base settings)"


def tradeoff_points(cells: Sequence[Any]) -> dict[str, list[tuple[float, float, float, int]]]:
    """Per setting: (mean epsilon, mean final accuracy, its 95% half-interval, seeds) for
    each privacy level, sorted by epsilon; cells that failed or diverged left out."""
    levels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for c in cells:
        eps = headline_epsilon(c.result.get("privacy"))
        final = c.result.get("final")
        if eps is None or not final or trouble(c) is not None:
            continue
        group = getattr(c, "group", None) or c.label
        levels.setdefault(setting_of(group), {}).setdefault(group, []).append(
            (eps, final["accuracy"]))
    out = {}
    for setting, by_level in levels.items():
        points = []
        for runs in by_level.values():
            mean, half = mean_ci([a for _, a in runs])
            points.append((sum(e for e, _ in runs) / len(runs), mean,
                           0.0 if math.isnan(half) else half, len(runs)))
        out[setting] = sorted(points)
    return out


def _shared(settings: Sequence[str]) -> set[str]:
    """The key=value parts every setting has (said once, in the title's sweep, not in
    every legend entry)."""
    parts = [set(s.split(", ")) for s in settings]
    return set.intersection(*parts) if len(parts) > 1 else set()


def tradeoff_plot(title: str, cells: Sequence[Any]) -> dict[str, Figure]:
    """privacy_accuracy_lines.png when some setting was run at two privacy levels or more."""
    lines = tradeoff_points(cells)
    if not any(len(points) > 1 for points in lines.values()):
        return {}
    fig = Figure(figsize=(7.0, 4.6))
    ax = fig.subplots()
    markers = "osD^v<>pP*X"
    shared = _shared(list(lines))
    for i, (setting, points) in enumerate(sorted(lines.items())):
        x, y, half = (np.array([p[k] for p in points], dtype=float) for k in range(3))
        own = ", ".join(p for p in setting.split(", ") if p not in shared) or setting
        ax.errorbar(x, y, yerr=half, marker=markers[i % len(markers)],
                    capsize=3, markersize=4, label=textwrap.fill(own, 48))
    ax.set_xscale("log")
    levels = sorted({float(f"{p[0]:.2g}") for points in lines.values() for p in points})
    ax.set_xticks(levels, [f"{e:g}" for e in levels])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("epsilon spent (mean over seeds; central: client-level)")
    ax.set_ylabel("final test accuracy (mean, 95% interval over seeds)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, which="both")
    place_legend(ax, fontsize=7)
    ax.set_title("privacy-accuracy trade-off, one line per setting\n" + wrap_title(title),
                 fontsize=10)
    return {"privacy_accuracy_lines.png": fig}
