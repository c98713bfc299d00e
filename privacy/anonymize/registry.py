"""The anonymizers by name: what each one reads, whether it is row-wise, how to run it.

Each entry's parameters are a frozen dataclass whose field names are the run-config
keys it reads (``dbscan_eps`` is ``dbscan-eps``): that dataclass is the only list of
them, so the cache key of a release (:mod:`clients.anonymized`) cannot miss one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dp.accounting import auto_delta
from .density import density
from .ksame import ksame
from .noise import gaussian_noise, laplace_noise, mask, random_noise
from .params import (
    CVAEParams,
    DensityParams,
    GaussianParams,
    HashingParams,
    KSameParams,
    LaplaceParams,
    MaskParams,
    NoParams,
    PCAParams,
    RandomParams,
)
from .release import AnonymizationError, Release
from .transforms import hashing, hashing_transform, pca, permutation

Run = Callable[[np.ndarray, np.ndarray, Any, int, int], Release]


@dataclass(frozen=True)
class AnonymizerSpec:
    """One anonymizer: ``run(x, y, params, seed, num_classes)``, its parameters, and
    whether every released row is a function of one record (``rowwise``)."""

    run: Run | None  # None: not run per client (the federated CVAE samples a shared decoder)
    params: type
    rowwise: bool
    public_map: Callable[[int, Any], Callable[[np.ndarray], np.ndarray]] | None = None


def _identity(x, y, p, seed, num_classes) -> Release:
    return Release(x.copy(), y.copy(), np.arange(len(x)), np.arange(len(x)),
                   {"guarantee": "none"})


def _cvae(x, y, p, seed, num_classes) -> Release:
    from .cvae import cvae_release  # imports torch: only runs that train a CVAE pay it

    return cvae_release(x, y, p, num_classes, seed)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


ANONYMIZERS: dict[str, AnonymizerSpec] = {
    "none": AnonymizerSpec(_identity, NoParams, True),
    "identity": AnonymizerSpec(_identity, NoParams, True),
    "ksame": AnonymizerSpec(lambda x, y, p, s, c: ksame(x, y, p.k, p.ksame_classwise),
                            KSameParams, False),
    "density": AnonymizerSpec(
        lambda x, y, p, s, c: density(x, y, p.dbscan_eps, p.dbscan_min_samples,
                                      p.density_outliers, p.density_classwise,
                                      p.density_noise, _rng(s)), DensityParams, False),
    "cvae": AnonymizerSpec(_cvae, CVAEParams, False),
    "cvae-federated": AnonymizerSpec(None, CVAEParams, False),
    # trained like cvae; the client trains on a fresh sample of it every epoch
    # (clients.anonymized.online_sample); this release is the one scored
    "cvae-online": AnonymizerSpec(_cvae, CVAEParams, False),
    "gaussian": AnonymizerSpec(
        lambda x, y, p, s, c: gaussian_noise(x, y, p.noise_epsilon,
                                             p.noise_delta or auto_delta(len(x)), p.noise_clip,
                                             _rng(s)), GaussianParams, True),
    "laplace": AnonymizerSpec(
        lambda x, y, p, s, c: laplace_noise(x, y, p.noise_epsilon, p.noise_clip, _rng(s)),
        LaplaceParams, True),
    "random": AnonymizerSpec(lambda x, y, p, s, c: random_noise(x, y, p.noise_scale, _rng(s)),
                             RandomParams, False),
    "mask": AnonymizerSpec(lambda x, y, p, s, c: mask(x, y, p.mask_fraction, _rng(s)),
                           MaskParams, True),
    "pca": AnonymizerSpec(lambda x, y, p, s, c: pca(x, y, p.pca_components), PCAParams, False),
    "permutation": AnonymizerSpec(lambda x, y, p, s, c: permutation(x, y, _rng(s)), NoParams,
                                  True),
    "hashing": AnonymizerSpec(lambda x, y, p, s, c: hashing(x, y, p.hash_salt), HashingParams,
                              True, lambda dim, p: hashing_transform(dim, p.hash_salt)),
}
ROWWISE = frozenset(name for name, spec in ANONYMIZERS.items() if spec.rowwise)
# what may also run on raw inputs (pixels, tabular rows), not only on embeddings: the
# row-wise ones without a public map the test data would need too
RAW_INPUTS = frozenset(n for n in ROWWISE if ANONYMIZERS[n].public_map is None)


def anonymize(name: str, x: np.ndarray, y: np.ndarray, params: Any, seed: int = 0,
              num_classes: int | None = None) -> Release:
    """Run the anonymizer ``name`` with its ``params`` on one client's data."""
    spec = ANONYMIZERS[name]
    if spec.run is None:
        raise AnonymizationError(f"{name!r} is not run per client: its release is sampled "
                                 "from the decoder the clients train together")
    classes = int(num_classes if num_classes is not None else int(np.max(y)) + 1)
    return spec.run(x, y, params, seed, classes)


def public_transform(name: str, params: Any, dim: int
                     ) -> Callable[[np.ndarray], np.ndarray] | None:
    """The federation-wide map an anonymizer applies to all data (test data included)."""
    spec = ANONYMIZERS[name]
    return None if spec.public_map is None else spec.public_map(dim, params)


def dp_sgd_unit(anonymizer: str, train_data: str) -> str:
    """What local DP-SGD's epsilon protects: "record" or "released row".

    ``train_data`` is ``released`` (DP-SGD trains on the anonymizer's output) or
    ``original`` (on the client's own records). On a release that is not row-wise one
    record can change every released row (k-Same's and DBSCAN's groups, PCA's basis, the
    CVAE, the per-feature std of ``random``), so no useful per-record bound follows.
    """
    if train_data == "original" or ANONYMIZERS[anonymizer].rowwise:
        return "record"
    return "released row"
