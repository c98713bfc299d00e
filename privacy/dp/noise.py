"""The Gaussian noise of central DP and its per-round generators (numpy only)."""

from __future__ import annotations

import secrets

import numpy as np


def gaussian_noise(shape: tuple[int, ...], std: float, rng: np.random.Generator,
                   secure: bool = False) -> np.ndarray:
    """N(0, std^2) noise; ``secure`` sums 4 draws / 2 against floating-point attacks.

    The secure variant follows Opacus' ``secure_mode`` (Holohan & Braghin 2021, section
    5.1): the sum of 2n Gaussians of the same std divided by sqrt(2n), n = 2.
    """
    if not secure:
        return rng.normal(0.0, std, shape)
    return sum(rng.normal(0.0, std, shape) for _ in range(4)) / 2.0


def noise_rng(seed: int, server_round: int, secure: bool) -> np.random.Generator:
    """The round's noise generator: reproducible from the run seed, or OS entropy."""
    if secure:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng([seed, server_round, 0xD9])
