"""Anonymizers for embeddings: fit on one client's (x, y), return what it releases.

Every anonymizer returns a :class:`Release` that says honestly what was released:
the vectors and labels, which original row each released row came from (when there
is one), the group each original row was merged into, and the mechanism's own
parameters. :mod:`privacy.metrics` scores it against the originals and a holdout.

- ``identity``: releases the originals (the baseline every metric is read against).
- ``ksame``: k-Same (Newton, Sweeney & Malin 2005) as used by Di Salvo et al. (BMVC
  2024): repeatedly take the unassigned point farthest from the centroid of the
  unassigned points plus its k-1 nearest unassigned neighbours; release their mean k
  times, each with its own label. ``classwise`` runs it inside each class
  (k-Same-Select). When fewer than 2k points remain they form the last group
  (between k and 2k-1 members), so every group has at least k members.
- ``density``: DBSCAN (Ester et al. 1996) on standardized embeddings; every cluster
  member is replaced by its cluster's centroid (optionally plus Gaussian noise);
  DBSCAN's outliers are dropped or merged into the nearest cluster.
- ``gaussian`` / ``laplace``: clip each vector to L2 (L1) norm C, add Gaussian
  (Laplace) noise calibrated by :mod:`privacy.mechanisms` to sensitivity 2C, so each
  released vector is (epsilon, delta)-DP (epsilon-DP) with respect to its original
  (local DP per record).
- ``random``: the seed project's uniform noise, +-noise_scale * std per feature (no
  formal guarantee).
- ``mask``: zero a random fraction of each vector's features.
- ``pca``: project on the client's top components and back (rank reduction in the
  original space, so the head still reads real test embeddings).
- ``permutation``: shuffle the rows (the seed project's method: the same vectors in
  another order; no protection, shown by the metrics).
- ``hashing``: salted signed feature hashing (Weinberger et al. 2009) into the same
  dimension; the salt is federation-wide, so test embeddings get the same transform
  (``Release.transform``) and an attacker who knows the salt can do the same.

CVAE anonymization lives in :mod:`privacy.cvae`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasks.config import ANONYMIZERS

from .accounting import auto_delta
from .distances import sq_dists
from .mechanisms import gaussian_sigma

# Anonymizers whose every released row is a function of one original record (and of
# randomness that does not depend on the data): a neighbouring dataset changes one
# released row, so DP-SGD on the release is DP per original record. The others (k-Same's
# and DBSCAN's data-dependent groups, PCA's fitted basis, the CVAE, the per-feature std of
# `random`) let one record change every released row.
ROWWISE = frozenset({"none", "identity", "gaussian", "laplace", "mask", "permutation",
                     "hashing"})


def dp_sgd_unit(anonymizer: str, train_data: str) -> str:
    """What local DP-SGD's epsilon protects: "record" or "released row".

    ``train_data`` is ``released`` (DP-SGD trains on the anonymizer's output) or
    ``original`` (on the client's own records).
    """
    if train_data == "original" or anonymizer in ROWWISE:
        return "record"
    return "released row"


class AnonymizationError(ValueError):
    """The anonymizer cannot produce a usable release with these parameters."""


@dataclass
class Release:
    """What a client releases, and how it relates to the originals."""

    x: np.ndarray  # released vectors, float32 (M, D)
    y: np.ndarray  # released labels (M,)
    source: np.ndarray | None = None  # original row of each released row (-1: none)
    groups: np.ndarray | None = None  # group id of each ORIGINAL row (-1: dropped)
    info: dict[str, Any] = field(default_factory=dict)
    transform: Callable[[np.ndarray], np.ndarray] | None = None  # public map for new data

    def __post_init__(self) -> None:
        if len(self.x) == 0:
            raise AnonymizationError("the anonymizer released nothing")
        if not np.isfinite(self.x).all():
            raise AnonymizationError("the anonymizer released non-finite values")
        self.x = np.ascontiguousarray(self.x, dtype=np.float32)


# --------------------------------------------------------------------------- k-Same


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


def _group_means(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
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
    return Release(_group_means(x, groups), y.copy(), np.arange(len(x)), groups,
                   {"k": k, "classwise": classwise, "groups": int(len(sizes)),
                    "group-size-min": int(sizes.min()), "group-size-max": int(sizes.max())})


# --------------------------------------------------------------------------- density


def density(x: np.ndarray, y: np.ndarray, eps: float, min_samples: int,
            outliers: str = "drop", classwise: bool = False, noise_std: float = 0.0,
            rng: np.random.Generator | None = None) -> Release:
    """DBSCAN clusters on standardized embeddings; members become their cluster's centroid."""
    from sklearn.cluster import DBSCAN
    from sklearn.preprocessing import StandardScaler

    if outliers not in ("drop", "merge"):
        raise AnonymizationError(f"outliers must be 'drop' or 'merge', got {outliers!r}")
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
    centroids = _group_means(x[kept], groups[kept])
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


# --------------------------------------------------------------------------- noise


def _clip(x: np.ndarray, bound: float, order: int) -> np.ndarray:
    norms = np.linalg.norm(x, ord=order, axis=1, keepdims=True)
    return x * np.minimum(1.0, bound / np.maximum(norms, 1e-12))


def gaussian_noise(x: np.ndarray, y: np.ndarray, epsilon: float, delta: float, clip: float,
                   rng: np.random.Generator) -> Release:
    """Clip to L2 norm C and add N(0, sigma^2): (epsilon, delta)-DP per released vector."""
    sigma = gaussian_sigma(epsilon, delta, sensitivity=2 * clip)
    noisy = _clip(x, clip, 2) + rng.normal(0.0, sigma, x.shape)
    return Release(noisy, y.copy(), np.arange(len(x)), None,
                   {"epsilon": epsilon, "delta": delta, "clip": clip, "sigma": sigma,
                    "guarantee": "(epsilon, delta)-DP per record (L2 sensitivity 2C)"})


def laplace_noise(x: np.ndarray, y: np.ndarray, epsilon: float, clip: float,
                  rng: np.random.Generator) -> Release:
    """Clip to L1 norm C and add Laplace(2C / epsilon): epsilon-DP per released vector."""
    b = 2 * clip / epsilon
    noisy = _clip(x, clip, 1) + rng.laplace(0.0, b, x.shape)
    return Release(noisy, y.copy(), np.arange(len(x)), None,
                   {"epsilon": epsilon, "delta": 0.0, "clip": clip, "scale": b,
                    "guarantee": "epsilon-DP per record (L1 sensitivity 2C)"})


def random_noise(x: np.ndarray, y: np.ndarray, scale: float, rng: np.random.Generator
                 ) -> Release:
    """Uniform noise of +-scale * (feature std): the seed project's baseline, no guarantee."""
    spread = scale * x.std(axis=0, keepdims=True)
    return Release(x + rng.uniform(-1, 1, x.shape) * spread, y.copy(), np.arange(len(x)),
                   None, {"noise-scale": scale, "guarantee": "none"})


def mask(x: np.ndarray, y: np.ndarray, fraction: float, rng: np.random.Generator) -> Release:
    """Zero a random ``fraction`` of each vector's features."""
    if not 0 <= fraction < 1:
        raise AnonymizationError(f"mask fraction must be in [0, 1), got {fraction}")
    keep = rng.random(x.shape) >= fraction
    return Release(x * keep, y.copy(), np.arange(len(x)), None,
                   {"mask-fraction": fraction, "guarantee": "none"})


def pca(x: np.ndarray, y: np.ndarray, components: int) -> Release:
    """Keep the client's top principal components, back in the original space."""
    from sklearn.decomposition import PCA

    if not 1 <= components <= min(x.shape):
        raise AnonymizationError(f"pca-components must be between 1 and {min(x.shape)}, got "
                                 f"{components}")
    model = PCA(n_components=components, random_state=0).fit(x)
    low = model.inverse_transform(model.transform(x))
    return Release(low, y.copy(), np.arange(len(x)), None,
                   {"components": components,
                    "explained-variance": float(model.explained_variance_ratio_.sum()),
                    "guarantee": "none"})


def permutation(x: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> Release:
    """Shuffle the rows (labels travel with them): the same vectors, in another order."""
    order = rng.permutation(len(x))
    return Release(x[order].copy(), y[order].copy(), order, None, {"guarantee": "none"})


def hashing_transform(dim: int, salt: str) -> Callable[[np.ndarray], np.ndarray]:
    """Signed feature hashing into ``dim`` buckets, keyed by a salt (a public map)."""
    digest = [hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(dim)]
    bucket = np.array([int.from_bytes(d[:4], "little") % dim for d in digest])
    sign = np.array([1.0 if d[4] & 1 else -1.0 for d in digest])

    def apply(v: np.ndarray) -> np.ndarray:
        out = np.zeros((len(v), dim), dtype=np.float64)
        np.add.at(out.T, bucket, (np.asarray(v, dtype=np.float64) * sign).T)
        return out.astype(np.float32)

    return apply


def hashing(x: np.ndarray, y: np.ndarray, salt: str) -> Release:
    transform = hashing_transform(x.shape[1], salt)
    return Release(transform(x), y.copy(), np.arange(len(x)), None,
                   {"salt-sha256": hashlib.sha256(salt.encode()).hexdigest()[:12],
                    "guarantee": "none (the map is public to the federation)"}, transform)


# --------------------------------------------------------------------------- dispatch


def public_transform(name: str, params: Mapping[str, Any], dim: int
                     ) -> Callable[[np.ndarray], np.ndarray] | None:
    """The federation-wide map an anonymizer applies to all data (test data included)."""
    if name == "hashing":
        return hashing_transform(dim, str(params["hash-salt"]))
    return None


def anonymize(name: str, x: np.ndarray, y: np.ndarray, params: Mapping[str, Any],
              seed: int = 0) -> Release:
    """Run the anonymizer ``name`` with run-config ``params`` on one client's data."""
    rng = np.random.default_rng(seed)
    if name in ("none", "identity"):
        return Release(x.copy(), y.copy(), np.arange(len(x)), np.arange(len(x)),
                       {"guarantee": "none"})
    if name == "ksame":
        return ksame(x, y, int(params["k"]), bool(params["ksame-classwise"]))
    if name == "density":
        return density(x, y, float(params["dbscan-eps"]), int(params["dbscan-min-samples"]),
                       str(params["density-outliers"]), bool(params["density-classwise"]),
                       float(params["density-noise"]), rng)
    if name == "gaussian":
        return gaussian_noise(x, y, float(params["noise-epsilon"]),
                              float(params["noise-delta"]) or auto_delta(len(x)),
                              float(params["noise-clip"]), rng)
    if name == "laplace":
        return laplace_noise(x, y, float(params["noise-epsilon"]), float(params["noise-clip"]),
                             rng)
    if name == "random":
        return random_noise(x, y, float(params["noise-scale"]), rng)
    if name == "mask":
        return mask(x, y, float(params["mask-fraction"]), rng)
    if name == "pca":
        return pca(x, y, int(params["pca-components"]))
    if name == "permutation":
        return permutation(x, y, rng)
    if name == "hashing":
        return hashing(x, y, str(params["hash-salt"]))
    if name in ("cvae", "cvae-federated"):
        from .cvae import cvae_release

        return cvae_release(x, y, params, seed)
    raise AnonymizationError(f"unknown anonymizer {name!r}; choose one of "
                             f"{', '.join(ANONYMIZERS)}")
