"""The Pareto front of a privacy-utility scatter."""

from __future__ import annotations

from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x, higher y)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -float("inf")
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front
