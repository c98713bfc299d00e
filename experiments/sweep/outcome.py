"""What became of a sweep's cell, as its tables and plots say it: a cell that did not finish
or whose model diverged is never a baseline, a trade-off line or a Pareto front."""

from __future__ import annotations

from typing import Any

from tasks.results.plots import shorten


def trouble(cell: Any) -> str | None:
    """Why a cell's numbers cannot stand for its settings: it did not finish (``failed``,
    ``crashed``, ``invalid``...) or its model diverged (``diverged at round 3``, run.json);
    None for a cell that finished with a sound model. Such a cell is never a baseline nor on
    a front, and every plot's legend says what became of it."""
    if cell.status != "finished":
        return str(cell.status or "did not run")
    diverged = cell.result.get("diverged")
    if diverged:
        at = diverged.get("round") if isinstance(diverged, dict) else None
        return f"diverged at round {at}" if at is not None else "diverged"
    return None


def named(label: str, why: str | None, width: int = 60) -> str:
    """A legend label with what became of its cell (``no DP (diverged at round 3)``), cut
    short before the note so the note always shows."""
    if why is None:
        return shorten(label, width)
    note = f" ({why})"
    return shorten(label, max(width - len(note), 12)) + note
