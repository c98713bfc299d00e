"""Density-based anonymization: DBSCAN clusters (Ester et al. 1996) replaced by their centroids.

DBSCAN runs on standardized embeddings (per class with ``classwise``); every cluster
member is released as its cluster's centroid (optionally plus Gaussian noise), and
DBSCAN's outliers are dropped or merged into the nearest cluster. Unlike the seed
project's "density" method, which added the same Laplace noise to every point, the
clusters really shape the release.
"""

from __future__ import annotations

import numpy as np

from ..analysis.distances import sq_dists
from .ksame import group_means
from .release import AnonymizationError, Release

OUTLIER_HANDLING = ("drop", "merge")


def density(x: np.ndarray, y: np.ndarray, eps: float, min_samples: int,
            outliers: str = "drop", classwise: bool = False, noise_std: float = 0.0,
            rng: np.random.Generator | None = None) -> Release:
    """DBSCAN clusters on standardized embeddings; members become their cluster's centroid."""
    # scikit-learn takes about a second to import: only runs that use DBSCAN pay it
    from sklearn.cluster import DBSCAN
    from sklearn.preprocessing import StandardScaler

    if outliers not in OUTLIER_HANDLING:
        raise AnonymizationError(f"outliers must be one of {OUTLIER_HANDLING}, got {outliers!r}")
    rng = rng or np.random.default_rng(0)
    groups = np.full(len(x), -1, dtype=np.int64)
    blocks = [np.flatnonzero(y == c) for c in np.unique(y)] if classwise else [np.arange(len(x))]
    next_id = 0
    for rows in blocks:
        z = StandardScaler().fit_transform(x[rows])
        labels = DBSCAN(eps=eps, min_samples=min_samples).fit_predict(z)
        if labels.max() < 0:
            continue
        clusters = labels >= 0
        if outliers == "merge" and (~clusters).any():
            centers = np.stack([z[labels == c].mean(0) for c in range(labels.max() + 1)])
            lone = np.flatnonzero(~clusters)
            labels[lone] = sq_dists(z[lone], centers).argmin(1)
        keep = labels >= 0
        groups[rows[keep]] = labels[keep] + next_id
        next_id += int(labels.max()) + 1
    kept = groups >= 0
    if not kept.any():
        raise AnonymizationError(
            f"DBSCAN with eps = {eps}, min-samples = {min_samples} found no cluster in "
            f"{len(x)} standardized embeddings: every point is an outlier, so nothing could "
            "be released. Raise dbscan-eps or lower dbscan-min-samples.")
    centroids = group_means(x[kept], groups[kept])
    if noise_std > 0:
        centroids = centroids + rng.normal(0.0, noise_std, centroids.shape)
    sizes = np.bincount(groups[kept])
    sizes = sizes[sizes > 0]
    return Release(centroids, y[kept].copy(), np.flatnonzero(kept), groups,
                   {"clusters": int(len(sizes)), "cluster-size-min": int(sizes.min()),
                    "cluster-size-max": int(sizes.max()),
                    "cluster-sizes": sorted(int(s) for s in sizes),
                    "outliers": int((~kept).sum()) if outliers == "drop" else 0,
                    "outlier-handling": outliers, "classwise": classwise,
                    "noise-std": noise_std})
