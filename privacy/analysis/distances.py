"""Euclidean distances in chunks: memory O(chunk x M), never an N x N matrix."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

CHUNK = 512


def chunks(n: int, size: int = CHUNK) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Squared distances between the rows of a and b, as a (len(a), len(b)) matrix."""
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.maximum(d, 0.0)


def min_dist(query: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Distance from each query row to its nearest reference row (scikit-learn, chunked)."""
    from sklearn.metrics import pairwise_distances_argmin_min  # 1 s to import: only when used

    return pairwise_distances_argmin_min(np.asarray(query, dtype=np.float64),
                                         np.asarray(reference, dtype=np.float64))[1]
