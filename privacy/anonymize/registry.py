"""The anonymizers by name: what each one reads, whether it is row-wise, how to run it.

Each entry's parameters are a frozen dataclass whose field names are the run-config
keys it reads (``dbscan_eps`` is ``dbscan-eps``): that dataclass is the only list of
them, so the cache key of a release (:mod:`clients.anonymized`) cannot miss one.
Register your own with ``@ANONYMIZERS.register("name", params=..., rowwise=...)`` in a
module the run config's ``plugins`` key names (docs/EXTENDING.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dp.accounting import auto_delta
from ..registry import Registry
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
class AnonymizerInfo:
    """What the config checks and the cache need to know of an anonymizer, without running it.

    ``params``: the frozen dataclass of the run-config keys it reads (field names are
    key names with ``_``: ``dbscan_eps`` is ``dbscan-eps``; fields must be keys of the
    anonymization section). ``rowwise``: every released row is a function of one record
    (then DP-SGD's epsilon on released rows is per record). ``public_map``: a
    federation-wide map of every input, test data included: ``(dim, params) -> (x -> x')``.
    """

    params: type
    rowwise: bool
    public_map: Callable[[int, Any], Callable[[np.ndarray], np.ndarray]] | None = None


ANONYMIZERS: Registry = Registry(
    "anonymizer", where="privacy.anonymize.registry.ANONYMIZERS", info=AnonymizerInfo,
    error=AnonymizationError,
    signature="anonymizer(x: np.ndarray, y: np.ndarray, params, seed: int, num_classes: int) "
              "-> privacy.anonymize.Release, registered with params= (its parameter "
              "dataclass), rowwise= and optionally public_map=")
"""The anonymizers by name: ``run(x, y, params, seed, num_classes) -> Release`` (one
client's rows, flat; ``params`` an instance of the entry's ``params`` dataclass), with
:class:`AnonymizerInfo` as metadata."""


def _identity(x, y, p, seed, num_classes) -> Release:
    return Release(x.copy(), y.copy(), np.arange(len(x)), np.arange(len(x)),
                   {"guarantee": "none"})


def _cvae(x, y, p, seed, num_classes) -> Release:
    from .cvae import cvae_release  # imports torch: only runs that train a CVAE pay it

    return cvae_release(x, y, p, num_classes, seed)


def _federated(x, y, p, seed, num_classes) -> Release:
    raise AnonymizationError("'cvae-federated' is not run per client: its release is sampled "
                             "from the decoder the clients train together")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


_add = ANONYMIZERS.register
_add("none", _identity, params=NoParams, rowwise=True)
_add("identity", _identity, params=NoParams, rowwise=True)
_add("ksame", lambda x, y, p, s, c: ksame(x, y, p.k, p.ksame_classwise),
     params=KSameParams, rowwise=False)
_add("density", lambda x, y, p, s, c: density(x, y, p.dbscan_eps, p.dbscan_min_samples,
                                              p.density_outliers, p.density_classwise,
                                              p.density_noise, _rng(s)),
     params=DensityParams, rowwise=False)
_add("cvae", _cvae, params=CVAEParams, rowwise=False)
_add("cvae-federated", _federated, params=CVAEParams, rowwise=False)
# trained like cvae; the client trains on a fresh sample of it every epoch
# (clients.anonymized.online_sample); this release is the one scored
_add("cvae-online", _cvae, params=CVAEParams, rowwise=False)
_add("gaussian", lambda x, y, p, s, c: gaussian_noise(x, y, p.noise_epsilon,
                                                      p.noise_delta or auto_delta(len(x)),
                                                      p.noise_clip, _rng(s)),
     params=GaussianParams, rowwise=True)
_add("laplace", lambda x, y, p, s, c: laplace_noise(x, y, p.noise_epsilon, p.noise_clip,
                                                    _rng(s)),
     params=LaplaceParams, rowwise=True)
_add("random", lambda x, y, p, s, c: random_noise(x, y, p.noise_scale, _rng(s)),
     params=RandomParams, rowwise=False)
_add("mask", lambda x, y, p, s, c: mask(x, y, p.mask_fraction, _rng(s)),
     params=MaskParams, rowwise=True)
_add("pca", lambda x, y, p, s, c: pca(x, y, p.pca_components), params=PCAParams, rowwise=False)
_add("permutation", lambda x, y, p, s, c: permutation(x, y, _rng(s)), params=NoParams,
     rowwise=True)
_add("hashing", lambda x, y, p, s, c: hashing(x, y, p.hash_salt), params=HashingParams,
     rowwise=True, public_map=lambda dim, p: hashing_transform(dim, p.hash_salt))


def rowwise_anonymizers() -> frozenset[str]:
    """The registered anonymizers whose every released row comes from one record."""
    return frozenset(name for name, info in ANONYMIZERS.items() if info.rowwise)


def raw_input_anonymizers() -> frozenset[str]:
    """What may also run on raw inputs (pixels, tabular rows), not only on embeddings: the
    row-wise ones without a public map the test data would need too."""
    return frozenset(name for name, info in ANONYMIZERS.items()
                     if info.rowwise and info.public_map is None)


def anonymize(name: str, x: np.ndarray, y: np.ndarray, params: Any, seed: int = 0,
              num_classes: int | None = None) -> Release:
    """Run the anonymizer ``name`` with its ``params`` on one client's data."""
    classes = int(num_classes if num_classes is not None else int(np.max(y)) + 1)
    return ANONYMIZERS.load(name)(x, y, params, seed, classes)


def public_transform(name: str, params: Any, dim: int
                     ) -> Callable[[np.ndarray], np.ndarray] | None:
    """The federation-wide map an anonymizer applies to all data (test data included)."""
    public_map = ANONYMIZERS.info(name).public_map
    return None if public_map is None else public_map(dim, params)


def dp_sgd_unit(anonymizer: str, train_data: str) -> str:
    """What local DP-SGD's epsilon protects: "record" or "released row".

    ``train_data`` is ``released`` (DP-SGD trains on the anonymizer's output) or
    ``original`` (on the client's own records). On a release that is not row-wise one
    record can change every released row (k-Same's and DBSCAN's groups, PCA's basis, the
    CVAE, the per-feature std of ``random``), so no useful per-record bound follows.
    """
    if train_data == "original" or ANONYMIZERS.info(anonymizer).rowwise:
        return "record"
    return "released row"
