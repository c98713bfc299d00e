"""Pictures of what leaked: reconstruction grids and membership-inference ROC curves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from privacy.analysis.leakage_metrics import to_pixels


def reconstruction_grid(path: Path, original: torch.Tensor, recon: torch.Tensor,
                        matched: Sequence[int], mean: Sequence[float], std: Sequence[float],
                        title: str, max_images: int = 16) -> Path:
    """Originals (top row) above the reconstruction matched to each (bottom row)."""
    a = to_pixels(original, mean, std)
    b = to_pixels(recon, mean, std)
    order = list(range(len(b)))[:max_images]
    cols = len(order)
    fig = Figure(figsize=(max(2.0, 1.1 * cols), 2.6))
    axes = np.atleast_2d(fig.subplots(2, cols, squeeze=False))
    for j, i in enumerate(order):
        for row, img in ((0, a[matched[i]]), (1, b[i])):
            ax = axes[row, j]
            pic = img.permute(1, 2, 0).numpy()
            ax.imshow(pic[..., 0] if pic.shape[-1] == 1 else pic, cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0, 0].set_ylabel("original", fontsize=8)
    axes[1, 0].set_ylabel("reconstructed", fontsize=8)
    fig.suptitle(title, fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def roc_plot(path: Path, curves: Mapping[str, Mapping[str, Any]], title: str) -> Path:
    """ROC curves on log axes, where the low false-positive rates that matter are visible."""
    fig = Figure(figsize=(5.2, 4.4))
    ax = fig.subplots()
    for label, c in curves.items():
        fpr = np.maximum(np.asarray(c["roc"]["fpr"]), 1e-4)
        tpr = np.maximum(np.asarray(c["roc"]["tpr"]), 1e-4)
        ax.plot(fpr, tpr, label=f"{label} (AUC {c['auc']:.3f})")
    grid = np.logspace(-4, 0, 50)
    ax.plot(grid, grid, ls="--", color="gray", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e-4, 1)
    ax.set_ylim(1e-4, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
