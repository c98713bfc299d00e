"""Scoring attacks against the ground truth the attacker never saw.

- Reconstructions: every reconstruction is matched to one original by an optimal
  assignment (Hungarian, on PSNR), then PSNR and SSIM (torchmetrics; images in [0, 1]
  pixel space) or, for vectors (embeddings), PSNR over the originals' range and cosine
  similarity; label accuracy is the share of labels recovered as a multiset.
- Membership inference: :mod:`.membership_metrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torchmetrics.functional.image import (
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)


def to_pixels(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Normalized images back to [0, 1] pixels."""
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x * s + m).clamp(0, 1)


def _psnr(a: torch.Tensor, b: torch.Tensor, data_range: float) -> float:
    return float(peak_signal_noise_ratio(a.unsqueeze(0), b.unsqueeze(0), data_range=data_range))


def reconstruction_scores(recon: torch.Tensor, recon_labels: torch.Tensor,
                          original: torch.Tensor, labels: torch.Tensor,
                          mean: Sequence[float] = (0.0,), std: Sequence[float] = (1.0,)
                          ) -> dict[str, Any]:
    """Match reconstructions to originals and score them (see the module docstring)."""
    images = original.ndim == 4
    if images:
        a, b, data_range = to_pixels(recon, mean, std), to_pixels(original, mean, std), 1.0
    else:
        a, b = recon.float(), original.float()
        data_range = float(b.max() - b.min()) or 1.0
    psnr = np.array([[_psnr(ai, bj, data_range) for bj in b] for ai in a])
    rows, cols = linear_sum_assignment(-psnr)
    out: dict[str, Any] = {
        "psnr": float(psnr[rows, cols].mean()),
        "psnr-max": float(psnr[rows, cols].max()),
        # the share of the originals some reconstruction matches above 30 dB (exactly)
        "recovered-above-30db": float((psnr[rows, cols] > 30).sum() / max(len(b), 1)),
        "label-accuracy": label_accuracy(recon_labels, labels),
        # of the records recovered above 30 dB, the share whose label came back right
        "label-accuracy-recovered": _paired_labels(recon_labels[rows], labels[cols],
                                                   psnr[rows, cols] > 30),
        "matched": [int(c) for c in cols],
    }
    if images:
        out["ssim"] = float(np.mean([float(structural_similarity_index_measure(
            a[i:i + 1], b[j:j + 1], data_range=1.0)) for i, j in zip(rows, cols, strict=True)]))
    else:
        out["cosine"] = float(torch.nn.functional.cosine_similarity(
            a[rows], b[cols], dim=1).mean())
    return out


def _paired_labels(predicted: torch.Tensor, true: torch.Tensor, mask: np.ndarray
                   ) -> float | None:
    if not mask.any():
        return None
    keep = torch.from_numpy(np.asarray(mask))
    return float((predicted[keep] == true[keep]).double().mean())


def label_accuracy(predicted: torch.Tensor, true: torch.Tensor) -> float:
    """Share of the true labels recovered, as a multiset (order does not matter)."""
    classes = int(max(predicted.max(), true.max())) + 1
    p = np.bincount(predicted.numpy(), minlength=classes)
    t = np.bincount(true.numpy(), minlength=classes)
    return float(np.minimum(p, t).sum() / max(len(true), 1))


def random_image_psnr(original: torch.Tensor, mean: Sequence[float], std: Sequence[float],
                      seed: int = 0) -> float:
    """PSNR of uniform-noise images against the originals: what guessing gets."""
    gen = torch.Generator().manual_seed(seed)
    b = to_pixels(original, mean, std)
    noise = torch.rand(b.shape, generator=gen)
    return float(np.mean([_psnr(noise[i], b[i], 1.0) for i in range(len(b))]))
