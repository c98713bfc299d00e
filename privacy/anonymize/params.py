"""The parameters of each anonymizer: one frozen dataclass each.

Field names are the run-config keys they come from (``dbscan_eps`` is ``dbscan-eps``),
so this is the one list of what every anonymizer reads. There are no defaults here:
the run-config schema holds them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NoParams:
    pass


@dataclass(frozen=True)
class KSameParams:
    k: int
    ksame_classwise: bool


@dataclass(frozen=True)
class DensityParams:
    dbscan_eps: float
    dbscan_min_samples: int
    density_outliers: str
    density_classwise: bool
    density_noise: float


@dataclass(frozen=True)
class GaussianParams:
    noise_epsilon: float
    noise_delta: float  # 0 = 1 / (10 n)
    noise_clip: float


@dataclass(frozen=True)
class LaplaceParams:
    noise_epsilon: float
    noise_clip: float


@dataclass(frozen=True)
class RandomParams:
    noise_scale: float


@dataclass(frozen=True)
class MaskParams:
    mask_fraction: float


@dataclass(frozen=True)
class PCAParams:
    pca_components: int


@dataclass(frozen=True)
class HashingParams:
    hash_salt: str


@dataclass(frozen=True)
class CVAEParams:
    cvae_latent: int
    cvae_hidden: int
    cvae_beta: float
    cvae_epochs: int
    cvae_patience: int
    cvae_lr: float
    cvae_batch_size: int
    cvae_epsilon: float
    cvae_clip: float
    cvae_public_records: int = 0
