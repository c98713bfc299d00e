"""k-Same (Newton, Sweeney & Malin 2005), as used by Di Salvo et al. (BMVC 2024).

Repeatedly take the unassigned point farthest from the centroid of the unassigned
points plus its k-1 nearest unassigned neighbours; release their mean k times, each
with its own label. ``classwise`` runs it inside each class (k-Same-Select). When fewer
than 2k points remain they form the last group (between k and 2k-1 members), so every
group has at least k members.
"""

from __future__ import annotations

import numpy as np

from .release import AnonymizationError, Release


def ksame_groups(x: np.ndarray, k: int) -> np.ndarray:
    """Group rows into groups of k (the last of k..2k-1) by the k-Same procedure.

    Memory is O(N D): distances are computed from one point to the unassigned rest,
    never as an N x N matrix.
    """
    n = len(x)
    if k < 1:
        raise AnonymizationError(f"k must be >= 1, got {k}")
    if k > n:
        raise AnonymizationError(f"k = {k} is larger than the {n} records to anonymize; "
                                 "use a smaller k")
    x = np.asarray(x, dtype=np.float64)
    groups = np.full(n, -1, dtype=np.int64)
    remaining = np.arange(n)
    gid = 0
    while len(remaining):
        if len(remaining) < 2 * k:
            groups[remaining] = gid
            break
        pts = x[remaining]
        centroid = pts.mean(axis=0)
        far = int(np.argmax(((pts - centroid) ** 2).sum(axis=1)))
        d = ((pts - pts[far]) ** 2).sum(axis=1)
        members = np.argpartition(d, k - 1)[:k]  # includes `far` itself (distance 0)
        groups[remaining[members]] = gid
        keep = np.ones(len(remaining), dtype=bool)
        keep[members] = False
        remaining = remaining[keep]
        gid += 1
    return groups


def group_means(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Every row replaced by the mean of its group."""
    out = np.empty_like(x, dtype=np.float64)
    for g in np.unique(groups):
        rows = groups == g
        out[rows] = x[rows].mean(axis=0)
    return out


def ksame(x: np.ndarray, y: np.ndarray, k: int, classwise: bool = False) -> Release:
    """k-Same: every released vector is the mean of its group of at least k originals."""
    if classwise:
        groups = np.full(len(x), -1, dtype=np.int64)
        offset = 0
        for c in np.unique(y):
            rows = np.flatnonzero(y == c)
            if len(rows) < k:
                raise AnonymizationError(
                    f"class {c} has {len(rows)} records, fewer than k = {k}: k-Same-Select "
                    "cannot form a group. Lower k or use classwise = false.")
            g = ksame_groups(x[rows], k)
            groups[rows] = g + offset
            offset += int(g.max()) + 1
    else:
        groups = ksame_groups(x, k)
    sizes = np.bincount(groups)
    return Release(group_means(x, groups), y.copy(), np.arange(len(x)), groups,
                   {"k": k, "classwise": classwise, "groups": int(len(sizes)),
                    "group-size-min": int(sizes.min()), "group-size-max": int(sizes.max())})
