"""Transforms the seed project called anonymization; the metrics show what they protect.

- ``pca``: project on the client's top principal components and back (rank reduction
  in the original space, so the head still reads real test embeddings).
- ``permutation``: shuffle the rows (the same vectors in another order).
- ``hashing``: salted signed feature hashing (Weinberger et al. 2009) into the same
  dimension; the salt is federation-wide, so test embeddings get the same transform
  (``Release.transform``) and an attacker who knows the salt can do the same.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from .release import AnonymizationError, Release


def pca(x: np.ndarray, y: np.ndarray, components: int) -> Release:
    """Keep the client's top principal components, back in the original space."""
    from sklearn.decomposition import PCA  # about a second to import: only when used

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
