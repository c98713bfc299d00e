"""Per-record noise and masking: each released row comes from its own record only.

- ``gaussian`` / ``laplace``: clip each vector to L2 (L1) norm C and add Gaussian
  (Laplace) noise calibrated to sensitivity 2C, so each released vector is (epsilon,
  delta)-DP (epsilon-DP) with respect to its original (local DP per record; the labels
  are released as they are). The Gaussian's sigma is the analytic one of Balle & Wang
  (2018), from Google's dp-accounting.
- ``random``: the seed project's uniform noise, +-scale x per-feature std (no formal
  guarantee; the std is computed from all the client's records).
- ``mask``: zero a random fraction of each vector's features.
"""

from __future__ import annotations

import numpy as np

from .release import AnonymizationError, Release


def _clip(x: np.ndarray, bound: float, order: int) -> np.ndarray:
    norms = np.linalg.norm(x, ord=order, axis=1, keepdims=True)
    return x * np.minimum(1.0, bound / np.maximum(norms, 1e-12))


def gaussian_noise(x: np.ndarray, y: np.ndarray, epsilon: float, delta: float, clip: float,
                   rng: np.random.Generator) -> Release:
    """Clip to L2 norm C and add N(0, sigma^2): (epsilon, delta)-DP per released vector."""
    # dp-accounting (and scipy) take most of a second to import: only this method needs it
    from dp_accounting import get_sigma_gaussian

    sigma = 2 * clip * get_sigma_gaussian(epsilon, delta)
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
