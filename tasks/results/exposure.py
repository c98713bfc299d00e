"""A run's canary exposures (``exposure.jsonl``, written by :mod:`server.memorization`):
read back, summed up per repetition count, and drawn against round."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..files import damaged, read_text
from .plots import _save, place_legend, wrap_title

LEDGER = "exposure.jsonl"


def read_exposure(run_dir: Path) -> list[dict[str, Any]]:
    """Every exposure line of a run, a repeated round (after a resume) kept once: its
    last measurement."""
    path = run_dir / LEDGER
    if not path.is_file():
        return []
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows[(int(row["round"]), int(row["canary"]))] = row
        except (ValueError, KeyError, TypeError) as exc:
            raise damaged(path, f"line {n} is not an exposure record ({exc})") from None
    return [rows[k] for k in sorted(rows)]


def plot_exposure(path: Path, rows: Sequence[Mapping[str, Any]], title: str,
                  space: float) -> None:
    """Exposure against round, one line per repetition count (the mean over its canaries,
    with their range), the maximum log2 |R| dashed."""
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.subplots()
    for reps in sorted({r["repetitions"] for r in rows}):
        mine = [r for r in rows if r["repetitions"] == reps]
        rounds = sorted({r["round"] for r in mine})
        values = [[r["exposure"] for r in mine if r["round"] == rnd] for rnd in rounds]
        mean = [float(np.mean(v)) for v in values]
        line, = ax.plot(rounds, mean, marker="o", ms=3,
                        label=f"{reps} repetition{'s' if reps > 1 else ''} "
                              f"({len(values[0])} canar{'ies' if len(values[0]) > 1 else 'y'})")
        if any(len(v) > 1 for v in values):
            ax.fill_between(rounds, [min(v) for v in values], [max(v) for v in values],
                            color=line.get_color(), alpha=0.2)
    ax.axhline(np.log2(space), color="grey", ls="--", lw=1, label="maximum: log2 |R|")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("exposure (bits)")
    ax.set_ylim(bottom=0)
    ax.set_title(wrap_title(title), fontsize=10)
    place_legend(ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)


def headline(rows: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """The last round's mean exposure per repetition count."""
    if not rows:
        return {}
    last = max(r["round"] for r in rows)
    out: dict[int, list[float]] = {}
    for r in rows:
        if r["round"] == last:
            out.setdefault(r["repetitions"], []).append(r["exposure"])
    return {k: float(np.mean(v)) for k, v in sorted(out.items())}
