"""Scoring attacks against the ground truth the attacker never saw.

- Reconstructions: every reconstruction is matched to one original by an optimal
  assignment (Hungarian, on PSNR), then PSNR and SSIM (torchmetrics; images in [0, 1]
  pixel space) or, for vectors (embeddings), PSNR over the originals' range and cosine
  similarity; label accuracy is the share of labels recovered as a multiset.
- Membership inference: ROC AUC and the true-positive rate at 1% and 0.1% false
  positives (Carlini et al. 2022: low-FPR numbers, not accuracy alone), and the curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import roc_auc_score, roc_curve
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
        "label-accuracy": label_accuracy(recon_labels, labels),
        "matched": [int(c) for c in cols],
    }
    if images:
        out["ssim"] = float(np.mean([float(structural_similarity_index_measure(
            a[i:i + 1], b[j:j + 1], data_range=1.0)) for i, j in zip(rows, cols, strict=True)]))
    else:
        out["cosine"] = float(torch.nn.functional.cosine_similarity(
            a[rows], b[cols], dim=1).mean())
    return out


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


def membership_scores(scores_members: np.ndarray, scores_nonmembers: np.ndarray
                      ) -> dict[str, Any]:
    """ROC AUC, TPR at 1% and 0.1% FPR, and the ROC curve of a membership attack.

    A TPR at FPR f needs at least 1/f non-members (Carlini et al. 2022); with fewer it is
    None rather than the TPR at zero false positives read off a coarse curve.
    """
    scores = np.concatenate([scores_members, scores_nonmembers])
    truth = np.concatenate([np.ones(len(scores_members)), np.zeros(len(scores_nonmembers))])
    fpr, tpr, _ = roc_curve(truth, scores)
    auc = float(roc_auc_score(truth, scores))
    return {"auc": auc, "auc-ci95": auc_interval(auc, len(scores_members),
                                                 len(scores_nonmembers)),
            "tpr-at-1%fpr": _tpr_at(0.01, fpr, tpr, len(scores_nonmembers)),
            "tpr-at-0.1%fpr": _tpr_at(0.001, fpr, tpr, len(scores_nonmembers)),
            "members": int(len(scores_members)), "nonmembers": int(len(scores_nonmembers)),
            "roc": {"fpr": fpr.tolist(), "tpr": tpr.tolist()}}


def _tpr_at(rate: float, fpr: np.ndarray, tpr: np.ndarray, nonmembers: int) -> float | None:
    """The best TPR among thresholds whose FPR is at most ``rate`` (no interpolation
    between ROC points, which would be optimistic)."""
    return float(tpr[fpr <= rate].max()) if nonmembers * rate >= 1 else None


def auc_interval(auc: float, members: int, nonmembers: int, z: float = 1.96
                 ) -> tuple[float, float]:
    """A 95% interval for an ROC AUC from its standard error (Hanley & McNeil 1982): wide
    when few members are scored, as for a client that trained on a handful of images."""
    q1, q2 = auc / (2 - auc), 2 * auc**2 / (1 + auc)
    var = (auc * (1 - auc) + (members - 1) * (q1 - auc**2)
           + (nonmembers - 1) * (q2 - auc**2)) / max(members * nonmembers, 1)
    se = float(np.sqrt(max(var, 0.0)))
    return max(0.0, auc - z * se), min(1.0, auc + z * se)
